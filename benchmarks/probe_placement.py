"""How much the 64-task row depends on the CPU its process runs on.

Runs the bench's 64 tasks x 100 awaited empty kernels (asyncio, the default
policy) in a fresh process pinned to each CPU in turn (and in a few
unpinned ones), and beside it, in the same process, a plain loop with no
gpuflow: the same kernel launched on four streams through cuda-bindings,
each launch followed by a 64-bit write of a sequence number into a pinned,
device-mapped word of its stream, and one callback per loop turn reading
the four words and resolving the futures they cover.  The plain loop's
rate is what that CPU allows a loop that launches, marks and polls; the
ratio of the two is gpuflow's own share, which a slower CPU moves less than
it moves either rate.

usage: python benchmarks/probe_placement.py [CPU ...]   (a CUDA device; default: every CPU
       this process may use, then three unpinned processes)
       python benchmarks/probe_placement.py --calls   (one unpinned process: the function
       calls a run of each loop makes, as cProfile counts them, the loops' own included)
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

TASKS, PER = 64, 100


def child(cpu: int | None, calls: bool = False) -> None:
    if cpu is not None:  # before any thread starts: the driver's inherit it
        os.sched_setaffinity(0, {cpu})
    import anyio
    from plain_loop import STREAMS, PlainLoop

    import gpuflow as gf
    from gpuflow._tools._bench import EMPTY, Raw, bench_references

    gf.init_device_contexts(backend="cuda")
    mod = gf.compile(EMPTY, references=bench_references())
    op = mod.empty(gf.LaunchConfig(1, 1))
    plain = PlainLoop([Raw(gf.new_stream()) for _ in range(STREAMS)])

    async def gpuflow_row() -> float:
        async def worker() -> None:
            for _ in range(PER):
                await op

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(TASKS):
                tg.start_soon(worker)
        return TASKS * PER / (time.perf_counter() - t0)

    def plain_row() -> Coroutine[Any, Any, float]:
        return plain.row(TASKS, PER)

    anyio.run(gpuflow_row)  # warm: streams, lanes, the poller
    asyncio.run(plain_row())
    if calls:
        import cProfile
        import pstats

        rows: list[tuple[str, Callable[[], float]]] = [
            ("gpuflow", lambda: anyio.run(gpuflow_row)),
            ("plain loop", lambda: asyncio.run(plain_row())),
        ]
        for name, row in rows:
            prof = cProfile.Profile()
            prof.enable()
            row()
            prof.disable()
            stats: Any = pstats.Stats(prof)
            total = sum(v[1] for v in stats.stats.values())
            print(f"{name}: {total / (TASKS * PER):.1f} calls a run")
        return
    ours, theirs = [], []
    for _ in range(5):  # in turns: both see the same CPU at the same time
        ours.append(anyio.run(gpuflow_row))
        theirs.append(asyncio.run(plain_row()))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"{a:.0f} {b:.0f}", flush=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--child"]:
        child(int(argv[1]) if argv[1] != "-" else None)
        return
    if argv[:1] == ["--calls"]:
        child(None, calls=True)
        return
    cpus: list[Any] = [int(c) for c in argv] or sorted(os.sched_getaffinity(0))
    runs = [*cpus, *(["-"] * (0 if argv else 3))]
    print(f"64 tasks x {PER} awaited empty kernels, asyncio, medians of 5 (op/s)")
    print(f"{'CPU':>9} {'gpuflow':>9} {'plain loop':>11} {'ratio':>6}")
    for cpu in runs:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(cpu)],
            capture_output=True, text=True, timeout=300,
        )
        if out.returncode:
            print(f"{cpu!s:>9} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        ours, plain = (float(x) for x in out.stdout.split()[-2:])
        where = "unpinned" if cpu == "-" else cpu
        print(f"{where!s:>9} {ours:>9,.0f} {plain:>11,.0f} {ours / plain:>6.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
