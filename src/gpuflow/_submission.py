"""A run, as the completion bridge sees it: what it keeps alive until the GPU
is done with it, and the tasks that wait for it.

A :class:`Submission` is made for every run (``_run``).  The operation hands
what its enqueued work still uses to it (``ExecutionContext.keep``); the
run's mark on its stream says where its work ends (``lane``, ``number``); an
await parks its task on it (:meth:`Submission.wait`).  The dispatcher
(``_bridge``) finishes it once the GPU reached the mark, or once the device
faulted: it releases what the run kept, runs its callbacks, and wakes the
parked tasks, those of the loop that saw the run done directly and those of
other loops through one post each (:func:`post`).

A run in flight holds few objects: with a thousand awaits pending, the
objects of the runs are most of what the garbage collector goes through at
each collection.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import anyio.lowlevel

from ._backends._base import Backend
from ._loops import Loop, current_loop

if TYPE_CHECKING:
    from ._bridge import _Lane

try:
    import resource as _resource
except ImportError:  # (Windows)
    _resource = None  # type: ignore[assignment]

#: A loop's non-blocking post (``Loop.post``).
Poster = Callable[[Callable[[], object]], object]
#: A task parked on a run: its loop, and what ``loop.wake`` wakes.
Waiter = tuple[Loop, Any]
#: Wake-ups for other loops, gathered to post once per loop: by ``id`` of
#: the loop's target, that target, its post, and the wake-ups.
Posts = dict[int, tuple[Any, Poster, list[Callable[[], object]]]]


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


#: An await whose run is done before it would park (an inline spin saw it
#: done) yields to the loop when another task or callback is ready to run
#: (asked at most every ``Loop.ready_check_s``), or when the loop's tasks
#: have not been let run at one of gpuflow's awaits for this long: a lone
#: task awaiting short kernels back to back skips the loop turns in
#: between, and others still run.  No turn is owed where the loop's thread
#: slept for most of that time (:func:`_slept`).
YIELD_EVERY_S = 1e-3


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


def post(target: Any, poster: Poster, fns: list[Callable[[], object]]) -> None:
    """Run ``fns`` in ``target``'s loop, without blocking; a finished loop is skipped."""

    def run_all() -> None:
        for fn in fns:
            fn()

    try:
        poster(fns[0] if len(fns) == 1 else run_all)
    except RuntimeError:
        pass  # the loop is closed (trio.RunFinishedError is one too): nobody waits
    except Exception as exc:
        warnings.warn(f"gpuflow: could not wake the event loop {target!r}: {exc!r}", stacklevel=1)


class Communicating(Protocol):
    """A communicator, as the bridge sees it (:class:`gpuflow.Communicator`)."""

    @property
    def busy(self) -> bool:
        """Collectives of it are in flight."""

    def failure(self) -> BaseException | None:
        """Why the runs that used it fail, once it was aborted."""

    def poll(self) -> None:
        """Ask the backend for its asynchronous error; abort on one."""

    def abort(self, reason: str) -> None:
        """Make its collectives in flight return (and fail)."""


#: Makes "done" one step against add_done_callback and a task's parking:
#: a callback or a parked task is either taken by the completion or sees
#: the run done.
_callbacks_lock = threading.Lock()


class Submission:
    """What one run enqueued and must keep alive until the GPU is done with it.

    ``keep`` holds host buffers, staging memory, graphs and leases that
    enqueued work still uses; it is released by the completion (or a fault),
    never earlier, whatever happens to the task that started the run.  Once
    submitted, ``lane`` is its stream's and ``number`` the mark there that
    covers it (its own; where that could not be enqueued, the stream's next
    one, which the lane owes until then).
    ``arms`` maps each other stream the run enqueued work on (a ``zip``
    arm) to an event recorded right after that work.
    """

    __slots__ = (
        "_keep", "arms", "comms", "device", "done", "error", "lane", "more_parked", "number",
        "on_done", "parked", "parked_loop",
    )  # fmt: skip

    def __init__(self, device: int) -> None:
        self.device = device
        #: the communicators whose collectives the run enqueued: a run that
        #: one of them aborted before it was seen done failed
        self.comms: list[Communicating] | None = None
        self._keep: list[object] | None = None  # (made for the first object kept)
        self.done = False
        self.error: BaseException | None = None
        #: the task parked on the run first, what its loop wakes and that
        #: loop (two slots, not a pair: an await in flight makes no object
        #: for it), and any others
        self.parked: Any = None
        self.parked_loop: Loop | None = None
        self.more_parked: list[Waiter] | None = None
        self.on_done: list[Callable[[BaseException | None], None]] | None = None
        self.lane: _Lane | None = None
        self.number = 0
        self.arms: dict[Any, Any] | None = None

    def reached(self) -> bool:
        """Whether the run's work is known to be done (seen done, or its mark
        reached: a read of the completion word).  Any thread."""
        if self.done:
            return True
        lane = self.lane
        return lane is not None and lane.read() >= self.number

    def order(self, backend: Backend, stream: Any, on: Any) -> bool:
        """As a hazard point: make later work on
        raw ``stream`` wait for this run's work on raw ``on``: nothing once it
        is known done, its mark on its own stream, the join event of a
        ``zip`` arm on another; False where it cannot say (not submitted yet:
        still being enqueued; then the caller waits for everything enqueued
        on ``on`` so far)."""
        if self.done:
            return True
        lane = self.lane
        if lane is None:
            # still being enqueued: where its work on ``on`` ends is not known
            # yet (an arm's join event so far may precede later work there)
            return False
        if lane.raw is on:
            if lane.read() < self.number:
                if lane.unmarked and self.number > lane.issued:
                    lane.dispatcher.mark_owed(lane)  # (else nothing may write it soon)
                backend.wait_mark(stream, on, self.number)
            return True
        arms = self.arms
        if arms is not None:
            event = arms.get(on)
            if event is not None:
                backend.wait_event(stream, event)
                return True
        return False

    def add_done_callback(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(error)`` once, on the thread that sees the work done (the
        awaiting loop's, or the dispatcher's; at once, here, if it already
        is).  Safe from any thread, also while the work completes.  ``fn``
        must not block or raise."""
        with _callbacks_lock:
            if not self.done:
                if self.on_done is None:
                    self.on_done = []
                self.on_done.append(fn)
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
        """Keep ``objs`` until the work is done (from the thread enqueueing it)."""
        keep = self._keep
        if keep is None:
            self._keep = list(objs)
        else:
            keep.extend(objs)

    def _finish(self, error: BaseException | None) -> bool:
        if error is None and self.comms is not None:
            for comm in self.comms:
                error = comm.failure()
                if error is not None:
                    break
        self.error = error
        self._keep = None
        with _callbacks_lock:  # a callback added meanwhile runs once, here or there
            self.done = True
            callbacks, self.on_done = self.on_done, None
        for fn in callbacks or ():
            try:
                fn(error)
            except BaseException as exc:  # never into the dispatcher thread
                warnings.warn(f"gpuflow: a completion callback raised {exc!r}", stacklevel=1)
        # (no task parks once done is set: who parked is fixed now)
        return self.parked is not None

    def _wake(self, here: Any, posts: Posts) -> None:
        """Wake the tasks parked on the finished run: those of loop ``here``
        (the loop running this) at once, and add the others to ``posts``."""
        park, loop, more = self.parked, self.parked_loop, self.more_parked
        self.parked = self.parked_loop = self.more_parked = None
        while loop is not None:
            target = loop.target
            if target is here:
                loop.wake(park)
            else:
                fn = functools.partial(loop.wake, park)
                entry = posts.get(id(target))
                if entry is None:
                    posts[id(target)] = (target, loop.post, [fn])
                else:
                    entry[2].append(fn)
            loop, park = more.pop() if more else (None, None)

    async def wait(self, loop: Loop | None = None) -> None:
        """Wait (cancellably) until the work is done; raise its device error.

        Parks the task with the running loop's own primitives (``loop``, or
        the current one), so on cancellation the loop's own exception
        propagates at once; the submission still retains its resources until
        the GPU is done.  While it waits, the loop's poller watches the run's
        stream.
        """
        lane = self.lane
        if loop is None:
            loop = current_loop()
        budget: float | None = None  # the busy poll left to the loop's poller: all of it
        loop.awaiting += 1
        try:
            if loop.awaiting == 1 and not self.done and lane is not None:
                # (before a waiter is registered: finished here, nobody is woken)
                d = lane.dispatcher
                if d.spin(loop, lane, self.number) and not self.done:
                    budget = await d.poll_alone(loop, self)
            if self.done:
                now = time.perf_counter()
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
                    await anyio.lowlevel.checkpoint()
            else:
                park = loop.park()
                with _callbacks_lock:
                    # the run may have been finished since the check; then
                    # nobody wakes us, and we must not wait
                    parked = not self.done
                    if parked:
                        if self.parked is None:
                            self.parked, self.parked_loop = park, loop
                        elif self.more_parked is None:
                            self.more_parked = [(loop, park)]
                        else:
                            self.more_parked.append((loop, park))
                if not parked:
                    await anyio.lowlevel.checkpoint()
                else:
                    if lane is not None:
                        lane.dispatcher.watch(loop, lane, budget)
                    loop.yielded = time.perf_counter()
                    await park
        finally:
            loop.awaiting -= 1
        if self.error is not None:
            raise self.error
