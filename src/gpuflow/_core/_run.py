"""A run: one execution of an operation, from its start to its completion.

Every way of running an operation (``await op``, ``op.run(policy)``,
``op.sync()``, ``op.sync_on(stream)``, ``op.enqueue_on(stream)``) makes one
:class:`Run` and takes it through the same life:

1. **start**: the stream is chosen (the innermost stream lease of the
   device, else the policy, which may make an await wait for an idle
   stream), the run's checks are made, and every scope the task runs in
   tracks the run;
2. **enqueue**: the operation enqueues its work on the stream
   (``execute(ctx)``) and hands the run what that work still uses;
3. **mark**: the stream's lane (``_completion``) enqueues the run's mark right
   after that work: the number the GPU writes into the stream's completion
   word when it gets there;
4. **wait**: a blocking run synchronizes the stream; an await alone in its
   loop reads the word itself, else parks, and its loop's poller (or the
   completer thread, or the GPU's wake-up of a sleeping loop) sees the
   mark reached;
5. **complete**: whoever sees the mark reached (or the device fault)
   completes the run (:meth:`Completer.complete`): it releases what the run kept,
   runs its callbacks, and wakes the tasks parked on it;
6. **resolve**: host data the work copied becomes the run's output.

:func:`await_run` is the one definition of the await: it asks once what
is unusual (a policy given, a scope open, a trace recording, a
cancellation-point watcher, a capture, a latency class, frees queued for
the finalizers, an operation that is not ordinary: one count,
:mod:`._unusual`, and the operation), and where nothing is, each step takes
its shortest form.  Whatever happens after something was
enqueued, the run keeps what that work uses until the GPU is done with it.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
import weakref
from collections.abc import Awaitable, Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any

import anyio

from .._errors import DeviceError, UsageError, UsageTypeError
from . import _cancel_points, _finalizers, _trace
from ._completion import BusyPoll, Communicating, Lane
from ._execution import ExecutionContext
from ._hazards import Point, capture_log, refuse_in_capture
from ._latency import current_class_var, current_poll_var
from ._loops import Loop, Posts, current_loop, refuse_blocking, wait_event
from ._pending import has_map, is_pending, resolve
from ._plan import enqueue_step
from ._policy import DEFAULT_POLICY, AtLevel, SchedulingPolicy, StreamPoolLeastLoaded
from ._runtime import CURRENT, Runtime, current_device, current_device_var, ensure_runtime
from ._scoped import current_scopes
from ._stream import Stream
from ._stream_protocols import stream_at
from ._unusual import UNUSUAL

if TYPE_CHECKING:
    from .._backends import Backend, RawEvent, RawStream
    from ._operation import DeviceOperation

try:
    import resource as _resource
except ImportError:  # (Windows)
    _resource = None  # type: ignore[assignment]

#: A task parked on a run: its loop, and what ``loop.wake`` wakes.
Waiter = tuple[Loop, Any]

_weak = weakref.ref

#: Makes "done" one step against add_done_callback and a task's parking:
#: a callback or a parked task is either taken by the completion or sees
#: the run done.
_callbacks_lock = threading.Lock()


class Run:
    """One run of an operation: what its enqueued work uses until the GPU is
    done with it, where that work ends, and the tasks that wait for it.

    ``keep`` holds host buffers, staging memory, graphs and leases that
    enqueued work still uses; it is released by the completion (or a fault),
    never earlier, whatever happens to the task that started the run.  Once
    marked, ``lane`` is its stream's and ``number`` the mark there that
    covers it (its own; where that could not be enqueued, the stream's next
    one, which the lane owes until then).  ``arms`` maps each other stream
    the run enqueued work on (a ``zip`` arm) to an event recorded right
    after that work.  As a hazard point (``_hazards.Point``), it orders
    later work after its own.

    A run in flight holds few objects: with a thousand awaits pending, the
    objects of the runs are most of what the garbage collector goes through
    at each collection.

    Made by gpuflow for each run (``ctx.run``); not constructed directly.
    """

    __slots__ = (
        "_arms", "_comms", "_keep", "_lane", "_more_parked", "_number", "_on_done", "_parked",
        "_parked_loop", "_poll_s", "_since", "_task", "_traced", "_waits", "_what", "device",
        "done", "error",
    )  # fmt: skip

    def __init__(self, device: int, op: DeviceOperation[object] | None = None) -> None:
        self.device = device
        #: what runs, and since when, for gf.in_flight(): a weak reference to
        #: its operation (a run keeps alive what its work uses, never more)
        self._what: Callable[[], object] | None = None if op is None else _weak(op)
        self._since = time.monotonic()
        #: the task that waits for it, once one parks or polls (gf.in_flight())
        self._task: Any = None
        #: the other streams' points its work was ordered after, by their
        #: lanes (gf.in_flight()); dropped once done
        self._waits: list[tuple[Lane | None, Point | None]] | None = None
        #: the communicators whose collectives the run enqueued: a run that
        #: one of them aborted before it was seen done failed
        self._comms: list[Communicating] | None = None
        self._keep: list[object] | None = None  # (made for the first object kept)
        self.done = False
        self.error: BaseException | None = None
        #: the task parked on the run first, what its loop wakes and that
        #: loop (two slots, not a pair: an await in flight makes no object
        #: for it), and any others
        self._parked: Any = None
        self._parked_loop: Loop | None = None
        self._more_parked: list[Waiter] | None = None
        self._on_done: list[Callable[[BaseException | None], None]] | None = None
        self._lane: Lane | None = None
        self._number = 0
        self._arms: dict[RawStream, RawEvent] | None = None
        #: its latency class's busy-poll budget in seconds (None: the runtime's)
        self._poll_s: float | None = None
        #: the trace hook: what the traces recording it are told (None: none is)
        self._traced: _trace.TracedRun | None = None

    def reached(self) -> bool:
        """Whether the run's work is known to be done (seen done, or its mark
        reached: a read of the completion word).  Any thread.

        Returns
        -------
        bool
        """
        if self.done:
            return True
        lane = self._lane
        return lane is not None and lane.read() >= self._number

    def _order(self, backend: Backend, stream: RawStream, on: RawStream) -> bool:
        """As a hazard point: make later work on raw ``stream`` wait for this
        run's work on raw ``on``: nothing once it is known done, its mark on
        its own stream, the join event of a ``zip`` arm on another; False
        where it cannot say (not marked yet: still being enqueued; then the
        caller waits for everything enqueued on ``on`` so far).

        Parameters
        ----------
        backend
            The backend the streams are of.
        stream, on
            Raw streams: the one to order, the one this run's work is on.

        Returns
        -------
        bool
            Whether the order was made (or needed none).
        """
        if self.done:
            return True
        lane = self._lane
        if lane is None:
            # still being enqueued: where its work on ``on`` ends is not known
            # yet (an arm's join event so far may precede later work there)
            return False
        if lane.raw is on:
            if lane.read() < self._number:
                if lane.unmarked and self._number > lane.issued:
                    lane.completer.mark_owed(lane)  # (else nothing may write it soon)
                backend.wait_mark(stream, on, self._number)
            return True
        arms = self._arms
        if arms is not None:
            event = arms.get(on)
            if event is not None:
                backend.wait_event(stream, event)
                return True
        return False

    def _wait_noted(self, on: Stream, point: Point | None) -> None:
        """Its work was ordered after ``point`` of ``on`` (a hazard): what
        gf.in_flight() says it may wait for."""
        waits = self._waits
        if waits is None:
            self._waits = [(on._lane, point)]
        else:
            waits.append((on._lane, point))

    def __repr__(self) -> str:
        op = None if self._what is None else self._what()
        what = "" if op is None else f" of {op!r}"
        state = "done" if self.done else f"in flight {time.monotonic() - self._since:.3f} s"
        return f"<gpuflow.lowlevel.Run{what} on device {self.device}, {state}>"

    def add_done_callback(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(error)`` once, on the thread that sees the work done (the
        awaiting loop's, or the completer's; at once, here, if it already
        is).  Safe from any thread, also while the work completes.  ``fn``
        must not block or raise.

        Parameters
        ----------
        fn
            Called with None, or the error the work failed with.
        """
        with _callbacks_lock:
            if not self.done:
                if self._on_done is None:
                    self._on_done = []
                self._on_done.append(fn)
                return
        fn(self.error)

    @property
    def keep(self) -> list[object]:
        """What the run keeps alive until its work is done (empty once it is)."""
        keep = self._keep
        if keep is None:
            keep = self._keep = []
        return keep

    def hold(self, objs: Iterable[object]) -> None:
        """Keep ``objs`` until the work is done (from the thread enqueueing it).

        Parameters
        ----------
        objs
            What the work uses.
        """
        keep = self._keep
        if keep is None:
            self._keep = list(objs)
        else:
            keep.extend(objs)

    # -- completion (called by whoever saw the work done: ``_completion``) --------------------
    def _complete(self, error: BaseException | None, here: object, posts: Posts) -> None:
        """The run's work is done (or failed with ``error``): release what it
        kept, run its callbacks (a failure in one is a warning), and wake the
        tasks parked on it: those of loop ``here`` (the loop running this)
        at once, the others added to ``posts`` (a wake-up only schedules its
        task: none resumes while this runs).

        Parameters
        ----------
        error
            None, or why the work failed.
        here
            The loop running this (its tasks are woken at once).
        posts
            Where wake-ups of other loops' tasks are gathered.
        """
        if error is None and self._comms is not None:
            for comm in self._comms:
                error = comm._failure()
                if error is not None:
                    break
        self.error = error
        self._keep = self._what = self._waits = self._task = None
        with _callbacks_lock:  # a callback added meanwhile runs once, here or there
            self.done = True
            callbacks, self._on_done = self._on_done, None
        if callbacks is not None:
            for fn in callbacks:
                try:
                    fn(error)
                except BaseException as exc:  # never into the completer thread
                    warnings.warn(f"gpuflow: a completion callback raised {exc!r}", stacklevel=1)
        # (no task parks once done is set: who parked is fixed now)
        park = self._parked
        if park is None:
            return
        loop, more = self._parked_loop, self._more_parked
        self._parked = self._parked_loop = self._more_parked = None
        while loop is not None:
            target = loop.target
            if target is here:
                if not park.done():  # (its task was cancelled, or it never parked)
                    park.set_result(None)
            else:
                fn = functools.partial(loop.wake, park)
                entry = posts.get(id(target))
                if entry is None:
                    posts[id(target)] = (target, loop.post, [fn])
                else:
                    entry[2].append(fn)
            loop, park = more.pop() if more else (None, None)

    # -- waiting -------------------------------------------------------------------
    def wait(self, loop: Loop | None = None) -> Awaitable[None]:
        """Wait (cancellably) until the work is done; raise its device error.

        Parks the task with the running loop's own primitives (``loop``, or
        the current one), so on cancellation the loop's own exception
        propagates at once; the run still keeps what its work uses until
        the GPU is done.  While it waits, the loop's poller watches the
        run's stream.

        Parameters
        ----------
        loop
            The running loop's adapter (None: found).

        Returns
        -------
        Awaitable[None]

        Raises
        ------
        gpuflow.DeviceFaultError
            The work faulted.
        """
        return _Waiting(self, current_loop() if loop is None else loop)


class _Waiting:
    __slots__ = ("loop", "run")

    def __init__(self, run: Run, loop: Loop) -> None:
        self.run = run
        self.loop = loop

    def __await__(self) -> Generator[object, None, None]:
        return _wait(self.run, self.loop)


# -- the wait ---------------------------------------------------------------------------
#
# An await alone in its loop (no other await of the loop in progress, nothing
# else of it pending) reads its run's word inline for up to INLINE_SPIN_S,
# then once per loop turn itself, within the busy-poll budget: the turn that
# sees the run done resumes it, with no future and no wake-up.  Otherwise,
# or once another await of the loop starts or the budget is spent, it parks
# with its loop's own primitive and its loop's poller watches the lane for
# what is left of the budget (``_completion``).

#: How long the task of a lone await (nothing else of its loop pending)
#: reads its word before it parks: a short kernel is then seen done without
#: a loop turn.  The loop runs nothing else meanwhile, so this stays short.
INLINE_SPIN_S = 20e-6

#: An await whose run is done before it would park (an inline read saw it
#: done) yields to the loop when another task or callback is ready to run
#: (asked at most every ``Loop.ready_check_s``), or when the loop's tasks
#: have not been let run at one of gpuflow's awaits for this long: a lone
#: task awaiting short kernels back to back skips the loop turns in
#: between, and others still run.  No turn is owed where the loop's thread
#: slept for most of that time (:func:`_slept`).
YIELD_EVERY_S = 1e-3

#: Where the system counts a thread's own waits (Linux).
_BY_THREAD: int | None = getattr(_resource, "RUSAGE_THREAD", None)


def _thread_usage() -> tuple[float, int] | None:
    """The calling thread's CPU time and count of voluntary context switches
    (waits) so far; None where the system does not count them by thread.
    (The CPU time is the thread's clock: the one ``getrusage`` gives may
    count, a millisecond late, time the thread spent running before.)"""
    if _BY_THREAD is None:
        return None
    return time.thread_time(), _resource.getrusage(_BY_THREAD).ru_nvcsw


def _slept(loop: Loop, since: float) -> bool:
    """Whether ``loop``'s thread (running this) slept for most of the
    ``since`` seconds since a task of the loop last let it run at one of
    gpuflow's awaits: it ran for less than half of them, and waited (a
    voluntary context switch) at least once.  Such a thread slept in its
    selector, most likely: its task awaited something else, and the loop
    turned.  A turn is then not owed, and right after such a gap it costs
    as much as a short run (a cold cache, a slow clock).

    A thread kept from running by the system's scheduler alone made no such
    switch, and owes its turn.  One kept from the GIL by another thread did
    make one, and yields at its next millisecond of running instead.  What
    is compared is counted from the previous call (an older time than the
    turn ``since`` is counted from, where the task parked meanwhile): the
    CPU time is then more, and a turn rather owed."""
    used = _thread_usage()
    if used is None:
        return False
    cpu, waits = used
    slept = waits > loop.slept_waits and cpu - loop.slept_cpu < since / 2
    loop.slept_cpu, loop.slept_waits = cpu, waits
    return slept


def _spin_inline(run: Run, loop: Loop, lane: Lane) -> bool:
    """A lone await: read the word for up to :data:`INLINE_SPIN_S` (within
    the busy-poll budget), and complete the run here if it is reached.
    Returns whether to go on reading the word at the loop's turns (the
    await is alone and its run was not seen done).

    Never where other awaits of the loop are in progress, parked or woken
    and not yet resumed: their tasks would wait for the spin, and submit
    their next work only after it (awaits of short kernels from many tasks
    would reach the GPU one at a time).  The caller asks that first, from
    ``loop.awaiting``."""
    d = lane.completer
    limit = min(INLINE_SPIN_S, d.busy_poll_s if run._poll_s is None else run._poll_s)
    if limit <= 0 or d.others_polled(loop):
        return False
    if lane.unmarked:  # (a run's mark failed: the next one covers it)
        d.mark_owed(lane)
    read = lane.read
    number = run._number
    clock = time.perf_counter
    deadline = clock() + limit
    reached = read()
    while reached < number:
        if clock() > deadline:
            return True
        reached = read()
    done = d.advance([(lane, reached)], time.monotonic())
    d.spun += len(done)
    d.complete_reached(done, loop.target)
    return False


def _poll_alone(run: Run, loop: Loop, lane: Lane) -> Generator[object, None, float]:
    """A lone await past its inline read: read the word once per loop turn
    from the task itself, within the busy-poll budget, while no other await
    of the loop is in progress.  The turn that sees the run done resumes the
    task: no future, no wake-up, no turn more.

    Returns when the run is done, or with the budget left (the task then
    parks, and the loop's poller polls for the rest of it: the await spins
    at most the budget in all).  Cancellation is the loop's own, at a turn;
    the run stays pending, and the completer thread takes it over
    ``LOOP_STALL_S`` after the last turn that read its word."""
    d = lane.completer
    run._task = loop.current_task()
    clock = time.monotonic
    busy = BusyPoll()
    now = clock()
    busy.start(now, d.busy_poll_s if run._poll_s is None else run._poll_s)
    lane.polled_until = busy.held_until(now)
    checkpoint = loop.checkpoint
    while True:
        yield from checkpoint().__await__()
        loop.yielded, loop.parked = time.perf_counter(), False  # (others ran: none owed)
        if run.done:
            return 0.0
        now = clock()
        busy.turn(now)
        lane.polled_until = busy.held_until(now)
        reached = lane.read()
        if reached > lane.completed:
            done = d.advance([(lane, reached)], now)
            d.polled += len(done)
            d.complete_reached(done, loop.target)
            if run.done:
                return 0.0
        if now >= busy.deadline or loop.awaiting > 1 or d.others_polled(loop):
            return max(0.0, busy.deadline - now)


def _wait(run: Run, loop: Loop, mark_on: Lane | None = None) -> Generator[object, None, None]:
    """:meth:`Run.wait`: the inline read and the loop's turns while alone,
    else a park; the yield a run seen done owes its loop now and then.

    ``mark_on``: the run is not marked yet; its mark is to be enqueued on
    that lane here.  A run that will park is then the park's before its
    mark is: nothing can complete it before, so nothing need be locked
    against whoever does."""
    alone = not loop.awaiting  # (the one place that decides: a lone await)
    loop.awaiting += 1
    try:
        if mark_on is not None and not alone:
            park = run._parked = loop.park()
            run._parked_loop = loop
            run._task = loop.current_task()
            mark_on.submit(run)
            mark_on.completer.poll_on(loop, mark_on, run._poll_s)
            loop.parked = True
            yield from park.__await__()
        else:
            if mark_on is not None:
                mark_on.submit(run)
            yield from _wait_marked(run, loop, alone)
    finally:
        loop.awaiting -= 1
    if run.error is not None:
        raise run.error


def _wait_marked(run: Run, loop: Loop, alone: bool) -> Generator[object, None, None]:
    """:func:`_wait` of a marked run: read its word while alone, then park."""
    lane = run._lane
    budget = run._poll_s  # the busy poll left to the loop's poller: all of it
    if alone and not run.done and lane is not None:
        # (before a waiter is registered: finished here, nobody is woken)
        if _spin_inline(run, loop, lane) and not run.done:
            budget = yield from _poll_alone(run, loop, lane)
    if run.done:
        now = time.perf_counter()
        if loop.parked:  # (an await of the loop parked since: it turned)
            loop.yielded, loop.parked = now, False
        yield_now = False
        since = now - loop.yielded
        if since >= YIELD_EVERY_S:
            yield_now = not _slept(loop, since)
            if not yield_now:  # (the loop turned meanwhile)
                loop.yielded = loop.asked = now
        if not yield_now and now - loop.asked >= loop.ready_check_s:
            loop.asked = now
            yield_now = loop.others_ready()
        if yield_now:
            loop.yielded = now
            yield from loop.checkpoint().__await__()
        return
    park = loop.park()
    with _callbacks_lock:
        # the run may have been finished since the check; then nobody wakes
        # us, and we must not wait
        parked = not run.done
        if parked:
            if run._parked is None:
                run._parked, run._parked_loop = park, loop
            elif run._more_parked is None:
                run._more_parked = [(loop, park)]
            else:
                run._more_parked.append((loop, park))
    if not parked:
        yield from loop.checkpoint().__await__()
        return
    run._task = loop.current_task()
    if lane is not None:
        lane.completer.poll_on(loop, lane, budget)
    loop.parked = True
    yield from park.__await__()


# -- starting a run: its stream, its checks, its scopes ----------------------------------


def ended_by(exc: BaseException) -> str:
    """How a wait ended, for a message: "was cancelled", or what it raised."""
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return "was cancelled"
    return f"ended by {exc!r}"


class _Pinned:
    """The policy of a run inside a stream lease: every part of it, zip arms
    included, stays on the lease's stream (any other stream of the pool may be
    another scope's lease)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: Stream) -> None:
        self._stream = stream

    def next_stream(self, device: int) -> Stream:
        return self._stream


class _RunName:
    """Names a run in an error message; formatted only when one is raised."""

    __slots__ = ("op",)

    def __init__(self, op: DeviceOperation[object]) -> None:
        self.op = op

    def __str__(self) -> str:
        return f"running {self.op!r}"


def _chosen(policy: SchedulingPolicy, device: int) -> Stream:
    """The stream an explicit ``policy`` gives a run on ``device``."""
    if not callable(getattr(policy, "next_stream", None)):
        # (what isinstance(policy, SchedulingPolicy) asks, without the
        # protocol check's cost: microseconds a run)
        raise UsageTypeError(
            f"policy must be a gf.SchedulingPolicy (with next_stream(device)), "
            f"got {type(policy).__name__}"
        )
    stream = policy.next_stream(device)
    if not isinstance(stream, Stream):
        raise UsageTypeError(
            f"{policy!r}.next_stream() returned {type(stream).__name__}, not a Stream"
        )
    return stream


def _choose(
    op: DeviceOperation[object], policy: SchedulingPolicy | None, device: int, can_wait: bool
) -> tuple[Stream | None, SchedulingPolicy]:
    """The stream of a run of ``op`` on ``device``, and the policy its zip
    arms fork with: the stream of the innermost stream lease of the device
    where ``policy`` is None, else what ``policy`` (the default policy
    where None) gives.  None for the stream where the policy is a
    :class:`StreamPoolLeastLoaded` with no stream idle (or awaits already
    waiting for one) and the run ``can_wait``: an await then waits for one
    (:func:`_idle_stream`)."""
    if policy is None:
        for scope in reversed(current_scopes.get()):
            s = scope._pinned
            # a lease of another device does not apply (a device group's child)
            if s is not None and s.device == device:
                return s, _Pinned(s)
        policy = DEFAULT_POLICY
    if isinstance(policy, StreamPoolLeastLoaded):
        prefer = op._plan.prefer
        home = None if prefer is None else prefer.get(device)
        cls = current_class_var.get()
        if cls is not None and (cls.priority or cls.sms is not None):
            # (a level's pool: no await waits for one of its streams)
            return (
                policy.next_stream(device, home, cls.priority, cls.sms),
                AtLevel(policy, cls.priority, cls.sms),
            )
        if not can_wait:
            return policy.next_stream(device, home), policy
        if ensure_runtime().completer.stream_waiters(device):
            return None, policy  # (behind the awaits that came first)
        return policy.idle_stream(device, home), policy
    return _chosen(policy, device), policy


async def _idle_stream(
    op: DeviceOperation[object], policy: StreamPoolLeastLoaded, device: int
) -> Stream:
    """Wait, in turn with the other awaits of ``device`` that found every
    stream busy, for one of its streams to go idle (cancellable: nothing is
    enqueued yet).  The first in turn looks again at least every
    ``stall_s`` seconds, whoever was to say that a stream went idle."""
    d = ensure_runtime().completer
    prefer = op._plan.prefer
    home = None if prefer is None else prefer.get(device)
    ticket = d.join_stream_queue(device)
    used = False
    try:
        while True:
            # (first after joining: a stream that went idle before woke nobody)
            if not d.stream_turn(device, ticket):
                # (not first: the head's leaving wakes it; only the head
                # looks again unasked, else a thousand waiters would poll)
                await wait_event(ticket.event)
                continue
            stream = policy.idle_stream(device, home)
            if stream is not None:
                used = True
                return stream
            # woken, and a run that could not wait took it: first still
            if d.stream_not_found(device, ticket):
                continue
            await wait_event(ticket.event, policy.stall_s)
    finally:
        d.leave_stream_queue(device, ticket, used)


def _start(
    op: DeviceOperation[object],
    stream: Stream | None,
    policy: SchedulingPolicy | None,
    how: str,
) -> tuple[Runtime, Run, ExecutionContext]:
    """Begin a run of ``op`` (``how``: "await", "sync", ...) on ``stream``,
    or where none is given, on the one :func:`_choose` gives (that cannot
    wait); the run's zip arms fork with ``policy`` (the default policy
    where None)."""
    if stream is None:
        stream, policy = _choose(op, policy, current_device(), False)
        assert stream is not None
    elif not isinstance(stream, Stream):
        raise UsageTypeError(f"expected a gpuflow Stream, got {type(stream).__name__}")
    rt, run = _begin(op, stream, how)
    return rt, run, ExecutionContext(rt, stream, policy or DEFAULT_POLICY, run)


def _begin(op: DeviceOperation[object], stream: Stream, how: str) -> tuple[Runtime, Run]:
    """The checks of a run of ``op`` on ``stream`` and the run, with its
    hooks: the scopes the task runs in track it from now on, and the traces
    recording now see it (``how``: "await", "sync", ...)."""
    if capture_log.get() is not None:
        refuse_in_capture(_RunName(op))
    rt = stream._runtime
    rt.check_startable(stream)
    if _finalizers.queue:  # frees of arrays dropped since the last run
        _finalizers.run_finalized()
    run = Run(stream.device, op)
    run._poll_s = current_poll_var.get()
    for scope in current_scopes.get():
        scope._track(run)
    if _trace.active:
        traced = run._traced = _trace.begin(op, how, stream)
        run.add_done_callback(traced.gpu_done)  # before anyone else can finish it
    return rt, run


def enqueue(
    op: DeviceOperation[object], stream: Stream, run: Run, ctx: ExecutionContext | None
) -> Any:
    """Enqueue ``op``'s work for ``run`` on ``stream``: every way of running
    an operation takes this step.  Its plan's step where one was prepared
    for that stream's device context generation (a launch whose arguments
    are final: one call, ordered after the hazards of the memory it uses,
    no context made), else ``op.execute`` in ``ctx``
    (made here, with the default policy, where None).  The output: host
    values not yet resolved.  A trace recording the run is told when the
    work is enqueued."""
    plan = op._plan
    if plan.generation == stream._generation and plan.step is not None:
        if plan.uses is None:
            plan.step(stream.raw)
            out = None
        else:
            out = enqueue_step(plan, stream, run)
    else:
        out = op.execute(ctx or ExecutionContext(stream._runtime, stream, DEFAULT_POLICY, run))
    if run._traced is not None:
        run._traced.enqueued()
    return out


def _ended(run: Run, exc: BaseException | None) -> None:
    """The caller is done with ``run`` (returned, or raised ``exc``): the
    trace hook's last step, once."""
    traced = run._traced
    if traced is not None:
        run._traced = None
        traced.ended(exc)


# -- the blocking runs and enqueue_on ---------------------------------------------------


def run_sync(op: DeviceOperation[object], policy: SchedulingPolicy | None) -> Any:
    refuse_blocking("op.sync()", "in async code, `await op` (or `await op.run(policy)`)")
    return _sync(op, None, policy)


def run_sync_on(op: DeviceOperation[object], stream: Stream) -> Any:
    refuse_blocking(
        "op.sync_on(stream)",
        "in async code, `op.enqueue_on(stream)` and then `await gf.wait_stream(stream)`",
    )
    return _sync(op, stream, None)


def _sync(
    op: DeviceOperation[object], stream: Stream | None, policy: SchedulingPolicy | None
) -> Any:
    _rt, run, ctx = _start(op, stream, policy, "sync")
    stream = ctx.stream
    # a blocking run is never handed to the completer: count it on its
    # stream, so that the default policy sees that stream as busy meanwhile
    stream._begin_blocking()
    try:
        out = _sync_run(op, stream, run, ctx)
    except BaseException as exc:
        _ended(run, exc)
        raise
    finally:
        stream._end_blocking()
        stream._runtime.completer.stream_freed(stream.device)
    _ended(run, None)
    return out


def _sync_run(op: DeviceOperation[object], stream: Stream, run: Run, ctx: ExecutionContext) -> Any:
    completer = stream._runtime.completer
    try:
        out = enqueue(op, stream, run, ctx)
    except BaseException:
        # what was enqueued finishes before what it uses is released
        try:
            stream.synchronize()
        finally:
            completer.complete([run])
        raise
    try:
        stream.synchronize()
    finally:
        completer.complete([run])
    if run.error is not None:  # a communicator aborted under the run
        raise run.error
    return out if out is None else resolve(out)


def start_run(
    op: DeviceOperation[object], stream: Stream | None, device: int, how: str
) -> tuple[Run, Any]:
    """Enqueue a run of ``op`` now, on ``stream``, or where None, where an
    await on ``device`` would put it but without waiting for a stream; the
    run, which no task awaits yet (the completer completes it, unless a task
    awaits it later: :meth:`Run.wait`), and its output, host values not yet
    resolved.  A run started for a task to await later (``how`` is
    ``"start_run"``) that the device fails once its work is enqueued is
    returned failed: its await, or its scope's exit, raises that."""
    policy: SchedulingPolicy | None = None
    if stream is None:
        stream, policy = _choose(op, None, device, False)
        assert stream is not None
    rt, run, ctx = _start(op, stream, policy, how)
    stream = ctx.stream
    try:
        out = enqueue(op, stream, run, ctx)
    except BaseException as exc:
        _ended(run, exc)
        try:
            rt.completer.submit(stream.raw, run, polled=False)
        except Exception:  # the original failure is the one to report
            pass
        raise
    try:
        rt.completer.submit(stream.raw, run, polled=False)  # (no task awaits it)
    except DeviceError as exc:
        # the device faulted under the work just enqueued (before its mark):
        # the run failed with it, and a started run's failure is its await's
        if how != "start_run" or run.error is None:
            _ended(run, exc)
            raise
    _ended(run, None)
    return run, out


def run_enqueue_on(op: DeviceOperation[object], stream: Stream) -> Any:
    _run, out = start_run(op, stream, stream.device, "enqueue_on")
    if is_pending(out):
        if has_map(out):
            raise UsageError(
                "enqueue_on() cannot apply map() to host data the GPU is still copying: "
                "use sync_on() or await"
            )
        return resolve(out)
    return out


def _foreign_home(rt: Runtime, foreign: tuple[int, int | None]) -> Stream | None:
    """The other library's stream an await of an operation itself completes
    on (its plan's ``foreign``: the handle, and the device the library said
    or None for the current one); None where the handle is one of
    gpuflow's own streams, on which the run goes as any other."""
    s, own = stream_at(rt, *foreign, current_device())
    return None if own else s


def _submit_foreign(rt: Runtime, stream: Stream, run: Run) -> None:
    """Hand ``run``, a run on another library's stream, to the completer.
    Where that stream takes no mark, the run (which enqueued nothing) is
    finished with the error."""
    try:
        rt.completer.submit(stream.raw, run, True)
    except BaseException as exc:
        if not run.done:  # refused (a fault fails it instead)
            rt.completer.complete([run], error=exc)
        raise


# -- the await ----------------------------------------------------------------------------


def await_run(
    op: DeviceOperation[object], policy: SchedulingPolicy | None = None
) -> Generator[object, None, Any]:
    """``await op`` (``op.run(policy)``): the one definition of the await.
    Its steps, each once: the stream (the policy's, or an idle pool stream),
    the run's checks and its scopes, the enqueue, the mark, the wait, the
    output.

    What makes an await unusual (:data:`._unusual.UNUSUAL`: a scope, a
    trace, a capture, a cancellation-point watcher, a latency class; or a
    policy given, an operation that is not ordinary) is asked here once;
    where nothing is, each step takes its shortest form: an idle stream of
    the default policy's, a run with nothing to check, a launch prepared
    once.  Frees that finalizers left (``x = await gf.full(...)`` again
    drops the last ``x``) are done first, and the await goes on as usual.
    An await of an operation that waits for another library's stream
    (``await gf.wait_stream(s)``) runs there: nothing is enqueued but its
    mark."""
    if _finalizers.queue:  # frees of arrays dropped since the last run
        _finalizers.run_finalized()
    plan = op._plan
    unusual = UNUSUAL.n or policy is not None or not plan.ordinary
    watcher = _cancel_points.watcher if unusual else None  # (a test's; None otherwise)
    if watcher is not None:
        yield from watcher(_cancel_points.BEFORE_ENQUEUE, op).__await__()
    loop = current_loop()
    # a task whose scope is already cancelled enqueues nothing (as any checkpoint)
    if loop.may_be_cancelled():
        yield from loop.checkpoint_if_cancelled().__await__()
    rt = CURRENT.runtime or ensure_runtime()
    out: Any = None
    home = None if plan.foreign is None else _foreign_home(rt, plan.foreign)
    if home is not None:
        # another library's stream: no stream of ours waits for it, and
        # nothing is enqueued but the run's mark there
        if unusual or not rt.startable(home):
            rt, run = _begin(op, home, "await")  # (which says why it cannot start)
            if run._traced is not None:
                run._traced.enqueued()  # (nothing to enqueue but the mark)
        else:
            run = Run(home.device, op)
        run.hold((op,))  # (what it names is used until the mark is reached)
        try:
            _submit_foreign(rt, home, run)
        except BaseException as exc:
            _ended(run, exc)
            raise
        mark_on = None
    else:
        stream = None
        device = 0
        if not unusual and not rt.completer.waiting:
            current = current_device_var.get()
            device = rt.default_device if current is None else current
            stream = DEFAULT_POLICY.idle_stream(device)
            if stream is not None and not rt.startable(stream):
                stream = None  # (the checks below say why)
        ctx = None
        if stream is not None:
            run = Run(device, op)
        else:
            # the policy's stream (a lease's, a class's, one given), waited
            # for where every stream is busy (see StreamPoolLeastLoaded)
            device = current_device()
            stream, run_policy = _choose(op, policy, device, True)
            if stream is None:
                assert isinstance(run_policy, StreamPoolLeastLoaded)
                stream = yield from _idle_stream(op, run_policy, device).__await__()
            rt, run, ctx = _start(op, stream, run_policy, "await")
        if ctx is None:
            lane = stream._lane  # (a pool stream's, made with it)
            assert lane is not None
        else:  # (any stream's: one whose lane was retired gets a new one, as at its first use)
            lane = rt.completer.lane(stream.raw, stream.device)
        try:
            out = enqueue(op, stream, run, ctx)
        except BaseException as exc:
            _ended(run, exc)
            try:
                lane.submit(run)
            except Exception:  # the original failure is the one to report
                pass
            raise
        ctx = None  # (what the enqueue used: freed now, not when the GPU is done)
        mark_on = lane
        if watcher is not None:
            # (marked before the point: a cancellation there leaves it pending)
            lane.submit(run)
            mark_on = None
    try:
        if watcher is not None:
            yield from watcher(_cancel_points.IN_FLIGHT, op).__await__()
        yield from _wait(run, loop, mark_on)
    except BaseException as exc:
        _ended(run, exc)
        if run._comms is not None and not run.done:
            # a collective left behind may wait for its peers for ever: abort
            for comm in run._comms:
                comm.abort(f"the await of {op!r} {ended_by(exc)} before its collectives did")
        raise
    if run._traced is not None:  # (inline: an await's every call counts)
        _ended(run, None)
    return out if out is None else resolve(out)


class RunAwaitable:
    """``op.run(policy)``: an awaitable that runs ``op`` with ``policy``."""

    __slots__ = ("_op", "_policy")

    def __init__(self, op: DeviceOperation[object], policy: SchedulingPolicy | None) -> None:
        self._op = op
        self._policy = policy

    def __await__(self) -> Generator[object, None, Any]:
        return await_run(self._op, self._policy)

