"""CUDA C++ kernels shared by the tests, with the NumPy references that ``sim`` runs.

Every kernel here is real CUDA C++: NVRTC compiles it on any machine, and on a
GPU the device code runs instead of the reference.  Each reference computes
exactly what its kernel computes (for the elements ``[0, n)``), so a test
that checks results passes on ``sim`` and on ``cuda`` alike.  Values the tests
use are small integers (also in the float kernels), so results are exact on
both, fused multiply-add or not.

``spin`` holds SMs: each of its blocks waits ``ns`` on the GPU, and on
``sim`` holds one of the device's simulated SMs as long
(:func:`gpuflow.testing.block_time`), so that a grid larger than the SMs
runs in waves.  The "slow" kernel takes a wall-clock time: the GPU spins on ``%globaltimer``
(nanoseconds) for ``ns``, the reference sleeps as long.  ``stamped_wait``
waits the same way and writes when it started and ended on the device's own
clock (``%globaltimer`` on a GPU; on ``sim``, ``time.monotonic_ns`` read by
the stream that runs it), so tests can see which kernels ran at once.  The faulting kernel
writes through a null pointer (an illegal address on a GPU); its reference
raises ``IndexError``, which ``sim`` turns into the same sticky fault.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import gpuflow as gf

SOURCE = r"""
extern "C" __global__ void saxpy(float a, const float* __restrict__ x, float* __restrict__ y,
                                 int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

extern "C" __global__ void vadd(const float* a, const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

extern "C" __global__ void scale(float* x, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * s;
}

extern "C" __global__ void copy_f32(const float* src, float* dst, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

extern "C" __global__ void add_i32(int* x, int c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + c;
}

extern "C" __global__ void mul_i32(int* x, int c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * c;
}

// one increment per launch, whatever the grid: counts how often the launch ran
extern "C" __global__ void count(int* counter) {
    if (blockIdx.x == 0 && threadIdx.x == 0) counter[0] += 1;
}

// every thread waits ns nanoseconds of wall-clock time, then writes its element
extern "C" __global__ void slow_fill(float* x, float v, int n, long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}

// every block waits ns nanoseconds of wall-clock time: a grid that holds SMs
extern "C" __global__ void spin(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
}

// waits ns nanoseconds of wall-clock time; t[0], t[1]: %globaltimer at its start and end
extern "C" __global__ void stamped_wait(long long* t, long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        t[0] = (long long)start;
        t[1] = (long long)now;
    }
}
"""

#: ``gf_wait_ns(ns)``: a device function that waits ``ns`` of wall-clock time
#: (``%globaltimer``), for kernels that must be slow on purpose.  The memory
#: clobber keeps the compiler from moving loads and stores across the wait.
WAIT_NS = r"""
__device__ __forceinline__ void gf_wait_ns(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start) :: "memory");
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now) :: "memory");
    } while (now - start < (unsigned long long)ns);
}
"""

# volatile: a plain store through a null pointer is undefined behaviour that
# NVRTC deletes outright (the kernel would then do nothing)
FAULT_SOURCE = r"""
extern "C" __global__ void null_write(int n) {
    if (threadIdx.x < n) ((volatile int*)0)[threadIdx.x] = 1;
}
"""


def saxpy_ref(a: float, x: np.ndarray, y: np.ndarray, n: int) -> None:
    y[:n] = np.float32(a) * x[:n] + y[:n]


def vadd_ref(a: np.ndarray, b: np.ndarray, out: np.ndarray, n: int) -> None:
    out[:n] = a[:n] + b[:n]


def scale_ref(x: np.ndarray, s: float, n: int) -> None:
    x[:n] = x[:n] * np.float32(s)


def copy_f32_ref(src: np.ndarray, dst: np.ndarray, n: int) -> None:
    dst[:n] = src[:n]


def add_i32_ref(x: np.ndarray, c: int, n: int) -> None:
    x[:n] = x[:n] + np.int32(c)


def mul_i32_ref(x: np.ndarray, c: int, n: int) -> None:
    x[:n] = x[:n] * np.int32(c)


def count_ref(counter: np.ndarray) -> None:
    counter[0] += 1


def slow_fill_ref(x: np.ndarray, v: float, n: int, ns: int) -> None:
    time.sleep(ns / 1e9)
    x[:n] = np.float32(v)


def stamped_wait_ref(t: np.ndarray, ns: int) -> None:
    start = now = time.monotonic_ns()
    while now - start < ns:
        time.sleep((ns - (now - start)) / 1e9)
        now = time.monotonic_ns()
    t[0] = start
    t[1] = now


@gf.testing.block_time(lambda ns: ns / 1e9)
def spin_ref(ns: int) -> None:
    """Nothing to compute: on ``sim`` each block holds an SM for ``ns``."""


def null_write_ref(n: int) -> None:
    raise IndexError("null_write: write through a null pointer")


REFERENCES: dict[str, Any] = {
    "saxpy": saxpy_ref,
    "vadd": vadd_ref,
    "scale": scale_ref,
    "copy_f32": copy_f32_ref,
    "add_i32": add_i32_ref,
    "mul_i32": mul_i32_ref,
    "count": count_ref,
    "slow_fill": slow_fill_ref,
    "stamped_wait": stamped_wait_ref,
    "spin": spin_ref,
}


def module() -> gf.Module:
    """The kernels of :data:`SOURCE` with their references (NVRTC caches the compile)."""
    return gf.compile(SOURCE, references=REFERENCES)


def fault_module() -> gf.Module:
    """``null_write``: a kernel that faults with an illegal address."""
    return gf.compile(FAULT_SOURCE, references={"null_write": null_write_ref})


def cfg(n: int) -> gf.LaunchConfig:
    return gf.LaunchConfig.for_num_elems(n)


def slow_fill(x: Any, v: float, seconds: float, n: int | None = None) -> gf.DeviceOperation[Any]:
    """Fill ``x`` (a float32 array or an operation producing one) with ``v`` after ``seconds``."""
    if n is None:
        if not isinstance(x, gf.DeviceArray):
            raise TypeError("slow_fill needs n when x is an operation")
        n = x.size
    return module().slow_fill(cfg(n), x, v, n, int(seconds * 1e9))


def spin(blocks: int, seconds: float) -> gf.DeviceOperation[None]:
    """``blocks`` blocks of 32 threads, each holding an SM for ``seconds``
    (on ``sim``, one block an SM; a GPU holds many at once)."""
    return module().spin(gf.LaunchConfig(blocks, 32), int(seconds * 1e9))


def stamped_wait(t: Any, seconds: float) -> gf.DeviceOperation[Any]:
    """Wait ``seconds`` on the device, then write its start and end times (ns, the
    device's clock) into ``t[0]``, ``t[1]`` (``t``: int64, two elements)."""
    return module().stamped_wait(gf.LaunchConfig(1, 1), t, int(seconds * 1e9))


def counter() -> gf.DeviceArray:
    """A fresh int32 counter (one element, zero) on the current device."""
    return gf.zeros(1, np.int32).sync()


def bump(counter: gf.DeviceArray) -> gf.DeviceOperation[Any]:
    """An operation that adds one to ``counter`` on the device each time it runs."""
    return module().count(gf.LaunchConfig(1, 1), counter)


def read_count(counter: gf.DeviceArray) -> int:
    return int(gf.to_host(counter).sync_on(stream_of(counter))[0])


def stream_of(a: gf.DeviceArray) -> gf.Stream:
    """A stream of the array's device (for reading it back from tests)."""
    return gf.SingleStream(device=a.device).stream


def num_devices() -> int:
    """How many devices the runtime has."""
    return gf.device_count()
