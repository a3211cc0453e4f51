"""What the first run after the GPU was idle costs, with and without gpuflow.

An empty kernel is run after a gap of 0, 1 and 10 ms, 60 times each, and
timed from its enqueue to its end, in turns:

* raw: ``enqueue_on`` of the kernel on one stream, then the driver's
  ``cuStreamSynchronize``, the gap a ``time.sleep`` or a spin-wait (the CPU
  kept busy: what is left is the GPU's own wake-up);
* gpuflow: ``await`` of the kernel (default policy) after the event loop
  slept through the gap (``anyio.sleep``), under asyncio, uvloop and Trio.

A service whose requests come with gaps pays the idle rows, not the
back-to-back one.

usage: python benchmarks/probe_idle.py   (a CUDA device)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import anyio

import gpuflow as gf
from gpuflow._bench import EMPTY, _refs
from gpuflow._bench_rows import event_loops

RUNS = 60


def _median_us(xs: list[float]) -> str:
    ordered = sorted(xs)
    return f"{statistics.median(xs) * 1e6:7.1f} µs (p90 {ordered[len(xs) * 9 // 10] * 1e6:7.1f})"


def _spin_wait(gap: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < gap:
        pass


def main() -> None:
    from cuda.bindings import driver as cu

    gf.init_device_contexts(backend="cuda")  # (raises where there is no GPU)
    mod = gf.compile(EMPTY, references=_refs())
    empty = mod.empty(gf.LaunchConfig(1, 1))
    stream = gf.new_stream()
    raw = cu.CUstream(stream.__cuda_stream__()[1])

    def blocking(gap: float, wait: Callable[[float], None]) -> list[float]:
        out = []
        for _ in range(RUNS):
            if gap:
                wait(gap)
            t0 = time.perf_counter()
            empty.enqueue_on(stream)
            cu.cuStreamSynchronize(raw)
            out.append(time.perf_counter() - t0)
        return out

    async def awaited(gap: float) -> list[float]:
        out = []
        for _ in range(RUNS):
            if gap:
                await anyio.sleep(gap)
            t0 = time.perf_counter()
            await empty
            out.append(time.perf_counter() - t0)
        return out

    print("an empty kernel after a gap: enqueue to end, median of 60 (90th percentile)")
    for gap in (0.0, 0.001, 0.01):
        print(f"gap {gap * 1e3:2.0f} ms")
        print(f"  raw, after time.sleep           {_median_us(blocking(gap, time.sleep))}")
        print(f"  raw, after a spin-wait          {_median_us(blocking(gap, _spin_wait))}")
        for lib, backend, options in event_loops():
            took = anyio.run(awaited, gap, backend=backend, backend_options=options)
            print(f"  gpuflow await ({lib:<7}), loop slept {_median_us(took)}", flush=True)


if __name__ == "__main__":
    main()
