"""Where does the time of one launch + await go?  Raw pieces, measured side by side.

a. launch + 1 sem_post host function + sem_wait (same thread)
b. launch + 2 sem_post host functions + sem_wait on the second
c. launch + event record + cuEventSynchronize
d. launch + close(fd) host function, asyncio loop woken by the fd (no Python thread)
e. launch + 1 sem_post host fn, a Python waiter thread, call_soon_threadsafe to asyncio
f. thread ping-pong through threading.Event (the cost of one GIL hand-off)
g. gpuflow await, marks="word" and marks="event", polling and not
h. (last: the fault lasts as long as the process) a faulting launch to the
   first cuStreamQuery that reports it

Needs a CUDA device; the kernels are compiled for that device's architecture.

Run: python benchmarks/probe_latency.py [--samples N]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import statistics
import threading
import time
from typing import Any

import anyio

import gpuflow as gf

EMPTY = 'extern "C" __global__ void empty() {}'
BAD = 'extern "C" __global__ void bad(unsigned long long a) { *((volatile int*)a) = 1; }'


def med(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 1)


def ok(res: tuple[Any, ...], what: str) -> Any:
    """The value of a cuda.bindings call; raises on an error code."""
    if int(res[0]) != 0:
        raise RuntimeError(f"{what} failed: {res[0]}")
    return res[1] if len(res) == 2 else res[1:]


class Raw:
    """One device's primary context, a stream, the empty kernel and libc's semaphores."""

    def __init__(self, device: int) -> None:
        from cuda.bindings import driver as cu

        from gpuflow._backends._nvrtc import compile_source  # the same NVRTC path as gpuflow

        self.cu = cu
        ok(cu.cuInit(0), "cuInit")
        self.dev = ok(cu.cuDeviceGet(device), "cuDeviceGet")
        attr = cu.CUdevice_attribute
        major = ok(cu.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev), "cuDeviceGetAttribute")
        minor = ok(cu.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev), "cuDeviceGetAttribute")
        self.arch = f"sm_{major}{minor}"
        self.compile_source = compile_source
        self.ctx = ok(cu.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        ok(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.stream = ok(cu.cuStreamCreate(1), "cuStreamCreate")
        self.mod = ok(cu.cuModuleLoadData(self.cubin(EMPTY)), "cuModuleLoadData")
        self.fn = ok(cu.cuModuleGetFunction(self.mod, b"empty"), "cuModuleGetFunction")
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libcuda = ctypes.CDLL("libcuda.so.1")
        self.libcuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p] * 3
        self.sem = ctypes.create_string_buffer(64)
        self.sem2 = ctypes.create_string_buffer(64)
        self.libc.sem_init(self.sem, 0, 0)
        self.libc.sem_init(self.sem2, 0, 0)
        self.post = ctypes.cast(self.libc.sem_post, ctypes.c_void_p).value
        self.close_addr = ctypes.cast(self.libc.close, ctypes.c_void_p).value
        self.sp = int(self.stream)

    def cubin(self, source: str) -> bytes:
        code: bytes = self.compile_source(source, self.arch, ())
        return code

    def launch(self) -> None:
        self.cu.cuLaunchKernel(self.fn, 1, 1, 1, 1, 1, 1, 0, self.stream, 0, 0)

    def host_func(self, fn: int | None, data: int) -> None:
        self.libcuda.cuLaunchHostFunc(self.sp, fn, data)


def a(r: Raw, n: int) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r.launch()
        r.host_func(r.post, ctypes.addressof(r.sem))
        r.libc.sem_wait(r.sem)
        out.append(time.perf_counter() - t0)
    return med(out)


def b(r: Raw, n: int) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r.launch()
        r.host_func(r.post, ctypes.addressof(r.sem))
        r.host_func(r.post, ctypes.addressof(r.sem2))
        r.libc.sem_wait(r.sem2)
        r.libc.sem_wait(r.sem)
        out.append(time.perf_counter() - t0)
    return med(out)


def c(r: Raw, n: int) -> float:
    cu = r.cu
    ev = ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r.launch()
        cu.cuEventRecord(ev, r.stream)
        cu.cuEventSynchronize(ev)
        out.append(time.perf_counter() - t0)
    cu.cuEventDestroy(ev)
    return med(out)


def d(r: Raw, n: int) -> float:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            rfd, wfd = os.pipe()
            fut = loop.create_future()
            loop.add_reader(rfd, fut.set_result, None)
            r.launch()
            r.host_func(r.close_addr, wfd)  # the driver's thread closes the write end
            await fut
            loop.remove_reader(rfd)
            os.close(rfd)
            out.append(time.perf_counter() - t0)
        return med(out)

    return asyncio.run(main())


def e(r: Raw, n: int) -> float:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        q: list[asyncio.Future[None]] = []
        stop = [False]

        def waiter() -> None:
            while True:
                r.libc.sem_wait(r.sem)
                if stop[0]:
                    return
                f = q.pop(0)
                loop.call_soon_threadsafe(f.set_result, None)

        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fut = loop.create_future()
            q.append(fut)
            r.launch()
            r.host_func(r.post, ctypes.addressof(r.sem))
            await fut
            out.append(time.perf_counter() - t0)
        stop[0] = True
        r.libc.sem_post(r.sem)
        return med(out)

    return asyncio.run(main())


def f(n: int) -> float:
    e1, e2 = threading.Event(), threading.Event()

    def other() -> None:
        for _ in range(n):
            e1.wait()
            e1.clear()
            e2.set()

    t = threading.Thread(target=other)
    t.start()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        e1.set()
        e2.wait()
        e2.clear()
        out.append(time.perf_counter() - t0)
    t.join()
    return med(out)


def g(n: int) -> None:
    from gpuflow._backends import _cuda  # its kinds of marks are the backend's, not public

    async def main(op: gf.DeviceOperation[Any]) -> float:
        for _ in range(300):
            await op
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await op
            out.append(time.perf_counter() - t0)
        return med(out)

    for marks in ("word", "event"):
        for poll_us in (200, 0):
            be = _cuda.CudaBackend(1, marks=marks)
            gf.init_device_contexts(backend=be, busy_poll_us=poll_us)
            m = gf.compile(EMPTY)
            op = m.empty(gf.LaunchConfig(1, 1))
            for lib in ("asyncio", "trio"):
                us = anyio.run(main, op, backend=lib)
                print(f"g gpuflow await marks={marks} busy_poll_us={poll_us} {lib}", us, "us",
                      flush=True)


def h(r: Raw) -> None:
    cu = r.cu
    ok(cu.cuCtxSetCurrent(r.ctx), "cuCtxSetCurrent")
    bmod = ok(cu.cuModuleLoadData(r.cubin(BAD)), "cuModuleLoadData")
    bfn = ok(cu.cuModuleGetFunction(bmod, b"bad"), "cuModuleGetFunction")
    s2 = ok(cu.cuStreamCreate(1), "cuStreamCreate")
    t0 = time.perf_counter()
    cu.cuLaunchKernel(bfn, 1, 1, 1, 32, 1, 1, 0, s2, ((8,), (ctypes.c_ulonglong,)), 0)
    while True:
        rc = cu.cuStreamQuery(s2)[0]
        if rc != cu.CUresult.CUDA_ERROR_NOT_READY:
            break
    print("h fault -> first failing cuStreamQuery", round((time.perf_counter() - t0) * 1e3, 2),
          "ms", rc, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=3000, help="samples per measurement")
    args = p.parse_args(argv)
    n = args.samples
    r = Raw(0)
    print(f"device 0: {r.arch}", flush=True)
    print("a launch+1 hostfn+sem_wait       ", a(r, n), "us", flush=True)
    print("b launch+2 hostfn+sem_wait       ", b(r, n), "us", flush=True)
    print("c launch+event+cuEventSynchronize", c(r, n), "us", flush=True)
    print("d launch+close(fd) hostfn+asyncio", d(r, n), "us", flush=True)
    print("e launch+hostfn+thread+asyncio   ", e(r, n), "us", flush=True)
    print("f thread ping-pong (round trip)  ", f(n), "us", flush=True)
    g(n)
    h(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
