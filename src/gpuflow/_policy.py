"""Scheduling policies: which stream of a device a run (or a ``zip`` arm) gets.

A policy is asked once per run, and once per extra ``zip`` arm, from the
thread that starts the run.  Inside a stream lease every run stays on the
lease's stream whatever the policy (see :mod:`._run`).
"""

from __future__ import annotations

import itertools
import threading
from typing import Protocol, runtime_checkable

from ._runtime import get_runtime, new_stream
from ._stream import Stream


@runtime_checkable
class SchedulingPolicy(Protocol):
    """Chooses the stream an operation runs on.

    ``next_stream`` is called once per run (and once per extra ``zip`` arm)
    from the thread that starts the run; it must be thread-safe and must not
    block.
    """

    def next_stream(self, device: int) -> Stream: ...


class StreamPoolRoundRobin:
    """The default policy: consecutive runs get consecutive streams of the
    device's pool (``streams_per_device`` of them), so independent operations
    overlap."""

    __slots__ = ("_counter",)

    def __init__(self) -> None:
        self._counter = itertools.count()

    def next_stream(self, device: int) -> Stream:
        pool = get_runtime().pool(device)
        return pool[next(self._counter) % len(pool)]

    def __repr__(self) -> str:
        return "StreamPoolRoundRobin()"


class SingleStream:
    """Every run on one stream of its own, on ``device``: strict order."""

    __slots__ = ("_device", "_lock", "_stream")

    def __init__(self, device: int = 0) -> None:
        self._device = device
        self._stream: Stream | None = None
        self._lock = threading.Lock()

    def next_stream(self, device: int) -> Stream:
        # the policy is bound to its device, whatever device is current
        s = self._stream
        if s is None or s._generation != s._runtime.generation(self._device) or not s._runtime.live:
            with self._lock:
                s = self._stream
                if (
                    s is None
                    or s._generation != s._runtime.generation(self._device)
                    or not s._runtime.live
                ):
                    s = self._stream = new_stream(self._device)
        return s

    @property
    def stream(self) -> Stream:
        """The policy's stream (made on first use)."""
        return self.next_stream(self._device)

    def __repr__(self) -> str:
        return f"SingleStream(device={self._device})"


#: The policy of runs that name none, outside a stream lease.
DEFAULT_POLICY: SchedulingPolicy = StreamPoolRoundRobin()
