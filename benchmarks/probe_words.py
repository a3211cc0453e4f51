"""Completion words on this GPU: stream memory operations (64-bit write and
wait, the v2 entry points through libcuda) on pinned, device-mapped host
memory.  Checks that a wait on another stream's word orders work, that a
host function behind such a wait fires when the word is written (not when
the writing stream's later work is done), and times a launch + write + poll.

usage: python benchmarks/probe_words.py   (plain cuda-bindings + ctypes)
"""

from __future__ import annotations

import ctypes
import os
import select
import statistics
import time

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc


def check(res):  # type: ignore[no-untyped-def]
    if int(res[0]) != 0:
        raise RuntimeError(f"CUDA error {res[0]}")
    return res[1] if len(res) == 2 else None


lib = ctypes.CDLL("libcuda.so.1")
vp, u64, ui = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint
for name, args in (
    ("cuStreamWriteValue64_v2", [vp, u64, u64, ui]),
    ("cuStreamWaitValue64_v2", [vp, u64, u64, ui]),
    ("cuLaunchHostFunc", [vp, vp, vp]),
    ("cuLaunchKernel", [vp] + [ui] * 7 + [vp, vp, vp]),
):
    getattr(lib, name).argtypes = args
    getattr(lib, name).restype = ctypes.c_int
W64, WAIT64 = lib.cuStreamWriteValue64_v2, lib.cuStreamWaitValue64_v2
CLOSE = ctypes.cast(ctypes.CDLL(None).close, vp).value

check(cu.cuInit(0))
dev = check(cu.cuDeviceGet(0))
ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
check(cu.cuCtxSetCurrent(ctx))
A = cu.CUdevice_attribute
for a in (
    "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1",
    "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1",
    "CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY",
):
    if hasattr(A, a):
        print(a, check(cu.cuDeviceGetAttribute(getattr(A, a), dev)))

src = b"""
extern "C" __global__ void spin(long long ns) {
    long long t0 = clock64(); (void)t0;
    unsigned long long start; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) { unsigned long long now; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
               if ((long long)(now - start) >= ns) break; }
}
extern "C" __global__ void empty() {}
"""
prog = check(nvrtc.nvrtcCreateProgram(src, b"k.cu", 0, [], []))
print("nvrtc", nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=sm_90"]))
cubin = bytearray(check(nvrtc.nvrtcGetCUBINSize(prog)))
check(nvrtc.nvrtcGetCUBIN(prog, cubin))
mod = check(cu.cuModuleLoadData(cubin))
SPIN = int(check(cu.cuModuleGetFunction(mod, b"spin")))
EMPTY = int(check(cu.cuModuleGetFunction(mod, b"empty")))
sa, sb, sc = (int(check(cu.cuStreamCreate(1))) for _ in range(3))
flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
host = int(check(cu.cuMemHostAlloc(4096, flags)))
dptr = int(check(cu.cuMemHostGetDevicePointer(host, 0)))
print("host", hex(host), "device view", hex(dptr), "same" if host == dptr else "differs")
words = (ctypes.c_uint64 * 512).from_address(host)
for i in range(512):
    words[i] = 0


def spin(stream: int, seconds: float) -> None:
    ns = ctypes.c_longlong(int(seconds * 1e9))
    arg = (vp * 1)(ctypes.cast(ctypes.pointer(ns), vp))
    assert lib.cuLaunchKernel(SPIN, 1, 1, 1, 1, 1, 1, 0, stream, arg, None) == 0


def empty(stream: int) -> None:
    assert lib.cuLaunchKernel(EMPTY, 1, 1, 1, 1, 1, 1, 0, stream, None, None) == 0


print("write64", W64(sa, dptr, 0, 0), "wait64", WAIT64(sb, dptr, 0, 0))

# 1. B waits for A's word 1 (after A's 0.3 s kernel); A then runs 2 s more
t0 = time.perf_counter()
spin(sa, 0.3)
assert W64(sa, dptr, 1, 0) == 0
spin(sa, 2.0)
assert W64(sa, dptr, 2, 0) == 0
assert WAIT64(sb, dptr, 1, 0) == 0  # CU_STREAM_WAIT_VALUE_GEQ = 0
empty(sb)
check(cu.cuStreamSynchronize(sb))
tb = time.perf_counter() - t0
# 2. a host function behind a wait on a third stream fires at word 2's... and at 1
r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
assert WAIT64(sc, dptr, 1, 0) == 0
assert lib.cuLaunchHostFunc(sc, CLOSE, w) == 0
ep = select.epoll()
ep.register(r, select.EPOLLIN)
ready = ep.poll(5.0)
tc = time.perf_counter() - t0
check(cu.cuStreamSynchronize(sa))
ta = time.perf_counter() - t0
print(f"B (waits for word 1) done at {tb:.3f} s; host function behind the wait at {tc:.3f} s "
      f"({'fired' if ready else 'NOT fired'}); A done at {ta:.3f} s; word now {words[0]}")
os.close(r)

# 3. latency: launch + write + poll the word from Python
seq = 10
xs, ys, zs = [], [], []
for _ in range(3000):
    seq += 1
    t = time.perf_counter()
    empty(sa)
    assert W64(sa, dptr + 8, seq, 0) == 0
    while words[1] < seq:
        pass
    xs.append(time.perf_counter() - t)
for _ in range(3000):
    t = time.perf_counter()
    empty(sa)
    check(cu.cuStreamSynchronize(sa))
    ys.append(time.perf_counter() - t)
for _ in range(3000):
    t = time.perf_counter()
    seq += 1
    assert W64(sa, dptr + 8, seq, 0) == 0
    zs.append(time.perf_counter() - t)
check(cu.cuStreamSynchronize(sa))
med = lambda v: f"{statistics.median(v) * 1e6:.1f} us"  # noqa: E731
print("launch + write64 + poll:", med(xs), "| launch + cuStreamSynchronize:", med(ys),
      "| write64 call alone:", med(zs))
# 4. cross-stream wait cost: B waits on A's word (already satisfied) + empty, sync
vs = []
for _ in range(2000):
    t = time.perf_counter()
    assert WAIT64(sb, dptr + 8, seq, 0) == 0
    empty(sb)
    check(cu.cuStreamSynchronize(sb))
    vs.append(time.perf_counter() - t)
ev = check(cu.cuEventCreate(2))
es = []
for _ in range(2000):
    t = time.perf_counter()
    check(cu.cuEventRecord(ev, sa))
    check(cu.cuStreamWaitEvent(sb, ev, 0))
    empty(sb)
    check(cu.cuStreamSynchronize(sb))
    es.append(time.perf_counter() - t)
print("satisfied wait64 + empty + sync:", med(vs), "| event record + wait + empty + sync:", med(es))
