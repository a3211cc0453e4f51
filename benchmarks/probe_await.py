"""Where one ``await op`` spends its time, on the backend in use.

Timestamps on one clock (``perf_counter``), all in the loop's thread:
front end up to the submit | the mark's enqueue | GPU + polling until the
word is seen reached (or the wake-up) | completion in the loop (finishing
the run, waking the task) | task resume.  Then the 64-task throughput with
the wake-ups it armed, and cProfile of the loop thread over awaits, a
132-step then-chain and the 64 tasks.

Run: python benchmarks/probe_await.py [cuda|sim|auto] [--samples N] [--busy-poll-us US]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio

import gpuflow as gf

# the probe times the bridge's own steps, so it instruments private machinery
from gpuflow._core._runtime import ensure_runtime

pc = time.perf_counter


def instrument(marks: dict[str, float]) -> None:
    """Note in ``marks`` when a run is submitted (its mark enqueued), and
    when the loop has completed it and woken its task."""
    disp = ensure_runtime().completer
    orig_submit, orig_complete = disp.submit, disp.complete

    def submit(raw: Any, sub: Any) -> None:
        marks["submit0"] = pc()
        orig_submit(raw, sub)
        marks["submit1"] = pc()

    def complete(*a: Any) -> None:
        marks.setdefault("seen", pc())
        orig_complete(*a)
        marks.setdefault("woken", pc())

    # instance attributes: the bridge looks these up on the completer at each call
    disp.submit = submit  # type: ignore[method-assign, assignment]
    disp.complete = complete  # type: ignore[method-assign, assignment]


async def segments(
    op: gf.DeviceOperation[Any], marks: dict[str, float], n: int
) -> dict[str, list[float]]:
    names = ("front", "mark", "gpu+poll", "complete", "resume", "total")
    seg: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(200):
        await op
    for _ in range(n):
        marks.clear()
        t0 = pc()
        await op
        t1 = pc()
        m = dict(marks)
        if not ("seen" in m and m["submit1"] <= m["seen"] <= m["woken"]):
            continue
        seg["front"].append(m["submit0"] - t0)
        seg["mark"].append(m["submit1"] - m["submit0"])
        seg["gpu+poll"].append(m["seen"] - m["submit1"])
        seg["complete"].append(m["woken"] - m["seen"])
        seg["resume"].append(t1 - m["woken"])
        seg["total"].append(t1 - t0)
    return seg


async def repeat(make: Callable[[], Any], count: int) -> None:
    for _ in range(count):
        await make()


async def tasks64(op: gf.DeviceOperation[Any]) -> None:
    async def worker() -> None:
        for _ in range(100):
            await op

    async with anyio.create_task_group() as tg:
        for _ in range(64):
            tg.start_soon(worker)


def count_pipes() -> list[int]:
    """``[pipe wake-ups]`` enqueued from now on."""
    be = ensure_runtime().backend
    counts = [0]
    close = be.enqueue_close

    def closing(raw: Any, fd: int) -> bool:
        counts[0] += 1
        return close(raw, fd)

    be.enqueue_close = closing  # type: ignore[method-assign, assignment]
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("backend", nargs="?", default="auto", choices=["auto", "cuda", "sim"])
    p.add_argument("--samples", type=int, default=2000, help="timed awaits per event loop")
    p.add_argument("--busy-poll-us", type=float, default=None, help="the busy-poll budget")
    args = p.parse_args(argv)
    backend = gf.init_device_contexts(backend=args.backend, busy_poll_us=args.busy_poll_us)
    marks: dict[str, float] = {}
    instrument(marks)
    mod = gf.compile('extern "C" __global__ void empty() {}', references={"empty": lambda: None})
    op = mod.empty(gf.LaunchConfig(1, 1))
    chain = op
    for _ in range(131):
        chain = chain.then(lambda _o: op)
    one = gf.SingleStream()
    n = args.samples

    loops: list[tuple[str, str, dict[str, Any]]] = [("asyncio", "asyncio", {})]
    if importlib.util.find_spec("uvloop") is not None:
        loops.append(("uvloop", "asyncio", {"use_uvloop": True}))
    loops.append(("trio", "trio", {}))
    for lib, name, options in loops:
        seg = anyio.run(segments, op, marks, n, backend=name, backend_options=options)
        print(f"{backend} {lib}: " + ", ".join(
            f"{k} {statistics.median(v) * 1e6:.1f} us" for k, v in seg.items()
        ) + f"  ({len(seg['total'])} of {n} samples)", flush=True)

    anyio.run(tasks64, op)
    counts = count_pipes()
    t0 = pc()
    anyio.run(tasks64, op)
    dt = pc() - t0
    print(f"64 tasks x 100 awaits (asyncio): {6400 / dt:.0f} op/s; pipe wake-ups: {counts[0]}; "
          f"pool streams: {len(gf.lowlevel.pool_streams(0))}", flush=True)
    runs: list[tuple[str, Callable[[], Any]]] = [
        ("await", lambda: anyio.run(repeat, lambda: op, 3000)),
        ("chain", lambda: anyio.run(repeat, lambda: chain.run(one), 60)),
        ("64 tasks x 100 awaits", lambda: anyio.run(tasks64, op)),
    ]
    for what, go in runs:
        pr = cProfile.Profile()
        pr.enable()
        go()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print(f"== cProfile, loop thread, {what}\n" + "\n".join(s.getvalue().splitlines()[4:40]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
