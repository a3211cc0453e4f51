"""Device arrays and the operations that make and move them.

A :class:`DeviceArray` is a typed, C-contiguous view of one allocation
(:class:`~gpuflow._hazards.Allocation`), which orders every use after the
uses it depends on and frees the memory in stream order when the last view
goes.  Allocation, fills, host transfers and device copies are operations
like any other: they enqueue on the run's stream.  Other libraries see an
array through DLPack and ``__cuda_array_interface__`` (:mod:`._export`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex, cast

import numpy as np

from .._backends import DType, HostArray
from .._core import (
    ANYWHERE,
    Allocation,
    DeviceOperation,
    PendingHost,
    Plan,
    enqueue_ordered,
    stream_elsewhere,
)
from .._errors import UsageError, UsageTypeError
from . import _export

if TYPE_CHECKING:
    from .._core import ExecutionContext, Stream

ShapeLike = SupportsIndex | Sequence[SupportsIndex]


def as_shape(shape: ShapeLike) -> tuple[int, ...]:
    if isinstance(shape, SupportsIndex) and not isinstance(shape, tuple | list):
        shape = (shape,)
    try:
        out = tuple(int(s.__index__()) for s in shape)
    except (TypeError, AttributeError):
        raise UsageError(f"shape must be an int or a sequence of ints, not {shape!r}") from None
    if any(s < 0 for s in out):
        raise UsageError(f"shape {out} has a negative dimension")
    return out


def _item(a: HostArray) -> np.generic:
    """The element of a 0-d array, as a NumPy scalar of its dtype."""
    return cast(np.generic, a[()])


def as_dtype(dtype: Any) -> DType:
    try:
        dt: DType = np.dtype(dtype)
    except TypeError:
        raise UsageError(f"{dtype!r} is not a NumPy dtype") from None
    if dt.hasobject or dt.kind not in "biufc":
        raise UsageError(f"dtype {dt} cannot live on the device (numbers and bool only)")
    return dt


class DeviceArray:
    """A C-contiguous array in device memory.

    Arrays are handles: operations that produce one return it while the GPU
    may still be writing it; gpuflow orders every later use after that write.
    Thread-safe to pass around; the memory is freed (in stream order) when
    the last array using it is garbage-collected.

    Other libraries take it without a copy: ``torch.from_dlpack(arr)``,
    ``cupy.from_dlpack(arr)``, ``cupy.asarray(arr)``; it is a device array
    of its CUDA device, also on ``sim``, and never host memory to NumPy
    (``gf.to_host`` copies it there).

    ``shape`` (a tuple of ints) and ``dtype`` (a NumPy dtype) are as NumPy's,
    and so are ``size``, ``ndim``, ``nbytes`` and ``len(arr)``.

    Made by the operations that make arrays (:func:`zeros`, :func:`from_host`,
    :func:`from_dlpack`, ...); not constructed directly.
    """

    __slots__ = ("__weakref__", "_allocation", "dtype", "shape")

    def __init__(self, alloc: Allocation, shape: tuple[int, ...], dtype: DType) -> None:
        #: the buffer and the record of its uses (:mod:`gpuflow.lowlevel`:
        #: an operation orders its use with ``before_read``/``before_write``)
        self._allocation = alloc
        self.shape = shape
        self.dtype = dtype

    @property
    def size(self) -> int:
        """How many elements the array has."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        """How many dimensions the array has."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """How many bytes the elements take."""
        return self.size * self.dtype.itemsize

    @property
    def device(self) -> int:
        """The ordinal of the device the memory is on."""
        return self._allocation.buffer.device

    @property
    def ptr(self) -> int:
        """The device address of the first element."""
        return self._allocation.buffer.ptr

    def reshape(self, *shape: SupportsIndex | Sequence[SupportsIndex]) -> DeviceArray:
        """The same memory with another shape (same number of elements).

        Parameters
        ----------
        *shape
            The new shape: ints, or one sequence of them (no ``-1``: every dimension given).

        Returns
        -------
        DeviceArray
            Sharing this array's memory (no copy, no GPU work).

        Raises
        ------
        gpuflow.UsageError
            A shape of another number of elements.
        """
        new = as_shape(shape[0] if len(shape) == 1 else shape)  # type: ignore[arg-type]
        if math.prod(new) != self.size:
            raise UsageError(f"cannot reshape an array of size {self.size} into {new}")
        return DeviceArray(self._allocation, new, self.dtype)

    def __len__(self) -> int:
        if not self.shape:
            raise UsageTypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<gpuflow.DeviceArray shape={self.shape} dtype={self.dtype} device={self.device}>"

    @property
    def readonly(self) -> bool:
        """True for memory another library lent read-only: kernels may only read it."""
        return self._allocation.readonly

    # -- the array protocols (the machinery is in _export) ------------------------
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule of this array's memory (the array API's protocol).

        ``stream`` is the consumer's: None or 1 the legacy default stream, 2
        the per-thread default stream, a ``CUstream`` address, or -1 for none;
        it waits (an event, never a host synchronize) for every use of the
        array gpuflow enqueued before the capsule is returned.  A versioned
        capsule when ``max_version`` is at least ``(1, 0)``, a legacy one
        otherwise.  The memory stays alive until the consumer calls the
        deleter, even if every gpuflow array of it is gone, and is then freed
        after the consumer's work on its stream too.  ``copy=True`` exports
        a copy; ``dl_device=(1, 0)`` (the host) copies to host memory, which
        blocks, so it is refused inside an event loop.
        """
        return _export.dlpack(
            self._allocation,
            self.shape,
            self.dtype,
            stream=stream,
            max_version=max_version,
            dl_device=dl_device,
            copy=copy,
        )

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(2, device)``: CUDA memory (``kDLCUDA``) of the array's device."""
        return _export.dlpack_device(self._allocation)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA Array Interface, version 3: pointer, shape, typestr, and the
        ``stream`` the consumer must wait on before it uses the memory."""
        return _export.cuda_array_interface(self._allocation, self.shape, self.dtype)

    def __array__(self, dtype: object = None, copy: object = None) -> NoReturn:
        raise UsageTypeError(
            f"{self!r} is in device memory, which NumPy cannot read: gf.to_host(arr) copies it "
            "to a NumPy array (await it, or .sync() outside an event loop)"
        )

    def _check_usable(self, ctx: ExecutionContext, what: str) -> None:
        """Raise :class:`gpuflow.UsageError`, naming ``what``, where the array
        belongs to a device context that was reset or replaced since it was
        made (its memory is gone): what an operation checks of each array
        it uses before it enqueues anything.

        Parameters
        ----------
        ctx
            The run's context.
        what
            What the array is to the operation, for the message.

        Raises
        ------
        gpuflow.UsageError
            The array's memory is gone.
        """
        a = self._allocation
        rt = ctx._runtime
        if a.generation != rt.generation(a.buffer.device) or a.writer._runtime is not rt:
            raise UsageError(
                f"{what}: {self!r} belongs to a device context that was reset or replaced"
            )


def allocate(
    ctx: ExecutionContext,
    shape: tuple[int, ...],
    dtype: DType,
    stream: Stream | None = None,
) -> DeviceArray:
    s = stream or ctx.stream
    if ctx.capturing:
        raise UsageError(
            "allocation inside a graph capture is not supported: allocate the arrays "
            "before capturing and write into them (gf.copy(src, out=...), kernels)"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    buf = ctx.backend.alloc(s.device, nbytes, s.raw)
    alloc = Allocation(ctx.backend, buf, s, ctx.run, s._runtime.memory)
    return DeviceArray(alloc, shape, dtype)


def _check_device_input(x: object, what: str) -> None:
    """Refuse what is not a device array or an operation, saying where the
    data is and what brings it to the device (``gf.value`` would not)."""
    if isinstance(x, DeviceArray | DeviceOperation):
        return
    if isinstance(x, np.ndarray | np.generic | list | tuple | int | float | complex):
        hint = "that is host data already (gf.from_host(x) copies host data to the device)"
    elif hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"):
        hint = (
            "another library's array: gf.from_dlpack(x) takes its device memory without "
            "a copy; gf.from_host(x) copies host memory to the device"
        )
    else:
        hint = "gpuflow's arrays come from gf.zeros, gf.from_host, gf.from_dlpack, kernels, ..."
    raise UsageTypeError(
        f"{what} takes a DeviceArray or an operation producing one, got "
        f"{type(x).__name__}: {hint}"
    )


def resolve_array(x: object, ctx: ExecutionContext, what: str) -> DeviceArray:
    if type(x) is DeviceArray:  # (the common case, first: no isinstance walk)
        x._check_usable(ctx, what)
        return x
    if isinstance(x, DeviceOperation):
        x = x.execute(ctx)
    if not isinstance(x, DeviceArray):
        raise UsageTypeError(
            f"{what} needs a DeviceArray (or an operation producing one), "
            f"got {type(x).__name__}"
        )
    x._check_usable(ctx, what)
    return x


class _Fill(DeviceOperation[DeviceArray]):
    __slots__ = ("_dtype", "_shape", "_value")

    def __init__(self, shape: tuple[int, ...], dtype: DType, value: object) -> None:
        self._shape = shape
        self._dtype = dtype
        try:
            with warnings.catch_warnings():
                # overflow to inf, NaN to an int and complex to real warn
                warnings.simplefilter("error")
                src = np.array(value)
                if src.ndim:
                    raise ValueError("it is not a scalar")
                self._value = _item(src.astype(dtype))
                # a casting rule cannot tell 0 (fits uint8 and bool) from 300
                # or -1 (does not): ints and bools must hold the value exactly
                if dtype.kind in "biu" and self._value != src[()]:
                    raise ValueError(f"{dtype} cannot hold it exactly")
        except (TypeError, ValueError, RuntimeWarning, OverflowError) as exc:
            raise UsageError(f"fill value {value!r} does not fit dtype {dtype}: {exc}") from None

    def execute(self, ctx: ExecutionContext) -> DeviceArray:
        out = allocate(ctx, self._shape, self._dtype)
        if out.size:
            ctx.backend.fill(out._allocation.buffer, self._value, out.size, ctx.stream.raw)
        return out

    def _output_dtype(self) -> DType | None:
        return self._dtype

    def label(self) -> str:
        return f"full {self._shape} {self._dtype} = {self._value}"

    def _kind(self) -> str:
        return "alloc"


def full(
    shape: ShapeLike, fill_value: object, dtype: object = None
) -> DeviceOperation[DeviceArray]:
    """An array of ``shape`` filled with ``fill_value``.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    shape
        An int or a sequence of ints, each zero or more.
    fill_value
        A number (or bool), cast to ``dtype``.
    dtype
        The elements' NumPy dtype (None: inferred from ``fill_value`` as NumPy does).

    Returns
    -------
    DeviceOperation[DeviceArray]
        An operation that allocates and fills a new array each time it runs.

    Raises
    ------
    gpuflow.UsageError
        A shape that is not one, or a dtype that cannot live on the device
        (numbers and bool only), when the operation is built.
    """
    dt = np.array(fill_value).dtype if dtype is None else dtype
    return _Fill(as_shape(shape), as_dtype(dt), fill_value)


def zeros(shape: ShapeLike, dtype: object = np.float64) -> DeviceOperation[DeviceArray]:
    """An array of zeros.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    shape
        An int or a sequence of ints, each zero or more.
    dtype
        The elements' NumPy dtype (``float64`` by default, as NumPy and CuPy).

    Returns
    -------
    DeviceOperation[DeviceArray]
        An operation that allocates and zeroes a new array each time it runs.

    Raises
    ------
    gpuflow.UsageError
        A shape that is not one, or a dtype that cannot live on the device
        (numbers and bool only), when the operation is built.
    """
    return _Fill(as_shape(shape), as_dtype(dtype), 0)


def ones(shape: ShapeLike, dtype: object = np.float64) -> DeviceOperation[DeviceArray]:
    """An array of ones.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    shape
        An int or a sequence of ints, each zero or more.
    dtype
        The elements' NumPy dtype (``float64`` by default, as NumPy and CuPy).

    Returns
    -------
    DeviceOperation[DeviceArray]
        An operation that allocates and fills a new array each time it runs.

    Raises
    ------
    gpuflow.UsageError
        A shape that is not one, or a dtype that cannot live on the device
        (numbers and bool only), when the operation is built.
    """
    return _Fill(as_shape(shape), as_dtype(dtype), 1)


class _Empty(DeviceOperation[DeviceArray]):
    __slots__ = ("_dtype", "_shape")

    def __init__(self, shape: tuple[int, ...], dtype: DType) -> None:
        self._shape = shape
        self._dtype = dtype

    def execute(self, ctx: ExecutionContext) -> DeviceArray:
        return allocate(ctx, self._shape, self._dtype)

    def _output_dtype(self) -> DType | None:
        return self._dtype

    def label(self) -> str:
        return f"empty {self._shape} {self._dtype}"

    def _kind(self) -> str:
        return "alloc"


def empty(shape: ShapeLike, dtype: object = np.float64) -> DeviceOperation[DeviceArray]:
    """An array whose elements are whatever its memory held: allocated, not
    written (as ``numpy.empty`` and ``cupy.empty``), for work that writes
    every element before it reads one.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    shape
        An int or a sequence of ints, each zero or more.
    dtype
        The elements' NumPy dtype (``float64`` by default, as NumPy and CuPy).

    Returns
    -------
    DeviceOperation[DeviceArray]
        An operation that allocates a new array each time it runs.

    Raises
    ------
    gpuflow.UsageError
        A shape that is not one, or a dtype that cannot live on the device
        (numbers and bool only), when the operation is built.
    """
    return _Empty(as_shape(shape), as_dtype(dtype))


def _like(a: object, dtype: object, shape: ShapeLike | None, what: str) -> tuple[Any, Any]:
    """The shape and dtype of an array ``*_like(a, ...)`` makes."""
    a_shape, a_dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
    if not isinstance(a_shape, tuple) or a_dtype is None:
        raise UsageTypeError(
            f"{what} takes an array (a DeviceArray, or a NumPy array) to take the shape and "
            f"dtype of, got {type(a).__name__}"
        )
    return (a_shape if shape is None else shape), (a_dtype if dtype is None else dtype)


def empty_like(
    a: DeviceArray | HostArray, dtype: object = None, shape: ShapeLike | None = None
) -> DeviceOperation[DeviceArray]:
    """:func:`empty` of ``a``'s shape and dtype (or those given), as
    ``numpy.empty_like``.  The array is made on the device the operation
    runs on (the current one), as CuPy's is, whatever ``a``'s.  Any thread:
    building the operation enqueues nothing.

    Parameters
    ----------
    a
        A :class:`DeviceArray` or a NumPy array.
    dtype
        The elements' dtype (None: ``a``'s).
    shape
        The shape (None: ``a``'s).

    Returns
    -------
    DeviceOperation[DeviceArray]

    Raises
    ------
    gpuflow.UsageTypeError
        ``a`` has no shape and dtype.
    gpuflow.UsageError
        As :func:`empty`.
    """
    shape, dtype = _like(a, dtype, shape, "empty_like()")
    return empty(shape, dtype)


def zeros_like(
    a: DeviceArray | HostArray, dtype: object = None, shape: ShapeLike | None = None
) -> DeviceOperation[DeviceArray]:
    """:func:`zeros` of ``a``'s shape and dtype (or those given), as
    ``numpy.zeros_like``; made on the device the operation runs on.  Any
    thread: building the operation enqueues nothing.

    Parameters
    ----------
    a
        A :class:`DeviceArray` or a NumPy array.
    dtype
        The elements' dtype (None: ``a``'s).
    shape
        The shape (None: ``a``'s).

    Returns
    -------
    DeviceOperation[DeviceArray]

    Raises
    ------
    gpuflow.UsageTypeError
        ``a`` has no shape and dtype.
    gpuflow.UsageError
        As :func:`zeros`.
    """
    shape, dtype = _like(a, dtype, shape, "zeros_like()")
    return zeros(shape, dtype)


def ones_like(
    a: DeviceArray | HostArray, dtype: object = None, shape: ShapeLike | None = None
) -> DeviceOperation[DeviceArray]:
    """:func:`ones` of ``a``'s shape and dtype (or those given), as
    ``numpy.ones_like``; made on the device the operation runs on.  Any
    thread: building the operation enqueues nothing.

    Parameters
    ----------
    a
        A :class:`DeviceArray` or a NumPy array.
    dtype
        The elements' dtype (None: ``a``'s).
    shape
        The shape (None: ``a``'s).

    Returns
    -------
    DeviceOperation[DeviceArray]

    Raises
    ------
    gpuflow.UsageTypeError
        ``a`` has no shape and dtype.
    gpuflow.UsageError
        As :func:`ones`.
    """
    shape, dtype = _like(a, dtype, shape, "ones_like()")
    return ones(shape, dtype)


def full_like(
    a: DeviceArray | HostArray,
    fill_value: object,
    dtype: object = None,
    shape: ShapeLike | None = None,
) -> DeviceOperation[DeviceArray]:
    """:func:`full` of ``a``'s shape and dtype (or those given), as
    ``numpy.full_like``: ``fill_value`` is cast to ``a``'s dtype, not
    inferred from it; made on the device the operation runs on.  Any
    thread: building the operation enqueues nothing.

    Parameters
    ----------
    a
        A :class:`DeviceArray` or a NumPy array.
    fill_value
        A number (or bool), cast to the dtype.
    dtype
        The elements' dtype (None: ``a``'s).
    shape
        The shape (None: ``a``'s).

    Returns
    -------
    DeviceOperation[DeviceArray]

    Raises
    ------
    gpuflow.UsageTypeError
        ``a`` has no shape and dtype.
    gpuflow.UsageError
        As :func:`full` (a value the dtype cannot hold among them).
    """
    shape, dtype = _like(a, dtype, shape, "full_like()")
    return full(shape, fill_value, dtype)


class _Arange(DeviceOperation[DeviceArray]):
    __slots__ = ("_dtype", "_n", "_start", "_step")

    def __init__(self, n: int, start: np.generic, step: np.generic, dtype: DType) -> None:
        self._n = n
        self._start = start
        self._step = step
        self._dtype = dtype

    def _output_dtype(self) -> DType | None:
        return self._dtype

    def execute(self, ctx: ExecutionContext) -> DeviceArray:
        out = allocate(ctx, (self._n,), self._dtype)
        if self._n:
            buf = out._allocation.buffer
            ctx.backend.arange(buf, self._start, self._step, self._n, ctx.stream.raw)
        return out

    def label(self) -> str:
        return f"arange {self._n} {self._dtype}"

    def _kind(self) -> str:
        return "alloc"


def arange(
    start: float, stop: float | None = None, step: float = 1, *, dtype: object = None
) -> DeviceOperation[DeviceArray]:
    """The numbers of ``[start, stop)`` by ``step``, as :func:`numpy.arange`.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    start, stop
        The interval (one argument: ``[0, start)``).
    step
        The distance between two numbers (not zero).
    dtype
        The elements' NumPy dtype (None: as NumPy infers it from the arguments).

    Returns
    -------
    DeviceOperation[DeviceArray]
        An operation that allocates and fills a new array each time it runs.

    Raises
    ------
    gpuflow.UsageError
        A zero ``step``, or a dtype that cannot live on the device, when the
        operation is built.
    """
    if stop is None:
        start, stop = 0, start
    if step == 0:
        raise UsageError("arange step must not be zero")
    dt = as_dtype(np.result_type(start, stop, step) if dtype is None else dtype)
    n = max(0, math.ceil((stop - start) / step))
    return _Arange(n, _item(np.array(start).astype(dt)), _item(np.array(step).astype(dt)), dt)


class _FromHost(DeviceOperation[DeviceArray]):
    __slots__ = ("_host",)

    def __init__(self, host: HostArray) -> None:
        self._host = host

    def _output_dtype(self) -> DType | None:
        dtype: DType = self._host.dtype
        return dtype

    def execute(self, ctx: ExecutionContext) -> DeviceArray:
        # ascontiguousarray makes a 0-d array 1-d: keep the shape
        src = np.ascontiguousarray(self._host).reshape(self._host.shape)
        if ctx.capturing:
            raise UsageError(
                "from_host inside a graph capture: host-to-device copies from pageable "
                "memory cannot be captured; copy before capturing"
            )
        out = allocate(ctx, src.shape, src.dtype)
        if out.nbytes:
            ctx.backend.copy_from_host(out._allocation.buffer, src, ctx.stream.raw)
            ctx.keep(src)
        return out

    def label(self) -> str:
        return f"from_host {self._host.shape} {self._host.dtype}"

    def _kind(self) -> str:
        return "copy"


def from_host(array: object) -> DeviceOperation[DeviceArray]:
    """Copy a host array to the device.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    array
        Anything :func:`numpy.asarray` takes; it is read when the operation
        runs, not when it is built.

    Returns
    -------
    DeviceOperation[DeviceArray]
        An operation that allocates a new array and copies into it each time
        it runs.

    Raises
    ------
    gpuflow.UsageError
        A dtype that cannot live on the device, when the operation is built.
    """
    host = np.asarray(array)
    as_dtype(host.dtype)
    return _FromHost(host)


class _ToHost(DeviceOperation[HostArray]):
    __slots__ = ("_src",)

    def __init__(self, src: DeviceArray | DeviceOperation[DeviceArray]) -> None:
        self._src = src

    def execute(self, ctx: ExecutionContext) -> Any:
        a = resolve_array(self._src, ctx, "to_host")
        if ctx.capturing:
            raise UsageError(
                "to_host inside a graph capture: device-to-host copies cannot be captured"
            )
        out = np.empty(a.shape, a.dtype)
        if a.nbytes:
            # the copy runs on the array's device; a run on another device joins it
            stream = ctx.stream if a.device == ctx.device else stream_elsewhere(a.device)
            alloc = a._allocation
            enqueue_ordered(
                ctx.run, ((alloc, stream, False),), ctx.backend.copy_to_host, out, alloc.buffer,
                stream.raw,
            )  # fmt: skip
            ctx.keep(out)
            ctx.wait_for(stream)
        return PendingHost(out)

    def label(self) -> str:
        return "to_host"

    def _children(self) -> Sequence[DeviceOperation[object]]:
        return (self._src,) if isinstance(self._src, DeviceOperation) else ()

    def _kind(self) -> str:
        return "copy"


def to_host(x: DeviceArray | DeviceOperation[DeviceArray]) -> DeviceOperation[HostArray]:
    """A NumPy copy of a device array.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    x
        The array, or an operation whose output is one.  The copy runs on
        the array's device, whichever device the run is on.

    Returns
    -------
    DeviceOperation[numpy.ndarray]
        An operation producing a new host array each time it runs.

    Raises
    ------
    gpuflow.UsageTypeError
        ``x`` is neither an array nor an operation, when the operation is built.
    gpuflow.UsageError
        Run inside a graph capture (a copy to the host cannot be captured).
    """
    _check_device_input(x, "to_host()")
    return _ToHost(x)


class _Copy(DeviceOperation[DeviceArray]):
    __slots__ = ("_device", "_known", "_out", "_plan", "_src")

    def __init__(
        self,
        src: DeviceArray | DeviceOperation[DeviceArray],
        out: DeviceArray | DeviceOperation[DeviceArray] | None,
        device: int | None,
    ) -> None:
        self._src = src
        self._out = out
        self._device = device
        #: the bytes copied, once a run found ``src`` and ``out``, both given
        #: as arrays, fit (their shapes, dtypes and devices never change);
        #: -1 until then, and for operations, whose outputs are checked each run
        self._known = -1
        self._plan = ANYWHERE

    def execute(self, ctx: ExecutionContext) -> DeviceArray:
        src = resolve_array(self._src, ctx, "copy() source")
        out = self._out
        nbytes = self._known
        if out is None:
            dev = ctx.device if self._device is None else ctx._runtime.check_device(self._device)
            stream = ctx.stream if dev == ctx.device else stream_elsewhere(dev)
            dst = allocate(ctx, src.shape, src.dtype, stream)
        else:
            dst = resolve_array(out, ctx, "copy() out")
            if nbytes < 0:
                nbytes = self._check_out(src, dst)
        if nbytes < 0:
            nbytes = src.nbytes
        if not nbytes:
            return dst
        # the copy runs on the destination's device (on a stream the default
        # policy gives, so that it queues behind no unrelated work there);
        # the run's stream joins it
        stream = ctx.stream
        if dst._allocation.buffer.device != stream.device:
            stream = stream_elsewhere(dst.device)
        s, d = src._allocation, dst._allocation
        be = ctx._runtime.backend
        enqueue_ordered(
            ctx.run, ((s, stream, False), (d, stream, True)), be.copy_device,
            d.buffer, s.buffer, nbytes, stream.raw,
        )  # fmt: skip
        if stream is not ctx.stream:
            ctx.wait_for(stream)
        elif (
            nbytes == self._known
            and src.device == stream.device
            and self._plan.generation != stream._generation
        ):
            # both arrays given, on the run's device: every run in this
            # device context enqueues the same copy, prepared once (an array
            # on another device could go with that device's context)
            step = functools.partial(be.copy_device, d.buffer, s.buffer, nbytes)
            self._plan = Plan(stream._generation, step, uses=((s, False), (d, True)), output=dst)
        return dst

    def _output_dtype(self) -> DType | None:
        # (the copy's dtype is its source's, or that of the array it fills)
        for x in (self._out, self._src):
            if isinstance(x, DeviceArray):
                return x.dtype
        if self._out is None and isinstance(self._src, DeviceOperation):
            return self._src._output_dtype()
        return None

    def _check_out(self, src: DeviceArray, dst: DeviceArray) -> int:
        """Refuse an ``out`` that does not fit ``src``; the bytes to copy."""
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise UsageError(
                f"copy(): out is {dst.shape} {dst.dtype}, the source {src.shape} {src.dtype}"
            )
        if self._device is not None and dst.device != self._device:
            raise UsageError(f"copy(): out is on device {dst.device}, not {self._device}")
        if dst.readonly:
            raise UsageError(f"copy(): out {dst!r} is read-only memory of another library")
        nbytes = src.nbytes
        if src is self._src and dst is self._out:
            self._known = nbytes
        return nbytes

    def label(self) -> str:
        where = "" if self._device is None else f" -> device {self._device}"
        return "copy" + (" into out" if self._out is not None else "") + where

    def _children(self) -> Sequence[DeviceOperation[object]]:
        return tuple(x for x in (self._src, self._out) if isinstance(x, DeviceOperation))

    def _kind(self) -> str:
        return "copy"


def copy(
    src: DeviceArray | DeviceOperation[DeviceArray],
    out: DeviceArray | DeviceOperation[DeviceArray] | None = None,
    device: int | None = None,
) -> DeviceOperation[DeviceArray]:
    """Copy a device array on the device.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    src
        The array, or an operation whose output is one.
    out
        The array to copy into (of ``src``'s shape and dtype), or an
        operation whose output is one; None: a new array.
    device
        The device of the new array (None: the device of the run).  Across
        devices the copy goes peer to peer where the hardware allows.

    Returns
    -------
    DeviceOperation[DeviceArray]
        ``out``, or the new array.

    Raises
    ------
    gpuflow.UsageTypeError
        ``src`` or ``out`` is neither an array nor an operation, when the
        operation is built.
    gpuflow.UsageError
        ``device`` is no device ordinal, when the operation is built.
    """
    _check_device_input(src, "copy() source")
    if out is not None:
        _check_device_input(out, "copy() out")
    if device is not None and (not isinstance(device, int) or device < 0):
        raise UsageError(f"copy(): device must be a device ordinal, not {device!r}")
    return _Copy(src, out, device)
