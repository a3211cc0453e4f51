"""The GPU work people already have: other libraries' arrays, streams and code.

* :func:`from_dlpack` wraps another library's device array (DLPack or
  ``__cuda_array_interface__``: CuPy, PyTorch, JAX, Numba, cuda.core, and
  gpuflow's own) as a :class:`DeviceArray`, without a copy.  The producer's
  pending work is made visible on the device's interop stream
  (:meth:`Runtime.interop_stream`) at import: the DLPack producer waits
  there itself (that is the stream gpuflow passes to ``__dlpack__``), and a
  ``__cuda_array_interface__`` producer's ``stream`` is waited for there
  with an event.  The array's allocation starts with that stream as its
  last writer, so gpuflow's first use of it on any stream waits for the
  producer's work (and for earlier arrivals, never for other imports' uses).
* :func:`wait_stream` is an operation that makes the run's stream wait for
  the work enqueued so far on another library's stream: awaited directly, it
  is how an event loop awaits a PyTorch forward pass without blocking.
* :func:`foreign` runs another library's code as a step of a pipeline, on
  gpuflow's stream: PyTorch's and CuPy's current stream is the run's stream
  while it runs (and any library's that registered an adapter), the
  gpuflow arrays it is given are ordered on that stream as written, and the
  device arrays it returns come back as :class:`DeviceArray` imports.

Lifetimes of imports: gpuflow never frees another library's memory.  An
:class:`ImportedAllocation` holds its *owner* (the consumed DLPack tensor,
or the ``__cuda_array_interface__`` producer object); when the last gpuflow
array of it goes, the owner is released in stream order, after every use
gpuflow enqueued: a run of its own keeps it, after the waits a free would
have (on a stream that used it, never on the interop stream), and the
completer thread drops it (a DLPack producer's deleter runs there) once the
GPU is past them.  The producer may drop its own
references at any time meanwhile.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from .._backends import Backend, DType, RawBuffer
from .._core import (
    Allocation,
    DeviceOperation,
    EventPoint,
    ExecutionContext,
    Plan,
    Run,
    Runtime,
    Stream,
    Uses,
    callable_name,
    describe_stream,
    enqueue_ordered,
    ensure_runtime,
    finalize_later,
    order_after,
    stream_at,
    stream_for,
    stream_handle,
    usable_stream,
    wait_for_uses,
)
from .._errors import UsageError, UsageTypeError
from .._memory import DeviceArray, dlpack

#: Owners whose release could not be ordered after gpuflow's uses: kept for
#: the life of the process (a leak is better than memory freed under the GPU).
_leaked: list[object] = []


class ImportedAllocation(Allocation):
    """Another library's memory: an allocation gpuflow never frees.

    When it goes, its ``owner`` is released after every use gpuflow
    enqueued, in stream order (a run of its own keeps the owner until then).

    Made by :func:`gpuflow.from_dlpack`; not constructed directly.
    """

    __slots__ = ("owner",)

    def __init__(
        self, backend: Backend, buffer: RawBuffer, stream: Stream, owner: object, readonly: bool
    ) -> None:
        super().__init__(backend, buffer, stream)
        if stream._runtime.is_interop(stream):
            # right after the waits for its producer: a first use waits for
            # this import's producer, not for those of imports made after it
            self.wrote = EventPoint(backend.record_event(stream.raw))
        self.owner = owner
        self.readonly = readonly

    def __del__(self) -> None:
        if sys.is_finalizing():
            return  # (the process is going away; see Allocation.__del__)
        finalize_later(_release, self.owner, self.uses())


def _release(owner: object, uses: Uses) -> None:
    """Release a dropped import's owner after every use gpuflow enqueued
    (an import's finalizer, done later: :mod:`._finalizers`)."""
    try:
        stream = writer = uses.writer
        rt = writer._runtime
        if not rt.current(writer):
            _leaked.append(owner)  # the context is gone: leak, never dangle
            return
        if rt.is_interop(stream) and (uses.readers or uses.foreign):
            # not written since the import: wait on a stream that used it,
            # never on the interop stream, which later imports wait for
            stream = next(iter(uses.readers), None) or rt.pool(stream.device)[0]
        stream = usable_stream(uses.backend, stream)
        wait_for_uses(uses, stream)
        release = Run(stream.device)
        release.hold((owner,))
        rt.completer.submit(stream.raw, release, polled=False)  # (no task awaits it)
    except Exception as exc:
        _leaked.append(owner)
        warnings.warn(
            f"gpuflow: could not release {owner!r} after gpuflow's uses ({exc!r}): leaked",
            stacklevel=1,
        )


# -- arrays in ------------------------------------------------------------------------------

_CUDA_TYPES = (dlpack.KDL_CUDA, dlpack.KDL_CUDA_MANAGED)
_HOST_TYPES = {
    dlpack.KDL_CPU: "kDLCPU",
    dlpack.KDL_CUDA_HOST: "kDLCUDAHost",
    dlpack.KDL_ROCM_HOST: "kDLROCMHost",
}


def _check_device_type(device_type: int, what: str) -> None:
    if device_type in _CUDA_TYPES:
        return
    if device_type in _HOST_TYPES:
        raise UsageError(
            f"{what} is in host memory (DLPack device {_HOST_TYPES[device_type]}), which "
            "kernels cannot use: gf.from_host(x) copies it to the device"
        )
    raise UsageError(f"{what} is on DLPack device type {device_type}, not a CUDA device")


def _our_device(rt: Runtime, device: int, what: str) -> int:
    if device not in rt.devices:
        raise UsageError(
            f"{what} is memory of CUDA device {device}, which gpuflow does not use "
            f"(its devices: {rt.devices}; see gf.init_device_contexts)"
        )
    return device


def _check_dtype(dtype: DType, what: str) -> DType:
    if dtype.hasobject or dtype.kind not in "biufc" or dtype.fields is not None:
        raise UsageError(f"{what} has dtype {dtype}, which gpuflow arrays cannot hold")
    if dtype.byteorder == ">":
        raise UsageError(f"{what} has big-endian dtype {dtype.str}: device memory is not")
    return dtype


def _check_contiguous(shape: tuple[int, ...], strides: Any, unit: int, what: str) -> None:
    """``strides`` (None, or in units of ``unit``: 1 for elements, the item size for
    bytes) must be C-contiguous; a dimension of extent 1 may have any stride."""
    if strides is None or math.prod(shape) == 0:
        return
    strides = tuple(int(s) for s in strides)
    expected = unit
    for extent, stride in zip(reversed(shape), reversed(strides), strict=True):
        if extent != 1 and stride != expected:
            raise UsageError(
                f"{what} is not C-contiguous (shape {shape}, strides {strides} in "
                f"{'elements' if unit == 1 else 'bytes'}), as gpuflow arrays are: make it "
                "contiguous first (tensor.contiguous(), cupy.ascontiguousarray)"
            )
        expected *= extent


def _arrival(rt: Runtime, device: int, stream: Stream | None) -> Stream:
    """The stream an import's producer makes its work visible on."""
    if stream is not None and stream.device == device:
        return stream
    return rt.interop_stream(device)


def _from_capsule(
    rt: Runtime,
    capsule: object,
    stream: Stream | None,
    what: str,
    device: int | None = None,
    producer: int | None = None,
) -> DeviceArray:
    """The array of ``capsule``; ``producer``: the handle of the stream whose
    later work the producer ordered its own before (None: the arrival stream,
    which the producer was given)."""
    t = dlpack.read_capsule(capsule)
    _check_device_type(t.device_type, what)
    if device is not None and t.device_id != device:
        raise UsageError(
            f"{what}: the DLPack tensor is on CUDA device {t.device_id}, but its producer "
            f"said device {device}"
        )
    device = _our_device(rt, t.device_id, what)
    dtype = dlpack.np_dtype(t.code, t.bits, t.lanes)
    _check_contiguous(t.shape, t.strides, 1, what)
    buffer = rt.backend.foreign_buffer(t.ptr, math.prod(t.shape) * dtype.itemsize, device)
    owner = dlpack.take_capsule(capsule, t)
    s = _arrival(rt, device, stream)
    if producer is not None:
        _arrive_after(rt, s, producer, device)  # (before the import marks its arrival there)
    return DeviceArray(ImportedAllocation(rt.backend, buffer, s, owner, t.readonly), t.shape, dtype)


def _from_dlpack_protocol(rt: Runtime, x: Any, stream: Stream | None, what: str) -> DeviceArray:
    try:
        device_type, device_id = x.__dlpack_device__()
    except AttributeError:
        raise UsageError(f"{what} has __dlpack__ but no __dlpack_device__") from None
    _check_device_type(int(device_type), what)
    device = _our_device(rt, int(device_id), what)
    s = _arrival(rt, device, stream)
    handle = rt.backend.stream_handle(s.raw)
    try:
        try:
            capsule = x.__dlpack__(stream=handle, max_version=dlpack.VERSION)
        except TypeError:  # a producer from before DLPack 1.0 takes no max_version
            capsule = x.__dlpack__(stream=handle)
    except UsageError:
        raise
    except (BufferError, TypeError, ValueError, RuntimeError) as exc:
        raise UsageError(f"{what}.__dlpack__() refused to export: {exc}") from exc
    return _from_capsule(rt, capsule, s, what, device)


def _from_cai(rt: Runtime, x: Any, stream: Stream | None, what: str) -> DeviceArray:
    cai = x.__cuda_array_interface__
    if not isinstance(cai, Mapping):
        raise UsageTypeError(f"{what}.__cuda_array_interface__ is not a dict")
    try:
        shape = tuple(int(v) for v in cai["shape"])
        ptr, readonly = cai["data"]
        dtype = _check_dtype(np.dtype(cai["typestr"]), what)
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{what}.__cuda_array_interface__ is malformed: {exc!r}") from None
    if cai.get("mask") is not None:
        raise UsageError(f"{what} is a masked array (__cuda_array_interface__ 'mask')")
    _check_contiguous(shape, cai.get("strides"), dtype.itemsize, what)
    buffer = rt.backend.foreign_buffer(int(ptr or 0), math.prod(shape) * dtype.itemsize, None)
    device = _our_device(rt, buffer.device, what)
    s = _arrival(rt, device, stream)
    producer = cai.get("stream")  # version 3: the consumer must wait on it
    if producer is not None:
        if isinstance(producer, bool) or not isinstance(producer, int) or producer <= 0:
            raise UsageError(
                f"{what}.__cuda_array_interface__ has stream {producer!r}: a CUstream address, "
                "1 or 2 (0 is disallowed)"
            )
        _arrive_after(rt, s, producer, device)
    return DeviceArray(ImportedAllocation(rt.backend, buffer, s, x, bool(readonly)), shape, dtype)


def _arrive_after(rt: Runtime, s: Stream, producer: int, device: int) -> None:
    """Make arrival stream ``s`` wait for the work enqueued so far on the
    producer's stream ``producer`` (a handle)."""
    order_after(rt.backend, s, stream_for(rt, producer, device)[0], None)


def import_array(rt: Runtime, x: object, stream: Stream | None = None) -> DeviceArray:
    """``x`` as a DeviceArray, the producer's pending work visible on ``stream``
    (default: the device's interop stream)."""
    dlpack.sweep()
    what = type(x).__name__
    if dlpack.is_capsule(x):
        # a capsule handed over as it is was asked of its producer with no
        # stream, which DLPack takes as the legacy default stream: the
        # producer ordered its work before that stream's later work, which
        # the arrival stream (non-blocking, as all of gpuflow's) must wait for
        return _from_capsule(rt, x, stream, "the DLPack capsule", producer=1)
    if hasattr(x, "__dlpack__"):
        return _from_dlpack_protocol(rt, x, stream, what)
    if hasattr(x, "__cuda_array_interface__"):
        return _from_cai(rt, x, stream, what)
    raise UsageTypeError(
        f"from_dlpack() needs a device array with __dlpack__ or __cuda_array_interface__ "
        f"(CuPy, PyTorch, JAX, Numba, cuda.core) or a DLPack capsule; got {what}"
    )


def from_dlpack(x: object) -> DeviceArray:
    """Another library's device array as a :class:`DeviceArray`, without a copy.

    ``x`` has ``__dlpack__`` (tried first) or ``__cuda_array_interface__``,
    or is a DLPack capsule.  The result shares ``x``'s memory: gpuflow keeps
    it alive for as long as any gpuflow array of it or any enqueued work
    uses it (the producer may drop ``x`` meanwhile), then releases it (the
    DLPack deleter runs then), never frees it.  gpuflow's first use of it
    waits for the producer's work pending at the import, with an event (a
    capsule given as it is was made for no stream, which DLPack takes as
    the legacy default stream: the work there at the import);
    uses through the producer afterwards are the producer's to order:
    ``torch.from_dlpack(arr)`` or ``cupy.asarray(arr)`` orders the
    consumer's current stream after gpuflow's writes, ``gf.wait_stream(s)``
    gpuflow's run after a foreign stream.  Raises :class:`UsageError` for
    host memory, memory of a device gpuflow does not use, a dtype it cannot
    pass, or a non-contiguous array, before anything is enqueued.

    Any thread.

    Parameters
    ----------
    x
        The other library's array (``__dlpack__``,
        ``__cuda_array_interface__``), or a DLPack capsule.

    Returns
    -------
    DeviceArray
        An array of ``x``'s memory, shape and dtype.

    Raises
    ------
    gpuflow.UsageError
        Host memory, memory of a device gpuflow does not use, a dtype it
        cannot pass, or a non-contiguous array.
    """
    return import_array(ensure_runtime(), x)


# -- foreign streams --------------------------------------------------------------------------


class _WaitStream(DeviceOperation[None]):
    __slots__ = ("_device", "_handle", "_plan", "_source")

    def __init__(self, source: object, handle: int, device: int | None) -> None:
        self._source = source  # keeps the library's stream object (and its handle) alive
        self._handle = handle
        self._device = device
        # Awaited directly (not composed), it runs on the other library's
        # stream itself: its run's completion mark is an event recorded
        # there, polled, and no stream of gpuflow's waits for the foreign
        # work (another run placed on that stream would wait for it too, and
        # the GPU would hop streams to say it is done).
        self._plan = Plan(foreign=(handle, device))

    def execute(self, ctx: ExecutionContext) -> None:
        if ctx.capturing:
            raise UsageError(
                "wait_stream inside a graph capture: the foreign work is not part of the "
                "graph; wait for it before launching the graph"
            )
        if self._source is not None:
            ctx.keep(self._source)  # (its handle is used until the run completes)
        be = ctx.backend
        here = ctx.stream
        if be.stream_handle(here.raw) == self._handle and (
            self._device is None or here.device == self._device
        ):
            return  # the run is on that stream: its work so far comes first
        s, own = stream_at(ctx._runtime, self._handle, self._device, ctx.device)
        if own:
            ctx.wait_for(s)
        elif s is not here:
            if be.stream_capturing(s.raw):  # (our stream would join the capture)
                raise UsageError(
                    f"wait_stream of {describe_stream(self._handle)}, which is being "
                    "captured into a graph: its work runs when the graph is launched"
                )
            be.wait_event(here.raw, be.record_event(s.raw))

    def label(self) -> str:
        return f"wait_stream {describe_stream(self._handle)}"

    def _kind(self) -> str:
        return "join"


def wait_stream(stream: object) -> DeviceOperation[None]:
    """An operation that completes when the work enqueued so far on ``stream`` is done.

    ``stream`` is anything with ``__cuda_stream__``, a ``torch.cuda.Stream``,
    a ``cupy.cuda.Stream``, or a raw ``CUstream`` handle (an int: 0 or 1 the
    legacy default stream, 2 the per-thread one) of the run's device (or of
    the device the stream object names).  "So far" is when the operation
    runs.  Awaited directly, ``await gf.wait_stream(s)`` completes on ``s``
    itself: an event recorded there, read by the loop's poller like any
    run's completion, and no stream of gpuflow's waits for the foreign work
    (other runs never queue behind it).  Composed (``then``, ``zip``, or
    run with ``sync``/``enqueue_on``), the run's stream waits on an event
    recorded on ``s``, so ``gf.wait_stream(s).then(...)`` orders gpuflow
    work after the foreign work.  Either way the event loop never blocks.
    Composable and cancellable like every operation; refused inside a graph
    capture, and while ``s`` is being captured into another library's
    graph (its work runs when that graph is launched).  A stream given as a
    bare handle must live until the run completes (a stream object is kept
    alive until then).

    Parameters
    ----------
    stream
        The other library's stream: an object with ``__cuda_stream__``, a
        ``torch.cuda.Stream``, a ``cupy.cuda.Stream``, or a ``CUstream``
        handle.

    Returns
    -------
    DeviceOperation[None]

    Raises
    ------
    gpuflow.UsageTypeError
        ``stream`` is no stream (a bool, an object with no handle).
    gpuflow.UsageError
        A negative handle, or an object whose protocol gives an invalid one.
    """
    handle, device = stream_handle(stream, "wait_stream()")
    return _WaitStream(stream if not isinstance(stream, int) else None, handle, device)


# -- foreign code on gpuflow's stream --------------------------------------------------------

StreamAdapter = Callable[[Stream], AbstractContextManager[Any] | None]


def _torch_adapter(stream: Stream) -> AbstractContextManager[Any] | None:
    torch = sys.modules.get("torch")
    if torch is None or not stream._runtime.backend.cuda_native or not torch.cuda.is_available():
        return None
    external = torch.cuda.ExternalStream(
        stream.__cuda_stream__()[1], device=torch.device("cuda", stream.device)
    )
    return torch.cuda.stream(external)  # type: ignore[no-any-return]


def _cupy_adapter(stream: Stream) -> AbstractContextManager[Any] | None:
    cupy = sys.modules.get("cupy")
    if cupy is None or not stream._runtime.backend.cuda_native:
        return None
    handle = stream.__cuda_stream__()[1]
    stack = contextlib.ExitStack()
    stack.enter_context(cupy.cuda.Device(stream.device))
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy 14 deprecates ExternalStream for this
        external = from_external(stream)  # (through ``__cuda_stream__``)
    else:
        try:
            external = cupy.cuda.ExternalStream(handle, stream.device)
        except TypeError:  # CuPy before 12 takes no device
            external = cupy.cuda.ExternalStream(handle)
    stack.enter_context(external)
    return stack


_adapters: list[StreamAdapter] = [_torch_adapter, _cupy_adapter]
_adapters_lock = threading.Lock()


def register_stream_adapter(adapter: StreamAdapter) -> Callable[[], None]:
    """Make another library run on gpuflow's stream inside :func:`gpuflow.foreign`.

    ``adapter(stream)`` gets the run's :class:`gpuflow.Stream` and returns a
    context manager during which the library's current stream is that stream
    (or None to do nothing, e.g. on a backend it cannot use).  PyTorch's and
    CuPy's are built in (on the ``cuda`` backend, once imported).  Returns a
    function that unregisters the adapter.  Thread-safe.

    Parameters
    ----------
    adapter
        Called with the run's :class:`gpuflow.Stream`; returns a context
        manager, or None.

    Returns
    -------
    Callable[[], None]
        Unregisters the adapter.

    Raises
    ------
    gpuflow.UsageTypeError
        ``adapter`` is not callable.
    """
    if not callable(adapter):
        raise UsageTypeError(f"register_stream_adapter() needs a callable, got {adapter!r:.60}")
    with _adapters_lock:
        _adapters.append(adapter)

    def unregister() -> None:
        with _adapters_lock:
            if adapter in _adapters:
                _adapters.remove(adapter)

    return unregister


def _is_device_array(v: object) -> bool:
    if isinstance(v, DeviceArray):
        return False
    if hasattr(v, "__dlpack__") and hasattr(v, "__dlpack_device__"):
        try:
            return int(v.__dlpack_device__()[0]) in _CUDA_TYPES
        except Exception:
            return False
    return hasattr(v, "__cuda_array_interface__")


def _resolve(x: object, ctx: ExecutionContext) -> Any:
    return x.execute(ctx) if isinstance(x, DeviceOperation) else x


class _Foreign(DeviceOperation[object]):
    __slots__ = ("_args", "_fn", "_kwargs")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self._fn = fn
        self._args = args
        self._kwargs = kwargs

    def execute(self, ctx: ExecutionContext) -> Any:
        what = f"foreign({callable_name(self._fn)})"
        if ctx.capturing:
            raise UsageError(
                f"{what} inside a graph capture: another library's work is not captured; "
                "run it before or after the graph"
            )
        args = tuple(_resolve(a, ctx) for a in self._args)
        kwargs = {k: _resolve(v, ctx) for k, v in self._kwargs.items()}
        arrays = [a for a in (*args, *kwargs.values()) if isinstance(a, DeviceArray)]
        for a in arrays:
            a._check_usable(ctx, what)
            if a.device != ctx.device:
                raise UsageError(
                    f"{what}: {a!r} is on device {a.device}, the run on device {ctx.device}"
                )
        stream = ctx.stream

        def enqueue() -> tuple[Any, Any]:
            # (the foreign enqueues and the imports: one step with the ordering)
            with contextlib.ExitStack() as on_stream:
                with _adapters_lock:
                    adapters = list(_adapters)
                for adapter in adapters:
                    cm = adapter(stream)
                    if cm is not None:
                        on_stream.enter_context(cm)
                out = self._fn(*args, **kwargs)
                return out, self._imports(ctx, out)

        # the code may write any array it gets
        uses = [(a._allocation, stream, True) for a in arrays]
        out, result = enqueue_ordered(ctx.run, uses, enqueue)
        ctx.keep(args, kwargs, out)
        return result

    @staticmethod
    def _imports(ctx: ExecutionContext, out: object) -> Any:
        def one(v: object) -> Any:
            return import_array(ctx._runtime, v, ctx.stream) if _is_device_array(v) else v

        if isinstance(out, tuple):
            return tuple(one(v) for v in out)
        if isinstance(out, list):
            return [one(v) for v in out]
        return one(out)

    def label(self) -> str:
        return f"foreign {callable_name(self._fn)}"

    def _children(self) -> tuple[DeviceOperation[object], ...]:
        return tuple(
            a for a in (*self._args, *self._kwargs.values()) if isinstance(a, DeviceOperation)
        )


def foreign(fn: Callable[..., Any], /, *args: object, **kwargs: object) -> DeviceOperation[Any]:
    """Another library's GPU code as a step of a pipeline, on gpuflow's stream.

    When the operation runs, ``fn(*args, **kwargs)`` is called on the host
    with the run's stream current in PyTorch and CuPy (whichever are
    imported, on the ``cuda`` backend) and in any library registered with
    :func:`gpuflow.lowlevel.register_stream_adapter`, so the work it
    enqueues is ordered with the run's like gpuflow's own.  Arguments that
    are operations run first (as a kernel's do); the :class:`DeviceArray`
    arguments are ordered on the run's stream as written by ``fn`` (pass
    ``fn`` the gpuflow arrays it uses as arguments, not through a closure),
    and stay alive until the run's work is done, as do ``fn``'s results.
    The operation produces ``fn``'s result with every device array in it
    (the result itself, or the items of a tuple or list) imported as a
    :class:`DeviceArray` (zero-copy, see :func:`from_dlpack`), ready for
    the next gpuflow step; ``torch.from_dlpack(arr)`` turns one back into
    a tensor without a copy.  Refused inside a graph capture.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    fn
        The other library's code: called on the host when the operation runs.
    *args, **kwargs
        Its arguments; operations among them run first, and their outputs
        are passed.

    Returns
    -------
    DeviceOperation
        ``fn``'s result, its device arrays imported as :class:`DeviceArray`.

    Raises
    ------
    gpuflow.UsageTypeError
        ``fn`` is not callable, when the operation is built.
    """
    if not callable(fn):
        raise UsageTypeError(f"foreign() needs a callable, got {type(fn).__name__}")
    return _Foreign(fn, args, kwargs)
