"""Finding gpuflow calls that block the calling thread (:func:`assert_no_stall`).

An event loop's thread must never wait for the GPU: a driver call that
synchronizes (a module load, a stream made when the driver grows its pool of
them, a free of page-locked memory), a lock held across one, a finalizer
that a garbage collection runs there.  While the block is open, a profile
hook of the calling thread times every entry into gpuflow from outside it
(a call, or one step of a coroutine between two suspensions; a finalizer run
by a collection in the user's code counts as an entry), and the slowest
C call each entry made (the driver, a lock, a sleep), to name the culprit.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

_PACKAGE = __name__.split(".", 1)[0]


@dataclass(frozen=True)
class Stall:
    """One entry into gpuflow that blocked its thread longer than the limit."""

    seconds: float
    #: the gpuflow function entered, ``module.qualname``
    function: str
    #: where it was entered from, ``file:line`` (the caller outside gpuflow)
    called_from: str
    #: the slowest C call it made (``"cuStreamCreate"``, ``"acquire"``...) and its time
    slowest_call: str
    slowest_seconds: float

    def __str__(self) -> str:
        return (
            f"{self.function} blocked {self.seconds * 1e3:.1f} ms (called from "
            f"{self.called_from}; slowest call inside: {self.slowest_call}, "
            f"{self.slowest_seconds * 1e3:.1f} ms)"
        )


def _ours(frame: FrameType | None) -> bool:
    if frame is None:
        return False
    name = frame.f_globals.get("__name__", "")
    return isinstance(name, str) and (name == _PACKAGE or name.startswith(_PACKAGE + "."))


class _Entry:
    __slots__ = ("c_name", "c_start", "frame", "slow", "slow_name", "start")

    def __init__(self, frame: FrameType, start: float) -> None:
        self.frame = frame
        self.start = start
        self.c_start = 0.0
        self.c_name = ""
        self.slow = 0.0
        self.slow_name = ""


@contextlib.contextmanager
def assert_no_stall(limit: float = 0.05) -> Iterator[list[Stall]]:
    """Fail when any single gpuflow call inside the block blocks the calling
    thread longer than ``limit`` seconds.

    ``with gf.testing.assert_no_stall(0.02): ...`` around code that must not
    wait for the GPU (the body of a request handler, say) raises
    :class:`AssertionError` on leaving the block, naming each gpuflow call
    that took longer, where the program called it, and the slowest call it
    made inside (a driver call, a lock).  Every entry into gpuflow counts: a
    call, one step of an awaited operation between two suspensions (the
    time the task spends suspended is not blocking), and a finalizer that a
    garbage collection runs in the block.  Blocking by design counts too:
    ``op.sync()`` or ``stream.synchronize()`` inside the block fails it.

    Only the calling thread is watched; the block yields the list of stalls
    seen so far.  The watching slows gpuflow calls down (a profile hook, as
    :func:`sys.setprofile`), so keep ``limit`` well above a call's usual
    microseconds; it replaces, for the block's duration, any profile hook
    the thread had, and restores it after.

    Parameters
    ----------
    limit
        The most seconds one entry into gpuflow may block its thread.

    Yields
    ------
    list[Stall]
        The stalls seen so far.

    Raises
    ------
    AssertionError
        On leaving the block, where a call took longer, naming each.
    ValueError
        ``limit`` is not a positive number.
    """
    if not limit > 0:
        raise ValueError(f"limit must be a positive number of seconds, not {limit!r}")
    stalls: list[Stall] = []
    entries: list[_Entry] = []
    clock = time.perf_counter

    def hook(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            if not entries and _ours(frame) and not _ours(frame.f_back):
                entries.append(_Entry(frame, clock()))
        elif event == "return":
            if entries and entries[-1].frame is frame:
                entry = entries.pop()
                took = clock() - entry.start
                if took > limit:
                    back = frame.f_back
                    where = f"{back.f_code.co_filename}:{back.f_lineno}" if back else "?"
                    code = frame.f_code
                    stalls.append(Stall(
                        took, f"{frame.f_globals.get('__name__')}.{code.co_qualname}", where,
                        entry.slow_name or "(none)", entry.slow,
                    ))  # fmt: skip
        elif entries:
            entry = entries[-1]
            if event == "c_call":
                entry.c_start = clock()
                entry.c_name = getattr(arg, "__name__", repr(arg))
            elif entry.c_start:  # c_return, c_exception
                took = clock() - entry.c_start
                if took > entry.slow:
                    entry.slow, entry.slow_name = took, entry.c_name
                entry.c_start = 0.0

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield stalls
    finally:
        sys.setprofile(previous)
    if stalls:
        lines = "\n  ".join(str(s) for s in stalls)
        raise AssertionError(
            f"{len(stalls)} gpuflow call(s) blocked the thread longer than "
            f"{limit * 1e3:g} ms:\n  {lines}"
        )
