"""One turn of a loop's poller that completes nothing: the price of each turn
inside the busy-poll budget.

Runs are left pending on four streams (a 0.5 s kernel each), then a poller of
its own, polled directly (the loop's would stop after its budget), is turned
20,000 times, against an empty turn of the loop: first with awaited runs
(their marks: words the poller reads), then with runs no task awaits (silent
marks, which a scope waiting for them has asked of the driver).  Asyncio.
The poller is the completion side's own (``gpuflow._core``), which no public
name reaches: hence a script here rather than a row of ``python -m gpuflow
bench``.

usage: python benchmarks/probe_poll_turn.py [--backend sim|cuda] [--quick]
"""

from __future__ import annotations

import argparse
import time

import anyio

import gpuflow as gf
from gpuflow._core import current_loop, ensure_runtime
from gpuflow._core._completion import Poller
from gpuflow._tools._bench import EMPTY, bench_references
from gpuflow._tools._bench_rows import row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    gf.init_device_contexts(backend=args.backend)
    mod = gf.compile(EMPTY, references=bench_references())  # (the bench's kernels: spin)
    n = 2000 if args.quick else 20000
    print("a loop turn of the poller that completes nothing (4 streams pending)")
    spin = mod.spin(gf.LaunchConfig(1, 1), int(0.5e9))

    async def measure(awaited: bool) -> tuple[float, float]:
        policies = [gf.SingleStream() for _ in range(4)]
        streams = [p.stream for p in policies]
        async with anyio.create_task_group() as tg:
            for policy, s in zip(policies, streams, strict=True):
                if awaited:
                    tg.start_soon(spin.run, policy)
                else:
                    spin.enqueue_on(s)
            while not all(s._lane is not None and s._lane.runs for s in streams):
                await anyio.sleep(0.001)  # (the awaits submitted)
            poller = Poller(ensure_runtime().completer, current_loop())
            for s in streams:
                assert s._lane is not None
                poller.lanes[s._lane] = None
            poller.busy.deadline = time.monotonic() + 60  # (it polls as long as it is called)
            t0 = time.perf_counter()
            for _ in range(n):
                poller.poll()
            turn = (time.perf_counter() - t0) / n
            for lane in poller.lanes:  # nobody polls them now: the completer thread may
                lane.polled_until = 0.0
            poller.lanes.clear()
            tg.cancel_scope.cancel()  # (the runs stay pending: the thread completes them)
        t0 = time.perf_counter()
        for _ in range(n):
            await anyio.lowlevel.checkpoint()
        empty = (time.perf_counter() - t0) / n
        for s in streams:
            await anyio.to_thread.run_sync(s.synchronize)
        return turn * 1e6, empty * 1e6

    for awaited, what in ((True, "awaited runs"), (False, "runs no task awaits")):
        turn, empty = anyio.run(measure, awaited)
        row(f"poller turn, nothing completed, {what} (asyncio)", turn, "us",
            "an empty loop turn", empty, "(small)")


if __name__ == "__main__":
    main()
