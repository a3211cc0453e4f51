"""Which driver calls block the calling thread while a kernel runs on another
stream (one that does not touch them)?  Each call is timed while a 0.2 s
kernel spins on a stream of its own; a call that takes about as long waited
for it.  Also: the cost of the calls gpuflow makes once a run.

usage: CUDA_DEVICE_MAX_CONNECTIONS=32 python benchmarks/probe_blocking.py
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc


def check(res: Any) -> Any:
    if int(res[0]) != 0:
        raise RuntimeError(f"CUDA error {res[0]}")
    return res[1] if len(res) == 2 else None


lib = ctypes.CDLL("libcuda.so.1")
vp, u64, ui = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint
lib.cuLaunchKernel.argtypes = [vp] + [ui] * 7 + [vp, vp, vp]
lib.cuStreamWriteValue64_v2.argtypes = [vp, u64, u64, ui]
check(cu.cuInit(0))
dev = check(cu.cuDeviceGet(0))
ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
check(cu.cuCtxSetCurrent(ctx))
SRC = rb"""
extern "C" __global__ void spin(long long ns) {
    unsigned long long s, n; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(s));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(n)); } while ((long long)(n - s) < ns);
}
extern "C" __global__ void empty() {}
"""


def build(tag: bytes) -> bytes:
    prog = check(nvrtc.nvrtcCreateProgram(SRC + b"// " + tag, b"k.cu", 0, [], []))
    check(nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=sm_90"]))
    out = bytearray(check(nvrtc.nvrtcGetCUBINSize(prog)))
    check(nvrtc.nvrtcGetCUBIN(prog, out))
    return bytes(out)


mod = check(cu.cuModuleLoadData(build(b"0")))
SPIN = int(check(cu.cuModuleGetFunction(mod, b"spin")))
EMPTY = check(cu.cuModuleGetFunction(mod, b"empty"))
busy = int(check(cu.cuStreamCreate(1)))
LONG = 0.2


def spin(stream: int, seconds: float = LONG) -> None:
    ns = ctypes.c_longlong(int(seconds * 1e9))
    arg = (vp * 1)(ctypes.cast(ctypes.pointer(ns), vp))
    assert lib.cuLaunchKernel(SPIN, 1, 1, 1, 1, 1, 1, 0, stream, arg, None) == 0


def during(what: str, fn: Callable[[], Any]) -> Any:
    check(cu.cuStreamSynchronize(busy))
    spin(busy)
    time.sleep(0.01)
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    flag = "  <-- WAITED" if dt > LONG / 2 else ""
    print(f"{what:60s} {dt * 1e3:8.2f} ms{flag}", flush=True)
    return out


print("CUDA_DEVICE_MAX_CONNECTIONS =", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
streams = []
for i in range(40):
    streams.append(during(f"cuStreamCreate #{i + 2}", lambda: int(check(cu.cuStreamCreate(1)))))
during("cuStreamCreateWithPriority", lambda: check(cu.cuStreamCreateWithPriority(1, 0)))
during("cuEventCreate", lambda: check(cu.cuEventCreate(2)))
during("cuModuleLoadData (a new module)", lambda: check(cu.cuModuleLoadData(build(b"1"))))
m2 = check(cu.cuModuleLoadData(build(b"2")))
during("cuModuleGetFunction", lambda: check(cu.cuModuleGetFunction(m2, b"empty")))
f2 = check(cu.cuModuleGetFunction(m2, b"spin"))
during("cuFuncLoad", lambda: check(cu.cuFuncLoad(f2)))
during("cuMemHostAlloc 64 KiB (mapped)", lambda: check(cu.cuMemHostAlloc(65536, 3)))
h = check(cu.cuMemHostAlloc(65536, 3))
during("cuMemFreeHost", lambda: check(cu.cuMemFreeHost(h)))
pool = check(cu.cuDeviceGetDefaultMemPool(dev))
buf = check(cu.cuMemAllocAsync(1 << 20, streams[0]))
during("cuMemFreeAsync (idle stream)", lambda: check(cu.cuMemFreeAsync(buf, streams[0])))
during("cuMemAllocAsync (idle stream)", lambda: check(cu.cuMemAllocAsync(1 << 20, streams[1])))
during("cuMemAlloc (plain)", lambda: check(cu.cuMemAlloc(1 << 20)))
b2 = check(cu.cuMemAlloc(1 << 20))
during("cuMemFree (plain)", lambda: check(cu.cuMemFree(b2)))
during("cuStreamDestroy (an idle stream)", lambda: check(cu.cuStreamDestroy(streams.pop())))
during("cuModuleUnload", lambda: check(cu.cuModuleUnload(m2)))
during("cuMemPoolTrimTo", lambda: check(cu.cuMemPoolTrimTo(pool, 0)))

# per-run costs: the completion word write, ctypes vs cuda.bindings
host = int(check(cu.cuMemHostAlloc(4096, 3)))
word = ctypes.c_uint64.from_address(host)
s0 = streams[0]
S0 = cu.CUstream(s0)
W = lib.cuStreamWriteValue64_v2
xs, ys, zs, rs = [], [], [], []
for i in range(2000):
    t = time.perf_counter()
    W(s0, host, i, 0)
    xs.append(time.perf_counter() - t)
    t = time.perf_counter()
    cu.cuStreamWriteValue64(S0, host, i, 0)
    ys.append(time.perf_counter() - t)
    t = time.perf_counter()
    _ = word.value
    rs.append(time.perf_counter() - t)
    t = time.perf_counter()
    cu.cuLaunchKernel(EMPTY, 1, 1, 1, 1, 1, 1, 0, S0, 0, 0)
    zs.append(time.perf_counter() - t)
check(cu.cuStreamSynchronize(s0))
m = lambda v: f"{statistics.median(v) * 1e6:.2f} us"  # noqa: E731
print("write64 via ctypes", m(xs), "| via cuda.bindings", m(ys), "| word read", m(rs),
      "| cuLaunchKernel via cuda.bindings", m(zs), "| word", word.value)
