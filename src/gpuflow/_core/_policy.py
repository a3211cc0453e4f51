"""Scheduling policies: which stream of a device a run (or a ``zip`` arm) gets.

A policy is asked once per run, and once per extra ``zip`` arm, from the
thread that starts the run.  Inside a stream lease every run stays on the
lease's stream whatever the policy (see :mod:`._run`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

from .._errors import UsageError
from ._latency import (
    ENCLOSING,
    LatencyClass,
    class_here,
    current_class_var,
    enter_class,
    leave_class,
)
from ._runtime import CURRENT, MAX_POOL_STREAMS, ensure_runtime, new_stream
from ._stream import Stream


@runtime_checkable
class SchedulingPolicy(Protocol):
    """Chooses the stream an operation runs on.

    ``next_stream`` is called once per run (and once per extra ``zip`` arm)
    from the thread that starts the run; it must be thread-safe and must not
    block.
    """

    def next_stream(self, device: int) -> Stream:
        """The stream of ``device`` that the next run (or ``zip`` arm) goes to.

        Parameters
        ----------
        device
            The device's ordinal.

        Returns
        -------
        Stream
        """
        ...


class StreamPoolLeastLoaded:
    """The default policy: a run goes to a stream of the device with nothing
    pending; when every stream has work, the device's pool grows by a stream,
    up to ``max_streams``.  New work thus never queues behind other work
    (such as what a cancelled await left running: the GPU cannot recall it)
    while another stream could take it, from the first run on.

    Each run looks at the device's streams in turn, starting one past where
    the previous run started (so on an idle device runs rotate over the pool
    exactly as with :class:`StreamPoolRoundRobin`, at about the same cost),
    and takes:

    1. the first stream with nothing pending that no stream lease holds:
       the GPU has reached the mark of every run enqueued on it (a read of
       its completion word, so this is the GPU's own progress, not when
       someone last looked), and no blocking ``sync`` is in flight on it;
    2. else a new stream: the pool grows by one, up to ``max_streams``
       streams in all (32 by default: CUDA's hardware queues, so that no
       two pool streams share one);
    3. else, for an ``await`` (``await op``, ``op.run(policy)``), no stream
       yet: the await waits, without blocking its loop and in the order the
       awaits came, for the first stream to go idle, and its run starts
       there.  How long the work already queued will take is known to
       nobody (a stream that holds one long kernel and one that holds a few
       short ones look alike when they were just given them), so a run
       queued on the GPU behind either might wait for the long one; waiting
       on the host for the first stream to finish never does.  A blocking
       run (``sync``), a ``zip`` arm and a direct call of
       :meth:`next_stream` cannot wait: they take the stream with the fewest
       runs pending, preferring one that is not *stalled* (it finished
       nothing for ``stall_s`` seconds: long work).

    A collective's run looks first at the stream of its communicator's
    previous collective on the device (``prefer``), and takes it where step
    1 would (nothing pending, no lease) while it is one of the device's
    streams (not one that a reset or a new ``init_device_contexts``
    retired): a rank runs a communicator's collectives in order whatever
    their streams, and on that one stream the next needs no wait on
    another.

    Streams added in step 2 stay for the life of the device's context (until
    ``gf.reset_device`` or a new ``init_device_contexts``) and take their
    turn in the rotation; on CUDA they are made when the runtime starts, so
    growing costs no driver call (making a stream can wait until the device
    is idle).  Stream leases and :class:`StreamPoolRoundRobin` use only the
    ``streams_per_device`` streams made at initialisation.  A bound no
    larger than ``streams_per_device`` turns growth off.

    What is pending is read without a lock: a race with the GPU makes a
    choice slightly stale, never wrong (any stream is correct; only latency
    differs).  A run being enqueued by another thread is not seen until it
    is submitted.

    Parameters
    ----------
    max_streams
        The most streams a device's pool grows to.
    stall_s
        How long a stream finishes nothing before it counts as stalled.

    Raises
    ------
    gpuflow.UsageError
        ``max_streams`` is not a positive int, or ``stall_s`` not a positive
        number.
    """

    __slots__ = ("_max", "_stall", "_turn")

    def __init__(self, max_streams: int = MAX_POOL_STREAMS, stall_s: float = 0.02) -> None:
        if not isinstance(max_streams, int) or isinstance(max_streams, bool) or max_streams < 1:
            raise UsageError(f"max_streams must be a positive int, not {max_streams!r}")
        if not isinstance(stall_s, (int, float)) or isinstance(stall_s, bool) or not stall_s > 0:
            raise UsageError(f"stall_s must be a positive number of seconds, not {stall_s!r}")
        self._max = max_streams
        self._stall = float(stall_s)
        self._turn = -1

    @property
    def max_streams(self) -> int:
        """The most streams a device's pool grows to under this policy."""
        return self._max

    @property
    def stall_s(self) -> float:
        """How long a busy stream may go without finishing a run before it
        counts as stalled."""
        return self._stall

    def idle_stream(
        self,
        device: int,
        prefer: Stream | None = None,
        priority: int = 0,
        sms: str | None = None,
    ) -> Stream | None:
        """Steps 1 and 2: a stream of ``device`` with nothing pending, or a
        new one; None where every stream is busy at the bound.  ``prefer``
        is looked at first, where it is one of the device's streams
        (gpuflow's runs of a collective pass their rank's previous
        stream).

        Parameters
        ----------
        device
            The device's ordinal.
        prefer
            A stream to look at first.
        priority
            The priority level of the streams (0: the default); each level
            has a pool of its own (see :func:`gpuflow.latency_class`).
        sms
            The name of the reserved SMs of the streams (None: the SMs no
            partition reserved); each has a pool of its own, at each level.

        Returns
        -------
        Stream or None
        """
        rt = CURRENT.runtime or ensure_runtime()
        if priority or sms is not None:
            streams = rt.streams(device, priority, sms)
        else:
            try:
                streams = rt.device_streams[device]
            except KeyError:
                streams = rt.streams(device)  # (which says why)
        if prefer is not None:
            # step 1's test, made on that stream alone first (a collective
            # run again after an awaited one: no loop, no rotation); never a
            # stream of a runtime replaced since, nor one a reset retired
            if not prefer.leased and prefer.idle() and prefer in streams:
                return prefer
        n = len(streams)
        # (a counter of the policy's own, not thread-safe and needing none: two
        # runs that start at the same stream only look at it first both)
        self._turn = start = (self._turn + 1) % n
        s = streams[start]  # (usually the one: looked at before any loop)
        if not s.leased and s.idle():
            return s
        # start + 1, ..., n - 1, 0, ..., start - 1 (negative indices wrap)
        for i in range(start + 1 - n, start):
            s = streams[i]
            if not s.leased and s.idle():
                return s
        if n < self._max:
            return rt.grow(device, self._max, priority, sms)
        return None

    def next_stream(
        self,
        device: int,
        prefer: Stream | None = None,
        priority: int = 0,
        sms: str | None = None,
    ) -> Stream:
        """The stream of ``device`` for the next run: steps 1 and 2
        (:meth:`idle_stream`), else the least-loaded stream (step 3 for a
        run that cannot wait).

        Parameters
        ----------
        device
            The device's ordinal.
        prefer
            A stream to look at first.
        priority
            The priority level of the streams (0: the default).
        sms
            The name of the reserved SMs of the streams (None: the others).

        Returns
        -------
        Stream
        """
        s = self.idle_stream(device, prefer, priority, sms)
        if s is None:
            streams = ensure_runtime().streams(device, priority, sms)
            s = least_loaded(streams, time.monotonic() - self._stall)
        return s

    def __repr__(self) -> str:
        return f"StreamPoolLeastLoaded(max_streams={self._max}, stall_s={self._stall})"


def least_loaded(streams: list[Stream], stalled_before: float) -> Stream:
    """The stream with the fewest runs pending, one still moving if any is,
    one no stream lease holds if any is."""
    return min(streams, key=lambda s: (s.leased, s.stalled(stalled_before), s.load()))


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
        """The pool stream of ``device`` after the one given last, in turn.

        Parameters
        ----------
        device
            The device's ordinal.

        Returns
        -------
        Stream
        """
        pool = ensure_runtime().pool(device)
        return pool[next(self._counter) % len(pool)]

    def __repr__(self) -> str:
        return "StreamPoolRoundRobin()"


class SingleStream:
    """Every run on one stream of its own, on ``device``: strict order.

    Parameters
    ----------
    device
        The device whose stream it is (made at the first run).
    """

    __slots__ = ("_device", "_lock", "_stream")

    def __init__(self, device: int = 0) -> None:
        self._device = device
        self._stream: Stream | None = None
        self._lock = threading.Lock()

    def next_stream(self, device: int) -> Stream:
        """The policy's one stream, whatever ``device`` (made anew where a
        reset or a new runtime replaced it).

        Parameters
        ----------
        device
            Ignored: the policy is bound to its stream's device.

        Returns
        -------
        Stream
        """
        # the policy is bound to its device, whatever device is current
        s = self._stream
        if s is None or not s.current():
            with self._lock:
                s = self._stream
                if s is None or not s.current():
                    s = self._stream = new_stream(self._device)
        return s

    @property
    def stream(self) -> Stream:
        """The policy's stream (made on first use)."""
        return self.next_stream(self._device)

    def __repr__(self) -> str:
        return f"SingleStream(device={self._device})"


#: The policy of runs that name none, outside a stream lease.
DEFAULT_POLICY = StreamPoolLeastLoaded()


# -- latency classes ------------------------------------------------------------------
#
# A class of runs (interactive requests beside batch work) gets the GPU's
# SMs first, or SMs of its own, and its own busy poll.  Its level (priority,
# reserved SMs) has a pool of its own on each device: the default policy's
# runs inside ``with gf.latency_class(...)`` take streams of that pool, and
# a run never waits behind a busy pool of another level.


class AtLevel:
    """``policy`` (the default policy) at one level: what a run's ``zip``
    arms fork with inside :func:`latency_class`."""

    __slots__ = ("_policy", "_priority", "_sms")

    def __init__(self, policy: StreamPoolLeastLoaded, priority: int, sms: str | None) -> None:
        self._policy = policy
        self._priority = priority
        self._sms = sms

    def next_stream(self, device: int) -> Stream:
        return self._policy.next_stream(device, None, self._priority, self._sms)

    def __repr__(self) -> str:
        sms = "" if self._sms is None else f" on SMs {self._sms!r}"
        return f"{self._policy!r} at priority {self._priority}{sms}"


@contextmanager
def latency_class(
    *,
    priority: int = ENCLOSING,
    sms: str | None = ENCLOSING,
    busy_poll_us: float | None = ENCLOSING,
) -> Iterator[LatencyClass]:
    """Run the work started in the block as one latency class.

    ``with gf.latency_class(priority=2, sms="interactive", busy_poll_us=1000):``
    — every run the default policy places, started in the block by this
    task or by tasks started from it (an ``await``, a ``sync()``, a
    ``zip``'s arms, ``start_run``; not ``enqueue_on``, which names its
    stream), takes a stream of the class's level on its device:

    * ``priority``: 0 is the default and each level above it is more
      urgent (see :func:`new_stream`): when SMs free up, the GPU gives them
      to the blocks of the most urgent kernels first (running blocks are
      not preempted; copies are not affected);
    * ``sms``: the name of SMs reserved at :func:`init_device_contexts`
      (``reserve_sms``): the runs' kernels use those SMs alone, and no
      other gpuflow work holds them;
    * ``busy_poll_us``: how long the loop reads the completion words of the
      class's awaits before it sleeps (see ``init_device_contexts``):
      interactive work polls longer, batch work (``0``) sleeps at once and
      leaves the CPU to others.

    Each level (priority and SMs) has a pool of its own, made at its first
    use and grown as the default pool is; at the pool's bound a run takes
    the least-loaded stream of its level rather than wait for one to go
    idle.  A stream lease's runs stay on its stream
    (``open_stream_lease(priority=..., sms=...)``; the class's busy poll
    still applies), and a policy given to a run decides its stream.

    Blocks nest: what an inner class names replaces the outer's, what it
    leaves out is the outer's.  Any thread; a context variable, as
    :func:`use_device`.  Cancellation and errors are unaffected: the class
    ends with the block, whatever ends it.

    Parameters
    ----------
    priority
        From 0 (the default) to the most urgent level of every device.
    sms
        The name of SMs every device reserved, or None (the others).
    busy_poll_us
        0 or more microseconds, or None (the runtime's budget).

    Each one left out is the enclosing class's: outside any, priority 0,
    no reserved SMs and the runtime's budget.

    Returns
    -------
    contextlib.AbstractContextManager[LatencyClass]
        Gives the class in effect inside the block.

    Raises
    ------
    gpuflow.UsageError
        ``priority`` is out of a device's range (the message says the
        range), no SMs of that name are reserved (it lists those that
        are), or ``busy_poll_us`` is negative.
    gpuflow.UsageTypeError
        ``priority`` is not an int, or ``sms`` not a str.
    """
    rt = ensure_runtime()
    cls = class_here(priority, sms, busy_poll_us)
    entered = enter_class(cls, rt, rt.devices)
    try:
        yield cls
    finally:
        leave_class(entered)


def stream_elsewhere(device: int, prefer: Stream | None = None) -> Stream:
    """A stream of ``device`` for a part of a run on another device (a copy
    from an array there, a collective's rank there): the default policy's,
    at the level of the current latency class (an idle one where it can),
    so that the part queues behind no unrelated work there and keeps its
    class (the run's own policy may be bound to its device, or to a stream
    lease of it).  ``prefer``: a stream to look at first."""
    cls = current_class_var.get()
    if cls is None:
        return DEFAULT_POLICY.next_stream(device, prefer)
    return DEFAULT_POLICY.next_stream(device, prefer, cls.priority, cls.sms)


def current_latency_class() -> LatencyClass:
    """The latency class of the runs the current task starts
    (``LatencyClass(0, None, None)`` outside any :func:`latency_class`).

    Any thread.

    Returns
    -------
    LatencyClass
    """
    return current_class_var.get() or LatencyClass()
