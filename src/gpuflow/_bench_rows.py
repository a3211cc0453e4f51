"""The rows every benchmark of ``python -m gpuflow bench`` prints: what was
measured, gpuflow's median, the baseline measured in the same run, their
ratio and the target; and the event loops each row is measured under."""

from __future__ import annotations

import importlib.util
import statistics
from typing import Any

ROWS: list[dict[str, Any]] = []


def row(name: str, value: float, unit: str, base_name: str = "", base: float | None = None,
        target: str = "", lower_is_better: bool = True) -> None:
    ratio = None if base is None or base == 0 else value / base
    ROWS.append(dict(name=name, value=value, unit=unit, base_name=base_name, base=base,
                     ratio=ratio, target=target))
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
