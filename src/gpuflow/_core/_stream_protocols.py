"""Other libraries' streams, as gpuflow sees them.

A stream reaches gpuflow from another library as a handle: through
``__cuda_stream__`` (cuda.core, and gpuflow's own :class:`Stream`), a
``torch.cuda.Stream``'s ``cuda_stream``, a ``cupy.cuda.Stream``'s ``ptr``,
or a bare ``CUstream`` address; 0 and 1 name the legacy default stream and
2 the per-thread one.  A handle of one of gpuflow's own live streams (pool,
``new_stream``, interop) is that :class:`Stream`, and joins hazard tracking
like any.  Any other is wrapped (:func:`foreign_stream`) to record an event
on it or make it wait, and kept no longer than the library's own use of a
gpuflow array lasts (an exported capsule, until its deleter): gpuflow cannot
know how long another library's stream lives.

Other libraries' arrays arrive on each device's private *interop stream*
(:meth:`Runtime.interop_stream`): an imported array's producer makes its
pending work visible there, and gpuflow's first use of the array waits for
it.  Only such waits run there, so waiting for it waits for arrivals only.
"""

from __future__ import annotations

from .._errors import UsageError, UsageTypeError
from ._runtime import Runtime
from ._stream import Stream


def _device_of(obj: object) -> int | None:
    """The device a stream object says it is on (torch, CuPy, cuda.core, gpuflow)."""
    index = getattr(obj, "device_index", None)  # torch's, an int: asked first (the
    if type(index) is int:  # common case; `device` makes a torch.device each time)
        return index
    for candidate in (getattr(obj, "device_id", None), getattr(obj, "device", None)):
        if isinstance(candidate, int) and not isinstance(candidate, bool):
            return candidate
        index = getattr(candidate, "index", None)  # a torch.device
        if index is None:
            index = getattr(candidate, "device_id", None)  # a cuda.core Device
        if isinstance(index, int) and not isinstance(index, bool):
            return index
    return None


def stream_handle(obj: object, what: str) -> tuple[int, int | None]:
    """``(handle, device)`` of a stream-like object (device None: not said).

    UsageTypeError for anything that is not a stream, UsageError for a bad handle.
    """
    if isinstance(obj, bool):
        raise UsageTypeError(f"{what} needs a stream, got a bool")
    if isinstance(obj, int):
        if obj < 0:
            raise UsageError(
                f"{what}: a stream handle is a CUstream address (0 or 1: the legacy default "
                f"stream, 2: the per-thread default stream), not {obj}"
            )
        return obj, None
    protocol = getattr(obj, "__cuda_stream__", None)
    if protocol is not None:
        out = protocol() if callable(protocol) else protocol
        try:
            _version, handle = out
            return _valid_handle(int(handle), obj, what), _device_of(obj)
        except (TypeError, ValueError):
            raise UsageTypeError(
                f"{what}: {type(obj).__name__}.__cuda_stream__() must give "
                f"(version, handle), gave {out!r:.60}"
            ) from None
    for attribute in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        handle = getattr(obj, attribute, None)
        if (
            isinstance(handle, int)
            and not isinstance(handle, bool)
            and (attribute == "cuda_stream" or "Stream" in type(obj).__name__)
        ):
            return _valid_handle(handle, obj, what), _device_of(obj)
    raise UsageTypeError(
        f"{what} needs a stream: an object with __cuda_stream__ (cuda.core, gpuflow), a "
        "torch.cuda.Stream, a cupy.cuda.Stream or a CUstream handle (an int); got "
        f"{type(obj).__name__}"
    )


def _valid_handle(handle: int, obj: object, what: str) -> int:
    if handle < 0:
        raise UsageError(f"{what}: {type(obj).__name__} gives stream handle {handle}")
    return handle


def own_stream(rt: Runtime, handle: int) -> Stream | None:
    """gpuflow's own live stream with ``handle``, if it is one."""
    return None if handle in (0, 1, 2) else rt.stream_by_handle(handle)


def foreign_stream(rt: Runtime, handle: int, device: int, named: bool = False) -> Stream:
    """Another library's stream ``handle`` (``device``: that of a default stream,
    or the one the library's stream object says, ``named``), to record an
    event on or make wait, now.  Never destroyed by gpuflow."""
    raw, dev = rt.backend.foreign_stream(handle, device, named)
    return rt.foreign_stream(raw, dev)


def stream_for(
    rt: Runtime, handle: int, device: int, named: bool = False
) -> tuple[Stream, bool]:
    """The stream with ``handle``: ``(gpuflow's own, True)`` or ``(a foreign
    one, False)``; ``named`` as for :func:`foreign_stream`."""
    own = own_stream(rt, handle)
    if own is not None:
        return own, True
    return foreign_stream(rt, handle, device, named), False


def stream_at(rt: Runtime, handle: int, device: int | None, here: int) -> tuple[Stream, bool]:
    """:func:`stream_for` of a handle another library gave with the device
    its stream object names (``device``), or with none (a raw handle: on
    ``here``, the run's device)."""
    if device is None:
        return stream_for(rt, handle, here)
    return stream_for(rt, handle, device, True)


def describe_stream(handle: int) -> str:
    """A stream handle for a message."""
    return {0: "the legacy default stream (0)", 1: "the legacy default stream (1)",
            2: "the per-thread default stream (2)"}.get(handle, f"stream 0x{handle:x}")  # fmt: skip

