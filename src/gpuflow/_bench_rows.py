"""The rows every benchmark of ``python -m gpuflow bench`` prints: what was
measured, gpuflow's median, the baseline measured in the same run, their
ratio and the target; and the event loops each row is measured under."""

from __future__ import annotations

import importlib.util
import re
import statistics
from typing import Any

from .lowlevel import current_completion_statistics

ROWS: list[dict[str, Any]] = []

#: The event loops a row may be measured under (uvloop is not asyncio here).
LOOPS = ("asyncio", "uvloop", "trio")


def row(name: str, value: float, unit: str, base_name: str = "", base: float | None = None,
        target: str = "", lower_is_better: bool = True) -> None:
    """Print and keep one row.

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
    ROWS.append(dict(name=name, value=value, unit=unit, base_name=base_name, base=base,
                     ratio=ratio, target=target, loop=loop))
    digits = 3 if unit == "ms" else 1
    b = "" if base is None else f"{base:10.{digits}f} {unit} ({base_name})"
    r = "" if ratio is None else f"{ratio:6.2f}x"
    print(f"  {name:<46}{value:10.{digits}f} {unit:<6} {b:<44} {r:>8}  {target}", flush=True)


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


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
            f"{a.polled - b.polled} by the loop's poller, {a.by_thread - b.by_thread} by "
            f"the dispatcher thread; sleeping wake-ups: {a.pipes_armed - b.pipes_armed} "
            f"pipes, {a.watched_by_thread - b.watched_by_thread} left to the thread"
        )
        self._before = a
