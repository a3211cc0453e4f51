"""The rows every benchmark of ``python -m gpuflow bench`` prints: what was
measured, gpuflow's median, the baseline measured in the same run, their
ratio and the target; and the event loops each row is measured under."""

from __future__ import annotations

import gc
import importlib.util
import inspect
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio

from ..lowlevel import current_completion_statistics

ROWS: list[dict[str, Any]] = []

#: The event loops a row may be measured under (uvloop is not asyncio here).
LOOPS = ("asyncio", "uvloop", "trio")


#: One condition of a target: ``<= 2x`` (the ratio to the baseline, or a
#: row's own value where its unit is ``x``), ``>= 70,000``, ``<= 15 us``,
#: ``<= 5 %`` (the row's value, in its unit), ``<= driver's first report +
#: 20 ms`` (the value against the baseline plus a margin); words after the
#: number (``beyond``) and a note in parentheses are the reader's.
_AIM = re.compile(
    r"(?P<op><=|>=)\s*(?:(?P<base>[^+,()]*?)\s*\+\s*)?(?P<number>[\d,]*\.?\d+)\s*"
    r"(?P<unit>x\b|[^\s,()]+)?"
)


#: The verdict of a row whose aim is a GPU's, measured on another backend.
NOT_JUDGED = "not judged"

#: The backend the rows are measured on (:func:`measured_on`): an aim set for
#: a GPU (``row(..., gpu_aim=True)``) is judged on ``cuda`` only.
_backend = "cuda"


def measured_on(backend: str) -> None:
    """Say which backend the rows that follow are measured on."""
    global _backend
    _backend = backend


def _clauses(target: str) -> list[re.Match[str]] | None:
    """The conditions of ``target``, read (None for a row without an aim);
    a condition that cannot be read is a bug of the bench, refused."""
    text = target.strip()
    if not text or text.startswith("("):
        return None
    read = []
    for clause in re.split(r",\s*(?=[<>]=)", text):
        m = _AIM.match(clause.strip())
        if m is None:
            raise ValueError(f"bench target {target!r}: cannot read the aim {clause!r}")
        read.append(m)
    return read


def verdict(
    target: str, value: float, unit: str, base: float | None, judged: bool = True
) -> str | None:
    """``"met"`` or ``"missed"`` for a row with an aim (every condition of
    ``target``, comma-separated, holds), None for a row without one (no
    condition, or a target in parentheses: a note on a row with no aim).
    A row whose aim is not ``judged`` where it ran (a GPU's aim, on sim)
    gets :data:`NOT_JUDGED`; its target is still read.

    A condition that cannot be read, or that the row's figures cannot decide
    (a ratio with no baseline, another unit than the row's), is a bug of the
    bench, refused."""
    clauses = _clauses(target)
    if clauses is None:
        return None
    if not judged:
        return NOT_JUDGED
    met = True
    for m in clauses:
        number = float(m["number"].replace(",", ""))
        aim_unit = m["unit"]
        if m["base"]:  # "<= the baseline + N unit"
            if base is None or aim_unit != unit:
                raise ValueError(f"bench target {target!r}: needs a baseline in {unit}")
            measured, number = value, base + number
        elif aim_unit == "x" and unit != "x":
            if base is None or base == 0:
                raise ValueError(f"bench target {target!r}: a ratio needs a baseline")
            measured = value / base
        else:
            if aim_unit not in (None, unit) and not (aim_unit == "x" and unit == "x"):
                raise ValueError(f"bench target {target!r}: in {aim_unit}, the row in {unit}")
            measured = value
        met = met and (measured <= number if m["op"] == "<=" else measured >= number)
    return "met" if met else "missed"


def row(name: str, value: float, unit: str, base_name: str = "", base: float | None = None,
        target: str = "", lower_is_better: bool = True, gpu_aim: bool = False) -> None:
    """Print and keep one row, and say whether it met its aim (:func:`verdict`).

    ``gpu_aim``: the aim is a GPU's (what a device does, not what gpuflow's
    Python does), judged on ``cuda`` only; elsewhere the row says so
    (:data:`NOT_JUDGED`) rather than met or missed.

    A row measured under one event loop names it (``"... (uvloop)"``), and
    a target set for one loop names that loop (``">= 70,000 (asyncio)"``):
    a target that names another loop than its row's is a bug of the bench
    (an asyncio target printed on a uvloop row), refused here.
    """
    own = re.search(rf"\(({'|'.join(LOOPS)})\)", name)
    loop = own.group(1) if own is not None else None
    named = [lib for lib in LOOPS if re.search(rf"\b{lib}\b", target, re.IGNORECASE)]
    foreign = [lib for lib in named if lib != loop]
    if foreign:
        raise ValueError(
            f"bench row {name!r}: its target {target!r} is set for {', '.join(foreign)}, "
            f"not for the loop it was measured under ({loop or 'none named'})"
        )
    ratio = None if base is None or base == 0 else value / base
    met = verdict(target, value, unit, base, judged=not gpu_aim or _backend == "cuda")
    ROWS.append(dict(name=name, value=value, unit=unit, base_name=base_name, base=base,
                     ratio=ratio, target=target, loop=loop, verdict=met, gpu_aim=gpu_aim))
    digits = 3 if unit == "ms" else 1
    b = "" if base is None else f"{base:10.{digits}f} {unit} ({base_name})"
    r = "" if ratio is None else f"{ratio:6.2f}x"
    said = "" if met is None else f": {met}"
    if met == NOT_JUDGED:
        said += f" on {_backend} (a GPU's aim)"
    print(f"  {name:<46}{value:10.{digits}f} {unit:<6} {b:<44} {r:>8}  {target}{said}",
          flush=True)


def summary() -> str:
    """The rows with an aim: how many met it, how many were not judged where
    they ran, and the names of those that missed."""
    aimed = [r for r in ROWS if r["verdict"] is not None]
    missed = [r["name"] for r in aimed if r["verdict"] == "missed"]
    unjudged = sum(r["verdict"] == NOT_JUDGED for r in aimed)
    met = len(aimed) - len(missed) - unjudged
    text = f"{len(aimed)} row(s) with an aim: {met} met, {len(missed)} missed"
    if unjudged:
        text += f", {unjudged} not judged on {_backend} (a GPU's aim)"
    return text + (": " + "; ".join(missed) if missed else "")


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def interleaved(
    paths: dict[str, Callable[[], Any]],
    n: int,
    block: int = 20,
    backend: str = "asyncio",
    options: dict[str, Any] | None = None,
) -> dict[str, list[float]]:
    """``n`` timed calls of each path, after ``n // 10`` untimed ones, taken
    in turns of ``block`` calls: a machine whose speed drifts during the run
    (other tenants, clocks) weighs on every path alike, and a ratio of their
    medians compares like with like.

    A coroutine function is awaited in an event loop (``anyio.run`` with
    ``backend`` and ``options``), a plain function called outside any (where
    gpuflow's blocking calls are allowed); with plain ones among the paths,
    each turn runs a loop of its own."""
    asynchronous = {name: inspect.iscoroutinefunction(fn) for name, fn in paths.items()}
    out: dict[str, list[float]] = {name: [] for name in paths}
    clock = time.perf_counter

    def plain_turn(count: int, keep: bool) -> None:
        for name, fn in paths.items():
            if not asynchronous[name]:
                samples = out[name] if keep else []
                for _ in range(count):
                    t0 = clock()
                    fn()
                    samples.append(clock() - t0)

    async def async_turns(count: int, keep: bool, turns: int) -> None:
        for _ in range(turns):
            for name, fn in paths.items():
                if asynchronous[name]:
                    samples = out[name] if keep else []
                    for _ in range(count):
                        t0 = clock()
                        await fn()
                        samples.append(clock() - t0)

    def loop_turns(count: int, keep: bool, turns: int) -> None:
        if any(asynchronous.values()):
            anyio.run(async_turns, count, keep, turns, backend=backend, backend_options=options)

    warm, turns = max(1, n // 10), max(1, n // block)
    if all(asynchronous.values()):
        async def everything() -> None:
            await async_turns(warm, False, 1)
            await async_turns(block, True, turns)

        anyio.run(everything, backend=backend, backend_options=options)
        return out
    loop_turns(warm, False, 1)
    plain_turn(warm, False)
    for _ in range(turns):
        loop_turns(block, True, 1)
        plain_turn(block, True)
    return out


def event_loops() -> list[tuple[str, str, dict[str, Any]]]:
    """``(name, AnyIO backend, backend options)`` of every loop measured:
    asyncio, and uvloop (an asyncio loop) and Trio where they are importable."""
    loops: list[tuple[str, str, dict[str, Any]]] = [("asyncio", "asyncio", {})]
    if importlib.util.find_spec("uvloop") is not None:
        loops.append(("uvloop", "asyncio", {"use_uvloop": True}))
    if importlib.util.find_spec("trio") is not None:
        loops.append(("trio", "trio", {}))
    return loops


def missing_loops() -> list[str]:
    """The loops :func:`event_loops` leaves out here."""
    return [m for m in ("uvloop", "trio") if importlib.util.find_spec(m) is None]


class Completions:
    """How the runs of a measurement were seen done, printed under its row
    (:func:`gpuflow.lowlevel.current_completion_statistics`, before and
    after): whether an await's inline read, the loop's poller or a wake-up
    ended it explains where its time went."""

    def __init__(self) -> None:
        self._before = current_completion_statistics()

    def show(self) -> None:
        b, a = self._before, current_completion_statistics()
        print(
            f"    seen done: {a.spun - b.spun} by the awaiting task's inline read, "
            f"{a.polled - b.polled} at a loop turn (the poller, or a lone await), "
            f"{a.by_thread - b.by_thread} by the completer thread; sleeping wake-ups: "
            f"{a.pipes_armed - b.pipes_armed} "
            f"pipes, {a.watched_by_thread - b.watched_by_thread} left to the thread"
        )
        self._before = a


class Collections:
    """The garbage collector's work during the measurements taken inside
    ``with`` blocks, printed under a row: its collections by generation and
    their share of the time measured.  With many awaits in flight a
    collection goes through the objects of every pending run (and of the
    loop's tasks), so this share is what grows with the tasks in flight."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.spent = 0.0  # seconds in collections, inside the blocks
        self.measured = 0.0  # seconds inside the blocks
        self._started = 0.0  # the collection under way began
        self._entered = 0.0  # the block under way began

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.spent += time.perf_counter() - self._started

    def __enter__(self) -> Collections:
        self._entered = time.perf_counter()
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)
        self.measured += time.perf_counter() - self._entered

    def show(self, label: str) -> None:
        share = 100 * self.spent / self.measured if self.measured else 0.0
        young, middle, old = self.collections
        print(f"    garbage collections, {label}: {young}/{middle}/{old} (generations 0/1/2), "
              f"{share:.1f} % of its time")
