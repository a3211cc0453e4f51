"""Pinned staging buffers: host copies that never block the calling thread.

Copies between pageable host memory and the device go through pinned staging
buffers so that neither direction blocks the calling thread: host to device
copies the source into the staging buffer at the call; device to host lands
in a staging buffer and is copied into the destination by the first
completion check that proves it finished (``take_signals``, ``query`` or
``synchronize``, on any stream), which always comes before the front end can
see the operation done.  Staging buffers are recycled by event query.  The
buffers of a device live in its :class:`Dev` (they go with its context).
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._errors import DeviceError
from .._codes import CUDA_ERROR_NOT_READY, CUDA_SUCCESS
from .._records import HostArray
from ._driver import driver, error_for

if TYPE_CHECKING:
    from ._handles import Dev
    from ._native import Native

STAGE_MIN = 64 * 1024  # smallest staging buffer (size classes are powers of two)
STAGE_H2D_MIN = 64 * 1024  # host-to-device copies below this go straight from pageable memory
STAGE_MAX = 256 << 20  # larger copies go straight (the driver's own pageable path)
STAGE_LIMIT = 1 << 30  # pinned staging memory per device, at most
_MEMHOSTALLOC_PORTABLE = 1


class HostBuf:
    """A pinned host buffer, and a NumPy view of its bytes."""

    __slots__ = ("array", "ptr", "size")

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr = ptr
        self.size = size
        raw: Any = (ctypes.c_uint8 * size).from_address(ptr)
        self.array: np.ndarray[Any, np.dtype[np.uint8]] = np.frombuffer(raw, dtype=np.uint8)


class Pending:
    """A staged copy in flight: ``buf`` is busy until ``event`` completes."""

    __slots__ = ("buf", "dst", "event", "nbytes")

    def __init__(
        self, event: int, buf: HostBuf, dst: HostArray | None, nbytes: int
    ) -> None:
        self.event = event
        self.buf = buf
        self.dst = dst
        self.nbytes = nbytes


class Staging:
    """The staging buffers of every device, and the device-to-host copies in flight.

    ``lock`` guards every device's staging state; ``d2h_pending`` counts the
    staged device-to-host copies not yet delivered (while it is 0, completion
    checks skip the sweep).
    """

    def __init__(
        self,
        devices: list[Dev],
        native: Native,
        cur: Callable[[Dev], object],
        call: Callable[..., tuple[Any, ...]],
    ) -> None:
        self._devices = devices
        self._n = native
        self.make_current = cur  # make a device's context current on this thread
        self._call = call  # a driver call with a device's context current
        self.lock = threading.Lock()
        self.d2h_pending = 0  # staged device-to-host copies not yet delivered

    def get(self, dev: Dev, nbytes: int) -> HostBuf | None:
        """A pinned buffer of at least ``nbytes``, or None (then copy directly)."""
        size = max(STAGE_MIN, 1 << (nbytes - 1).bit_length())
        with self.lock:
            self.sweep(dev)
            free = dev.free_host.get(size)
            if free:
                return free.pop()
            if dev.host_bytes + size > STAGE_LIMIT:
                return None
            dev.host_bytes += size
        try:
            (ptr,) = self._call(
                dev, "cuMemHostAlloc", driver().cuMemHostAlloc, size, _MEMHOSTALLOC_PORTABLE
            )
        except DeviceError:
            with self.lock:
                dev.host_bytes -= size
            return None
        return HostBuf(int(ptr), size)

    def sweep(self, dev: Dev) -> None:
        """Deliver finished device-to-host copies, recycle finished staging buffers.

        The caller holds :attr:`lock`; never raises (a fault is recorded, the entries dropped).
        """
        if not dev.pending or dev.fault is not None:
            return
        self.make_current(dev)
        keep: list[Pending] = []
        pending = dev.pending
        for i, p in enumerate(pending):
            rc = self._n.event_query(p.event)
            if rc == CUDA_SUCCESS:
                if p.dst is not None:
                    p.dst[...] = p.buf.array[: p.nbytes]
                    self.d2h_pending -= 1
                dev.free_host.setdefault(p.buf.size, []).append(p.buf)
                dev.events.append(p.event)
            elif rc == CUDA_ERROR_NOT_READY:
                keep.append(p)
            else:
                error_for(rc, "cuEventQuery", dev)  # not raised: a sticky code is recorded
                # lost: nothing still pending on this device will ever be delivered
                lost = keep + pending[i:]
                self.d2h_pending -= sum(1 for q in lost if q.dst is not None)
                keep = []
                break
        dev.pending = keep

    def sweep_all(self) -> None:
        """:meth:`sweep` every device; a failure is a warning (completion checks call it)."""
        try:
            with self.lock:
                for dev in self._devices:
                    if dev.pending:
                        self.sweep(dev)
        except Exception as exc:
            warnings.warn(f"gpuflow: staged copy delivery failed: {exc!r}", stacklevel=2)

    def done(self, dev: Dev, p: Pending) -> None:
        """``p`` is enqueued: its buffer is busy, its destination waits for delivery."""
        with self.lock:
            dev.pending.append(p)
            if p.dst is not None:
                self.d2h_pending += 1

    def drop(self, dev: Dev) -> None:
        """Forget ``dev``'s staging buffers: pinned memory goes with its context.

        The caller holds :attr:`lock`.
        """
        self.d2h_pending -= sum(1 for p in dev.pending if p.dst is not None)
        dev.pending = []
        dev.free_host = {}
        dev.host_bytes = 0
