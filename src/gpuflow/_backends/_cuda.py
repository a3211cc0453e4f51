"""The ``cuda`` backend: the interface of :mod:`._base` on the CUDA driver.

The only module of gpuflow (with :mod:`._nvrtc`) that touches CUDA.  Handles
are kept as plain integers; the driver is reached two ways:

* ``cuda.bindings.driver`` for everything set up once or rarely (contexts,
  streams, events, modules, memory pools, copies, graphs) and for
  ``cuLaunchKernel``, called with the address of a per-thread parameter array
  (measured: faster than libcuda through ctypes, whose per-argument
  conversions cost more than the bindings' whole call);
* libcuda itself, through :mod:`ctypes`, for the small calls made once or more
  per operation (event record and wait, stream and event query, host
  functions, stream-ordered alloc/free, graph launch), and necessarily for
  ``cuLaunchHostFunc``: the bindings' wrapper takes the GIL when the host
  function fires (measured: 5 ms stream stalls).

cuda.core is not used at run time: its objects own their handles with
finalizers of their own, which would destroy them after a primary-context
reset or after a sticky fault, where gpuflow must leak instead; and its
per-call overhead is above the 1 µs gpuflow may add to a launch.

Completion bridge, native half: each stream owns a POSIX semaphore;
``enqueue_signal`` enqueues two host functions, ``sem_post(stream_sem)`` then
``sem_post(global_sem)``, both libc's own ``sem_post`` called by the driver
thread with no Python involved.  The dispatcher sleeps in ``sem_timedwait`` on
the global semaphore (ctypes releases the GIL) and counts each stream's posts
with ``sem_trywait``.  ``CudaBackend(signals="event")`` is the measured
alternative: a pooled event then one host function; see ``__init__``.

Sticky faults: ``query`` (and every call that meets the fault) records a
:class:`DeviceFaultError`; later calls raise it.  ``reset_device`` resets the
primary context and retains it again; with driver 580 (CUDA 13) on an H200
the driver refused every retain after an illegal address (measured), as
CUDA's documentation warns ("the process must be terminated and
relaunched"): the reset then raises :class:`DeviceFaultError` with the
driver's code and the device stays faulted.

Contexts: one primary context per device, made current on whichever thread
calls, cached per thread (a token per context generation, so a reset makes
every thread set the new one).

Copies between pageable host memory and the device go through pinned staging
buffers so that neither direction blocks the calling thread: host to device
copies the source into the staging buffer at the call; device to host lands
in a staging buffer and is copied into the destination by the first
completion check that proves it finished (``take_signals``, ``query`` or
``synchronize``, on any stream), which always comes before the front end can
see the operation done.  Staging buffers are recycled by event query.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from .._errors import DeviceError, DeviceFaultError, OutOfMemoryError, UsageError
from ._base import Backend, KernelArg, ModuleSource, PointerArg
from ._codes import (
    CONTEXT_ERRORS,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
    CUDA_SUCCESS,
    STICKY_ERRORS,
    error_class,
)

__all__ = ["CudaBackend", "cuda_device_count"]

# -- driver constants (result codes: .._codes) ------------------------------------
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2
_MEMHOSTALLOC_PORTABLE = 1

_MAX_ARGS = 512  # 8-byte slots of the per-thread parameter buffer
_DEFAULT_SHMEM = 48 * 1024
_STAGE_MIN = 64 * 1024  # smallest staging buffer (size classes are powers of two)
_STAGE_H2D_MIN = 64 * 1024  # host-to-device copies below this go straight from pageable memory
_STAGE_MAX = 256 << 20  # larger copies go straight (the driver's own pageable path)
_STAGE_LIMIT = 1 << 30  # pinned staging memory per device, at most
_FILL_THREADS = 256
_FILL_MAX_BLOCKS = 8192

_cu_module: Any = None


def _driver() -> Any:
    """``cuda.bindings.driver``, imported on first use (no libcuda needed to import it)."""
    global _cu_module
    if _cu_module is None:
        from cuda.bindings import driver

        _cu_module = driver
    return _cu_module


def cuda_device_count() -> int:
    """How many CUDA devices the driver reports; 0 where there is no driver or device."""
    try:
        cu = _driver()
        (err,) = cu.cuInit(0)
        if int(err) != CUDA_SUCCESS:
            return 0
        err, n = cu.cuDeviceGetCount()
        return int(n) if int(err) == CUDA_SUCCESS else 0
    except Exception:  # no driver library, no device, broken install: no CUDA here
        return 0


def _err_name(rc: int) -> str:
    try:
        return str(_driver().CUresult(rc).name)
    except Exception:
        return f"CUresult {rc}"


# -- libc / libcuda through ctypes -----------------------------------------------
class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Native:
    """The ctypes entry points (libcuda's and libc's semaphores)."""

    def __init__(self) -> None:
        vp, ui, ci = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        lib = ctypes.CDLL("libcuda.so.1")

        def cu(name: str, argtypes: list[Any]) -> Any:
            f = getattr(lib, name)
            f.argtypes = argtypes
            f.restype = ci
            return f

        self.ctx_set_current = cu("cuCtxSetCurrent", [vp])
        self.ctx_synchronize = cu("cuCtxSynchronize", [])
        self.launch_host_func = cu("cuLaunchHostFunc", [vp, vp, vp])
        self.event_record = cu("cuEventRecord", [vp, vp])
        self.event_query = cu("cuEventQuery", [vp])
        self.stream_wait_event = cu("cuStreamWaitEvent", [vp, vp, ui])
        self.stream_query = cu("cuStreamQuery", [vp])
        self.stream_synchronize = cu("cuStreamSynchronize", [vp])
        self.graph_launch = cu("cuGraphLaunch", [vp, vp])
        self.mem_alloc_async = cu(
            "cuMemAllocAsync", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, vp]
        )
        self.mem_free_async = cu("cuMemFreeAsync", [ctypes.c_uint64, vp])

        libc = ctypes.CDLL(None, use_errno=True)
        self.sem_post_addr: int = ctypes.cast(libc.sem_post, vp).value or 0
        self.sem_init = libc.sem_init
        self.sem_init.argtypes = [vp, ci, ui]
        self.sem_init.restype = ci
        self.sem_post = libc.sem_post
        self.sem_post.argtypes = [vp]
        self.sem_post.restype = ci
        self.sem_wait = libc.sem_wait
        self.sem_wait.argtypes = [vp]
        self.sem_wait.restype = ci
        self.sem_trywait = libc.sem_trywait
        self.sem_trywait.argtypes = [vp]
        self.sem_trywait.restype = ci
        self.sem_timedwait = libc.sem_timedwait
        self.sem_timedwait.argtypes = [vp, ctypes.POINTER(_Timespec)]
        self.sem_timedwait.restype = ci
        # glibc >= 2.30: a monotonic deadline, immune to wall-clock jumps
        self.sem_clockwait: Any = getattr(libc, "sem_clockwait", None)
        if self.sem_clockwait is not None:
            self.sem_clockwait.argtypes = [vp, ci, ctypes.POINTER(_Timespec)]
            self.sem_clockwait.restype = ci

    def new_sem(self) -> tuple[Any, int]:
        buf = ctypes.create_string_buffer(64)  # sizeof(sem_t) is 32 on x86-64 and aarch64
        if self.sem_init(buf, 0, 0) != 0:
            raise DeviceError(f"sem_init failed (errno {ctypes.get_errno()})")
        # a host function may still post it after its stream and backend are
        # gone (a backend replaced by init_device_contexts, say): the memory
        # must never be reused for anything else, so it lives with the process
        _SEMAPHORES.append(buf)
        return buf, ctypes.addressof(buf)


#: Every semaphore a host function may post: 64 bytes a stream, never freed.
_SEMAPHORES: list[Any] = []


# -- handles ---------------------------------------------------------------------
class _Token:
    """Identity of one life of a device's primary context (a reset makes a new one)."""

    __slots__ = ()


class _Dev:
    __slots__ = (
        "arch",
        "builtins",
        "ctx",
        "cudev",
        "events",
        "fault",
        "free_host",
        "host_bytes",
        "index",
        "lock",
        "name",
        "peers",
        "pending",
        "pool",
        "side",
        "token",
    )  # fmt: skip

    def __init__(self, index: int, cudev: Any, name: str, arch: str) -> None:
        self.index = index
        self.cudev = cudev
        self.ctx = 0
        self.token = _Token()
        self.fault: DeviceFaultError | None = None
        self.name = name
        self.arch = arch
        self.pool: Any = None
        self.lock = threading.RLock()
        self.events: list[int] = []  # recycled CUevents (disable-timing)
        self.side = 0  # a private stream for allocations made during a capture
        self.builtins: dict[str, Any] | None = None
        self.free_host: dict[int, list[_HostBuf]] = {}
        self.pending: list[_Pending] = []
        self.host_bytes = 0
        self.peers: list[int] = []


class _Capture:
    __slots__ = ("deferred_frees", "streams")

    def __init__(self, origin: CudaStream) -> None:
        self.streams: list[CudaStream] = [origin]
        self.deferred_frees: list[tuple[CudaBuffer, CudaStream]] = []


class CudaStream:
    """A non-blocking stream and its completion semaphore."""

    __slots__ = (
        "capture", "destroyed", "dev", "handle", "obj", "pre_capture", "sem_addr", "sig_events",
        "token",
    )  # fmt: skip

    def __init__(self, dev: _Dev, handle: Any, sem_addr: int) -> None:
        self.dev = dev
        self.obj = handle  # the cuda.bindings CUstream, for the launch path
        self.handle = int(handle)
        self.sem_addr = sem_addr
        self.sig_events: collections.deque[int] = collections.deque()
        self.token = dev.token
        self.capture: _Capture | None = None
        self.pre_capture = 0  # an event recorded just before the capture began
        self.destroyed = False

    def __repr__(self) -> str:
        return f"<cuda stream 0x{self.handle:x} on device {self.dev.index}>"


class CudaEvent:
    """A recorded event; its CUevent goes back to the device's pool when dropped."""

    __slots__ = ("capture", "dev", "handle", "token")

    def __init__(self, dev: _Dev, handle: int, capture: _Capture | None) -> None:
        self.dev = dev
        self.handle = handle
        self.token = dev.token
        self.capture = capture

    def __del__(self) -> None:
        dev = self.dev
        if self.token is dev.token and dev.fault is None:
            dev.events.append(self.handle)


class CudaBuffer:
    """Device memory from the device's stream-ordered pool."""

    __slots__ = ("dev", "device", "freed", "nbytes", "ptr", "token")

    def __init__(self, dev: _Dev, nbytes: int, ptr: int) -> None:
        self.dev = dev
        self.device = dev.index
        self.nbytes = nbytes
        self.ptr = ptr
        self.token = dev.token
        self.freed = False

    def __repr__(self) -> str:
        return f"<cuda buffer 0x{self.ptr:x} ({self.nbytes} bytes) on device {self.device}>"


class _Module:
    """A loaded CUmodule; unloaded when its last kernel handle goes."""

    __slots__ = ("__weakref__", "backend", "dev", "handle", "token")

    def __init__(self, backend: CudaBackend, dev: _Dev, handle: int) -> None:
        self.backend = backend
        self.dev = dev
        self.handle = handle
        self.token = dev.token

    def __del__(self) -> None:
        dev = self.dev
        if self.token is not dev.token or dev.fault is not None:
            return  # gone with the context, or a faulted context: leak
        try:
            self.backend._cur(dev)
            _driver().cuModuleUnload(self.handle)
        except Exception:
            pass


class CudaKernel:
    """A launchable CUfunction; keeps its module loaded."""

    __slots__ = ("dev", "func", "module", "name", "obj", "shmem_max", "token")

    def __init__(self, dev: _Dev, name: str, func: Any, module: _Module) -> None:
        self.dev = dev
        self.name = name
        self.obj = func  # the cuda.bindings CUfunction, for the launch path
        self.func = int(func)
        self.module = module
        self.token = dev.token
        self.shmem_max = _DEFAULT_SHMEM

    def __repr__(self) -> str:
        return f"<cuda kernel {self.name!r} on device {self.dev.index}>"


class CudaGraph:
    """An instantiated graph (CUgraphExec) and the CUgraph it came from."""

    __slots__ = ("backend", "dev", "exec", "graph", "token")

    def __init__(self, backend: CudaBackend, dev: _Dev, graph: int, exec_: int) -> None:
        self.backend = backend
        self.dev = dev
        self.graph = graph
        self.exec = exec_
        self.token = dev.token

    def __del__(self) -> None:
        dev = self.dev
        if self.token is not dev.token or dev.fault is not None:
            return
        try:
            self.backend._cur(dev)
            cu = _driver()
            cu.cuGraphExecDestroy(self.exec)
            cu.cuGraphDestroy(self.graph)
        except Exception:
            pass


class _HostBuf:
    __slots__ = ("array", "ptr", "size")

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr = ptr
        self.size = size
        raw: Any = (ctypes.c_uint8 * size).from_address(ptr)
        self.array: np.ndarray[Any, np.dtype[np.uint8]] = np.frombuffer(raw, dtype=np.uint8)


class _Pending:
    """A staged copy in flight: ``buf`` is busy until ``event`` completes."""

    __slots__ = ("buf", "dst", "event", "nbytes")

    def __init__(
        self, event: int, buf: _HostBuf, dst: np.ndarray[Any, Any] | None, nbytes: int
    ) -> None:
        self.event = event
        self.buf = buf
        self.dst = dst
        self.nbytes = nbytes


class _ThreadState(threading.local):
    """Per thread: which context is current, and a kernel-parameter buffer.

    The parameter buffer is ``_MAX_ARGS`` pointers followed by ``_MAX_ARGS``
    8-byte value slots; pointer ``i`` always points at slot ``i``, so a launch
    only packs its values (the driver copies them during ``cuLaunchKernel``).
    """

    def __init__(self) -> None:
        self.token: _Token | None = None
        self.params = (ctypes.c_uint64 * (2 * _MAX_ARGS))()
        base = ctypes.addressof(self.params)
        for i in range(_MAX_ARGS):
            self.params[i] = base + 8 * (_MAX_ARGS + i)
        self.params_addr = base


_VALUES_OFFSET = 8 * _MAX_ARGS

_SCALAR_CODES = {
    ("f", 2): "e", ("f", 4): "f", ("f", 8): "d",
    ("i", 1): "b", ("i", 2): "h", ("i", 4): "i", ("i", 8): "q",
    ("u", 1): "B", ("u", 2): "H", ("u", 4): "I", ("u", 8): "Q",
    ("b", 1): "?",
}  # fmt: skip


def _slot_code(t: type) -> str:
    if t is PointerArg:
        return "Q"
    if issubclass(t, np.generic):
        dt = np.dtype(t)
        code = _SCALAR_CODES.get((dt.kind, dt.itemsize))
        if code is not None:
            return code + "x" * (8 - dt.itemsize)
    raise UsageError(f"kernel argument of type {t.__name__} is not supported by the cuda backend")


# -- built-in kernels: fill with 8-byte patterns, arange --------------------------
_BUILTIN_SOURCE = r"""
typedef unsigned long long u64;
#define GF_LOOP for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; \
                     i += (u64)gridDim.x * blockDim.x)
__device__ __forceinline__ unsigned short gf_f2h(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float gf_h2f(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
extern "C" __global__ void gf_fill_u64(u64* p, u64 v, u64 n) { GF_LOOP p[i] = v; }
/* integers: start + (T)i * step, wrapping as NumPy does (two's complement) */
#define GF_ARANGE_U(NAME, T) \
  extern "C" __global__ void NAME(T* p, T start, T step, u64 n) { \
    GF_LOOP p[i] = (T)(i * (u64)step + (u64)start); }
GF_ARANGE_U(gf_arange_u8, unsigned char)
GF_ARANGE_U(gf_arange_u16, unsigned short)
GF_ARANGE_U(gf_arange_u32, unsigned int)
GF_ARANGE_U(gf_arange_u64, u64)
/* floats: round i to T, then one rounding per operation (no FMA), as NumPy */
extern "C" __global__ void gf_arange_f32(float* p, float start, float step, u64 n) {
  GF_LOOP p[i] = __fadd_rn(__fmul_rn(__ll2float_rn((long long)i), step), start);
}
extern "C" __global__ void gf_arange_f64(double* p, double start, double step, u64 n) {
  GF_LOOP p[i] = __dadd_rn(__dmul_rn(__ll2double_rn((long long)i), step), start);
}
extern "C" __global__ void gf_arange_f16(unsigned short* p, unsigned short start,
                                         unsigned short step, u64 n) {
  GF_LOOP {
    unsigned short hi = gf_f2h(__ll2float_rn((long long)i));
    unsigned short prod = gf_f2h(__fmul_rn(gf_h2f(hi), gf_h2f(step)));
    p[i] = gf_f2h(__fadd_rn(gf_h2f(prod), gf_h2f(start)));
  }
}
/* bool: start + astype(i, bool) * step is start | (i != 0 & step) */
extern "C" __global__ void gf_arange_b8(unsigned char* p, unsigned char start,
                                        unsigned char step, u64 n) {
  GF_LOOP p[i] = (unsigned char)(start | ((i != 0) & step));
}
"""

_BUILTIN_NAMES = (
    "gf_fill_u64", "gf_arange_u8", "gf_arange_u16", "gf_arange_u32", "gf_arange_u64",
    "gf_arange_f16", "gf_arange_f32", "gf_arange_f64", "gf_arange_b8",
)  # fmt: skip
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_BUILTIN_STRUCT = struct.Struct("<QQQQ")  # pointer, start, step, n: each in an 8-byte slot
_FILL_STRUCT = struct.Struct("<QQQ")
_ARANGE_F32_STRUCT = struct.Struct("<Qf4xf4xQ")
_ARANGE_F64_STRUCT = struct.Struct("<QddQ")


def _arange_kernel(dtype: np.dtype[Any]) -> str:
    if dtype.kind == "f" and dtype.itemsize in (2, 4, 8):
        return f"gf_arange_f{dtype.itemsize * 8}"
    if dtype.kind in "iu" and dtype.itemsize in (1, 2, 4, 8):
        return f"gf_arange_u{dtype.itemsize * 8}"
    if dtype.kind == "b":
        return "gf_arange_b8"
    raise UsageError(f"arange does not support dtype {dtype} on the cuda backend")


# -- the backend -----------------------------------------------------------------
class CudaBackend(Backend):
    """CUDA devices through the driver API: one primary context per device."""

    name = "cuda"

    def __init__(self, num_devices: int | None = None, *, signals: str = "hostfunc") -> None:
        """``signals``: how :meth:`enqueue_signal` marks its point of the stream.

        ``"hostfunc"`` (the default): two host functions, ``sem_post`` of the
        stream's semaphore then of the dispatcher's.  ``"event"``: a pooled event
        then one host function posting the dispatcher's semaphore; the stream's
        count is its completed events (half the host functions, so half the
        time the stream is held).  Inside a capture both use host functions.
        """
        if signals not in ("hostfunc", "event"):
            raise UsageError(f"signals must be 'hostfunc' or 'event', not {signals!r}")
        cu = _driver()
        self._cu = cu
        self._launch = cu.cuLaunchKernel
        self._event_signals = signals == "event"
        self._sig_lock = threading.Lock()
        self.last_reset_trace: list[str] = []  # driver calls of the last reset_device
        self._check(cu.cuInit(0), "cuInit")
        (available,) = self._check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        available = int(available)
        n = available if num_devices is None else num_devices
        if n < 1 or n > available:
            raise UsageError(
                f"num_devices={num_devices} but {available} CUDA device(s) are present"
            )
        self._n = _Native()
        self._tls = _ThreadState()
        self._plans: dict[tuple[type, ...], struct.Struct] = {}
        self._modules: weakref.WeakValueDictionary[tuple[int, bytes], _Module] = (
            weakref.WeakValueDictionary()
        )
        self._module_lock = threading.Lock()
        self._stage_lock = threading.Lock()
        self._d2h_pending = 0  # staged device-to-host copies not yet delivered
        self._gsem, self._gsem_addr = self._n.new_sem()
        self._stream_lock = threading.Lock()
        self._devices: list[_Dev] = []
        for i in range(n):
            (cudev,) = self._check(cu.cuDeviceGet(i), "cuDeviceGet")
            (raw,) = self._check(cu.cuDeviceGetName(256, cudev), "cuDeviceGetName")
            name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace").strip()
            attr = cu.CUdevice_attribute
            (major,) = self._check(
                cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, cudev),
                "cuDeviceGetAttribute",
            )
            (minor,) = self._check(
                cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, cudev),
                "cuDeviceGetAttribute",
            )
            dev = _Dev(i, cudev, name, f"sm_{int(major)}{int(minor)}")
            (ctx,) = self._check(cu.cuDevicePrimaryCtxRetain(cudev), "cuDevicePrimaryCtxRetain")
            dev.ctx = int(ctx)
            self._devices.append(dev)
            self._setup_context(dev)
        for dev in self._devices:
            for other in self._devices:
                if other is not dev:
                    (ok,) = self._check(
                        cu.cuDeviceCanAccessPeer(dev.cudev, other.cudev), "cuDeviceCanAccessPeer"
                    )
                    if int(ok):
                        dev.peers.append(other.index)
        for dev in self._devices:
            self._enable_peers(dev)

    # -- plumbing ---------------------------------------------------------------
    def _check(self, res: Any, what: str, dev: _Dev | None = None) -> tuple[Any, ...]:
        """Unpack a cuda.bindings result tuple, raising on an error code."""
        rc = int(res[0])
        if rc != CUDA_SUCCESS:
            self._fail(rc, what, dev)
        return tuple(res[1:])

    def _fail(self, rc: int, what: str, dev: _Dev | None, launch: bool = False) -> NoReturn:
        name = _err_name(rc)
        index = None if dev is None else dev.index
        cls = error_class(rc, launch=launch)
        if cls is DeviceFaultError:
            if dev is not None:
                raise self._set_fault(dev, rc, name, what)
            cls = DeviceError  # no device to hold the fault
        if cls is OutOfMemoryError:
            raise OutOfMemoryError(
                f"{what}: out of memory on CUDA device {index}", code=rc, name=name, device=index
            )
        raise cls(f"{what} failed", code=rc, name=name, device=index)

    def _set_fault(self, dev: _Dev, rc: int, name: str, what: str) -> DeviceFaultError:
        with dev.lock:
            if dev.fault is None:
                dev.fault = DeviceFaultError(
                    f"CUDA device {dev.index} ({dev.name}) has a sticky fault, seen by {what}; "
                    "until a reset (which the driver may refuse: then restart the process) "
                    "every call on the device fails",
                    code=rc,
                    name=name,
                    device=dev.index,
                )
            return dev.fault

    def _cur(self, dev: _Dev) -> _ThreadState:
        """Make ``dev``'s primary context current on this thread (cached per thread)."""
        ts = self._tls
        if ts.token is not dev.token:
            rc = self._n.ctx_set_current(dev.ctx)
            if rc != CUDA_SUCCESS:
                self._fail(rc, "cuCtxSetCurrent", dev)
            ts.token = dev.token
        return ts

    def _force_cur(self, dev: _Dev) -> None:
        """Someone else changed this thread's context behind the cache: set it again."""
        self._tls.token = None
        self._cur(dev)

    def _call(self, dev: _Dev, what: str, fn: Any, *args: Any) -> tuple[Any, ...]:
        """A cuda.bindings call with ``dev``'s context current; one retry on a context error."""
        self._cur(dev)
        res = fn(*args)
        if int(res[0]) in CONTEXT_ERRORS:
            self._force_cur(dev)
            res = fn(*args)
        return self._check(res, what, dev)

    def _setup_context(self, dev: _Dev) -> None:
        """What each life of a primary context needs: pool settings, a private stream."""
        cu = self._cu
        (pool,) = self._call(
            dev, "cuDeviceGetDefaultMemPool", cu.cuDeviceGetDefaultMemPool, dev.cudev
        )
        dev.pool = pool
        # keep freed memory in the pool: returning it to the OS at each sync costs
        threshold = cu.cuuint64_t(0xFFFFFFFFFFFFFFFF)
        self._call(
            dev,
            "cuMemPoolSetAttribute",
            cu.cuMemPoolSetAttribute,
            pool,
            cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            threshold,
        )
        (side,) = self._call(dev, "cuStreamCreate", cu.cuStreamCreate, _STREAM_NON_BLOCKING)
        dev.side = int(side)

    def _enable_peers(self, dev: _Dev) -> None:
        """Peer access from ``dev`` to every capable device, both for contexts and pools."""
        cu = self._cu
        for j in dev.peers:
            other = self._devices[j]
            try:
                self._cur(dev)
                (err,) = cu.cuCtxEnablePeerAccess(other.ctx, 0)
                if int(err) not in (CUDA_SUCCESS, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                    self._fail(int(err), "cuCtxEnablePeerAccess", dev)
                desc = cu.CUmemAccessDesc()
                desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = dev.index
                desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                self._call(
                    other, "cuMemPoolSetAccess", cu.cuMemPoolSetAccess, other.pool, [desc], 1
                )
            except DeviceError as exc:
                warnings.warn(
                    f"gpuflow: peer access {dev.index} -> {j} not enabled: {exc}", stacklevel=2
                )

    def _dev(self, device: int) -> _Dev:
        try:
            if device < 0:
                raise IndexError
            return self._devices[device]
        except (IndexError, TypeError):
            raise UsageError(
                f"device {device} does not exist: the cuda backend has {len(self._devices)}"
            ) from None

    def _live(self, stream: CudaStream) -> _Dev:
        """The stream's device, after the fault and stale-handle checks of an enqueue."""
        dev = stream.dev
        if dev.fault is not None:
            raise dev.fault
        if stream.token is not dev.token:
            raise UsageError(f"{stream!r} was created before its device was reset")
        if stream.destroyed:
            raise UsageError(f"{stream!r} was destroyed")
        return dev

    # -- devices ------------------------------------------------------------------
    @property
    def device_count(self) -> int:
        return len(self._devices)

    def device_name(self, device: int) -> str:
        return self._dev(device).name

    def device_arch(self, device: int) -> str:
        """``sm_XY`` of ``device`` (what :meth:`load_kernel` asks the module for)."""
        return self._dev(device).arch

    # -- streams ------------------------------------------------------------------
    def create_stream(self, device: int) -> CudaStream:
        dev = self._dev(device)
        if dev.fault is not None:
            raise dev.fault
        (h,) = self._call(dev, "cuStreamCreate", self._cu.cuStreamCreate, _STREAM_NON_BLOCKING)
        _buf, addr = self._n.new_sem()
        return CudaStream(dev, h, addr)

    def destroy_stream(self, stream: Any) -> None:
        try:
            dev = stream.dev
            # a stream is dropped (its finalizer, on any thread) while the
            # dispatcher may be querying it: a query must never use a handle
            # destroyed under it
            with self._stream_lock:
                if stream.destroyed:
                    return
                stream.destroyed = True
                if stream.token is not dev.token or dev.fault is not None:
                    return  # gone with the context, or a faulted one: leak
                self._cur(dev)
                (err,) = self._cu.cuStreamDestroy(stream.handle)
            if int(err) != CUDA_SUCCESS:
                warnings.warn(
                    f"gpuflow: destroying {stream!r} failed: {_err_name(int(err))}", stacklevel=2
                )
        except Exception as exc:
            warnings.warn(f"gpuflow: destroying {stream!r} failed: {exc!r}", stacklevel=2)

    def stream_handle(self, stream: Any) -> int:
        return int(stream.handle)

    def synchronize(self, stream: Any) -> None:
        dev = stream.dev
        if dev.fault is not None:
            raise dev.fault
        if stream.capture is not None:
            raise UsageError("cannot synchronize a stream while it is being captured")
        if stream.token is not dev.token or stream.destroyed:
            return  # its work went with the context (or the stream is gone)
        self._cur(dev)
        rc = self._n.stream_synchronize(stream.handle)
        if rc != CUDA_SUCCESS:
            self._fail(rc, "cuStreamSynchronize", dev)
        if self._d2h_pending:
            self._sweep_all()

    def query(self, stream: Any) -> bool:
        dev = stream.dev
        if dev.fault is not None:
            raise dev.fault
        with self._stream_lock:  # not destroyed while we ask
            if stream.token is not dev.token or stream.destroyed:
                return True
            self._cur(dev)
            if stream.capture is not None:
                # querying a capturing stream would invalidate the capture: ask about
                # the work enqueued before it began instead
                rc = self._n.event_query(stream.pre_capture) if stream.pre_capture else CUDA_SUCCESS
            else:
                rc = self._n.stream_query(stream.handle)
        if rc == CUDA_SUCCESS:
            if self._d2h_pending:
                self._sweep_all()
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self._fail(rc, "cuStreamQuery", dev)

    # -- events -------------------------------------------------------------------
    def _new_event(self, dev: _Dev) -> int:
        (ev,) = self._call(dev, "cuEventCreate", self._cu.cuEventCreate, _EVENT_DISABLE_TIMING)
        return int(ev)

    def _record(self, dev: _Dev, stream_handle: int) -> int:
        """Record a pooled event on a stream (context already current)."""
        try:
            ev = dev.events.pop()
        except IndexError:
            ev = self._new_event(dev)
        rc = self._n.event_record(ev, stream_handle)
        if rc != CUDA_SUCCESS:
            self._fail(rc, "cuEventRecord", dev)
        return ev

    def record_event(self, stream: Any) -> CudaEvent:
        dev = self._live(stream)
        self._cur(dev)
        return CudaEvent(dev, self._record(dev, stream.handle), stream.capture)

    def wait_event(self, stream: Any, event: Any) -> None:
        dev = self._live(stream)
        other = event.dev
        if event.token is not other.token:
            return  # its work went with a reset context: nothing left to wait for
        if other.fault is not None and other is not dev:
            raise other.fault
        self._cur(dev)
        if event.capture is not None and stream.capture is None:
            # CUDA's fork: waiting on an event recorded in a capture joins it.  What
            # the stream had before is marked for query (which must not touch it now).
            pre = self._record(dev, stream.handle)
            if stream.pre_capture:
                dev.events.append(stream.pre_capture)
            stream.pre_capture = pre
            stream.capture = event.capture
            event.capture.streams.append(stream)
        rc = self._n.stream_wait_event(stream.handle, event.handle, 0)
        if rc != CUDA_SUCCESS:
            self._fail(rc, "cuStreamWaitEvent", dev)

    # -- memory -------------------------------------------------------------------
    def alloc(self, device: int, nbytes: int, stream: Any) -> CudaBuffer:
        dev = self._dev(device)
        self._live(stream)
        if dev.fault is not None:
            raise dev.fault
        self._cur(dev)
        # During a capture (or for another device than the stream's) the memory is
        # taken outside the graph, on a private stream, and made usable at once:
        # the graph then sees fixed addresses, as the sim backend does.
        side = stream.capture is not None or stream.dev is not dev
        h = dev.side if side else stream.handle
        size = max(int(nbytes), 1)
        out = ctypes.c_uint64()
        rc = self._n.mem_alloc_async(ctypes.byref(out), size, h)
        if rc == CUDA_ERROR_OUT_OF_MEMORY:
            # memory freed to the pool but cached there: give it back and retry once
            self._cu.cuMemPoolTrimTo(dev.pool, 0)
            rc = self._n.mem_alloc_async(ctypes.byref(out), size, h)
        if rc != CUDA_SUCCESS:
            if rc == CUDA_ERROR_OUT_OF_MEMORY:
                raise OutOfMemoryError(
                    f"out of memory on CUDA device {dev.index}: {nbytes} bytes requested",
                    code=rc,
                    name=_err_name(rc),
                    device=dev.index,
                )
            self._fail(rc, "cuMemAllocAsync", dev)
        if side:
            rc = self._n.stream_synchronize(dev.side)
            if rc != CUDA_SUCCESS:
                self._fail(rc, "cuStreamSynchronize", dev)
        return CudaBuffer(dev, int(nbytes), int(out.value))

    def free(self, buffer: Any, stream: Any) -> None:
        try:
            if buffer.freed:
                return
            dev = buffer.dev
            if dev.fault is not None or buffer.token is not dev.token:
                buffer.freed = True  # the context is gone with its memory, or faulted: leak
                return
            sdev = stream.dev
            if stream.token is not sdev.token or sdev.fault is not None:
                buffer.freed = True  # its stream's work may never finish: leak
                return
            if stream.destroyed:
                warnings.warn(
                    f"gpuflow: {buffer!r} freed on a destroyed stream: leaked", stacklevel=2
                )
                buffer.freed = True
                return
            if stream.capture is not None:
                # a free in a capture would be a graph node, legal only for graph memory:
                # free it on the stream when the capture ends instead
                stream.capture.deferred_frees.append((buffer, stream))
                return
            self._cur(sdev)
            rc = self._n.mem_free_async(buffer.ptr, stream.handle)
            if rc in CONTEXT_ERRORS:
                self._force_cur(sdev)
                rc = self._n.mem_free_async(buffer.ptr, stream.handle)
            buffer.freed = True
            if rc in STICKY_ERRORS:
                self._set_fault(sdev, rc, _err_name(rc), "cuMemFreeAsync")
            elif rc != CUDA_SUCCESS:
                warnings.warn(
                    f"gpuflow: freeing {buffer!r} failed: {_err_name(rc)}", stacklevel=2
                )
        except Exception as exc:  # a finalizer must not raise
            warnings.warn(f"gpuflow: freeing {buffer!r} failed: {exc!r}", stacklevel=2)

    # staging ------------------------------------------------------------------
    def _stage_get(self, dev: _Dev, nbytes: int) -> _HostBuf | None:
        """A pinned buffer of at least ``nbytes``, or None (then copy directly)."""
        size = max(_STAGE_MIN, 1 << (nbytes - 1).bit_length())
        with self._stage_lock:
            self._sweep(dev)
            free = dev.free_host.get(size)
            if free:
                return free.pop()
            if dev.host_bytes + size > _STAGE_LIMIT:
                return None
            dev.host_bytes += size
        try:
            (ptr,) = self._call(
                dev, "cuMemHostAlloc", self._cu.cuMemHostAlloc, size, _MEMHOSTALLOC_PORTABLE
            )
        except DeviceError:
            with self._stage_lock:
                dev.host_bytes -= size
            return None
        return _HostBuf(int(ptr), size)

    def _sweep(self, dev: _Dev) -> None:
        """Deliver finished device-to-host copies, recycle finished staging buffers.

        Holds ``_stage_lock``; never raises (a fault is recorded, the entries dropped).
        """
        if not dev.pending or dev.fault is not None:
            return
        self._cur(dev)
        keep: list[_Pending] = []
        pending = dev.pending
        for i, p in enumerate(pending):
            rc = self._n.event_query(p.event)
            if rc == CUDA_SUCCESS:
                if p.dst is not None:
                    p.dst[...] = p.buf.array[: p.nbytes]
                    self._d2h_pending -= 1
                dev.free_host.setdefault(p.buf.size, []).append(p.buf)
                dev.events.append(p.event)
            elif rc == CUDA_ERROR_NOT_READY:
                keep.append(p)
            else:
                if rc in STICKY_ERRORS:
                    self._set_fault(dev, rc, _err_name(rc), "cuEventQuery")
                # lost: nothing still pending on this device will ever be delivered
                lost = keep + pending[i:]
                self._d2h_pending -= sum(1 for q in lost if q.dst is not None)
                keep = []
                break
        dev.pending = keep

    def _sweep_all(self) -> None:
        try:
            with self._stage_lock:
                for dev in self._devices:
                    if dev.pending:
                        self._sweep(dev)
        except Exception as exc:
            warnings.warn(f"gpuflow: staged copy delivery failed: {exc!r}", stacklevel=2)

    def _stage_done(self, dev: _Dev, p: _Pending) -> None:
        with self._stage_lock:
            dev.pending.append(p)
            if p.dst is not None:
                self._d2h_pending += 1

    def copy_from_host(self, dst: Any, src: np.ndarray[Any, Any], stream: Any) -> None:
        dev = self._live(stream)
        n = int(src.nbytes)
        if n == 0:
            return
        if not src.flags.c_contiguous:
            raise UsageError("copy_from_host needs a C-contiguous array")
        if n > dst.nbytes:
            raise UsageError(f"copy of {n} bytes into {dst!r}")
        buf = None
        if stream.capture is None and _STAGE_H2D_MIN <= n <= _STAGE_MAX:
            buf = self._stage_get(dev, n)
        self._cur(dev)
        cu = self._cu
        if buf is None:
            self._call(
                dev, "cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync,
                dst.ptr, src.ctypes.data, n, stream.handle,
            )  # fmt: skip
            return
        buf.array[:n] = src.reshape(-1).view(np.uint8)
        # (on an error below the staging buffer is dropped, never reused)
        self._call(
            dev, "cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync, dst.ptr, buf.ptr, n, stream.handle
        )
        ev = self._record(dev, stream.handle)
        self._stage_done(dev, _Pending(ev, buf, None, n))

    def copy_to_host(self, dst: np.ndarray[Any, Any], src: Any, stream: Any) -> None:
        dev = self._live(stream)
        n = int(dst.nbytes)
        if n == 0:
            return
        if not dst.flags.c_contiguous:
            raise UsageError("copy_to_host needs a C-contiguous array")
        if n > src.nbytes:
            raise UsageError(f"copy of {n} bytes from {src!r}")
        buf = None
        if stream.capture is None and n <= _STAGE_MAX:
            buf = self._stage_get(dev, n)
        self._cur(dev)
        cu = self._cu
        if buf is None:
            # pageable destination: the driver returns only once the copy is done
            self._call(
                dev, "cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync,
                dst.ctypes.data, src.ptr, n, stream.handle,
            )  # fmt: skip
            return
        flat = dst.reshape(-1).view(np.uint8)
        self._call(
            dev, "cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync, buf.ptr, src.ptr, n, stream.handle
        )
        ev = self._record(dev, stream.handle)
        self._stage_done(dev, _Pending(ev, buf, flat, n))

    def copy_device(self, dst: Any, src: Any, nbytes: int, stream: Any) -> None:
        dev = self._live(stream)
        if nbytes <= 0:
            return
        cu = self._cu
        if dst.device != src.device:
            self._call(
                dev, "cuMemcpyPeerAsync", cu.cuMemcpyPeerAsync,
                dst.ptr, dst.dev.ctx, src.ptr, src.dev.ctx, nbytes, stream.handle,
            )  # fmt: skip
        else:
            self._call(
                dev, "cuMemcpyDtoDAsync", cu.cuMemcpyDtoDAsync,
                dst.ptr, src.ptr, nbytes, stream.handle,
            )  # fmt: skip

    def _builtin(self, dev: _Dev, name: str) -> Any:
        fns = dev.builtins
        if fns is None:
            from ._nvrtc import compile_source

            cubin = compile_source(_BUILTIN_SOURCE, dev.arch, ())
            (mod,) = self._call(dev, "cuModuleLoadData", self._cu.cuModuleLoadData, cubin)
            fns = {}
            for fname in _BUILTIN_NAMES:
                (f,) = self._call(
                    dev, "cuModuleGetFunction", self._cu.cuModuleGetFunction, mod, fname.encode()
                )
                fns[fname] = f
            dev.builtins = fns
        return fns[name]

    def _launch_builtin(
        self, dev: _Dev, stream: CudaStream, fname: str, st: struct.Struct, values: tuple[Any, ...]
    ) -> None:
        func = self._builtin(dev, fname)
        count = int(values[-1])
        blocks = min((count + _FILL_THREADS - 1) // _FILL_THREADS, _FILL_MAX_BLOCKS)
        ts = self._cur(dev)
        st.pack_into(ts.params, _VALUES_OFFSET, *values)
        (err,) = self._cu.cuLaunchKernel(
            func, blocks, 1, 1, _FILL_THREADS, 1, 1, 0, stream.obj, ts.params_addr, 0
        )
        if err:
            self._fail(int(err), f"built-in kernel {fname}", dev, launch=True)

    def fill(self, dst: Any, value: np.generic, count: int, stream: Any) -> None:
        dev = self._live(stream)
        if count <= 0:
            return
        size = value.dtype.itemsize
        bits = value.tobytes()
        cu = self._cu
        h = stream.handle
        if size == 1:
            self._call(dev, "cuMemsetD8Async", cu.cuMemsetD8Async, dst.ptr, bits[0], count, h)
        elif size == 2:
            v = int.from_bytes(bits, "little")
            self._call(dev, "cuMemsetD16Async", cu.cuMemsetD16Async, dst.ptr, v, count, h)
        elif size == 4:
            v = int.from_bytes(bits, "little")
            self._call(dev, "cuMemsetD32Async", cu.cuMemsetD32Async, dst.ptr, v, count, h)
        elif size == 8 and bits[:4] == bits[4:]:
            v = int.from_bytes(bits[:4], "little")
            self._call(dev, "cuMemsetD32Async", cu.cuMemsetD32Async, dst.ptr, v, 2 * count, h)
        elif size == 8:
            v = int.from_bytes(bits, "little")
            self._launch_builtin(dev, stream, "gf_fill_u64", _FILL_STRUCT, (dst.ptr, v, count))
        else:
            raise UsageError(f"fill does not support dtype {value.dtype} on the cuda backend")

    def arange(
        self, dst: Any, start: np.generic, step: np.generic, count: int, stream: Any
    ) -> None:
        dev = self._live(stream)
        if count <= 0:
            return
        dtype = start.dtype
        fname = _arange_kernel(dtype)
        step_: Any = np.asarray(step).astype(dtype)[()]
        step = step_
        if dtype.kind == "f" and dtype.itemsize != 2:
            a: Any = float(start)
            b: Any = float(step)
            st = _ARANGE_F32_STRUCT if dtype.itemsize == 4 else _ARANGE_F64_STRUCT
        else:
            u = _UINT_OF_SIZE[dtype.itemsize]
            a = int(np.asarray(start).view(u)[()])
            b = int(np.asarray(step).view(u)[()])
            if dtype.kind == "b":
                a, b = int(bool(a)), int(bool(b))
            st = _BUILTIN_STRUCT
        self._launch_builtin(dev, stream, fname, st, (dst.ptr, a, b, count))

    # -- kernels --------------------------------------------------------------------
    def load_kernel(self, device: int, module: ModuleSource, name: str) -> CudaKernel:
        dev = self._dev(device)
        if dev.fault is not None:
            raise dev.fault
        cubin = module.binary_for(dev.arch)
        key = (dev.index, cubin)
        with self._module_lock:
            mod = self._modules.get(key)
            if mod is not None and mod.token is not dev.token:
                mod = None
            if mod is None:
                (h,) = self._call(dev, "cuModuleLoadData", self._cu.cuModuleLoadData, cubin)
                mod = _Module(self, dev, int(h))
                self._modules[key] = mod
        self._cur(dev)
        err, f = self._cu.cuModuleGetFunction(mod.handle, name.encode())
        if int(err) != CUDA_SUCCESS:
            raise DeviceError(
                f"kernel {name!r} not found in its module (is it declared extern \"C\"?)",
                code=int(err),
                name=_err_name(int(err)),
                device=dev.index,
            )
        return CudaKernel(dev, name, f, mod)

    def launch(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shmem: int,
        args: Sequence[KernelArg],
        stream: Any,
    ) -> None:
        dev = stream.dev
        if dev.fault is not None:
            raise dev.fault
        if kernel.token is not dev.token or stream.token is not dev.token or stream.destroyed:
            self._stale_launch(kernel, stream)
        ts = self._tls
        if ts.token is not dev.token:
            self._cur(dev)
        if args:
            key = tuple(map(type, args))
            st = self._plans.get(key)
            if st is None:
                st = self._plan(key)
            st.pack_into(
                ts.params,
                _VALUES_OFFSET,
                *[a.buffer.ptr if type(a) is PointerArg else a for a in args],
            )
            params = ts.params_addr
        else:
            params = 0
        gx, gy, gz = grid
        bx, by, bz = block
        # cuda.bindings' cuLaunchKernel (Cython, GIL released) with the parameter array's
        # address: measured faster than libcuda through ctypes, whose 11 converted
        # arguments cost more than the bindings' whole call
        (err,) = self._launch(kernel.obj, gx, gy, gz, bx, by, bz, shmem, stream.obj, params, 0)
        if err:
            self._launch_failed(int(err), kernel, grid, block, shmem, params, stream)

    def _plan(self, key: tuple[type, ...]) -> struct.Struct:
        if len(key) > _MAX_ARGS:
            raise UsageError(f"at most {_MAX_ARGS} kernel arguments, not {len(key)}")
        st = struct.Struct("<" + "".join(_slot_code(t) for t in key))
        self._plans[key] = st
        return st

    def _stale_launch(self, kernel: CudaKernel, stream: CudaStream) -> NoReturn:
        if kernel.token is not kernel.dev.token:
            raise UsageError(f"kernel {kernel.name!r} was loaded before its device was reset")
        self._live(stream)
        raise UsageError(f"kernel {kernel.name!r} belongs to another device than {stream!r}")

    def _launch_failed(
        self,
        rc: int,
        kernel: CudaKernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shmem: int,
        params: int,
        stream: CudaStream,
    ) -> None:
        dev = stream.dev
        retry = False
        if rc in CONTEXT_ERRORS:
            self._force_cur(dev)
            retry = True
        elif rc == CUDA_ERROR_INVALID_VALUE and shmem > kernel.shmem_max:
            # more than 48 KiB of dynamic shared memory must be opted into
            cu = self._cu
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            (err,) = cu.cuFuncSetAttribute(kernel.obj, attr, shmem)
            if int(err) == CUDA_SUCCESS:
                kernel.shmem_max = shmem
                retry = True
        if retry:
            (err,) = self._launch(kernel.obj, *grid, *block, shmem, stream.obj, params, 0)
            rc = int(err)
            if rc == CUDA_SUCCESS:
                return
        self._fail(
            rc,
            f"launch of kernel {kernel.name!r} with grid={tuple(grid)} block={tuple(block)} "
            f"shmem={shmem}",
            dev,
            launch=True,
        )

    # -- the native half of the completion bridge -------------------------------------
    def enqueue_signal(self, stream: Any) -> None:
        dev = self._live(stream)
        if self._tls.token is not dev.token:
            self._cur(dev)
        n = self._n
        post = n.sem_post_addr
        h = stream.handle
        if self._event_signals and stream.capture is None:
            ev = self._record(dev, h)
            rc = n.launch_host_func(h, post, self._gsem_addr)
            if rc == CUDA_SUCCESS:
                stream.sig_events.append(ev)
                return
        else:
            rc = n.launch_host_func(h, post, stream.sem_addr)
            if rc == CUDA_SUCCESS:
                rc = n.launch_host_func(h, post, self._gsem_addr)
        if rc != CUDA_SUCCESS:
            self._fail(rc, "cuLaunchHostFunc", dev)

    def wait_signals(self, timeout: float | None) -> None:
        n = self._n
        g = self._gsem_addr
        if timeout is None:
            while n.sem_wait(g) != 0:
                if ctypes.get_errno() != errno.EINTR:
                    return
        elif timeout <= 0:
            if n.sem_trywait(g) != 0:
                return
        else:
            if n.sem_clockwait is not None:
                deadline = time.clock_gettime(time.CLOCK_MONOTONIC) + timeout
                clock = time.CLOCK_MONOTONIC
            else:
                deadline = time.time() + timeout
                clock = -1
            sec = int(deadline)
            ts = _Timespec(sec, int((deadline - sec) * 1e9))
            ref = ctypes.byref(ts)
            while True:
                if clock >= 0:
                    rc = n.sem_clockwait(g, clock, ref)
                else:
                    rc = n.sem_timedwait(g, ref)
                if rc == 0:
                    break
                if ctypes.get_errno() != errno.EINTR:
                    return  # ETIMEDOUT
        while n.sem_trywait(g) == 0:  # coalesce: one wake-up for every post so far
            pass

    def take_signals(self, stream: Any) -> int:
        trywait = self._n.sem_trywait
        addr = stream.sem_addr
        count = 0
        while trywait(addr) == 0:
            count += 1
        if stream.sig_events:
            count += self._take_event_signals(stream)
        if self._d2h_pending:
            # a staged copy before any of these signals is done: deliver it first
            self._sweep_all()
        return count

    def _take_event_signals(self, stream: CudaStream) -> int:
        """Completed signal events of ``stream``, FIFO (``signals="event"``); never raises."""
        dev = stream.dev
        q = stream.sig_events
        count = 0
        with self._sig_lock:
            if stream.token is not dev.token or dev.fault is not None:
                q.clear()  # gone with the context, or never to complete
                return 0
            try:
                self._cur(dev)
            except DeviceError:
                return 0
            query = self._n.event_query
            while q:
                rc = query(q[0])
                if rc == CUDA_SUCCESS:
                    dev.events.append(q.popleft())
                    count += 1
                    continue
                if rc in STICKY_ERRORS:
                    self._set_fault(dev, rc, _err_name(rc), "cuEventQuery")
                break
        return count

    def wake(self) -> None:
        self._n.sem_post(self._gsem_addr)

    # -- graphs -------------------------------------------------------------------------
    def begin_capture(self, stream: Any) -> None:
        # Relaxed mode: other threads (the dispatcher's queries, finalizers' frees on
        # other streams, other tasks' work) stay legal during a capture; fork/join
        # through record_event/wait_event works in every mode.
        dev = self._live(stream)
        if stream.capture is not None:
            raise UsageError("the stream is already being captured")
        self._cur(dev)
        pre = self._record(dev, stream.handle)
        cu = self._cu
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        try:
            self._call(dev, "cuStreamBeginCapture", cu.cuStreamBeginCapture, stream.handle, mode)
        except BaseException:
            dev.events.append(pre)
            raise
        if stream.pre_capture:
            dev.events.append(stream.pre_capture)
        stream.pre_capture = pre
        stream.capture = _Capture(stream)

    def end_capture(self, stream: Any) -> CudaGraph:
        cap = stream.capture
        if cap is None:
            raise UsageError("the stream is not being captured")
        dev = stream.dev
        cu = self._cu
        self._cur(dev)
        err, graph = cu.cuStreamEndCapture(stream.handle)
        for s in cap.streams:
            s.capture = None
        for buffer, s in cap.deferred_frees:
            self.free(buffer, s)
        if int(err) != CUDA_SUCCESS:
            self._fail(int(err), "cuStreamEndCapture", dev)
        try:
            (exec_,) = self._call(dev, "cuGraphInstantiate", cu.cuGraphInstantiate, graph, 0)
        except BaseException:
            cu.cuGraphDestroy(graph)
            raise
        return CudaGraph(self, dev, int(graph), int(exec_))

    def launch_graph(self, graph: Any, stream: Any) -> None:
        dev = self._live(stream)
        if graph.token is not graph.dev.token:
            raise UsageError("the graph was captured before its device was reset")
        self._cur(dev)
        rc = self._n.graph_launch(graph.exec, stream.handle)
        if rc != CUDA_SUCCESS:
            self._fail(rc, "cuGraphLaunch", dev)

    # -- faults ---------------------------------------------------------------------------
    def device_fault(self, device: int) -> DeviceFaultError | None:
        return self._dev(device).fault

    def reset_device(self, device: int) -> None:
        dev = self._dev(device)
        cu = self._cu
        trace: list[str] = []
        last = 0

        def step(what: str, res: Any) -> tuple[Any, ...]:
            nonlocal last
            last = int(res[0])
            trace.append(f"{what}: {_err_name(last) if last else 'ok'}")
            return tuple(res[1:])

        with dev.lock, self._stage_lock:
            # no thread of ours keeps the old context current: this one lets go now,
            # the others set the new one at their next call (the token changes below)
            self._n.ctx_set_current(None)
            self._tls.token = None
            ctx: Any = None
            for attempt in range(3):
                if attempt == 2:
                    # last resort: drop the reference taken at start-up, so that the
                    # driver destroys the context, and retain a new one
                    step("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(dev.cudev))
                else:
                    step("cuDevicePrimaryCtxReset", cu.cuDevicePrimaryCtxReset(dev.cudev))
                # a reset does not release our reference; retaining again makes the
                # context live (that extra reference is kept)
                out = step("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev.cudev))
                if last == CUDA_SUCCESS:
                    self._n.ctx_set_current(int(out[0]))
                    last = self._n.ctx_synchronize()
                    trace.append(f"cuCtxSynchronize: {_err_name(last) if last else 'ok'}")
                    self._n.ctx_set_current(None)
                    if last == CUDA_SUCCESS:
                        ctx = out[0]
                        break
                    step("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(dev.cudev))
                time.sleep(0.05)
            self.last_reset_trace = trace
            if ctx is None:
                raise DeviceFaultError(
                    f"CUDA device {dev.index} could not be reset ({'; '.join(trace)}); "
                    "the driver keeps the fault: restart the process",
                    code=last or None,
                    name=_err_name(last) if last else None,
                    device=dev.index,
                )
            dev.ctx = int(ctx)
            dev.token = _Token()  # every thread sets the new context; old handles are stale
            dev.fault = None
            dev.events = []
            dev.builtins = None
            # pinned staging memory went with the context
            self._d2h_pending -= sum(1 for p in dev.pending if p.dst is not None)
            dev.pending = []
            dev.free_host = {}
            dev.host_bytes = 0
            self._setup_context(dev)
        self._enable_peers(dev)
        for other in self._devices:
            if dev.index in other.peers:
                self._enable_peers(other)

    def close(self) -> None:
        """Wake a dispatcher blocked in :meth:`wait_signals`; handles go with the process."""
        self.wake()
