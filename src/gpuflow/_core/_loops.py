"""Everything that depends on which event loop runs: one adapter per loop.

gpuflow speaks to a running loop in five ways only: schedule a call at the
end of the loop's current turn, from the loop's own thread (``call_soon``);
post a call from any thread without blocking (``post``); park the current
task until the loop wakes it (``park``, ``wake``); run a function once per loop
turn for as long as it asks to (``start_poller``: how a busy loop reads the
GPU's completion words); and have the loop itself call back whenever a file
descriptor is readable (``watch``: how the GPU wakes a sleeping loop with no
thread in between).  :func:`current_loop` picks the adapter once per run,
and nothing else in gpuflow asks which loop it is on.

It is also the one place that says where a task of gpuflow's may suspend
(as Trio's ``_traps``): an adapter's ``park``, ``checkpoint`` and
``checkpoint_if_cancelled``, and :func:`wait_event`.  The run path yields
what these give and nothing else; cancellation at each is the loop's own.

* asyncio (and loops built on it, such as uvloop): ``loop.call_soon``,
  ``loop.call_soon_threadsafe``, a future (the park itself), a callback that schedules itself
  again with ``call_soon``, and ``loop.add_reader``.
* Trio: ``TrioToken.run_sync_soon`` for both kinds of call (it is safe from
  any thread and never blocks), ``wait_task_rescheduled`` / ``reschedule``
  to park and wake the task directly (the park yields the request that
  ``wait_task_rescheduled`` yields to Trio's scheduler itself, where Trio
  keeps it as its current releases do), a system task that checkpoints once
  per batch, and a system task in ``wait_readable`` (Trio has no reader
  callbacks).

A post to a loop that has finished raises :class:`RuntimeError` (Trio's
``RunFinishedError`` is one): the caller drops it, since nobody waits there.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import sys
import threading
import warnings
import weakref
from collections.abc import Awaitable, Callable, Generator, Sized
from types import ModuleType
from typing import Any, Protocol

import anyio
import anyio.lowlevel

from .._errors import UsageError

#: A call a loop runs for gpuflow: a wake-up, a flush.
Call = Callable[[], object]
#: A loop's non-blocking post (``Loop.post``).
Poster = Callable[[Call], object]
#: Wake-ups for other loops, gathered to post once per loop: by ``id`` of
#: the loop's target, that target, its post, and the wake-ups.
Posts = dict[int, tuple[Any, Poster, list[Call]]]

#: How often a task awaiting short kernels back to back asks Trio whether
#: other tasks are ready (they wait at most this long, as they do for a
#: spin): a yield to Trio's scheduler costs more than a short await spends
#: in gpuflow.
READY_CHECK_S = 50e-6
#: How often such a task yields on a loop that cannot tell whether others are
#: ready (uvloop): a yield there costs about a fifth of a short await
#: (docs/performance.md, "Measurements behind the code"), so it yields at most
#: this often rather than at every await; others wait that long at most.
#: (asyncio's own loop lets an await of a finished future run on without
#: yielding.)
BLIND_YIELD_S = 200e-6


class Loop(Protocol):
    """The running event loop, as gpuflow uses it."""

    #: When a task of this loop last let the others run at one of gpuflow's
    #: awaits (``time.perf_counter``): see ``_run.YIELD_EVERY_S``.
    yielded: float
    #: An await of the loop parked since ``yielded`` was taken: the loop
    #: turns before that await resumes, so its tasks have run later than
    #: ``yielded`` says, and the await that finds this set takes the time anew.
    parked: bool
    #: The loop thread's CPU time and count of voluntary context switches
    #: when an await last asked whether it slept: see ``_run._slept``.
    slept_cpu: float
    slept_waits: int
    #: When such an await last asked :meth:`others_ready`.
    asked: float
    #: How many of its tasks are inside a gpuflow await now (parked, or
    #: woken and not yet resumed): only a lone await spins.
    awaiting: int
    #: The completion side's poller of this loop (``_completion``), once it has one.
    poller: Any

    #: How long a task may run gpuflow's awaits back to back before it asks
    #: :meth:`others_ready` again (0 under asyncio, where asking and yielding
    #: cost little; Trio: :data:`READY_CHECK_S`; a loop that cannot tell:
    #: :data:`BLIND_YIELD_S`; see ``_run.YIELD_EVERY_S``).
    ready_check_s: float

    #: AnyIO's ``checkpoint_if_cancelled`` for this loop (Trio's own under
    #: Trio, which is what AnyIO calls there, without finding the loop first).
    checkpoint_if_cancelled: Callable[[], Awaitable[None]]
    #: False where the current task is surely not in a cancelled scope:
    #: then ``checkpoint_if_cancelled`` would return at once, and need not
    #: be awaited.  True where it may be (or the loop cannot tell).
    may_be_cancelled: Callable[[], bool]
    #: One turn of the loop (the loop's own checkpoint: a cancelled task
    #: gets the loop's cancellation there).
    checkpoint: Callable[[], Awaitable[None]]
    #: The task running now (the loop's own task object: an asyncio Task,
    #: a Trio task): what ``gf.in_flight()`` names a run's waiter by.
    current_task: Callable[[], object]

    def others_ready(self) -> bool:
        """Whether another task or callback of the loop is ready to run now
        (True where the loop cannot tell)."""

    def fast_paths(self) -> dict[str, bool]:
        """Each fast path the adapter reaches into the loop's or AnyIO's
        private state for, by name, and whether it was found where it
        looked: False means the slower public way is taken (the test suite
        fails on one, rather than every await getting slower unnoticed).
        From a task of the loop."""

    #: The loop (or Trio token): the identity completions are grouped by.
    target: Any

    def call_soon(self, fn: Call) -> object:
        """Run ``fn`` at the end of this turn of the loop (from its own thread only)."""

    def post(self, fn: Call) -> object:
        """Run ``fn`` in the loop soon; callable from any thread, never blocks."""

    def park(self) -> Any:
        """A park of the current task: ``await park`` suspends it until
        :meth:`wake` of the park runs in the loop, or until the task is
        cancelled, which raises the loop's own cancellation.  Awaited at
        most once; may be dropped unawaited.  In the loop's thread, a park
        also answers ``done()`` (woken, or its task cancelled) and
        ``set_result(None)`` (:meth:`wake`), as an asyncio future does.
        (One object: a run in flight holds it for its task.)"""

    def wake(self, park: Any) -> None:
        """Resume the task parked on ``park``.  In the loop's own thread only
        (from another: :meth:`post` it); idempotent, and harmless after the
        task was cancelled or when the park was never awaited."""

    def start_poller(self, poll: Callable[[], bool]) -> Call:
        """Run ``poll()`` in the loop once per turn while it returns True.
        Returns ``kick``, which starts it again after it returned False
        (harmless while it runs).  From the loop's own thread only;
        ``poll`` must not raise."""

    def watch(self, fd: int, on_ready: Call) -> None:
        """Call ``on_ready()`` in the loop each time ``fd`` is readable, until
        the loop ends.  ``on_ready`` must not raise.  NotImplementedError
        where the loop cannot watch file descriptors."""

    def finished(self) -> bool:
        """Whether the loop has ended: it will call nothing any more.  Safe
        from any thread."""

    def running_in(self, ident: int) -> bool:
        """Whether this is the loop running in the thread ``ident`` (the
        calling thread) now: asked at every await, it costs no system call
        where the loop can tell."""


def post(target: object, poster: Poster, fns: list[Call]) -> None:
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


def _true() -> bool:
    return True


def _current_task_is_python() -> bool:
    """Whether ``asyncio.current_task`` is Python code (before Python 3.12),
    which a look into asyncio's own dictionary beats."""
    return not isinstance(asyncio.current_task, type(len))


def _asyncio_current_tasks() -> dict[Any, Any] | None:
    """asyncio's own dictionary of each loop's current task, where
    ``asyncio.current_task`` is Python code that reads it (a C
    ``current_task`` is as fast as the dictionary): else None."""
    current_tasks = getattr(asyncio.tasks, "_current_tasks", None)
    if isinstance(current_tasks, dict) and _current_task_is_python():
        return current_tasks
    return None


def _anyio_asyncio_scopes(loop: asyncio.AbstractEventLoop) -> Callable[[], bool]:
    """``may_be_cancelled`` under asyncio: AnyIO's own record of the current
    task's cancel scopes, read as its ``checkpoint_if_cancelled`` reads it
    (the innermost scope out to the first shielded one), without a
    coroutine.  Where AnyIO keeps it otherwise, always True: the checkpoint
    is then awaited at every run, as before.  Every await asks, so the
    current task and its record are looked up as asyncio and AnyIO keep
    them (the dictionaries behind ``asyncio.current_task`` and AnyIO's
    weak one), where they can be."""
    try:
        from anyio._backends import _asyncio as anyio_asyncio

        states = anyio_asyncio._task_states
        probe = anyio_asyncio.CancelScope()
        probe._cancel_called, probe._shield, probe._parent_scope  # noqa: B018
        by_ref = states.data.get  # type: ignore[attr-defined]  # (a WeakKeyDictionary's own)
    except Exception:
        return _true
    current_tasks = _asyncio_current_tasks()
    if current_tasks is not None:
        current_task: Callable[[], object] = functools.partial(current_tasks.get, loop)
    else:
        current_task = functools.partial(asyncio.current_task, loop)
    ref = weakref.ref

    def may_be_cancelled() -> bool:
        task = current_task()
        if task is None:
            return False
        try:
            state = by_ref(ref(task))
            if state is None:  # a task AnyIO did not start: no scope of it
                return False
            scope = state.cancel_scope
            while scope is not None:
                if scope._cancel_called:
                    return True
                if scope._shield:
                    return False
                scope = scope._parent_scope
        except Exception:  # (a layout seen only now)
            return True
        return False

    return may_be_cancelled


def _trio_task_cancelled(trio: ModuleType) -> Callable[[], bool]:
    """``may_be_cancelled`` under Trio: what ``checkpoint_if_cancelled``
    looks at first (the task's effective cancellation, a Ctrl-C pending for
    the main task), read without its coroutine.  Where Trio keeps it
    otherwise, always True: the checkpoint is then awaited at every run."""
    current_task = trio.lowlevel.current_task
    try:
        task = current_task()
        task._cancel_status.effectively_cancelled  # noqa: B018
        task._runner.ki_pending  # noqa: B018
        task._runner.main_task  # noqa: B018
    except Exception:
        return _true

    def may_be_cancelled() -> bool:
        task = current_task()
        try:
            runner = task._runner
            return bool(
                task._cancel_status.effectively_cancelled
                or (task is runner.main_task and runner.ki_pending)
            )
        except Exception:  # (a layout seen only now)
            return True

    return may_be_cancelled


def _backend_checkpoint_if_cancelled() -> Callable[[], Awaitable[None]]:
    """AnyIO's ``checkpoint_if_cancelled`` of the running loop's backend,
    found once: the public one finds the backend at every call (about a
    microsecond of a short await)."""
    try:
        from anyio._core._eventloop import get_async_backend

        fn: Callable[[], Awaitable[None]] = get_async_backend().checkpoint_if_cancelled
    except Exception:  # an AnyIO laid out otherwise: its public call
        return anyio.lowlevel.checkpoint_if_cancelled
    return fn


async def _sleep0() -> None:
    await asyncio.sleep(0)


async def wait_event(event: anyio.Event, timeout: float | None = None) -> None:
    """Suspend until ``event`` is set, or for ``timeout`` seconds at most
    where given (then return as if it were).  Cancellation is the loop's
    own, at once; the event stays as it was."""
    if timeout is None:
        await event.wait()
        return
    with anyio.move_on_after(timeout):
        await event.wait()


def _wake_future(fut: asyncio.Future[None]) -> None:
    if not fut.done():  # cancelled, or woken twice
        fut.set_result(None)


class _Asyncio:
    __slots__ = (
        "_loop", "_new_future", "_ready", "_tells_thread", "asked", "awaiting", "call_soon",
        "checkpoint", "checkpoint_if_cancelled", "current_task", "may_be_cancelled", "parked",
        "poller", "post", "ready_check_s", "slept_cpu", "slept_waits", "target", "yielded",
    )  # fmt: skip

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = self.target = loop
        self._tells_thread = isinstance(loop, asyncio.BaseEventLoop)
        self.poller: Any = None
        self.yielded = self.asked = self.slept_cpu = 0.0
        self.parked = False
        self.slept_waits = 0
        self.awaiting = 0
        # the callbacks the loop runs in its next turn: asyncio's own loop
        # keeps them in a deque (uvloop keeps them where Python cannot see)
        self._ready: Any = getattr(loop, "_ready", None)
        self.ready_check_s = 0.0 if self._ready is not None else BLIND_YIELD_S
        self.checkpoint_if_cancelled = _backend_checkpoint_if_cancelled()
        self.may_be_cancelled = _anyio_asyncio_scopes(loop)
        self.checkpoint: Callable[[], Awaitable[None]] = _sleep0
        current_tasks = _asyncio_current_tasks()
        self.current_task: Callable[[], object] = (
            functools.partial(asyncio.current_task, loop)
            if current_tasks is None
            else functools.partial(current_tasks.get, loop)
        )
        self.call_soon: Callable[[Call], object] = loop.call_soon
        self.post: Callable[[Call], object] = loop.call_soon_threadsafe
        # asyncio's own create_future is a Python call that makes a Future:
        # make it here (a loop with a create_future of its own keeps it)
        create = loop.create_future
        if type(loop).create_future is asyncio.BaseEventLoop.create_future:
            create = functools.partial(asyncio.Future, loop=loop)
        self._new_future: Callable[[], asyncio.Future[None]] = create

    def park(self) -> asyncio.Future[None]:
        return self._new_future()

    def fast_paths(self) -> dict[str, bool]:
        """Each fast path this adapter reaches into AnyIO or asyncio for, and
        whether it was found (False: the slower public way is taken)."""
        paths = {
            "AnyIO's record of a task's cancel scopes": self.may_be_cancelled is not _true,
            "AnyIO's backend checkpoint_if_cancelled": (
                self.checkpoint_if_cancelled is not anyio.lowlevel.checkpoint_if_cancelled
            ),
            "asyncio's Runner counts Ctrl-C": _asyncio_runner_counts_interrupts(),
        }
        if self._tells_thread:  # (asyncio's own loops; uvloop keeps these in C)
            paths["asyncio's loop keeps its thread"] = hasattr(self._loop, "_thread_id")
            paths["asyncio's loop keeps its ready callbacks"] = self._ready is not None
            if _current_task_is_python():
                # (from Python 3.12 it is C code, as fast as the dictionary:
                # the public call is the fast way there, and no path is needed)
                paths["asyncio's dictionary of current tasks"] = (
                    _asyncio_current_tasks() is not None
                )
        return paths

    wake = staticmethod(_wake_future)

    def others_ready(self) -> bool:
        ready = self._ready
        return ready is None or bool(ready)

    def start_poller(self, poll: Callable[[], bool]) -> Call:
        call_soon = self._loop.call_soon
        running = False

        def turn() -> None:
            nonlocal running
            if poll():
                call_soon(turn)  # runs in the next turn: the selector polls in between
            else:
                running = False

        def kick() -> None:
            nonlocal running
            if not running:
                running = True
                call_soon(turn)

        return kick

    def watch(self, fd: int, on_ready: Call) -> None:
        self._loop.add_reader(fd, on_ready)  # NotImplementedError on a proactor loop

    def finished(self) -> bool:
        return self._loop.is_closed()

    def running_in(self, ident: int) -> bool:
        if self._tells_thread:  # (asyncio's own loops keep the thread running them)
            return self._loop._thread_id == ident  # type: ignore[attr-defined,no-any-return]
        return asyncio._get_running_loop() is self._loop


#: A Trio park's states: made (its task has not yielded yet), waiting in
#: Trio's trap, woken (or its task cancelled)
_MADE, _WAITING, _WOKEN = "made", "waiting", "woken"


class _TrioPark:
    """A Trio task parked until :meth:`wake` (or its cancellation).

    A park is made before its task yields to Trio, and whatever completes
    the run may wake it in between, in the same step of the same task (a
    completion read inline, a fault while enqueueing the run's mark).  Trio
    must be asked to reschedule a task only while it waits in the park's
    trap: a task rescheduled while it runs is queued to run again after it
    may have ended, and Trio's run then fails with an internal error.  So a
    wake-up before the await only marks the park woken, and the await then
    returns at once, as an asyncio future's does once it has a result."""

    __slots__ = ("lowlevel", "state", "task", "trap")

    def __init__(self, lowlevel: ModuleType, trap: Callable[[Any], object] | None) -> None:
        self.lowlevel = lowlevel
        self.task = lowlevel.current_task()
        self.state = _MADE
        self.trap = trap

    def wake(self) -> None:  # in Trio's thread, through run_sync_soon
        state = self.state
        if state is not _WOKEN:
            self.state = _WOKEN
            if state is _WAITING:
                self.lowlevel.reschedule(self.task)

    # (what a woken park and an asyncio future have in common: whoever
    # completes a run in the loop's thread wakes either the same way)
    def done(self) -> bool:
        return self.state is _WOKEN

    def set_result(self, _value: None) -> None:
        self.wake()

    def _abort(self, _raise_cancel: Any) -> Any:
        self.state = _WOKEN  # cancelled: a later wake-up must not reschedule
        return self.lowlevel.Abort.SUCCEEDED

    def __await__(self) -> Generator[Any, Any, None]:
        if self.state is _WOKEN:  # woken before its task yielded
            return
        self.state = _WAITING
        trap = self.trap
        if trap is None:
            yield from self.lowlevel.wait_task_rescheduled(self._abort).__await__()
            return
        # what wait_task_rescheduled does, without its coroutine, that
        # coroutine's wrapper and the generator it yields through: objects
        # every parked await would hold, and with 1,000 tasks parked the
        # garbage collector's share of the loop is what bounds its rate (the
        # wake-up's outcome unwrapped: a cancellation raises here)
        (yield trap(self._abort)).unwrap()


def _trio_park_trap() -> Callable[[Any], object] | None:
    """The request to Trio's scheduler that ``wait_task_rescheduled`` yields
    (given the abort function), or None where Trio keeps it otherwise: parks
    then go through the public call."""
    try:
        from trio._core import _traps

        trap: Callable[[Any], object] = _traps.WaitTaskRescheduled
        trap(lambda _raise_cancel: None)  # (made as Trio makes it: of one abort function)
    except Exception:
        return None
    return trap


def _trio_run_queue() -> Sized | None:
    """The current Trio run's queue of runnable tasks (what
    ``current_statistics().tasks_runnable`` counts; one object for the whole
    run), or None where Trio keeps it otherwise."""
    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT

        runq = GLOBAL_RUN_CONTEXT.runner.runq
        len(runq)
    except Exception:
        return None
    return runq


class _Trio:
    __slots__ = (
        "_ended", "_runq", "_statistics", "_token", "_trap", "_trio", "asked", "awaiting",
        "call_soon", "checkpoint", "checkpoint_if_cancelled", "current_task",
        "may_be_cancelled", "parked", "poller", "post", "ready_check_s", "slept_cpu",
        "slept_waits", "target", "yielded",
    )  # fmt: skip

    def __init__(self, trio: ModuleType) -> None:
        self._trio = trio
        self.poller: Any = None
        self._ended = False
        self.yielded = self.asked = self.slept_cpu = 0.0
        self.parked = False
        self.slept_waits = 0
        self.awaiting = 0
        self._statistics = trio.lowlevel.current_statistics
        # current_statistics, the only public count of runnable tasks, gathers
        # every statistic of the run: read Trio's run queue itself where Trio
        # keeps it, which costs nothing.  Asked no more often for that: asking
        # at every await made no difference that showed (docs/performance.md,
        # "Measurements behind the code"), so the interval that was measured
        # longest stays
        self._runq = _trio_run_queue()
        self._trap = _trio_park_trap()
        self.ready_check_s = READY_CHECK_S
        self.checkpoint_if_cancelled: Callable[[], Awaitable[None]] = (
            trio.lowlevel.checkpoint_if_cancelled
        )
        self.checkpoint: Callable[[], Awaitable[None]] = trio.lowlevel.checkpoint
        self.current_task: Callable[[], object] = trio.lowlevel.current_task
        self.may_be_cancelled: Callable[[], bool] = _trio_task_cancelled(trio)
        self._token = trio.lowlevel.current_trio_token
        self.target = token = trio.lowlevel.current_trio_token()
        # run_sync_soon is both: safe from any thread, and from the loop's
        # own thread it runs at the end of the current batch of tasks
        self.call_soon: Callable[[Call], object] = token.run_sync_soon
        self.post: Callable[[Call], object] = token.run_sync_soon

    def park(self) -> _TrioPark:
        return _TrioPark(self._trio.lowlevel, self._trap)

    def fast_paths(self) -> dict[str, bool]:
        """Each fast path this adapter reaches into Trio for, and whether it
        was found (False: the slower public way is taken).  Asked from a
        task of the run."""
        nursery = self._trio.lowlevel.current_task().parent_nursery
        return {
            "Trio's task cancel status": self.may_be_cancelled is not _true,
            "Trio's run queue": self._runq is not None,
            "Trio's park trap": self._trap is not None,
            "Trio's nursery pending errors": nursery is None
            or isinstance(getattr(nursery, "_pending_excs", None), list),
        }

    wake = staticmethod(_TrioPark.wake)

    def start_poller(self, poll: Callable[[], bool]) -> Call:
        lowlevel = self._trio.lowlevel
        state = {"running": True, "parked": None}

        async def poller() -> None:
            # a system task: cancelled only when the run ends, after every
            # task of the program
            task = lowlevel.current_task()
            while True:
                if not state["running"]:
                    state["parked"] = task
                    await lowlevel.wait_task_rescheduled(lambda _: lowlevel.Abort.SUCCEEDED)
                state["running"] = poll()
                # one poll a batch of Trio's scheduler, which checks for I/O in between
                await lowlevel.checkpoint()

        def kick() -> None:
            if not state["running"]:
                state["running"] = True
                task, state["parked"] = state["parked"], None
                if task is not None:
                    lowlevel.reschedule(task)

        lowlevel.spawn_system_task(poller, name="gpuflow poller")
        return kick

    def others_ready(self) -> bool:
        runq = self._runq
        if runq is not None:
            return bool(runq)
        return bool(self._statistics().tasks_runnable)

    def watch(self, fd: int, on_ready: Call) -> None:
        lowlevel = self._trio.lowlevel

        async def watcher() -> None:
            # a system task: cancelled only when the run ends, after every
            # task of the program (a nursery could end sooner)
            try:
                while True:
                    await lowlevel.wait_readable(fd)
                    on_ready()
            finally:
                self._ended = True

        lowlevel.spawn_system_task(watcher, name="gpuflow completions")

    def finished(self) -> bool:
        return self._ended

    def running_in(self, ident: int) -> bool:
        try:
            return self._token() is self.target
        except RuntimeError:  # (no Trio run in this thread now)
            return False


#: The adapter of the loop found last in each thread (by thread identity):
#: a loop runs many runs, and asking asyncio for the running loop costs a
#: system call (``getpid``, against a fork), where asking the adapter found
#: last whether its loop is still this thread's running one costs none
_found: dict[int, Loop] = {}
_get_ident = threading.get_ident


def _in_trio() -> ModuleType | None:
    """The trio module when this thread runs inside ``trio.run``, else None."""
    trio = sys.modules.get("trio")  # a program that never imported Trio is not in it
    if trio is not None and trio.lowlevel.in_trio_run():
        return trio
    return None


def running_loop_name() -> str | None:
    """``"asyncio"`` or ``"trio"`` when this thread runs an event loop, else None."""
    if _in_trio() is not None:
        return "trio"
    # (the running loop, without raising where there is none: every blocking
    # run asks this)
    return None if asyncio._get_running_loop() is None else "asyncio"


def _asyncio_runner_counts_interrupts() -> bool:
    return isinstance(getattr(asyncio.Runner(), "_interrupt_count", None), int)


def _asyncio_interrupted() -> bool:
    """Whether the asyncio runner of this thread (``asyncio.run``, AnyIO's
    ``anyio.run``) saw a Ctrl-C: it then cancels its main task, and raises
    :class:`KeyboardInterrupt` once that task has ended.  Its handler of
    ``SIGINT`` is its own method, which counts the interrupts (Python
    3.11+); where asyncio keeps them otherwise, False."""
    handler = signal.getsignal(signal.SIGINT)
    runner = getattr(getattr(handler, "func", None), "__self__", None)
    if not isinstance(runner, asyncio.Runner):
        return False
    count = getattr(runner, "_interrupt_count", 0)
    return isinstance(count, int) and count > 0


def _trio_interrupted() -> bool:
    """Whether a Trio nursery that the current task runs in (directly or
    further out) holds a :class:`KeyboardInterrupt` raised into its parent
    task: Trio raises Ctrl-C in the main task, which is most often waiting
    for a nursery's children, and the children are left by the
    cancellation that follows.  Read in Trio's record of a nursery's
    pending errors; where Trio keeps them otherwise, False."""
    trio = _in_trio()
    if trio is None:
        return False
    try:
        nursery = trio.lowlevel.current_task().parent_nursery
        while nursery is not None:
            for pending in getattr(nursery, "_pending_excs", ()):
                if isinstance(pending, KeyboardInterrupt):
                    return True
            nursery = nursery.parent_task.parent_nursery
    except Exception:  # (a layout seen only now)
        return False
    return False


def interrupted(exc: BaseException | None) -> bool:
    """Whether a scope is left because the user pressed Ctrl-C: ``exc`` is
    (or a group that holds) :class:`KeyboardInterrupt`, as Trio raises it
    into the main task, or it is a cancellation of asyncio's runner's
    answer to ``SIGINT``.  A scope then does not wait for the GPU: the
    interrupt reaches the program at once, and what the GPU still uses
    stays alive until it is done, as for a cancelled await."""
    if exc is None:
        return False
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, BaseExceptionGroup) and exc.split(KeyboardInterrupt)[0] is not None:
        return True
    if isinstance(exc, asyncio.CancelledError):
        return _asyncio_interrupted()
    return _trio_interrupted()  # (Trio's Cancelled, after a Ctrl-C in a parent task)


def refuse_blocking(what: str, instead: str) -> None:
    """Raise :class:`UsageError` where the calling thread runs an event loop:
    ``what`` (a blocking call) would stop every task of the loop for as long
    as it waits.  ``instead`` names what does the same without blocking."""
    lib = running_loop_name()
    if lib is not None:
        raise UsageError(
            f"{what} would block the running {lib} event loop (every task of it would "
            f"wait): {instead}"
        )


def current_loop() -> Loop:
    """The adapter of the loop running in this thread (UsageError if none)."""
    ident = _get_ident()
    loop = _found.get(ident)
    if loop is not None and loop.running_in(ident):
        return loop
    trio = _in_trio()
    if trio is not None:
        target: Any = trio.lowlevel.current_trio_token()
    else:
        try:
            target = asyncio.get_running_loop()
        except RuntimeError:
            raise UsageError(
                "awaiting a gpuflow operation needs a running asyncio or Trio event loop"
            ) from None
    if loop is None or loop.target is not target:  # (its adapter is made once)
        loop = _found[ident] = _Trio(trio) if trio is not None else _Asyncio(target)
    return loop


def task_name(task: object) -> str:
    """A task's name as its loop keeps it (asyncio's ``get_name()``, Trio's
    ``name``)."""
    get_name = getattr(task, "get_name", None)
    return str(get_name() if callable(get_name) else getattr(task, "name", task))
