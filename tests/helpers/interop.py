"""What the interop tests share: late kernels (their work comes first and
is slow, so a missing dependency shows as wrong data), and :class:`FakeLib`,
a CUDA library that knows gpuflow arrays only through DLPack and streams
only by their handles (the ``lib`` fixture)."""

from __future__ import annotations

import contextlib
import ctypes
import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import gpuflow as gf
from gpuflow._memory import _dlpack
from gpuflow.lowlevel import PointerArg

from . import kernels as K

F32 = np.float32


N = 256


#: how long the work that must come first takes: surely still running when
#: the work that depends on it is enqueued, on a loaded machine
SLOW = 0.3


#: slack on "cannot have finished yet" (clock granularity)
EARLY = 0.01


DEADLINE = 20.0


# The memory clobber keeps the compiler from moving loads and stores across
# the wait, so "wait, write" and "read, wait, write" happen in that order.
SOURCE = K.WAIT_NS + r"""

// a slow write: waits ns nanoseconds, then writes v
extern "C" __global__ void late_fill(float* x, float v, int n, long long ns) {
    gf_wait_ns(ns);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}

// a slow read: waits ns nanoseconds, then copies src into dst
extern "C" __global__ void late_copy(const float* src, float* dst, int n, long long ns) {
    gf_wait_ns(ns);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

// a slow read-modify-write: reads x, waits ns nanoseconds, writes x * s
extern "C" __global__ void late_scale(float* x, float s, int n, long long ns) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = i < n ? x[i] : 0.0f;
    gf_wait_ns(ns);
    if (i < n) x[i] = v * s;
}

extern "C" __global__ void add(float* x, float c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + c;
}
"""


def late_fill_ref(x: np.ndarray, v: float, n: int, ns: int) -> None:
    time.sleep(ns / 1e9)
    x[:n] = np.float32(v)


def late_copy_ref(src: np.ndarray, dst: np.ndarray, n: int, ns: int) -> None:
    time.sleep(ns / 1e9)
    dst[:n] = src[:n]


def late_scale_ref(x: np.ndarray, s: float, n: int, ns: int) -> None:
    v = x[:n].copy()
    time.sleep(ns / 1e9)
    x[:n] = v * np.float32(s)


def add_ref(x: np.ndarray, c: float, n: int) -> None:
    x[:n] = x[:n] + np.float32(c)


MOD = gf.compile(
    SOURCE,
    references={
        "late_fill": late_fill_ref,
        "late_copy": late_copy_ref,
        "late_scale": late_scale_ref,
        "add": add_ref,
    },
)


CFG = gf.LaunchConfig.for_num_elems(N)


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


def late_fill(x: Any, v: float, seconds: float = SLOW) -> gf.DeviceOperation[Any]:
    return MOD.late_fill(CFG, x, v, N, ns(seconds))


def late_copy(src: Any, dst: Any, seconds: float = SLOW) -> gf.DeviceOperation[Any]:
    return MOD.late_copy(CFG, src, dst, N, ns(seconds))


def add(x: Any, c: float) -> gf.DeviceOperation[Any]:
    return MOD.add(CFG, x, c, N)


def handle(s: gf.Stream) -> int:
    return s.__cuda_stream__()[1]


def backend() -> gf.lowlevel.Backend:
    return gf.lowlevel.current_backend_object()


def idle(s: gf.Stream) -> bool:
    """The backend's own word on whether ``s`` has finished its work (not gpuflow's
    bookkeeping)."""
    return backend().query(s.raw)


# a consumer's view of capsules, through the C API (prototypes of our own)
_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi)
)


_new_capsule = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))


def capsule_name(capsule: Any) -> str:
    return str(_get_name(capsule).decode())


def wait_until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE} s"
        time.sleep(0.002)


class CaiOnly:
    """A producer that speaks only ``__cuda_array_interface__`` (as Numba's
    arrays do), and owns what backs its memory: a gpuflow array."""

    def __init__(self, backing: gf.DeviceArray, **changes: Any) -> None:
        self.backing = backing
        self.__cuda_array_interface__ = {**backing.__cuda_array_interface__, **changes}


class DlpackOnly:
    """A producer that speaks only DLPack (as JAX's arrays do)."""

    def __init__(self, backing: gf.DeviceArray) -> None:
        self.backing = backing

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.backing.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.backing.__dlpack_device__()


class FakeLib:
    """Another CUDA library, on any backend.

    It takes gpuflow arrays through DLPack only, on its *current stream* (its
    own stream, which is no gpuflow stream, or the one an adapter makes
    current, as ``torch.cuda.stream`` does), and lets go of them as soon as
    its work is enqueued, as a PyTorch temporary does.  It enqueues real
    kernels through the backend interface on that stream, knowing the stream
    only by its handle.  Its own stream lives as long as the backend.
    """

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self._own_raw = backend().create_stream(device)
        self.own = backend().stream_handle(self._own_raw)
        self.current: int | None = None

    def stream(self) -> int:
        return self.own if self.current is None else self.current

    def idle(self) -> bool:
        """The backend's word on whether its own stream has finished its work."""
        return backend().query(self._own_raw)

    @contextlib.contextmanager
    def on(self, stream: gf.Stream) -> Iterator[None]:
        previous, self.current = self.current, handle(stream)
        try:
            yield
        finally:
            self.current = previous

    def _take(self, array: Any) -> tuple[Any, _dlpack.ManagedTensor]:
        capsule = array.__dlpack__(stream=self.stream(), max_version=(1, 0))
        t = _dlpack.read_capsule(capsule)
        owner = _dlpack.take_capsule(capsule, t)
        nbytes = math.prod(t.shape) * 4
        return backend().foreign_buffer(t.ptr, nbytes, t.device_id), owner

    def _launch(self, name: str, *args: Any) -> None:
        be = backend()
        raw, _device = be.foreign_stream(self.stream(), self.device)
        kernel = be.load_kernel(self.device, MOD, name)
        be.launch(kernel, CFG.grid, CFG.block, 0, args, raw)

    def late_copy(self, src: Any, dst: Any, seconds: float = SLOW) -> None:
        s, s_owner = self._take(src)
        d, d_owner = self._take(dst)
        f32 = np.dtype(F32)
        self._launch(
            "late_copy", PointerArg(s, f32, N, False), PointerArg(d, f32, N, True),
            np.int32(N), np.int64(ns(seconds)),
        )  # fmt: skip
        del s_owner, d_owner  # let go at once: the work is still pending

    def late_scale(self, x: Any, factor: float, seconds: float = SLOW) -> None:
        buf, owner = self._take(x)
        self._launch(
            "late_scale", PointerArg(buf, np.dtype(F32), N, True), np.float32(factor),
            np.int32(N), np.int64(ns(seconds)),
        )  # fmt: skip
        del owner

    def late_fill_untracked(self, ptr: int, value: float, seconds: float = SLOW) -> None:
        """A write gpuflow knows nothing of: through a raw device pointer."""
        buf = backend().foreign_buffer(ptr, N * 4, self.device)
        self._launch(
            "late_fill", PointerArg(buf, np.dtype(F32), N, True), np.float32(value),
            np.int32(N), np.int64(ns(seconds)),
        )  # fmt: skip


@pytest.fixture
def lib() -> Iterator[FakeLib]:
    """A FakeLib that ``gf.foreign`` puts on gpuflow's stream."""
    fake = FakeLib()
    unregister = gf.lowlevel.register_stream_adapter(fake.on)
    yield fake
    unregister()


