"""gpuflow's benchmarks: medians and ratios against baselines measured in the
same process, side by side.  ``python -m gpuflow bench [--quick] [--only NAME]
[--trace PATH] [--json PATH] [--devices N]`` (``--trace``: also a timeline of
every run, see ``gf.trace``; ``--json``: the rows as JSON).

Shipped inside the package, so that ``python -m gpuflow bench`` works
wherever gpuflow is installed.

Absolute times only mean something on a GPU (backend ``cuda``); on ``sim``
the gpuflow side runs and the raw-driver baselines are left out.  Each row:
what was measured, gpuflow's median, the baseline and its median, their
ratio, and the target the issue set.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import random
import statistics
import textwrap
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import numpy as np

import gpuflow as gf

from ..lowlevel import pool_streams
from ._bench_classes import bench_classes
from ._bench_comm import bench_collectives
from ._bench_poll import (
    bench_cpu,
    bench_enqueue,
    bench_in_flight,
    bench_torch_requests,
)
from ._bench_rows import (
    ROWS,
    Collections,
    Completions,
    event_loops,
    interleaved,
    measured_on,
    median_us,
    missing_loops,
    row,
    summary,
)

EMPTY = r"""
extern "C" __global__ void empty() {}
extern "C" __global__ void crash(int* p, unsigned long long bad) {
    *((volatile int*)(bad + 4 * threadIdx.x)) = p[0];  // an address nothing maps
}
extern "C" __global__ void busy(float* x, int iters) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float a = x[i], b = 1.0001f, c = 0.9999f;
    for (int k = 0; k < iters; ++k) { a = a * b + c; b = b * c + a * 1e-9f; }
    x[i] = a + b;
}
extern "C" __global__ void spin(long long ns) {  // busy for ns of wall-clock time
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
}
"""


def bench_references() -> dict[str, Callable[..., None]]:
    """The NumPy references of :data:`EMPTY`'s kernels, for ``sim``."""
    def crash(p: object, bad: int) -> None:
        raise IndexError("illegal address (write through a null pointer)")

    def busy(x: Any, iters: int) -> None:
        x += 1.0

    @gf.testing.block_time(lambda ns: ns / 1e9)  # each block holds a simulated SM as long
    def spin(ns: int) -> None:
        pass

    return {"empty": lambda: None, "crash": crash, "busy": busy, "spin": spin}


# -- raw driver baselines (cuda only) ----------------------------------------------
class Raw:
    """The same kernels through cuda.bindings alone: what the driver itself allows."""

    def __init__(self, stream: gf.Stream) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        dev = stream.device
        cudev = cu.cuDeviceGet(dev)[1]
        major = cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, cudev)[1]
        minor = cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, cudev)[1]
        cubin = gf.compile(EMPTY, references=bench_references()).binary_for(f"sm_{major}{minor}")
        ctx = cu.cuDevicePrimaryCtxRetain(cudev)[1]
        cu.cuCtxSetCurrent(ctx)
        self.mod = cu.cuModuleLoadData(cubin)[1]
        self.empty = cu.cuModuleGetFunction(self.mod, b"empty")[1]
        handle = stream.__cuda_stream__()[1]
        self.owner = stream  # (the handle lives as long as the stream: keep it)
        self.stream = cu.CUstream(handle)
        # the naive bridge: libc close() as the host function, through ctypes
        # (the bindings' wrapper would take the GIL in the driver's thread)
        vp = ctypes.c_void_p
        self._host_func = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
        self._host_func.argtypes = [vp, vp, vp]
        self._close = ctypes.cast(ctypes.CDLL(None).close, vp).value
        self._handle = handle

    def launch(self) -> None:
        self.cu.cuLaunchKernel(self.empty, 1, 1, 1, 1, 1, 1, 0, self.stream, 0, 0)

    def sync(self) -> None:
        self.cu.cuStreamSynchronize(self.stream)

    async def naive_await(self) -> None:
        """Launch, and await it through a fresh pipe whose write end the GPU
        closes: the 30-line bridge a user could write, one pipe per op."""
        r, w = os.pipe()
        self.launch()
        self._host_func(self._handle, self._close, w)
        try:
            await anyio.wait_readable(r)
        finally:
            os.close(r)


def bench_launch_await(mod: gf.Module, quick: bool, cuda: bool) -> None:
    n = 300 if quick else 3000
    op = mod.empty(gf.LaunchConfig(1, 1))
    print("launch + await of one empty kernel (median per op; the paths taken in turns)")
    raw = Raw(gf.new_stream()) if cuda else None
    for lib, backend, options in event_loops():
        async def ours() -> None:
            await op

        paths: dict[str, Callable[[], Any]] = {"ours": ours}
        if raw is not None:
            async def thread(raw: Raw = raw) -> None:
                raw.launch()
                await anyio.to_thread.run_sync(raw.sync)

            def blocking(raw: Raw = raw) -> None:
                raw.launch()
                raw.sync()

            paths.update(thread=thread, naive=raw.naive_await, blocking=blocking)
        seen = Completions()
        got = interleaved(paths, n, 100, backend, options)
        us = {name: median_us(samples) for name, samples in got.items()}
        if raw is None:
            row(f"gpuflow await ({lib})", us["ours"], "us", target="(sim: no target)")
            seen.show()
            continue
        row(f"gpuflow await ({lib})", us["ours"], "us", f"to_thread(sync) {lib}", us["thread"],
            "<= 0.35x")
        seen.show()
        row(f"gpuflow await ({lib}) vs naive bridge", us["ours"], "us",
            "launch+close(pipe) host fn", us["naive"], "(reference)")
        row(f"gpuflow await ({lib}) vs blocking", us["ours"], "us", "launch+cuStreamSynchronize",
            us["blocking"], "<= 2x")


def bench_throughput(mod: gf.Module, quick: bool, cuda: bool) -> None:
    tasks, per = 64, (20 if quick else 100)
    turns = 1 if quick else 3  # (medians of three, in turns with the baseline's runs)
    op = mod.empty(gf.LaunchConfig(1, 1))
    print(f"{tasks} tasks x {per} awaited tiny kernels over the 4-stream pool")
    raws = [Raw(s) for s in pool_streams(0)[:4]] if cuda else []

    async def timed(worker: Callable[[int], Coroutine[Any, Any, None]]) -> float:
        async with anyio.create_task_group() as tg:  # warm-up
            for i in range(4):
                tg.start_soon(worker, i)
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(tasks):
                tg.start_soon(worker, i)
        return tasks * per / (time.perf_counter() - t0)

    async def ours(_i: int) -> None:
        for _ in range(per):
            await op

    async def naive(i: int) -> None:
        raw = raws[i % len(raws)]
        for _ in range(per):
            await raw.naive_await()

    each = 5 if quick else per  # (the 1,000 tasks' awaits each)

    async def many(n: int) -> float:
        async def worker() -> None:
            for _ in range(each):
                await op

        async with anyio.create_task_group() as tg:  # warm-up, as the 64 tasks'
            for _ in range(4):
                tg.start_soon(worker)
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(worker)
        return n * each / (time.perf_counter() - t0)

    for lib, backend, options in event_loops():
        target = ">= 70,000 (asyncio)" if lib == "asyncio" else ""
        seen = Completions()
        collected = {tasks: Collections(), 1000: Collections()}
        rates, base = [], []
        for _ in range(turns):
            with collected[tasks]:
                rates.append(anyio.run(timed, ours, backend=backend, backend_options=options))
            if cuda:
                base.append(anyio.run(timed, naive, backend=backend, backend_options=options))
        rate = statistics.median(rates)
        if not cuda:
            row(f"awaited ops per second ({lib})", rate, "op/s",
                target="(sim: no target)", lower_is_better=False)
            seen.show()
        else:
            row(f"awaited ops per second ({lib})", rate, "op/s",
                f"naive close(pipe) bridge {lib}", statistics.median(base),
                f">= 2.5x{', ' + target if target else ''}", lower_is_better=False)
            seen.show()
        # measured as its baseline is: warmed, the median of 3 (one, --quick)
        thousands = []
        for _ in range(turns):
            with collected[1000]:
                thousands.append(anyio.run(many, 1000, backend=backend, backend_options=options))
        # (on sim every stream is a thread of this process, which a thousand
        # tasks' loop competes with for the GIL: the aim is a GPU's)
        row(f"awaited ops per second, 1,000 tasks ({lib})", statistics.median(thousands), "op/s",
            f"{tasks} tasks {lib}", rate, ">= 0.8x", lower_is_better=False, gpu_aim=True)
        collected[tasks].show(f"{tasks} tasks")
        collected[1000].show("1,000 tasks")


def _chain(mod: gf.Module, n: int) -> gf.DeviceOperation[object]:
    k = mod.empty(gf.LaunchConfig(1, 1))
    op: gf.DeviceOperation[object] = k
    for _ in range(n - 1):
        op = op.then(lambda _o: k)
    return op


def bench_chain_and_graph(mod: gf.Module, quick: bool, cuda: bool) -> None:
    reps = 20 if quick else 200
    chain = _chain(mod, 132)
    stream = gf.new_stream()
    print("132-kernel token (median per token; the paths taken in turns)")
    one = gf.SingleStream()
    graph = chain.capture(stream)
    launch = graph.launch()

    async def chain_awaited() -> None:
        await chain.run(one)

    async def replay_awaited() -> None:
        await launch.run(one)

    paths: dict[str, Callable[[], Any]] = {"chain": chain_awaited, "replay": replay_awaited}
    if cuda:
        raw = Raw(stream)
        cu = raw.cu
        gexec = cu.CUgraphExec(gf.lowlevel.graph_exec_handle(graph))

        def raw_chain() -> None:
            for _ in range(132):
                raw.launch()
            raw.sync()

        def raw_replay() -> None:
            cu.cuGraphLaunch(gexec, raw.stream)
            raw.sync()

        def replay_synced() -> None:
            launch.sync_on(stream)

        paths.update(raw_chain=raw_chain, raw_replay=raw_replay, synced=replay_synced)
    got = interleaved(paths, reps, 10)
    us = {name: median_us(samples) for name, samples in got.items()}
    per_kernel = []
    k = mod.empty(gf.LaunchConfig(1, 1))
    for _ in range(max(3, reps // 20)):
        t0 = time.perf_counter()
        for _ in range(132):
            k.sync_on(stream)
        per_kernel.append(time.perf_counter() - t0)
    sync_each = median_us(per_kernel)
    ours, replay = us["chain"], us["replay"]
    if cuda:
        row("then chain awaited once", ours, "us", "raw cuLaunchKernel x132 + sync",
            us["raw_chain"], "<= 1.15x")
    row("then chain awaited once", ours, "us", "op.sync() after every kernel", sync_each,
        "<= 0.6x")
    row("graph replay awaited", replay, "us", "op.sync() after every kernel", sync_each,
        "<= 0.1x (10x faster)")
    if cuda:
        row("graph replay awaited", replay, "us", "raw cuGraphLaunch + sync (same graph)",
            us["raw_replay"], "<= 1.2x")
        row("graph replay, launch().sync_on(stream)", us["synced"], "us",
            "raw cuGraphLaunch + sync (same graph)", us["raw_replay"], "<= 1.1x")
        row("graph replay, launch().sync_on(stream)", us["synced"], "us",
            "op.sync() after every kernel", sync_each, "<= 0.1x (10x faster)")


def bench_host_function_hold(mod: gf.Module, cuda: bool) -> None:
    """How long the stream is held between two events recorded around a
    mark or a wake-up while the loop's thread runs Python (holding the GIL).

    Behind 1 ms of work, the three are enqueued before the GPU reaches
    them, so the events' interval is the GPU's own: the hold.  On an idle
    stream (reference) the interval also spans the host's enqueue of the
    mark and of the second event, during which the GPU waits for the host,
    not for the mark.  The wake-up is a host function: beside it, the
    driver's own hold for a host function that does nothing (libc's
    ``getpid``, enqueued with ``cuLaunchHostFunc``), behind the same work."""
    if not cuda:
        print("stream held by a completion mark or a wake-up: needs a CUDA device")
        return
    from cuda.bindings import driver as cu

    print("stream held by a completion mark or a wake-up while the loop thread runs Python")
    stream = gf.new_stream()
    s = cu.CUstream(stream.__cuda_stream__()[1])
    e0 = cu.cuEventCreate(0)[1]
    e1 = cu.cuEventCreate(0)[1]
    op = gf.value(None)
    ahead = mod.spin(gf.LaunchConfig(1, 1), 1_000_000)
    backend = gf.lowlevel.current_backend_object()

    def close_a_pipe() -> None:  # what a loop that goes to sleep enqueues
        r, w = os.pipe()
        backend.enqueue_close(stream.raw, w)
        pipes.append(r)

    def awaited() -> None:  # what an awaited run enqueues after its work
        backend.mark(stream.raw)

    def silent() -> None:  # what a run no task awaits enqueues (enqueue_on)
        op.enqueue_on(stream)

    getpid = ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
    launch_host_func = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
    launch_host_func.argtypes = [ctypes.c_void_p] * 3

    def host_function() -> None:  # the driver's own: no pipe, no gpuflow
        if launch_host_func(stream.__cuda_stream__()[1], getpid, None):
            raise RuntimeError("cuLaunchHostFunc failed")

    pipes: list[int] = []
    kinds: list[tuple[str, Callable[[], None]]] = [
        ("completion mark (an awaited run's)", awaited),
        ("silent mark (enqueue_on's)", silent),
        ("pipe wake-up (a sleeping loop)", close_a_pipe),
    ]

    def hold(enqueues: list[Callable[[], None]], behind: bool) -> list[float]:
        """The median hold of each of ``enqueues``, taking turns."""
        held: list[list[float]] = [[] for _ in enqueues]
        for _ in range(15):
            for enqueue, samples in zip(enqueues, held, strict=True):
                if behind:
                    ahead.enqueue_on(stream)
                cu.cuEventRecord(e0, s)
                enqueue()
                cu.cuEventRecord(e1, s)
                t0 = time.perf_counter()
                x = 0
                while time.perf_counter() - t0 < 0.02:  # the GIL is held by pure Python
                    x += 1
                stream.synchronize()
                samples.append(cu.cuEventElapsedTime(e0, e1)[1])
        return [statistics.median(samples) for samples in held]

    for what, enqueue in kinds:  # behind 1 ms of work: the hold itself
        # (the wake-up, a host function, in turns with the driver's own)
        held, *floor = hold([enqueue, host_function] if enqueue is close_a_pipe else [enqueue],
                            True)
        row(f"hold, GIL busy: {what}", held, "ms", "GIL-taking callback (DESIGN.md)", 5.2,
            "<= 0.2 ms")
        for driver in floor:
            row(f"hold, GIL busy: {what}, against the driver's", held, "ms",
                "a host function doing nothing (the driver's)", driver, "(reference)")
    for what, enqueue in kinds:
        (held,) = hold([enqueue], False)
        row(f"hold, idle stream, the host's enqueue in it: {what}", held, "ms",
            "GIL-taking callback (DESIGN.md)", 5.2, "(reference)")
    for r in pipes:
        os.close(r)


def bench_lease_exit(mod: gf.Module, quick: bool) -> None:
    """A task awaiting 20 ms of GPU work in a stream lease is cancelled 5 ms
    in; its lease exit must come within 1 ms of the work's end.

    The work's end is bounded without asking gpuflow or any other observer:
    the kernel spins for 20 ms of the device's own clock from when it starts,
    and it starts after it was enqueued, so it ends no earlier than the
    enqueue's time plus 20 ms.  The row is how long after that bound the
    lease was left: never less than the real lateness, and never negative,
    since the lease waits for the work (an exit before the bound would be a
    lease that did not wait, and fails the bench).  An observer of the end
    itself cannot do this: a helper thread blocked in ``stream.synchronize()``
    notes the time only once it holds the GIL again, which the loop's thread,
    polling for the same completion, may hold; its note could come after the
    lease had been left, and the row then read negative.
    """
    work_s, cancel_after = 0.020, 0.005
    op = mod.spin(gf.LaunchConfig(1, 1), int(work_s * 1e9))
    print(f"stream lease exit after cancellation ({work_s * 1e3:.0f} ms of GPU work, "
          f"cancelled after {cancel_after * 1e3:.0f} ms)")
    for lib, backend, options in event_loops():
        late: list[float] = []
        remaining: list[float] = []

        async def sample(late: list[float], remaining: list[float]) -> None:
            marks: dict[str, float] = {}

            async def job(*, task_status: Any) -> None:
                try:
                    async with gf.open_stream_lease():
                        task_status.started()
                        marks["enqueue"] = time.perf_counter()  # the kernel starts later
                        await op
                finally:  # the cancellation goes on out of the lease
                    marks["exit"] = time.perf_counter()

            async with anyio.create_task_group() as tg:
                await tg.start(job)
                await anyio.sleep(cancel_after)
                marks["cancel"] = time.perf_counter()
                tg.cancel_scope.cancel()
            end = marks["enqueue"] + work_s  # the earliest the work can have ended
            if marks["exit"] < end:
                raise AssertionError(
                    f"the stream lease was left {(end - marks['exit']) * 1e3:.3f} ms before "
                    "its GPU work could have ended: it did not wait for it"
                )
            late.append(marks["exit"] - end)
            remaining.append(end - marks["cancel"])

        async def main(late: list[float], remaining: list[float]) -> None:
            for _ in range(5 if quick else 25):
                await sample(late, remaining)

        anyio.run(main, late, remaining, backend=backend, backend_options=options)
        # (on sim the kernel's end and its completion are threads of this
        # process, woken by the system's scheduler: the aim is a GPU's)
        row(f"lease exit beyond the GPU work's end ({lib})", statistics.median(late) * 1e3,
            "ms", "work left at the cancel", statistics.median(remaining) * 1e3,
            "<= 1 ms beyond", gpu_aim=True)


def mixed_deadline_load(
    slow: gf.DeviceOperation[object],
    fast: gf.DeviceOperation[object],
    policy: gf.SchedulingPolicy | None,
    *,
    in_flight: int = 16,
    slow_every: int = 8,
    deadline: float = 0.2,
    seconds: float = 5.0,
    backend: str = "asyncio",
    backend_options: dict[str, Any] | None = None,
) -> tuple[int, int]:
    """A service in one process: ``in_flight`` tasks each serve requests back
    to back for ``seconds``; a request runs ``slow`` with probability
    ``1 / slow_every`` (a seeded draw: both policies see the same sequence),
    else ``fast``; every request is abandoned at its ``deadline`` (its GPU
    work, which cannot be recalled, runs on).  ``policy=None`` is the default
    policy.  Returns ``(fast requests, fast requests that missed)``; before it
    returns, every run of the load has finished on the device."""
    counts = [0, 0]
    draw = random.Random(8).random

    async def serve() -> None:
        async def worker() -> None:
            while time.perf_counter() < end:
                is_slow = draw() * slow_every < 1
                op = slow if is_slow else fast
                with anyio.move_on_after(deadline) as scope:
                    await op.run(policy)
                if not is_slow:
                    counts[0] += 1
                    counts[1] += scope.cancelled_caught

        end = time.perf_counter() + seconds
        async with anyio.create_task_group() as tg:
            for _ in range(in_flight):
                tg.start_soon(worker)
        while gf.testing.pending_runs():  # abandoned work, still on the device
            await anyio.sleep(0.01)

    anyio.run(serve, backend=backend, backend_options=backend_options or {})
    return counts[0], counts[1]


def bench_deadlines(mod: gf.Module, quick: bool) -> None:
    """The service load that round robin fails: slow requests abandoned at
    their deadline keep a pool stream busy, and fast requests dealt to it
    behind them miss theirs."""
    seconds = 1.5 if quick else 6.0
    slow = mod.spin(gf.LaunchConfig(1, 1), 400_000_000)
    k = mod.empty(gf.LaunchConfig(1, 1))
    fast = k.then(lambda _o: k).then(lambda _o: k)  # a short pipeline: three kernels
    print(f"16 requests in flight for {seconds:.1f} s, 1 in 8 runs 400 ms of GPU work, "
          "200 ms deadline each: fast requests that miss it")
    fast_rr, missed_rr = mixed_deadline_load(
        slow, fast, gf.StreamPoolRoundRobin(), seconds=seconds)
    fast_ll, missed_ll = mixed_deadline_load(slow, fast, None, seconds=seconds)
    rr = 100 * missed_rr / max(fast_rr, 1)
    ll = 100 * missed_ll / max(fast_ll, 1)
    grown = len(gf.lowlevel.pool_streams())
    row("deadline misses, round robin", rr, "%", target=f"({fast_rr} fast requests)")
    row("deadline misses, default (least loaded)", ll, "%", "round robin", rr,
        f"<= 5 % ({fast_ll} fast requests, {grown} streams)")
    burst = 200
    print(f"a burst of {burst} requests at once, past the pool's bound of 32 streams: 1 in 10 "
          "runs 500 ms of GPU work, the others 5 ms, 300 ms deadline each")
    for name, policy in (("round robin", gf.StreamPoolRoundRobin()), ("default", None)):
        fast_n, missed = burst_deadline_load(mod, policy, burst)
        share = 100 * missed / max(fast_n, 1)
        if policy is not None:
            row(f"burst: deadline misses, {name}", share, "%", target=f"({fast_n} fast requests)")
            base = share
        else:
            row(f"burst: deadline misses, {name}", share, "%", "round robin", base,
                f"<= 1 % ({fast_n} fast requests)")


def burst_deadline_load(
    mod: gf.Module, policy: gf.SchedulingPolicy | None, requests: int
) -> tuple[int, int]:
    """``requests`` started at once, every tenth 500 ms of GPU work, the
    others 5 ms, each abandoned at 300 ms: ``(fast requests, fast ones that
    missed)``, once every run of the burst has finished on the device."""
    counts = [0, 0]

    async def request(ms: int) -> None:
        op = mod.spin(gf.LaunchConfig(1, 1), ms * 1_000_000)
        with anyio.move_on_after(0.3) as scope:
            await op.run(policy)
        if ms < 500:
            counts[0] += 1
            counts[1] += scope.cancelled_caught

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(requests):
                tg.start_soon(request, 500 if i % 10 == 0 else 5)
        while gf.testing.pending_runs():  # abandoned work, still on the device
            await anyio.sleep(0.01)

    anyio.run(main)
    return counts[0], counts[1]


def bench_overlap(mod: gf.Module, quick: bool) -> None:
    """A request that needs 5 ms of GPU work and 5 ms of host work: the run
    started first in a stream lease (``lease.start_run``) and awaited after
    the host work, against the same awaited first and the host work done
    after it, in turns.  The host work lets the GIL go (as I/O or NumPy
    on large arrays do: a sleep here): ``sim``'s device runs in threads of
    this process, which a loop that held the GIL would hold up."""
    work_s = 0.005
    op = mod.spin(gf.LaunchConfig(1, 1), int(work_s * 1e9))

    def host_work() -> None:
        time.sleep(work_s)

    async def started_first() -> None:
        async with gf.open_stream_lease() as lease:
            started = lease.start_run(op)
            host_work()
            await started

    async def one_after_the_other() -> None:
        async with gf.open_stream_lease():
            await op
            host_work()

    print(f"{work_s * 1e3:.0f} ms of GPU work and {work_s * 1e3:.0f} ms of host work in one "
          "request (a stream lease each)")
    for lib, backend, options in event_loops():
        times = interleaved({"started": started_first, "serial": one_after_the_other},
                            20 if quick else 100, backend=backend, options=options)
        row(f"run started first, awaited after ({lib})", statistics.median(times["started"]) * 1e3,
            "ms", "awaited, then host work", statistics.median(times["serial"]) * 1e3,
            "<= 0.6x")


def _driver_first_report(stream: gf.Stream, since: float, stop: threading.Event) -> float:
    """Seconds from ``since`` until the driver first reports a sticky fault
    (``cuStreamQuery`` of ``stream`` polled every 0.1 ms on this thread)."""
    from cuda.bindings import driver as cu

    ok = (cu.CUresult.CUDA_SUCCESS, cu.CUresult.CUDA_ERROR_NOT_READY)
    dev = cu.cuDeviceGet(stream.device)[1]
    cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(dev)[1])
    handle = cu.CUstream(stream.__cuda_stream__()[1])
    while not stop.is_set():
        (err,) = cu.cuStreamQuery(handle)
        if err not in ok:
            return time.perf_counter() - since
        time.sleep(0.0001)
    return math.nan


def bench_fault(mod: gf.Module, cuda: bool) -> None:
    """Last: on cuda the driver keeps a sticky fault until the process ends."""
    print("device fault to failed await")
    times, reports = [], []
    for _ in range(1 if cuda else 3):
        arr = gf.zeros(1, np.int32).sync()
        op = mod.crash(gf.LaunchConfig(1, 32), arr, 8)
        watched = gf.new_stream()
        stop = threading.Event()

        async def main(op: gf.DeviceOperation[object], watched: gf.Stream,
                       stop: threading.Event) -> float:
            t0 = time.perf_counter()
            helper = threading.Thread(target=lambda: reports.append(
                _driver_first_report(watched, t0, stop)))
            if cuda:  # the driver's own report, timed from the same instant
                helper.start()
            try:
                await op
            except gf.DeviceFaultError:
                return time.perf_counter() - t0
            finally:
                if cuda:  # it has seen the fault by now, or it never will
                    await anyio.to_thread.run_sync(helper.join, 1.0)
                    stop.set()
            raise AssertionError("the faulting kernel did not fail")

        times.append(anyio.run(main, op, watched, stop))
        del arr
        if not cuda:
            gf.reset_device(gf.current_device())
    # (the aim is against the driver's own report, which only a GPU gives)
    first = statistics.median(reports) * 1e3 if reports else None
    row("fault -> DeviceFaultError", statistics.median(times) * 1e3, "ms",
        "driver's first report (cuStreamQuery)" if first is not None else "",
        first, "<= driver's first report + 20 ms", gpu_aim=True)


def bench_fan_out(mod: gf.Module, quick: bool, cuda: bool) -> None:
    devices = list(range(gf.device_count()))
    if len(devices) < 2:
        print("fan-out: one device only; needs two (on sim: --devices 2)")
        return
    iters = 2_000 if not cuda else (20_000 if quick else 200_000)
    n = 8 if quick else 32
    print(f"compute-bound pipeline of {2 * n} kernels: one device vs a device group of 2")

    def pipeline(x: gf.DeviceArray) -> gf.DeviceOperation[object]:
        cfg = gf.LaunchConfig(132 * 8, 256)
        op: gf.DeviceOperation[object] = mod.busy(cfg, x, iters)
        for _ in range(n - 1):
            op = op.then(lambda _o: mod.busy(cfg, x, iters))
        return op

    size = 132 * 8 * 256
    xs = {}
    for d in devices[:2]:
        xs[d] = gf.copy(gf.zeros(size, np.float32).sync(), device=d).sync()
    pipeline(xs[devices[0]]).sync()  # warm-up

    async def one() -> float:
        t0 = time.perf_counter()
        await pipeline(xs[devices[0]])
        await pipeline(xs[devices[0]])
        return time.perf_counter() - t0

    async def two() -> float:
        async def work(d: int) -> None:
            await pipeline(xs[d])

        t0 = time.perf_counter()
        async with gf.open_device_group(devices[:2]) as g:
            for d in devices[:2]:
                g.start_soon(work, d, device=d)
        return time.perf_counter() - t0

    t1 = statistics.median(anyio.run(one) for _ in range(3))
    t2 = statistics.median(anyio.run(two) for _ in range(3))
    # (sim's devices are threads of one process, sharing its cores: a GPU's aim)
    row("device group speed-up (2 devices)", t1 / t2, "x", target=">= 1.9x",
        lower_is_better=False, gpu_aim=True)


#: The names ``--only`` takes, in the order they run, and what each measures.
BENCHES = {
    "launch": "one awaited empty kernel under each event loop, against "
              "to_thread(stream.synchronize), a naive one-pipe bridge and a blocking "
              "launch + synchronize",
    "throughput": "awaited operations per second: 64 tasks, then 1,000, each awaiting tiny "
                  "kernels",
    "enqueue": "enqueue_on of a 4-byte copy: the Python of a run no loop awaits",
    "cpu": "the CPU an idle runtime uses over a second, and the CPU of one awaited "
           "1-second kernel",
    "inflight": "200 short requests with 32 in flight against 8 (medians of three "
                "runs each, in turns), and the latency at 32",
    "chain": "a 132-kernel then chain awaited once, and its captured graph replayed, "
             "against a sync after every kernel and the raw driver",
    "hold": "how long a completion mark and a sleeping loop's wake-up hold their "
            "stream while Python holds the GIL, behind 1 ms of work (the wake-up also "
            "beside a host function that does nothing) and on an idle stream (cuda only)",
    "lease": "a task in a stream lease cancelled 5 ms into 20 ms of GPU work: how long "
             "after the work's end the lease is left",
    "deadlines": "a service with per-request deadlines: the fast requests that miss, "
                 "round robin against the default policy, with 16 requests in flight and "
                 "in a burst of 200 at once (past the pool's 32 streams)",
    "overlap": "a request of 5 ms of GPU work and 5 ms of host work: the run started "
               "first (lease.start_run) and awaited after, against awaited then host work",
    "classes": "short requests while long kernels keep every SM busy: p50 and p99 with no "
               "class (against an idle device), at a higher priority and on reserved SMs "
               "(against no class)",
    "fanout": "a device group over two devices against one device (needs two)",
    "torch": "a PyTorch request (an MLP forward) awaited with gf.wait_stream, one and 64 in "
             "flight, against to_thread(torch.cuda.synchronize) (needs PyTorch and cuda)",
    "nccl": "all-reduce bandwidth against nccl4py's own call (alone, and eight in one "
            "group), and an awaited 4-byte all-reduce (needs nccl4py and cuda)",
    "fault": "a faulting kernel to DeviceFaultError in its await, against the driver's "
             "first report (runs last: on cuda the fault lasts as long as the process)",
}


def _help_epilog() -> str:
    lines = ["names for --only (default: all, in this order):"]
    for name, what in BENCHES.items():
        lines += textwrap.wrap(what, 78, initial_indent=f"  {name:<11} ",
                               subsequent_indent=" " * 14)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gpuflow bench",
        description=textwrap.fill(
            "gpuflow's benchmarks. Each row: what was measured, gpuflow's median, a "
            "baseline measured in the same run and their ratio, and the target. Absolute "
            "times mean something only on a GPU (--backend cuda); on sim the gpuflow side "
            "runs and the raw-driver baselines are left out. A row with an aim says "
            "whether it met it, and the last line counts them.", 78),
        epilog=_help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"],
                   help="where to run (default: cuda where a device is present, else sim)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--only", action="append", default=[], choices=list(BENCHES),
                   metavar="NAME", help="run only NAME (repeatable; the names are below)")
    p.add_argument("--trace", metavar="PATH",
                   help="also write a timeline of every run to PATH (Chrome trace-event "
                   "JSON, for ui.perfetto.dev); tracing slows the runs it records")
    p.add_argument("--json", metavar="PATH",
                   help="also write the rows to PATH as JSON (backend, rows: each its "
                   "figures, target, loop and verdict)")
    p.add_argument("--devices", metavar="N", type=int,
                   help="run on N devices (sim: simulate N, so that the two-device rows "
                   "run; default: every device the backend has)")
    args = p.parse_args(argv)
    if args.devices is not None and args.devices < 1:
        p.error(f"--devices: a positive number of devices, not '{args.devices}'")
    backend = gf.init_device_contexts(backend=args.backend, num_devices=args.devices)
    measured_on(backend)
    cuda = backend == "cuda"
    be = gf.lowlevel.current_backend_object()
    print(f"gpuflow bench on backend {backend!r}: "
          + ", ".join(be.device_name(d) for d in range(gf.device_count())))
    if not cuda:
        print("(sim: absolute times mean nothing; raw-driver baselines are left out)")
    missing = missing_loops()
    if missing:
        extra = "; pip install 'gpuflow[trio]' adds Trio" if "trio" in missing else ""
        print(f"(not installed, so not measured: {', '.join(missing)}{extra})")
    mod = gf.compile(EMPTY, references=bench_references())
    only = set(args.only) or set(BENCHES)
    head = f"  {'measured':<46}{'gpuflow':>10} {'':<6} {'baseline (same run)':<44}"
    print(f"{head} {'ratio':>8}  target")
    with gf.trace(args.trace) if args.trace else contextlib.nullcontext():
        run_benches(mod, only, args.quick, cuda)
    if args.trace:
        print(f"timeline of every run: {args.trace}")
    print(summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": backend, "rows": ROWS}, f, indent=1)
    return 0


#: What each name of :data:`BENCHES` runs: ``(module, quick, cuda)``, in
#: that order.
_RUNS: dict[str, Callable[[gf.Module, bool, bool], None]] = {
    "launch": bench_launch_await,
    "throughput": bench_throughput,
    "enqueue": lambda _mod, quick, cuda: bench_enqueue(quick, cuda),
    "cpu": bench_cpu,
    "inflight": bench_in_flight,
    "chain": bench_chain_and_graph,
    "hold": lambda mod, _quick, cuda: bench_host_function_hold(mod, cuda),
    "lease": lambda mod, quick, _cuda: bench_lease_exit(mod, quick),
    "deadlines": lambda mod, quick, _cuda: bench_deadlines(mod, quick),
    "overlap": lambda mod, quick, _cuda: bench_overlap(mod, quick),
    "classes": lambda mod, quick, _cuda: bench_classes(mod, quick),
    "fanout": bench_fan_out,
    "torch": lambda _mod, quick, cuda: bench_torch_requests(quick, cuda),
    "nccl": lambda _mod, quick, cuda: bench_collectives(quick, cuda),
    # last: a sticky fault ends the process's use of the device
    "fault": lambda mod, _quick, cuda: bench_fault(mod, cuda),
}


def run_benches(mod: gf.Module, only: set[str], quick: bool, cuda: bool) -> None:
    for name, run in _RUNS.items():
        if name in only:
            run(mod, quick, cuda)
