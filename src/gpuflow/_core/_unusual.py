"""Whether anything makes a run unusual: one count, read once a run.

An await where nothing is unusual (no policy given, no scope open, no
trace recording, no cancellation-point watcher, no capture under way)
takes the shortest form of each step (:func:`._run.await_run`).  Whatever
would make a run unusual while it is on says so here, for as long as it is
on: a stream lease or a device group open in any task, a trace recording,
``cancel_at_every_point`` running, a capture under way, a latency class.
A run reads the count once; where it is not zero the run asks each of them
in turn (most apply to one task only: asking is right for every run,
skipping it for most).
"""

from __future__ import annotations

import threading


class Unusual:
    """How many things that make runs unusual are on now, in any thread."""

    __slots__ = ("_lock", "n")

    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def begin(self) -> None:
        """One more is on (a scope entered, a trace started, ...)."""
        with self._lock:
            self.n += 1

    def end(self) -> None:
        """One of them is over."""
        with self._lock:
            self.n -= 1


#: The process's count (a run reads ``UNUSUAL.n``).
UNUSUAL = Unusual()
