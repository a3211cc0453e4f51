"""A latency class's first request while batch work keeps every SM busy,
against its second; and which driver calls a first use could wait on.

Part 1 (gpuflow, as installed or on ``PYTHONPATH``): in a fresh runtime, a
batch kernel of four 20 ms waves over every SM, then, 10 ms in, a short
request (one block of 1 ms) in ``latency_class(priority=top)``, and again
in a fresh runtime with 8 reserved SMs, in ``latency_class(sms=...)``: the
first request and the second, each timed.  Part 2 (``--driver``): each
driver call a class's first use might make, timed while a 0.2 s kernel
spins on a stream of its own (a call that takes about as long waited).

usage: python benchmarks/probe_class_first_use.py [--driver]
"""

from __future__ import annotations

import sys
import time
from typing import Any

import anyio

import gpuflow as gf

SPIN = r"""
extern "C" __global__ void spin(long long ns) {
    unsigned long long s, n; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(s));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(n)); } while ((long long)(n - s) < ns);
}"""


@gf.testing.block_time(lambda ns: ns / 1e9)
def _spin_ref(ns: int) -> None:
    pass


def first_and_second(**cls: Any) -> tuple[float, float]:
    mod = gf.compile(SPIN + f"\n// {time.time_ns()}\n", references={"spin": _spin_ref})
    be = gf.lowlevel.current_backend_object()
    sms = be.sm_count(0) or 132
    resident = 1 if be.name == "sim" else 32
    batch = mod.spin(gf.LaunchConfig(sms * resident * 4, 32), 20_000_000)
    short = mod.spin(gf.LaunchConfig(1, 32), 1_000_000)
    took: list[float] = []

    async def main() -> None:
        for _ in range(2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(batch.run)
                await anyio.sleep(0.01)
                t0 = time.perf_counter()
                with gf.latency_class(**cls):
                    await short
                took.append(time.perf_counter() - t0)

    anyio.run(main)
    return took[0], took[1]


def part1() -> None:
    backend = gf.init_device_contexts()
    top = gf.lowlevel.current_backend_object().stream_priorities(0)
    print(f"gpuflow {gf.__version__} from {gf.__file__}, backend {backend}")
    first, second = first_and_second()
    print(f"  no class:           first {first * 1e3:7.2f} ms, second {second * 1e3:7.2f} ms")
    gf.init_device_contexts(backend=backend)
    first, second = first_and_second(priority=top)
    print(f"  priority {top}:         first {first * 1e3:7.2f} ms, second {second * 1e3:7.2f} ms")
    gf.init_device_contexts(backend=backend, reserve_sms={"interactive": 8})
    first, second = first_and_second(sms="interactive")
    print(f"  8 reserved SMs:     first {first * 1e3:7.2f} ms, second {second * 1e3:7.2f} ms")


def part2() -> None:
    import ctypes

    from cuda.bindings import driver as cu

    def check(res: Any) -> Any:
        if int(res[0]) != 0:
            raise RuntimeError(f"CUDA error {res[0]}")
        return res[1] if len(res) == 2 else None

    check(cu.cuInit(0))
    dev = check(cu.cuDeviceGet(0))
    check(cu.cuCtxSetCurrent(check(cu.cuDevicePrimaryCtxRetain(dev))))
    mod = gf.compile(SPIN + "\n// part 2\n", references={"spin": _spin_ref})

    def image(tag: str) -> bytes:
        src = SPIN + f"\n// {tag} {time.time_ns()}\n"
        return gf.compile(src, references={"spin": _spin_ref}).binary_for("sm_90")

    cumod = check(cu.cuModuleLoadData(mod.binary_for("sm_90")))
    spin = check(cu.cuModuleGetFunction(cumod, b"spin"))
    busy = check(cu.cuStreamCreate(1))
    ns = ctypes.c_longlong(200_000_000)
    args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(ns), ctypes.c_void_p))

    def during(what: str, fn: Any) -> Any:
        check(cu.cuStreamSynchronize(busy))
        check(cu.cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, busy, ctypes.addressof(args), 0))
        time.sleep(0.01)
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        print(f"  {what:56s} {dt * 1e3:8.2f} ms{'  <-- WAITED' if dt > 0.1 else ''}", flush=True)
        return out

    print("driver calls while a 0.2 s kernel spins on another stream")
    for i in range(8):
        during(f"cuStreamCreateWithPriority(-5) #{i + 1}",
               lambda: check(cu.cuStreamCreateWithPriority(1, -5)))
    during("cuModuleLoadData (a new module, the device's context)",
           lambda: check(cu.cuModuleLoadData(image("new"))))
    page = ctypes.create_string_buffer(8192)
    addr = (ctypes.addressof(page) + 4095) // 4096 * 4096
    during("cuMemHostRegister (a page: a new slab of completion words)",
           lambda: check(cu.cuMemHostRegister(addr, 4096, 3)))
    during("cuEventCreate", lambda: check(cu.cuEventCreate(2)))
    # a green context of 8 SMs, a stream in it, and a module loaded into it
    res = check(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    parts, _n, _rest = check(cu.cuDevSmResourceSplitByCount(1, res, 0, 8))
    desc = check(cu.cuDevResourceGenerateDesc([parts[0]], 1))
    green = during("cuGreenCtxCreate", lambda: check(cu.cuGreenCtxCreate(desc, dev, 1)))
    during("cuGreenCtxStreamCreate", lambda: check(cu.cuGreenCtxStreamCreate(green, 1, 0)))
    gctx = check(cu.cuCtxFromGreenCtx(green))

    def load_in_green() -> Any:
        check(cu.cuCtxPushCurrent(gctx))
        try:
            return check(cu.cuModuleLoadData(image("green")))
        finally:
            check(cu.cuCtxPopCurrent())

    during("cuModuleLoadData (a new module, into the green context)", load_in_green)


if __name__ == "__main__":
    part1()
    if "--driver" in sys.argv[1:]:
        part2()
