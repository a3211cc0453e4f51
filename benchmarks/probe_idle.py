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

``--pieces`` splits both paths at the same gaps (asyncio): the raw path into
its ``enqueue_on`` call and its ``cuStreamSynchronize``; the await into its
start to the end of its submission (the run's start, the launch and the
mark), from there to the run seen done (the GPU and the reads of its word),
and from there to the task resumed (the completion, the yield an await owes
its loop, if any, and the resume).  The await runs three ways, twice each,
in turns, with the awaits that yielded counted: as is (a lone await owes
its loop a turn after 1 ms without one, unless the loop's thread slept
meanwhile), owed a turn after 1 ms however the thread spent it (as before
gpuflow looked whether it slept), and with no fairness yield at all
(``_run.YIELD_EVERY_S`` set past any gap): what that yield costs
after a gap, in the piece and in the whole.  Timers wrap the completer's
``submit`` and ``advance``, which adds a little to each await.

usage: python benchmarks/probe_idle.py [--pieces]   (a CUDA device)
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio

import gpuflow as gf
from gpuflow._core import _completion, _run
from gpuflow._tools._bench import EMPTY, bench_references
from gpuflow._tools._bench_rows import event_loops

RUNS = 60


def _median_us(xs: list[float]) -> str:
    ordered = sorted(xs)
    return f"{statistics.median(xs) * 1e6:7.1f} µs (p90 {ordered[len(xs) * 9 // 10] * 1e6:7.1f})"


def _spin_wait(gap: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < gap:
        pass


def _blocking(
    empty: gf.DeviceOperation[None],
    stream: gf.Stream,
    raw: Any,
    gap: float,
    wait: Callable[[float], None],
    out: dict[str, list[float]],
) -> dict[str, list[float]]:
    """The raw path ``RUNS`` times after ``wait(gap)``: seconds of the
    ``enqueue_on`` call, of the ``cuStreamSynchronize`` after it, and whole,
    added to ``out``."""
    from cuda.bindings import driver as cu

    for name in ("enqueue_on", "cuStreamSynchronize", "whole"):
        out.setdefault(name, [])
    for _ in range(RUNS):
        if gap:
            wait(gap)
        t0 = time.perf_counter()
        empty.enqueue_on(stream)
        t1 = time.perf_counter()
        cu.cuStreamSynchronize(raw)
        t2 = time.perf_counter()
        out["enqueue_on"].append(t1 - t0)
        out["cuStreamSynchronize"].append(t2 - t1)
        out["whole"].append(t2 - t0)
    return out


def main() -> None:
    from cuda.bindings import driver as cu

    gf.init_device_contexts(backend="cuda")  # (raises where there is no GPU)
    mod = gf.compile(EMPTY, references=bench_references())
    empty = mod.empty(gf.LaunchConfig(1, 1))
    stream = gf.new_stream()
    raw = cu.CUstream(stream.__cuda_stream__()[1])
    if "--pieces" in sys.argv[1:]:
        pieces(empty, stream, raw)
        return

    def blocking(gap: float, wait: Callable[[float], None]) -> list[float]:
        return _blocking(empty, stream, raw, gap, wait, {})["whole"]

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


def pieces(empty: gf.DeviceOperation[None], stream: gf.Stream, raw: Any) -> None:
    # when the await's submission ended, and when its run was first seen done
    marks: dict[str, float] = {}
    submit, advance = _completion.Completer.submit, _completion.Completer.advance

    def timed_submit(self: Any, *args: Any, **kw: Any) -> Any:
        out = submit(self, *args, **kw)
        marks["submitted"] = time.perf_counter()
        return out

    def timed_advance(self: Any, *args: Any, **kw: Any) -> Any:
        done = advance(self, *args, **kw)
        if done and "seen" not in marks:
            marks["seen"] = time.perf_counter()
        return done

    _completion.Completer.submit = timed_submit  # type: ignore[method-assign]
    _completion.Completer.advance = timed_advance  # type: ignore[method-assign]
    yielded = [0]
    checkpoint = anyio.lowlevel.checkpoint

    async def counted() -> None:  # (the await's own yield: the loop's sleep is another call)
        yielded[0] += 1
        await checkpoint()

    anyio.lowlevel.checkpoint = counted
    owed, usage = _run.YIELD_EVERY_S, _run._thread_usage

    async def awaited(gap: float, out: dict[str, list[float]]) -> None:
        for _ in range(RUNS):
            if gap:
                await anyio.sleep(gap)
            marks.clear()
            t0 = time.perf_counter()
            await empty
            t1 = time.perf_counter()
            seen = marks.get("seen", t1)  # (not seen by this thread: all in the middle)
            out["start to submitted"].append(marks["submitted"] - t0)
            out["submitted to seen done"].append(seen - marks["submitted"])
            out["seen done to resumed"].append(t1 - seen)
            out["whole await"].append(t1 - t0)

    def show(what: str, out: dict[str, list[float]]) -> None:
        print(f"  {what}")
        for piece, took in out.items():
            print(f"    {piece:<24} {_median_us(took)}")

    print("an empty kernel after a gap, in pieces: median of 60 (90th percentile), asyncio")
    for gap in (0.0, 0.001, 0.01):
        print(f"gap {gap * 1e3:2.0f} ms")
        names = ("start to submitted", "submitted to seen done", "seen done to resumed",
                 "whole await")  # fmt: skip
        ways = {
            "as is": (owed, usage),
            "owed after 1 ms however the thread spent it": (owed, lambda: None),
            "no fairness yield": (float("inf"), usage),
        }
        outs: dict[str, dict[str, list[float]]] = {w: {n: [] for n in names} for w in ways}
        yields = dict.fromkeys(ways, 0)
        raw_out: dict[str, list[float]] = {}
        for _ in range(2):  # (in turns)
            _blocking(empty, stream, raw, gap, time.sleep, raw_out)
            for way, (every, measure) in ways.items():
                _run.YIELD_EVERY_S = every
                _run._thread_usage = measure
                yielded[0] = 0
                anyio.run(awaited, gap, outs[way])
                yields[way] += yielded[0]
        _run.YIELD_EVERY_S, _run._thread_usage = owed, usage
        show("raw: enqueue_on, then cuStreamSynchronize, after time.sleep", raw_out)
        for way, out in outs.items():
            show(f"gpuflow await, {way}: {yields[way]} of {2 * RUNS} awaits yielded", out)


if __name__ == "__main__":
    main()
