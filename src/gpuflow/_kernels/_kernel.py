"""CUDA C++ kernels: compiled by NVRTC, launched as operations.

:func:`compile` runs NVRTC at once (no GPU needed, so a syntax error is a
:class:`CompileError` on every machine) and parses the signature of every
``extern "C" __global__`` function.  Calling a kernel checks the arguments
against that signature (count, pointer dtype, scalar type and range) and
raises a :class:`UsageError` naming the kernel and the parameter before
anything is enqueued.  ``const T*`` parameters are read, ``T*`` ones are
written: that decides the hazards a launch orders itself after.

On ``sim``, a kernel runs its NumPy reference from ``references=`` (the
convention is in :func:`compile`'s docstring).
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import anyio.to_thread
import numpy as np

from .._backends import (
    CHECK_ARCH,
    DType,
    LaunchLimits,
    PointerArg,
    RawKernel,
    compile_source,
)
from .._core import (
    ANYWHERE,
    Allocation,
    DeviceOperation,
    Plan,
    Runtime,
    current_device,
    current_runtime,
    enqueue_ordered,
    enqueue_step,
    ensure_runtime,
    runtime_started,
)
from .._errors import CompileError, UsageError, UsageTypeError
from .._memory import DeviceArray

if TYPE_CHECKING:
    from .._core import ExecutionContext

_C_TYPES: dict[str, DType] = {
    name: np.dtype(dt)
    for names, dt in [
        (("float",), np.float32),
        (("double",), np.float64),
        (("__half", "half"), np.float16),
        (("bool",), np.bool_),
        (("char", "signed char", "int8_t"), np.int8),
        (("unsigned char", "uint8_t"), np.uint8),
        (("short", "short int", "signed short", "int16_t"), np.int16),
        (("unsigned short", "unsigned short int", "uint16_t"), np.uint16),
        (("int", "signed", "signed int", "int32_t"), np.int32),
        (("unsigned", "unsigned int", "uint32_t"), np.uint32),
        (
            ("long", "long int", "long long", "long long int", "signed long long", "int64_t",
             "ptrdiff_t", "ssize_t"),
            np.int64,
        ),
        (
            ("unsigned long", "unsigned long int", "unsigned long long",
             "unsigned long long int", "uint64_t", "size_t"),
            np.uint64,
        ),
    ]
    for name in names
}
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict"}


@dataclass(frozen=True, slots=True)
class Param:
    """One kernel parameter as the signature declares it."""

    name: str
    ctype: str
    dtype: DType | None  # None: void*
    pointer: bool
    const: bool

    def describe(self) -> str:
        if self.pointer:
            return f"{'const ' if self.const else ''}{self.ctype}* {self.name}"
        return f"{self.ctype} {self.name}"


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", " ", src)


_KERNEL_RE = re.compile(
    r"__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+"
    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)"
)


def _extern_c_spans(src: str) -> list[tuple[int, int]]:
    spans = []
    for m in re.finditer(r'extern\s+"C"\s*\{', src):
        depth, i = 1, m.end()
        while i < len(src) and depth:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        spans.append((m.end(), i))
    return spans


def _parse_param(kernel: str, text: str) -> Param:
    text = " ".join(text.split())
    m = re.match(r"^(.*?)([A-Za-z_]\w*)\s*(\[\s*\])?$", text)
    if not m or "&" in text:
        raise CompileError(f"kernel {kernel!r}: cannot parse parameter {text!r}", "")
    decl, name, brackets = m.group(1), m.group(2), m.group(3)
    stars = decl.count("*") + (1 if brackets else 0)
    if stars > 1:
        raise CompileError(
            f"kernel {kernel!r}: parameter {text!r}: only plain pointers and scalars are supported",
            "",
        )
    base, _, _after = decl.partition("*")
    words = [w for w in base.replace("*", " ").split() if w not in _QUALIFIERS]
    const = "const" in base.split()
    ctype = " ".join(words)
    if stars and ctype == "void":
        return Param(name, ctype, None, True, const)
    dtype = _C_TYPES.get(ctype)
    if dtype is None:
        raise CompileError(
            f"kernel {kernel!r}: parameter {text!r} has a type gpuflow cannot pass "
            f"(supported: {', '.join(sorted(set(_C_TYPES)))}, pointers to them, void*)",
            "",
        )
    return Param(name, ctype, dtype, bool(stars), const)


def parse_kernels(source: str) -> dict[str, tuple[Param, ...]]:
    """The ``extern "C" __global__`` kernels of ``source`` and their parameters."""
    src = _strip_comments(source)
    spans = _extern_c_spans(src)
    kernels: dict[str, tuple[Param, ...]] = {}
    for m in _KERNEL_RE.finditer(src):
        prefix = src[max(0, m.start() - 40) : m.start()]
        in_block = any(a <= m.start() < b for a, b in spans)
        if not in_block and not re.search(r'extern\s+"C"\s*$', prefix):
            continue  # a C++-mangled kernel cannot be looked up by name
        name, params = m.group(1), m.group(2).strip()
        if params in ("", "void"):
            kernels[name] = ()
        else:
            kernels[name] = tuple(_parse_param(name, p) for p in params.split(","))
    return kernels


#: A grid or block size: an int (NumPy's too) or a sequence of one to three.
Dims = int | np.integer[Any] | Sequence[int | np.integer[Any]]


class LaunchConfig:
    """Grid and block dimensions (ints or up to 3-tuples) and dynamic shared memory bytes.

    ``grid`` and ``block`` read back as 3-tuples, ``shmem`` as an int.

    Parameters
    ----------
    grid
        Blocks: an int, or 1 to 3 positive ints.
    block
        Threads a block: an int, or 1 to 3 positive ints.
    shmem
        Dynamic shared memory a block, in bytes.

    Raises
    ------
    gpuflow.UsageError
        A dimension that is not 1 to 3 positive ints, or a negative ``shmem``.
    """

    __slots__ = ("_fits", "block", "grid", "shmem")

    def __init__(
        self,
        grid: Dims,
        block: Dims,
        shmem: int = 0,
    ) -> None:
        self.grid = self._dims(grid, "grid")
        self.block = self._dims(block, "block")
        if not isinstance(shmem, int) or shmem < 0:
            raise UsageError(f"LaunchConfig: shmem must be a non-negative int, not {shmem!r}")
        self.shmem = shmem
        #: the last device limits it was found within (a launch's check, once)
        self._fits: LaunchLimits | None = None

    def _check(self, kernel: str, device: int, limits: LaunchLimits) -> None:
        """Refuse a launch past ``device``'s ``limits``, naming the limit,
        the value and the device."""
        if self._fits is limits:
            return
        where = f"kernel {kernel!r} on device {device}"
        for what, dims, most in (("grid", self.grid, limits.max_grid),
                                 ("block", self.block, limits.max_block)):
            for axis, n, top in zip("xyz", dims, most, strict=True):
                if n > top:
                    raise UsageError(
                        f"{where}: {what}={dims} asks for {n} along {axis}, past the device's "
                        f"limit of {top} (the most {'blocks' if what == 'grid' else 'threads'} "
                        f"a {what} has along {axis})"
                    )
        threads = self.block[0] * self.block[1] * self.block[2]
        if threads > limits.max_threads_per_block:
            raise UsageError(
                f"{where}: block={self.block} is {threads} threads, past the device's limit "
                f"of {limits.max_threads_per_block} threads a block"
            )
        if self.shmem > limits.max_shared_memory_per_block:
            raise UsageError(
                f"{where}: shmem={self.shmem} bytes, past the device's limit of "
                f"{limits.max_shared_memory_per_block} bytes of shared memory a block"
            )
        self._fits = limits

    @staticmethod
    def _dims(v: Dims, what: str) -> tuple[int, int, int]:
        if isinstance(v, int | np.integer):
            t: tuple[Any, ...] = (v,)
        elif isinstance(v, Sequence):
            t = tuple(v)
        else:  # a float or None is a usage error, not a TypeError from tuple()
            t = ()
        if not 1 <= len(t) <= 3 or not all(isinstance(x, int | np.integer) and x >= 1 for x in t):
            raise UsageError(f"LaunchConfig: {what} must be 1 to 3 positive ints, not {v!r}")
        t = tuple(int(x) for x in t) + (1,) * (3 - len(t))
        return (t[0], t[1], t[2])

    @classmethod
    def for_num_elems(cls, n: int, block: int = 256) -> LaunchConfig:
        """One thread an element: ``ceil(n / block)`` blocks of ``block`` threads.

        Parameters
        ----------
        n
            How many elements (zero or more: at least one block).
        block
            Threads a block.

        Returns
        -------
        LaunchConfig

        Raises
        ------
        gpuflow.UsageError
            ``n`` is not a non-negative int.
        """
        if not isinstance(n, int) or n < 0:
            raise UsageError(f"for_num_elems: n must be a non-negative int, not {n!r}")
        return cls(max(1, math.ceil(n / block)), block)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LaunchConfig) and (self.grid, self.block, self.shmem) == (
            other.grid, other.block, other.shmem,
        )

    def __hash__(self) -> int:
        return hash((self.grid, self.block, self.shmem))

    def __repr__(self) -> str:
        return f"LaunchConfig(grid={self.grid}, block={self.block}, shmem={self.shmem})"


class Module:
    """A compiled CUDA C++ source; its kernels are attributes (``mod.saxpy``).

    Made by :func:`compile`; not constructed directly.
    """

    def __init__(
        self,
        source: str,
        references: dict[str, Callable[..., object]],
        options: tuple[str, ...],
        signatures: dict[str, tuple[Param, ...]],
    ) -> None:
        self.source = source
        self.references = references
        self.options = options
        self._kernels = {n: Kernel(self, n, p) for n, p in signatures.items()}
        # per runtime (weakly: a replaced runtime's handles go with it)
        self._loaded: weakref.WeakKeyDictionary[Runtime, dict[tuple[int, int, str], RawKernel]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    @property
    def kernels(self) -> dict[str, Kernel]:
        """The module's kernels, by name."""
        return dict(self._kernels)

    def binary_for(self, arch: str) -> bytes:
        """Device code for ``arch`` (``sm_90``: CUBIN; ``compute_90``: PTX), compiled once.

        Parameters
        ----------
        arch
            An NVRTC architecture (``"sm_90"``, ``"compute_90"``).

        Returns
        -------
        bytes

        Raises
        ------
        gpuflow.CompileError
            NVRTC rejected the source for ``arch``.
        """
        return compile_source(self.source, arch, self.options)

    def __getattr__(self, name: str) -> Kernel:
        kernels = self.__dict__.get("_kernels", {})
        try:
            return kernels[name]  # type: ignore[no-any-return]
        except KeyError:
            raise AttributeError(
                f"the module has no extern \"C\" __global__ kernel {name!r} "
                f"(it has: {', '.join(kernels) or 'none'})"
            ) from None

    def __dir__(self) -> list[str]:
        return [*super().__dir__(), *self._kernels]

    def __repr__(self) -> str:
        return f"<gpuflow.Module kernels: {', '.join(self._kernels) or 'none'}>"

    def _load(self, ctx: ExecutionContext, name: str) -> RawKernel:
        return self._load_on(ctx._runtime, ctx.device, name)

    def _load_on(self, rt: Runtime, device: int, name: str) -> RawKernel:
        # a kernel handle belongs to one runtime, device and context generation
        key = (device, rt.generation(device), name)
        with self._lock:
            loaded = self._loaded.get(rt)
            if loaded is None:
                loaded = self._loaded[rt] = {}
            k = loaded.get(key)
            if k is None:
                k = loaded[key] = rt.backend.load_kernel(device, self, name)
        return k

    def _load_ahead(self, rt: Runtime) -> None:
        """Load every kernel on every device of ``rt`` now, into every context
        that runs it (the device's, and each partition's of reserved SMs),
        where loading waits for the device's running kernels (CUDA: seen on
        the H200, a module's load waited for a kernel running on another
        stream; ``sim`` does as CUDA does): a first launch then never stalls
        the thread that makes it, whatever class it runs in.  A failure is a
        warning, and the load is tried again at the first launch (which
        raises)."""
        be = rt.backend
        if not be.loads_wait_for_kernels or not rt.live:
            return
        try:
            for device in rt.devices:
                be.load_ahead(device, self, rt.partitions_of(device))
        except Exception as exc:
            warnings.warn(f"gpuflow: loading a module ahead failed: {exc!r}", stacklevel=2)


def compile(
    source: str,
    references: Mapping[str, Callable[..., object]] | None = None,
    options: Sequence[str] = (),
) -> Module:
    """Compile CUDA C++ with NVRTC and parse its ``extern "C" __global__`` kernels.

    NVRTC runs at once, on any machine (no GPU needed): a source it rejects
    raises :class:`CompileError`, with NVRTC's log in ``.log``.  ``options``
    are more NVRTC options (``"-DN=4"``, ``"-I/path"``).  Each kernel is an
    attribute of the returned :class:`Module`:
    ``mod.saxpy(gf.LaunchConfig(grid, block), *args)`` is an operation that
    launches it, its arguments checked against the C signature first.

    ``references`` maps kernel names to Python functions that the ``sim``
    backend runs in the kernels' place (``cuda`` runs the device code).  A
    reference computes what the whole launch computes, and is called:

    * with one argument per kernel parameter, in the signature's order (a
      reference that cannot take that many is refused here);
    * with each pointer as a flat, 1-D NumPy view of the whole array, of the
      dtype its C type names (``float*``: float32; ``void*``: the array's
      own), whatever the array's shape;
    * with ``const T*`` views read-only, ``T*`` views writable;
    * with scalars as Python numbers (``int``, ``float``, ``bool``);
    * without the launch configuration.

    It writes its results in place, into the writable views; what it returns
    is ignored.  A reference that raises is a sticky fault of the device, as
    an illegal address is on a GPU.  For example::

        extern "C" __global__ void saxpy(float a, const float* x, float* y, int n)

        def saxpy(a: float, x: np.ndarray, y: np.ndarray, n: int) -> None:
            y[:n] = a * x[:n] + y[:n]

    Index the views with the bounds the kernel uses (``y[:n]``, not
    ``y[:]`` or the whole array): a view's slice that reaches past the end
    of its array (``n`` larger than ``y``) is then reported as the
    out-of-bounds access it is on a GPU, a sticky fault naming the slice,
    where NumPy alone would clip the slice and hide the bad launch.

    Any thread; it blocks while NVRTC compiles and while the module loads,
    which waits for the kernels running on the device (compile at start-up;
    in an event loop that serves meanwhile, ``await gf.compile_async(...)``).

    Parameters
    ----------
    source
        The CUDA C++ text.
    references
        Per kernel name, the Python function ``sim`` runs in its place
        (above); a kernel with none cannot run on ``sim``.
    options
        More NVRTC options.

    Returns
    -------
    Module
        Its kernels as attributes.

    Raises
    ------
    gpuflow.CompileError
        NVRTC rejected the source (its log in ``.log``).
    gpuflow.UsageTypeError
        ``source`` is not text.
    gpuflow.UsageError
        A reference names no kernel of the source, is not callable, or
        cannot take the kernel's parameters.
    """
    if not isinstance(source, str):
        raise UsageTypeError(
            f"compile() expected CUDA C++ source text, got {type(source).__name__}"
        )
    refs = dict(references or {})
    opts = tuple(options)
    compile_source(source, CHECK_ARCH, opts)
    sigs = parse_kernels(source)
    unknown = set(refs) - set(sigs)
    if unknown:
        raise UsageError(
            f"references name kernels the source does not define: {', '.join(sorted(unknown))}"
        )
    for n, fn in refs.items():
        if not callable(fn):
            raise UsageError(f"reference for kernel {n!r} is not callable")
        _check_arity(n, sigs[n], fn)
    module = Module(source, refs, opts, sigs)
    _compiled.add(module)
    rt = current_runtime()
    if rt is not None:
        module._load_ahead(rt)
    return module


async def compile_async(
    source: str,
    references: Mapping[str, Callable[..., object]] | None = None,
    options: Sequence[str] = (),
) -> Module:
    """:func:`compile` without blocking the event loop: NVRTC's compile and
    the module's loads run in a worker thread, and the await parks
    meanwhile, so a service compiles while it serves.

    A module's load waits for the kernels running on the device (CUDA's
    driver does; so does ``sim``): :func:`compile` in an event loop's thread
    stops every task of the loop that long, behind work it does not depend
    on.  This returns the same module, loaded into every context that runs
    it, once the worker is done.  Cancellation raises the loop's own
    exception at once; the worker finishes on its own (a compile and a load
    cannot be stopped) and its module is dropped.

    Parameters
    ----------
    source
        The CUDA C++ text.
    references
        Per kernel name, the Python function ``sim`` runs in its place.
    options
        More NVRTC options.

    Returns
    -------
    Module
        Its kernels as attributes.

    Raises
    ------
    gpuflow.CompileError
        NVRTC rejected the source (its log in ``.log``).
    gpuflow.UsageTypeError
        ``source`` is not text (before any thread starts).
    gpuflow.UsageError
        As :func:`compile`.
    """
    if not isinstance(source, str):
        raise UsageTypeError(
            f"compile_async() expected CUDA C++ source text, got {type(source).__name__}"
        )
    work = functools.partial(compile, source, references, tuple(options))
    return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)


#: Every live module: a runtime made later loads them ahead (see Module._load_ahead).
_compiled: weakref.WeakSet[Module] = weakref.WeakSet()


def _load_compiled(rt: Runtime) -> None:
    for module in list(_compiled):
        module._load_ahead(rt)


runtime_started.append(_load_compiled)


def _check_arity(kernel: str, params: tuple[Param, ...], fn: Callable[..., object]) -> None:
    # on sim a reference called with the wrong number of arguments would fail
    # only at its first launch, as a sticky fault of the whole device
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none to read: trust them
        return
    try:
        sig.bind(*params)  # *args and defaults take part, as in the real call
    except TypeError:
        wanted = ", ".join(p.describe() for p in params)
        raise UsageTypeError(
            f"the reference for kernel {kernel!r} takes {sig}, but it is called with one "
            f"argument per kernel parameter, in order: {kernel}({wanted})"
        ) from None


def _scalar(kernel: str, p: Param, v: Any) -> np.generic:
    assert p.dtype is not None
    kind = p.dtype.kind
    if isinstance(v, np.generic):
        ok = (
            v.dtype == p.dtype
            or (kind == "f" and v.dtype.kind in "fiu")
            or (kind in "iu" and v.dtype.kind in "iu")
        )
    elif isinstance(v, bool):
        ok = kind == "b"
    elif isinstance(v, int):
        ok = kind in "iuf"
    elif isinstance(v, float):
        ok = kind == "f"
    else:
        ok = False
    if not ok:
        raise UsageTypeError(
            f"kernel {kernel!r}, parameter {p.describe()!r}: expected {_a(p.ctype)} scalar, "
            f"got {described(v)}"
        )
    if kind in "iu":
        info = np.iinfo(p.dtype)  # type: ignore[type-var]  # (an integer dtype, by its kind)
        if not info.min <= int(v) <= info.max:
            raise UsageError(
                f"kernel {kernel!r}, parameter {p.describe()!r}: {v} is out of range for {p.ctype}"
            )
    return p.dtype.type(v)


def _a(word: str) -> str:
    """``word`` with its indefinite article: "an int", "a float"."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def described(value: object) -> str:
    """A value as an error message names it: what the user passed, not a
    class of gpuflow's internals."""
    if isinstance(value, DeviceOperation):
        return f"an operation ({value!r})"
    if isinstance(value, DeviceArray):
        return f"a DeviceArray ({value.shape} {value.dtype})"
    return f"{type(value).__name__} {value!r:.60}"


def _check_array(kernel: str, p: Param, a: DeviceArray) -> None:
    if p.dtype is not None and a.dtype != p.dtype:
        raise UsageError(
            f"kernel {kernel!r}, parameter {p.describe()!r}: needs a {p.dtype} array, "
            f"got {a.dtype}"
        )


class Kernel:
    """A kernel of a :class:`Module`; call it to get a launch operation.

    Made by :func:`compile`: an attribute of its :class:`Module`; not
    constructed directly.
    """

    def __init__(self, module: Module, name: str, params: tuple[Param, ...]) -> None:
        self.module = module
        self.name = name
        self.params = params

    @property
    def signature(self) -> str:
        """The kernel's C signature as gpuflow parsed it (``saxpy(float a, ...)``)."""
        return f"{self.name}({', '.join(p.describe() for p in self.params)})"

    def __call__(self, config: LaunchConfig, *args: object) -> DeviceOperation[Any]:
        """An operation launching the kernel with ``args``.

        Arguments are DeviceArrays, operations producing them (run first, in
        order, on the same stream) or scalars.  The operation produces the
        arrays the kernel may write (non-``const`` pointers): one array, a
        tuple of them, or None.
        """
        if not isinstance(config, LaunchConfig):
            raise UsageTypeError(
                f"kernel {self.name!r}: the first argument must be a gf.LaunchConfig "
                f"(e.g. gf.LaunchConfig.for_num_elems(n)), got {described(config)}"
            )
        if len(args) != len(self.params):
            raise UsageTypeError(
                f"kernel {self.signature} takes {len(self.params)} arguments, got {len(args)}"
            )
        # (the device it will most likely run on: the current one; a run on
        # another device checks again there, when the kernel is loaded)
        device = current_device()
        config._check(self.name, device, ensure_runtime().backend.launch_limits(device))
        checked: list[object] = []
        for p, a in zip(self.params, args, strict=True):
            if isinstance(a, DeviceOperation):
                dtype = a._output_dtype()  # (what it produces, where known already)
                if dtype is not None:
                    if not p.pointer:
                        raise UsageTypeError(
                            f"kernel {self.name!r}, parameter {p.describe()!r}: expected "
                            f"{_a(p.ctype)} scalar, got {described(a)}, which makes an array"
                        )
                    if p.dtype is not None and dtype != p.dtype:
                        raise UsageError(
                            f"kernel {self.name!r}, parameter {p.describe()!r}: needs a "
                            f"{p.dtype} array, got {described(a)}, which makes a {dtype} one"
                        )
                checked.append(a)
            elif p.pointer:
                if not isinstance(a, DeviceArray):
                    raise UsageTypeError(
                        f"kernel {self.name!r}, parameter {p.describe()!r}: needs a DeviceArray "
                        f"(or an operation producing one), got {described(a)}"
                    )
                _check_array(self.name, p, a)
                checked.append(a)
            else:
                checked.append(_scalar(self.name, p, a))
        return _Launch(self, config, tuple(checked))

    def __repr__(self) -> str:
        return f"<gpuflow.Kernel {self.signature}>"


#: What a run of a launch of arrays enqueues: the loaded kernel, its
#: arguments, its uses of memory (each allocation, and whether it is
#: written: reads first) and its output.
_Prepared = tuple[
    RawKernel, list["PointerArg | np.generic"], list[tuple["Allocation", bool]], object
]


class _Launch(DeviceOperation[object]):
    __slots__ = ("_args", "_cache", "_config", "_kernel", "_plain", "_plan")

    def __init__(self, kernel: Kernel, config: LaunchConfig, args: tuple[object, ...]) -> None:
        self._kernel = kernel
        self._config = config
        self._args = args
        self._plan = ANYWHERE
        # scalars only: nothing to resolve, no hazards, the arguments are final
        self._plain = not any(
            p.pointer or isinstance(a, DeviceOperation)
            for p, a in zip(kernel.params, args, strict=True)
        )
        #: the kernel loaded for one device context generation
        self._cache: tuple[int, RawKernel] | None = None

    def _loaded(self, ctx: ExecutionContext) -> RawKernel:
        # one launch op is usually run on one device: remember its handle
        # there (and make a plain launch's plan, its step), for that device
        # context's generation (unique in the process: a new runtime's
        # never matches)
        c = self._cache
        generation = ctx.stream._generation
        if c is None or c[0] != generation:
            cfg = self._config
            cfg._check(self._kernel.name, ctx.device, ctx.backend.launch_limits(ctx.device))
            raw = self._kernel.module._load(ctx, self._kernel.name)
            c = self._cache = (generation, raw)
            if self._plain:  # (prepared once: the common await calls it)
                step = ctx._runtime.backend.prepare_launch(  # (its arguments are scalars)
                    raw, cfg.grid, cfg.block, cfg.shmem, cast("tuple[np.generic, ...]", self._args)
                )
                self._plan = Plan(generation, step)
        return c[1]

    def execute(self, ctx: ExecutionContext) -> Any:
        stream = ctx.stream
        plan = self._plan
        if plan.generation != stream._generation and self._plain:
            self._loaded(ctx)  # (its plan, for this context)
            plan = self._plan
        if plan.generation == stream._generation and plan.step is not None:
            if plan.uses is None:  # (scalars only)
                plan.step(stream.raw)
                return None
            return enqueue_step(plan, stream, ctx.run)  # (its arrays are final)
        raw, args, uses, out = self._prepare(ctx)
        cfg = self._config
        enqueue_ordered(
            ctx.run, [(alloc, stream, writes) for alloc, writes in uses], ctx.backend.launch,
            raw, cfg.grid, cfg.block, cfg.shmem, args, stream.raw,
        )  # fmt: skip
        return out

    def _prepare(self, ctx: ExecutionContext) -> _Prepared:
        """The launch's arguments, its uses of memory (reads first) and its
        output, its arrays checked.  Where every argument is final (no
        operation among them, whose run this one's enqueues, each time),
        the launch's plan for the device context's generation: a step with
        those uses and that output, which every run then takes as it is."""
        k = self._kernel
        values: list[Any] = []
        final = True
        for p, a in zip(k.params, self._args, strict=True):
            if isinstance(a, DeviceOperation):
                final = False
                a = a.execute(ctx)
                if p.pointer:
                    if not isinstance(a, DeviceArray):
                        raise UsageError(
                            f"kernel {k.name!r}, parameter {p.describe()!r}: the operation "
                            f"produced {type(a).__name__}, not a DeviceArray"
                        )
                    _check_array(k.name, p, a)
                else:
                    a = _scalar(k.name, p, a)
            values.append(a)
        args: list[PointerArg | np.generic] = []
        written: list[DeviceArray] = []
        reads: list[tuple[Allocation, bool]] = []
        writes: list[tuple[Allocation, bool]] = []
        for p, a in zip(k.params, values, strict=True):
            if p.pointer:
                a._check_usable(ctx, f"kernel {k.name!r}, parameter {p.describe()!r}")
                if a.device != ctx.device:
                    raise UsageError(
                        f"kernel {k.name!r}, parameter {p.describe()!r}: the array is on "
                        f"device {a.device}, the launch on device {ctx.device} "
                        "(gf.copy(array, device=...) moves it)"
                    )
                dt = a.dtype if p.dtype is None else p.dtype
                buf = a._allocation.buffer
                args.append(PointerArg(buf, dt, a.nbytes // dt.itemsize, not p.const))
                if p.const:
                    reads.append((a._allocation, False))
                else:
                    if a.readonly:
                        raise UsageError(
                            f"kernel {k.name!r}, parameter {p.describe()!r}: the array is "
                            "read-only memory of another library; declare the parameter const"
                        )
                    writes.append((a._allocation, True))
                    written.append(a)
            else:
                args.append(a)
        raw = self._loaded(ctx)
        out = None if not written else written[0] if len(written) == 1 else tuple(written)
        uses = reads + writes
        if final:  # (an array's device and context are its own for good)
            cfg = self._config
            step = ctx._runtime.backend.prepare_launch(raw, cfg.grid, cfg.block, cfg.shmem, args)
            self._plan = Plan(ctx.stream._generation, step, uses=tuple(uses), output=out)
        return raw, args, uses, out

    def label(self) -> str:
        return f"kernel {self._kernel.name}"

    def _children(self) -> Sequence[DeviceOperation[object]]:
        return tuple(a for a in self._args if isinstance(a, DeviceOperation))

    def _kind(self) -> str:
        return "kernel"
