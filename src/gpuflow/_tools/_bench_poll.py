"""The bench rows of the completion path: what polling costs and what sleeping saves.

* ``enqueue_on`` of a 4-byte copy: the Python of a run that no loop awaits,
  against a raw ``cuMemcpyDtoDAsync``;
* the CPU an idle runtime uses while its loop sleeps for a second, and the
  CPU of one awaited 1-second kernel (the busy-poll budget, then a sleep),
  against ``to_thread(stream.synchronize)`` of the same kernel;
* a PyTorch request (a 4-layer bf16 MLP forward, batch 32, width 1024)
  awaited through ``gf.wait_stream``, against
  ``to_thread(torch.cuda.synchronize)``, one in flight and 64 (the two
  paths taken in turns); beside it at one in flight, the floor with no
  gpuflow: an event recorded after the forward, asked once per loop turn;
* 200 requests of a few short operations each (an array, a 2 ms kernel, a
  kernel over the array, the copy back), 32 in flight against 8: more in
  flight must not be slower (on ``sim`` too, where every stream is a thread).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

import gpuflow as gf

from ._bench_rows import Completions, event_loops, interleaved, median_us, row


def bench_enqueue(quick: bool, cuda: bool) -> None:
    n = 300 if quick else 3000
    src = gf.full(1, 1.0, dtype=np.float32).sync()
    dst = gf.zeros(1, dtype=np.float32).sync()
    op = gf.copy(src, out=dst)
    stream = gf.new_stream()
    print("enqueue_on of a 4-byte copy (median per run; the paths taken in turns)")

    def ours() -> None:
        op.enqueue_on(stream)

    paths: dict[str, Callable[[], object]] = {"ours": ours}
    if cuda:
        from cuda.bindings import driver as cu

        raw_stream = cu.CUstream(stream.__cuda_stream__()[1])
        sp = src.__cuda_array_interface__["data"][0]
        dp = dst.__cuda_array_interface__["data"][0]

        def raw_copy() -> None:
            cu.cuMemcpyDtoDAsync(dp, sp, 4, raw_stream)

        paths["raw"] = raw_copy
    got = interleaved(paths, n, 50)
    stream.synchronize()
    if not cuda:
        row("enqueue_on(stream) of a 4-byte copy", median_us(got["ours"]), "us",
            target="(sim: no target)")
        return
    row("enqueue_on(stream) of a 4-byte copy", median_us(got["ours"]), "us",
        "raw cuMemcpyDtoDAsync", median_us(got["raw"]), "<= 15 us")


def bench_cpu(mod: gf.Module, quick: bool, cuda: bool) -> None:
    """CPU time (this process, every thread) of an idle second and of a long await."""
    print("CPU time while the loop sleeps and while it awaits long work")
    seconds = 0.5 if quick else 1.0
    ns = int(seconds * 1e9)
    stream = gf.new_stream()

    async def idle() -> float:
        for _ in range(20):
            await mod.empty(gf.LaunchConfig(1, 1))
        cpu = time.process_time()
        await anyio.sleep(seconds)
        return time.process_time() - cpu

    async def long_await() -> float:
        cpu = time.process_time()
        await mod.spin(gf.LaunchConfig(1, 1), ns)
        return time.process_time() - cpu

    async def long_thread() -> float:
        cpu = time.process_time()
        mod.spin(gf.LaunchConfig(1, 1), ns).enqueue_on(stream)
        await anyio.to_thread.run_sync(stream.synchronize)
        return time.process_time() - cpu

    async def plain_sleep() -> float:
        cpu = time.process_time()
        await anyio.sleep(seconds)
        return time.process_time() - cpu

    for lib, backend, options in event_loops():
        def run(fn: Any, backend: str = backend, options: dict[str, Any] = options) -> float:
            return float(anyio.run(fn, backend=backend, backend_options=options)) * 1e3

        base = run(plain_sleep)
        row(f"CPU of an idle runtime, loop asleep {seconds:g} s ({lib})", run(idle), "ms",
            "the same sleep, no GPU work before", base, f"<= {50 * seconds:g} ms")
        row(f"CPU of one {seconds:g} s await ({lib})", run(long_await), "ms",
            "to_thread(stream.synchronize)", run(long_thread), f"<= {250 * seconds:g} ms")


def mlp_forward() -> Callable[[], object]:
    """The request of the PyTorch rows: a 4-layer bf16 MLP forward (batch 32,
    width 1024, no autograd) on the current torch stream."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    model = model.to("cuda", torch.bfloat16).eval()
    x = torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16)

    def forward() -> Any:
        with torch.no_grad():
            return model(x)

    return forward


def bench_torch_requests(quick: bool, cuda: bool) -> None:
    """A PyTorch service: a 4-layer bf16 MLP forward per request, awaited."""
    if not cuda or importlib.util.find_spec("torch") is None:
        print("PyTorch requests: needs a CUDA device and PyTorch")
        return
    import torch

    forward = mlp_forward()
    new_stream: Any = torch.cuda.Stream  # (untyped where torch is installed)
    new_event: Any = torch.cuda.Event
    streams = [new_stream() for _ in range(8)]
    n, tasks, each = (100, 64, 5) if quick else (1000, 64, 40)
    count = [0]
    # seconds from the forward's return (its kernels enqueued) to the end of
    # the wait, by path: the forward's own Python is the same on every path
    after: dict[str, list[float]] = {"ours": [], "thread": [], "polled": []}
    clock = time.perf_counter

    async def ours() -> None:
        s = streams[count[0] % len(streams)]
        count[0] += 1
        with torch.cuda.stream(s):
            forward()
        t = clock()
        await gf.wait_stream(s)
        after["ours"].append(clock() - t)

    async def thread() -> None:
        forward()
        t = clock()
        await anyio.to_thread.run_sync(torch.cuda.synchronize)
        after["thread"].append(clock() - t)

    async def polled() -> None:  # the floor: an event asked once per loop turn, no gpuflow
        s = streams[count[0] % len(streams)]
        count[0] += 1
        with torch.cuda.stream(s):
            forward()
            t = clock()
            done = new_event()
            done.record(s)
        while not done.query():
            await anyio.lowlevel.checkpoint()
        after["polled"].append(clock() - t)

    async def rate(fn: Any) -> float:
        async def worker() -> None:
            for _ in range(each):
                await fn()

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(tasks):
                tg.start_soon(worker)
        return tasks * each / (time.perf_counter() - t0)

    print("a PyTorch request: 4-layer bf16 MLP forward (batch 32, width 1024), awaited")
    for lib, backend, options in event_loops():
        def run(
            fn: Any, arg: Any, backend: str = backend, options: dict[str, Any] = options
        ) -> float:
            return float(anyio.run(fn, arg, backend=backend, backend_options=options))

        seen = Completions()
        for spent in after.values():
            spent.clear()
        one = interleaved(
            {"ours": ours, "thread": thread, "polled": polled}, n, 20, backend, options
        )
        row(f"await gf.wait_stream(torch), 1 in flight ({lib})", median_us(one["ours"]), "us",
            f"to_thread(torch.cuda.synchronize) {lib}", median_us(one["thread"]), "<= 0.6x")
        row(f"  the same, event.query() each loop turn ({lib})", median_us(one["polled"]), "us",
            f"to_thread(torch.cuda.synchronize) {lib}", median_us(one["thread"]), "(no gpuflow)")
        # where gpuflow's request loses to the event's: the wait after the
        # forward (the forward's kernels finish about when its Python returns)
        row(f"  gpuflow's wait after the forward ({lib})", median_us(after["ours"]), "us",
            "the event's, no gpuflow", median_us(after["polled"]), "(where the gap is)")
        row(f"  to_thread's wait after the forward ({lib})", median_us(after["thread"]), "us",
            "the event's, no gpuflow", median_us(after["polled"]), "(reference)")
        seen.show()
        rates: dict[Any, list[float]] = {ours: [], thread: []}
        for _ in range(3):  # (in turns)
            for fn, done in rates.items():
                done.append(run(rate, fn))
        row(f"await gf.wait_stream(torch), {tasks} in flight ({lib})",
            statistics.median(rates[ours]), "req/s", f"to_thread(torch.cuda.synchronize) {lib}",
            statistics.median(rates[thread]), ">= 1.5x", lower_is_better=False)
        seen.show()
    torch.cuda.synchronize()


def bench_in_flight(mod: gf.Module, quick: bool, cuda: bool) -> None:
    """The same 200 requests with 8 and with 32 in flight: the median of
    three runs of each, the two taking turns."""
    requests = 100 if quick else 200
    print(f"{requests} requests (arange, a 2 ms kernel, a kernel over it, to_host), in flight")

    async def serve(in_flight: int) -> tuple[float, list[float]]:
        slots = anyio.Semaphore(in_flight)
        took: list[float] = []

        async def request() -> None:
            async with slots:
                t0 = time.perf_counter()
                x = await gf.arange(1024, dtype=np.float32)
                await mod.spin(gf.LaunchConfig(1, 1), 2_000_000)
                await mod.busy(gf.LaunchConfig(4, 256), x, 16)
                await gf.to_host(x)
                took.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(requests):
                tg.start_soon(request)
        return time.perf_counter() - t0, took

    anyio.run(serve, 32)  # (warm-up: the pool grows as it is used)
    walls8, walls32, took = [], [], []
    for _ in range(1 if quick else 3):  # in turns: the host moves both alike
        walls8.append(anyio.run(serve, 8)[0])
        wall, lat = anyio.run(serve, 32)
        walls32.append(wall)
        took += lat
    row(f"{requests} requests, 32 in flight (asyncio)", statistics.median(walls32) * 1e3, "ms",
        "8 in flight", statistics.median(walls8) * 1e3, "<= 1.0x")
    took.sort()
    row("a request's latency at 32 in flight, 99th percentile", took[len(took) * 99 // 100] * 1e3,
        "ms", "a 200 ms deadline", 200.0, "<= 0.5x (well inside)")
