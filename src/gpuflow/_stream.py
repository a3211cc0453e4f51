"""Streams and the policies that choose them.

A :class:`Stream` is a handle on one backend stream of one device.  gpuflow
makes streams in exactly two places: the per-device pool that
:func:`init_device_contexts` creates, and :func:`new_stream`.  Operations
never create streams; a :class:`SchedulingPolicy` picks one per run.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ._runtime import Runtime


class Stream:
    """A device stream: work enqueued on it runs in order.

    Hashable; two ``Stream`` objects are equal when they are the same
    underlying stream.  Safe to use from any thread.  Implements
    ``__cuda_stream__`` on the ``cuda`` backend, so CuPy, PyTorch and
    cuda.core can enqueue on it.
    """

    __slots__ = ("__weakref__", "_device", "_generation", "_raw", "_runtime")

    def __init__(self, runtime: Runtime, device: int, raw: Any) -> None:
        self._runtime = runtime
        self._device = device
        self._raw = raw
        self._generation = runtime.generation(device)

    @property
    def device(self) -> int:
        """The ordinal of the stream's device."""
        return self._device

    def synchronize(self) -> None:
        """Block the calling thread until all work enqueued on the stream is done.

        Raises :class:`DeviceFaultError` if the device faulted.  Do not call it
        from an event loop's thread: ``await`` the operation instead.
        """
        self._runtime.backend.synchronize(self._raw)

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol: ``(version, CUstream address)``."""
        return (0, self._runtime.backend.stream_handle(self._raw))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other._raw is self._raw

    def __hash__(self) -> int:
        return id(self._raw)

    def __repr__(self) -> str:
        return f"<gpuflow.Stream device={self._device} {self._raw!r}>"


def new_stream(device: int | None = None) -> Stream:
    """A new stream of its own on ``device`` (default: the current device).

    The stream is destroyed when the last reference to it goes; work already
    enqueued on it still completes.
    """
    from ._runtime import current_device, get_runtime

    rt = get_runtime()
    dev = rt.check_device(current_device() if device is None else device)
    raw = rt.backend.create_stream(dev)
    s = Stream(rt, dev, raw)
    weakref.finalize(s, rt.backend.destroy_stream, raw)
    return s


@runtime_checkable
class SchedulingPolicy(Protocol):
    """Chooses the stream an operation runs on.

    ``next_stream`` is called once per run (and once per extra ``zip`` arm)
    from the thread that starts the run; it must be thread-safe and must not
    block.
    """

    def next_stream(self, device: int) -> Stream: ...


class StreamPoolRoundRobin:
    """The default policy: consecutive runs get consecutive streams of the
    device's pool (``streams_per_device`` of them), so independent operations
    overlap."""

    __slots__ = ("_counter",)

    def __init__(self) -> None:
        self._counter = itertools.count()

    def next_stream(self, device: int) -> Stream:
        pool = _runtime.get_runtime().pool(device)
        return pool[next(self._counter) % len(pool)]

    def __repr__(self) -> str:
        return "StreamPoolRoundRobin()"


class SingleStream:
    """Every run on one stream of its own, on ``device``: strict order."""

    __slots__ = ("_device", "_lock", "_stream")

    def __init__(self, device: int = 0) -> None:
        self._device = device
        self._stream: Stream | None = None
        self._lock = threading.Lock()

    def next_stream(self, device: int) -> Stream:
        # the policy is bound to its device, whatever device is current
        s = self._stream
        if s is None or s._generation != s._runtime.generation(self._device) or not s._runtime.live:
            with self._lock:
                s = self._stream
                if (
                    s is None
                    or s._generation != s._runtime.generation(self._device)
                    or not s._runtime.live
                ):
                    s = self._stream = new_stream(self._device)
        return s

    @property
    def stream(self) -> Stream:
        """The policy's stream (made on first use)."""
        return self.next_stream(self._device)

    def __repr__(self) -> str:
        return f"SingleStream(device={self._device})"


# at the end: _runtime imports this module's classes at its top
from . import _runtime  # noqa: E402
