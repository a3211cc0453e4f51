"""Where does the time of one launch + await go?  Raw pieces, measured side by side.

a. launch + 1 sem_post host function + sem_wait (same thread)
b. launch + 2 sem_post host functions + sem_wait on the second
c. launch + event record + cuEventSynchronize
d. launch + close(fd) host function, asyncio loop woken by the fd (no Python thread)
e. launch + 1 sem_post host fn, a Python waiter thread, call_soon_threadsafe to asyncio
f. thread ping-pong through threading.Event (the cost of one GIL hand-off)
g. gpuflow await, signals="hostfunc" and signals="event"
"""

import asyncio
import ctypes
import os
import statistics
import threading
import time

import anyio
from cuda.bindings import driver as cu

import gpuflow as gf
from gpuflow._backends._nvrtc import compile_source

N = 3000


def med(xs):
    return round(statistics.median(xs) * 1e6, 1)


cu.cuInit(0)
dev = cu.cuDeviceGet(0)[1]
ctx = cu.cuDevicePrimaryCtxRetain(dev)[1]
cu.cuCtxSetCurrent(ctx)
stream = cu.cuStreamCreate(1)[1]
cubin = compile_source('extern "C" __global__ void empty() {}', "sm_90", ())
mod = cu.cuModuleLoadData(cubin)[1]
fn = cu.cuModuleGetFunction(mod, b"empty")[1]
libc = ctypes.CDLL(None, use_errno=True)
libcuda = ctypes.CDLL("libcuda.so.1")
libcuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
sem = ctypes.create_string_buffer(64)
sem2 = ctypes.create_string_buffer(64)
libc.sem_init(sem, 0, 0)
libc.sem_init(sem2, 0, 0)
post = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
close_addr = ctypes.cast(libc.close, ctypes.c_void_p).value
sp = int(stream)


def launch():
    cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0)


def a():
    out = []
    for _ in range(N):
        t0 = time.perf_counter()
        launch()
        libcuda.cuLaunchHostFunc(sp, post, ctypes.addressof(sem))
        libc.sem_wait(sem)
        out.append(time.perf_counter() - t0)
    return med(out)


def b():
    out = []
    for _ in range(N):
        t0 = time.perf_counter()
        launch()
        libcuda.cuLaunchHostFunc(sp, post, ctypes.addressof(sem))
        libcuda.cuLaunchHostFunc(sp, post, ctypes.addressof(sem2))
        libc.sem_wait(sem2)
        libc.sem_wait(sem)
        out.append(time.perf_counter() - t0)
    return med(out)


def c():
    ev = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1]
    out = []
    for _ in range(N):
        t0 = time.perf_counter()
        launch()
        cu.cuEventRecord(ev, stream)
        cu.cuEventSynchronize(ev)
        out.append(time.perf_counter() - t0)
    return med(out)


def d():
    async def main():
        loop = asyncio.get_running_loop()
        out = []
        for _ in range(N):
            t0 = time.perf_counter()
            r, w = os.pipe()
            fut = loop.create_future()
            loop.add_reader(r, fut.set_result, None)
            launch()
            libcuda.cuLaunchHostFunc(sp, close_addr, w)
            await fut
            loop.remove_reader(r)
            os.close(r)
            out.append(time.perf_counter() - t0)
        return med(out)

    return asyncio.run(main())


def e():
    async def main():
        loop = asyncio.get_running_loop()
        q = []
        stop = [False]

        def waiter():
            while True:
                libc.sem_wait(sem)
                if stop[0]:
                    return
                f = q.pop(0)
                loop.call_soon_threadsafe(f.set_result, None)

        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        out = []
        for _ in range(N):
            t0 = time.perf_counter()
            fut = loop.create_future()
            q.append(fut)
            launch()
            libcuda.cuLaunchHostFunc(sp, post, ctypes.addressof(sem))
            await fut
            out.append(time.perf_counter() - t0)
        stop[0] = True
        libc.sem_post(sem)
        return med(out)

    return asyncio.run(main())


def f():
    e1, e2 = threading.Event(), threading.Event()

    def other():
        for _ in range(N):
            e1.wait()
            e1.clear()
            e2.set()

    t = threading.Thread(target=other)
    t.start()
    out = []
    for _ in range(N):
        t0 = time.perf_counter()
        e1.set()
        e2.wait()
        e2.clear()
        out.append(time.perf_counter() - t0)
    t.join()
    return med(out)


print("a launch+1 hostfn+sem_wait       ", a(), "us", flush=True)
print("b launch+2 hostfn+sem_wait       ", b(), "us", flush=True)
print("c launch+event+cuEventSynchronize", c(), "us", flush=True)
print("d launch+close(fd) hostfn+asyncio", d(), "us", flush=True)
print("e launch+hostfn+thread+asyncio   ", e(), "us", flush=True)
print("f thread ping-pong (round trip)  ", f(), "us", flush=True)

for signals in ("hostfunc", "event"):
    from gpuflow import _runtime as R
    from gpuflow._backends import _cuda

    be = _cuda.CudaBackend(1, signals=signals)
    R._runtime = R.Runtime(be, 0, [0], 4)
    m = gf.compile('extern "C" __global__ void empty() {}')
    op = m.empty(gf.LaunchConfig(1, 1))
    for lib in ("asyncio", "trio"):

        async def main():
            for _ in range(300):
                await op
            out = []
            for _ in range(N):
                t0 = time.perf_counter()
                await op
                out.append(time.perf_counter() - t0)
            return med(out)

        print(
            f"g gpuflow await signals={signals} {lib}",
            anyio.run(main, backend=lib),
            "us",
            flush=True,
        )

# h. last (the fault lasts as long as the process): launch a faulting kernel and
# time the first cuStreamQuery that reports it, in a tight loop
bad = compile_source(
    'extern "C" __global__ void bad(unsigned long long a) { *((volatile int*)a) = 1; }',
    "sm_90", (),
)
cu.cuCtxSetCurrent(ctx)
bmod = cu.cuModuleLoadData(bad)[1]
bfn = cu.cuModuleGetFunction(bmod, b"bad")[1]
s2 = cu.cuStreamCreate(1)[1]
t0 = time.perf_counter()
cu.cuLaunchKernel(bfn, 1, 1, 1, 32, 1, 1, 0, s2, ((8,), (ctypes.c_ulonglong,)), 0)
while True:
    rc = cu.cuStreamQuery(s2)[0]
    if rc != cu.CUresult.CUDA_ERROR_NOT_READY:
        break
print("h fault -> first failing cuStreamQuery", round((time.perf_counter() - t0) * 1e3, 2), "ms",
      rc, flush=True)
