"""Scheduling policies: which stream of a device a run (or a ``zip`` arm) gets.

A policy is asked once per run, and once per extra ``zip`` arm, from the
thread that starts the run.  Inside a stream lease every run stays on the
lease's stream whatever the policy (see :mod:`._run`).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from ._errors import UsageError
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


class StreamPoolLeastLoaded:
    """The default policy: a run goes to a pool stream with nothing pending,
    else to the least-loaded one; new work does not queue behind long work,
    such as what a cancelled await left running (the GPU cannot recall it),
    while another stream could take it.

    Each run looks at the device's streams in turn, starting one past where
    the previous run started (so on an idle device runs rotate over the pool
    exactly as with :class:`StreamPoolRoundRobin`, at about the same cost),
    and takes:

    1. the first stream with nothing pending: no awaited or enqueued run the
       GPU has not been seen to finish, no blocking ``sync`` in flight;
    2. else, when no stream is *stalled*, the one with the fewest pending
       runs; a stream is stalled when it has pending runs and none of its
       runs has been seen to finish for ``stall_s`` seconds (long work);
    3. else a new stream: the device's pool grows by one, up to
       ``max_streams`` streams in all.  Where some stream holds long work,
       work not yet seen to be long may hold up any busy stream, so the new
       run gets a stream of its own;
    4. else (at the bound) the least-loaded stream that is not stalled, or
       the least-loaded one.

    Streams added in step 3 stay for the life of the device's context (until
    ``gf.reset_device`` or a new ``init_device_contexts``) and take their
    turn in the rotation; stream leases and :class:`StreamPoolRoundRobin`
    use only the ``streams_per_device`` streams made at initialisation.  A bound
    no larger than ``streams_per_device`` turns growth off.  Many short runs
    with nothing stalled never grow the pool (they share completion signals
    per stream, which more streams would split).  On CUDA, streams beyond
    the driver's hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``, which
    gpuflow sets to 32 unless the user set it) share queues, where long work
    can still hold up unrelated work.

    What is pending is read from the completion dispatcher without a lock: a
    race with a completion makes a choice slightly stale, never wrong (any
    stream is correct; only latency differs).  Completions are seen by the
    awaiting loop's thread or the dispatcher thread, either of which may be
    busy (a loop running other tasks) or wait for the GIL for one switch
    interval (5 ms) or more: ``stall_s`` (20 ms by default) stays well above
    that, so short work never looks stalled.
    """

    __slots__ = ("_counter", "_max", "_stall")

    def __init__(self, max_streams: int = 64, stall_s: float = 0.02) -> None:
        if not isinstance(max_streams, int) or isinstance(max_streams, bool) or max_streams < 1:
            raise UsageError(f"max_streams must be a positive int, not {max_streams!r}")
        if not isinstance(stall_s, (int, float)) or isinstance(stall_s, bool) or not stall_s > 0:
            raise UsageError(f"stall_s must be a positive number of seconds, not {stall_s!r}")
        self._max = max_streams
        self._stall = float(stall_s)
        self._counter = itertools.count()

    @property
    def max_streams(self) -> int:
        """The most streams a device's pool grows to under this policy."""
        return self._max

    @property
    def stall_s(self) -> float:
        """How long a busy stream may go without finishing a run before it
        counts as stalled."""
        return self._stall

    def next_stream(self, device: int) -> Stream:
        rt = get_runtime()
        streams = rt.streams(device)
        start = next(self._counter) % len(streams)
        first = streams[start]
        dispatcher = rt.dispatcher
        if not dispatcher.pending and not first._syncs:
            return first  # nothing pending anywhere: round robin's cost
        lanes = dispatcher.lanes
        best = first
        best_pending = -1
        best_since = oldest = math.inf
        for s in streams[start:] + streams[:start] if start else streams:
            lane = lanes.get(s._raw)
            if lane is None or not lane.subs:  # no lane, or only signals left in flight
                if not s._syncs:
                    return s  # idle
                pending, since = s._syncs, math.inf
            else:
                pending, since = len(lane.subs) + s._syncs, lane.since
                if since < oldest:
                    oldest = since
            if best_pending < 0 or pending < best_pending:
                best, best_pending, best_since = s, pending, since
        stalled_before = time.monotonic() - self._stall
        if oldest > stalled_before:
            return best  # every stream is busy, none stalled
        if len(streams) < self._max:
            grown = rt.grow(device, self._max)
            if grown is not None:
                return grown
        if best_since > stalled_before:
            return best
        return _least_loaded_moving(lanes, streams, start, stalled_before) or best

    def __repr__(self) -> str:
        return f"StreamPoolLeastLoaded(max_streams={self._max}, stall_s={self._stall})"


def _least_loaded_moving(
    lanes: Mapping[Any, Any], streams: list[Stream], start: int, stalled_before: float
) -> Stream | None:
    """The least-loaded stream that is not stalled (or one fallen idle)."""
    found: Stream | None = None
    least = 0
    for s in streams[start:] + streams[:start]:
        lane = lanes.get(s._raw)
        if lane is None or not lane.subs:
            if not s._syncs:
                return s
            pending = s._syncs
        elif lane.since > stalled_before:
            pending = len(lane.subs) + s._syncs
        else:
            continue
        if found is None or pending < least:
            found, least = s, pending
    return found


class StreamPoolRoundRobin:
    """Consecutive runs get consecutive streams of the device's pool
    (``streams_per_device`` of them), whatever is pending on them, so
    independent operations overlap.  The default before
    :class:`StreamPoolLeastLoaded`: a run may queue behind long (or
    abandoned) work on its stream while another stream is idle."""

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
DEFAULT_POLICY: SchedulingPolicy = StreamPoolLeastLoaded()
