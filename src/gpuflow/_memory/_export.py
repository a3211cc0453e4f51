"""What a :class:`DeviceArray` gives other libraries: DLPack, ``__cuda_array_interface__``.

Both protocols hand over the array's own device memory (a copy only when
the consumer asks for one), as a device array of the array's CUDA device,
on ``sim`` too, whose addresses map back to its buffers.

Ordering, never a host synchronize.  DLPack: the consumer names the stream
it will use the array on (``stream``: None and 1 the legacy default stream,
2 the per-thread default stream, a ``CUstream`` address, -1 for "do not
synchronize"); before the capsule is returned that stream waits, with
events, for every use gpuflow enqueued (the last write, and the reads
since: the consumer may write).  When that stream is one of gpuflow's own,
the export is a write on it for hazard tracking, like any other.
``__cuda_array_interface__`` names a stream instead (its ``stream`` entry):
the array's last writer, first made to wait for the reads since; the
consumer waits on it.

Lifetime.  A capsule holds the array's allocation until the consumer calls
the deleter, however long the consumer keeps it and whether or not any
gpuflow array of it is left; the allocation is then freed in stream order
like any, after the consumer's work too: the deleter records an event on
the consumer's stream, which every later use of the allocation and its free
wait for (:meth:`Allocation.after_foreign`).  A consumer of
``__cuda_array_interface__`` keeps the DeviceArray itself alive, and gpuflow
learns nothing of its work: the free waits for gpuflow's uses only.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from .._backends import DType
from .._core import (
    Allocation,
    Runtime,
    Stream,
    capture_log,
    hazard_lock,
    refuse_blocking,
    stream_for,
    wait_for_uses,
)
from .._errors import UsageError, UsageTypeError
from . import _dlpack

#: Allocations whose free could not be ordered after a consumer's work: kept
#: for the life of the process (a leak is better than a dangling pointer).
_leaked: list[Allocation] = []


def _check(alloc: Allocation, what: str) -> Runtime:
    rt = alloc.writer._runtime
    if not rt.live or alloc.generation != rt.generation(alloc.buffer.device):
        raise UsageError(
            f"{what}: the array belongs to a device context that was reset or replaced"
        )
    if capture_log.get() is not None:
        raise UsageError(
            f"{what} inside a graph capture: another library's work on the array would not "
            "be part of the graph; export before capturing"
        )
    return rt


def dlpack_device(alloc: Allocation) -> tuple[int, int]:
    return (_dlpack.KDL_CUDA, alloc.buffer.device)


def _version(max_version: Any) -> tuple[int, int] | None:
    """The capsule version for a consumer that understands up to ``max_version``."""
    if max_version is None:
        return None
    try:
        major, minor = (int(v) for v in max_version)
    except (TypeError, ValueError):
        raise UsageTypeError(
            f"__dlpack__: max_version must be a (major, minor) tuple, not {max_version!r}"
        ) from None
    if major < 1:
        return None
    if major == _dlpack.VERSION[0]:
        return (major, min(minor, _dlpack.VERSION[1]))
    return _dlpack.VERSION  # a newer consumer reads older versions


def _consumer_handle(stream: object) -> int | None:
    """The consumer's stream handle; None: the consumer does its own ordering."""
    if stream is None:
        return 1  # the protocol's meaning of None on CUDA: the legacy default stream
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise UsageTypeError(f"__dlpack__: stream must be an int or None, not {stream!r:.40}")
    if stream == -1:
        return None
    if stream <= 0:
        raise UsageError(
            f"__dlpack__: stream {stream} is not allowed (1: the legacy default stream, "
            "2: the per-thread default stream, a CUstream address, -1: no synchronization; "
            "0 is ambiguous)"
        )
    return stream


def _keep(alloc: Allocation) -> None:
    """The release of an export that needs no more than holding the allocation."""


def _after_consumer(alloc: Allocation, consumer: Stream) -> None:
    """The consumer let go: the allocation's later uses and its free wait for the
    work it enqueued on its stream so far.  Runs on the thread of the deleter."""
    rt = consumer._runtime
    if sys.is_finalizing():
        return  # the process is going away with its memory (and its streams)
    if not rt.current(consumer):
        return  # the context is gone with its memory (the allocation leaks)
    try:
        event = rt.backend.record_event(consumer.raw)
    except Exception as exc:
        _leaked.append(alloc)
        warnings.warn(
            f"gpuflow: could not order the free of an exported array after its consumer's "
            f"stream ({exc!r}); the memory is leaked rather than freed under it",
            stacklevel=1,
        )
        return
    key = (consumer.device, rt.backend.stream_handle(consumer.raw))
    alloc.after_foreign(key, event)


def _order_for_consumer(
    rt: Runtime, alloc: Allocation, handle: int | None, device: int
) -> Callable[[], None]:
    """Make the consumer's stream wait for gpuflow's uses; the release to run when
    the consumer lets go."""
    if handle is None:
        return functools.partial(_keep, alloc)
    consumer, own = stream_for(rt, handle, device)
    # the interop stream only ever waits (gpuflow's import tracks its own
    # uses): made a writer, it would carry frees that later imports wait for
    arrival = own and rt.is_interop(consumer)
    with hazard_lock:
        if own and not arrival:
            alloc.before_write(consumer)
        else:
            wait_for_uses(alloc, consumer)
    if own:
        return functools.partial(_keep, alloc)
    return functools.partial(_after_consumer, alloc, consumer)


def _device_arg(dl_device: Any) -> tuple[int, int]:
    try:
        kind, index = dl_device
        return int(kind), int(index)
    except (TypeError, ValueError):
        raise UsageTypeError(
            f"__dlpack__: dl_device must be a (device type, index) tuple, not {dl_device!r:.40}"
        ) from None


def _device_copy(
    rt: Runtime, alloc: Allocation, shape: tuple[int, ...], dtype: DType
) -> Allocation:
    """A new allocation holding a copy, made on the stream of the last write."""
    device = alloc.buffer.device
    s = alloc.writer
    be = rt.backend
    nbytes = math.prod(shape) * dtype.itemsize
    copy = Allocation(be, be.alloc(device, nbytes, s.raw), s, ledger=rt.memory)
    if nbytes:
        with hazard_lock:
            alloc.before_read(s)
            be.copy_device(copy.buffer, alloc.buffer, nbytes, s.raw)
    return copy


def _host_capsule(
    rt: Runtime,
    alloc: Allocation,
    shape: tuple[int, ...],
    dtype: DType,
    max_version: Any,
) -> Any:
    """A NumPy copy of the array, as NumPy's own DLPack capsule (``IS_COPIED``)."""
    refuse_blocking(
        "exporting a device array to host memory (a DLPack export to the CPU)",
        "in async code, `await gf.to_host(array)`",
    )
    device = alloc.buffer.device
    s = rt.interop_stream(device)
    be = rt.backend
    out: np.ndarray[tuple[int, ...], np.dtype[np.number]] = np.empty(shape, dtype)
    if out.nbytes:
        with hazard_lock:
            alloc.before_read(s)
            be.copy_to_host(out, alloc.buffer, s.raw)
        be.synchronize(s.raw)
    try:
        capsule = out.__dlpack__(max_version=max_version)
    except TypeError:  # NumPy before 2.1 makes legacy capsules only
        capsule = out.__dlpack__()
    _dlpack.mark_copied(capsule)
    return capsule


def dlpack(
    alloc: Allocation,
    shape: tuple[int, ...],
    dtype: DType,
    *,
    stream: object,
    max_version: object,
    dl_device: object,
    copy: object,
) -> Any:
    """``DeviceArray.__dlpack__`` (see the module docstring)."""
    rt = _check(alloc, "__dlpack__")
    device = alloc.buffer.device
    version = _version(max_version)
    if copy is not None and not isinstance(copy, bool):
        raise UsageTypeError(f"__dlpack__: copy must be True, False or None, not {copy!r:.40}")
    if dl_device is not None:
        kind, index = _device_arg(dl_device)
        if kind == _dlpack.KDL_CPU:
            if copy is False:
                raise BufferError(
                    f"the array is in the memory of CUDA device {device}: host memory needs "
                    "a copy, and copy=False refuses one"
                )
            if stream is not None:
                raise UsageError("__dlpack__: a copy to host memory takes no stream")
            return _host_capsule(rt, alloc, shape, dtype, max_version)
        if (kind, index) != (_dlpack.KDL_CUDA, device):
            raise BufferError(
                f"the array is in the memory of CUDA device {device}: gpuflow exports it "
                f"there, or copies it to the host, not to device {(kind, index)}"
            )
    handle = _consumer_handle(stream)
    flags = _dlpack.FLAG_READ_ONLY if alloc.readonly else 0
    if copy:
        alloc = _device_copy(rt, alloc, shape, dtype)
        flags = _dlpack.FLAG_IS_COPIED
    release = _order_for_consumer(rt, alloc, handle, device)
    return _dlpack.export_capsule(
        alloc.buffer.ptr, device, shape, dtype, release, version=version, flags=flags
    )


def cuda_array_interface(
    alloc: Allocation, shape: tuple[int, ...], dtype: DType
) -> dict[str, Any]:
    """``DeviceArray.__cuda_array_interface__``, version 3."""
    rt = _check(alloc, "__cuda_array_interface__")
    with hazard_lock:
        # the stream named must follow every use so far: the consumer may write
        alloc.before_write(alloc.writer)
        writer = alloc.writer
    nbytes = math.prod(shape) * dtype.itemsize
    return {
        "shape": shape,
        "typestr": dtype.str,
        "data": (alloc.buffer.ptr if nbytes else 0, alloc.readonly),
        "strides": None,
        "descr": [("", dtype.str)],
        "version": 3,
        "stream": rt.backend.stream_handle(writer.raw),
    }
