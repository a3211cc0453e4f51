"""The completion bridge: from "the GPU reached the end of a run" to the awaiting task.

Every run ends with a *mark* on its stream (:meth:`Backend.mark`): when the
GPU gets there, it writes the mark's number into the stream's *completion
word*, which lives in host memory.  "Is run *n* done" is a read of that word:
no driver call, no thread, no host function on the way.

* **A mark right after each run.**  Every run is marked as it is
  submitted, awaited or not (a run no task awaits with a *silent* mark,
  which the backend may make cheaper for the GPU and read by asking the
  driver: :meth:`Backend.mark`), so that work on another stream that depends
  on it waits for that run and not for what its stream was given later (a
  mark shared with the runs enqueued after it would come after their
  work, and a short consumer would wait for a long kernel it does not
  use).  A mark that could not be enqueued is owed: the stream's next mark
  covers the run, and whoever first needs it enqueues it (an await of
  the run, a hazard of another stream, ``Stream.synchronize``, a capture,
  a stream being destroyed, or the completer thread at its tick).

* **Poll while busy.**  While a loop has runs pending, its poller reads the
  words of the streams those runs are on once per loop turn, and completes
  every run a word covers, in order: it releases what the runs kept and
  wakes their tasks directly.  One read per stream per turn, however many
  runs are pending.  An await alone in its loop reads its own word instead:
  inline for a few microseconds, then once per turn of the loop, so that
  the turn that sees its run done resumes it (``_run``).
* **Sleep when idle.**  When no run completes within the busy-poll budget
  (``busy_poll_s``; see :func:`gpuflow.init_device_contexts`), the poller
  stops and arms a wake-up for the oldest pending run of each stream: a
  pipe whose write end the GPU closes right after that run (a host function
  that is libc's ``close``, no GIL), in an epoll set the loop watches; its
  selector returns and the poller runs again.  A host function enqueued
  now would run after everything already queued behind that run, so where
  the run is not the last on its stream the completer thread watches the
  word instead, every :data:`FAST_WATCH_S`, and posts to the loop.  An
  idle loop burns no CPU.
* **The completer thread** reads every word with runs pending at each tick
  (:data:`WATCHDOG_S` while anything is pending): it completes the runs no
  loop awaits (``enqueue_on``, releases) and those of loops that stopped or
  ended, posting their wake-ups (``call_soon_threadsafe`` /
  ``TrioToken.run_sync_soon``; a finished loop is skipped).  A faulted
  device writes no word and runs no host function: at the same ticks the
  thread queries the streams with runs pending and fails every run of a
  faulted device with :class:`DeviceFaultError`; it closes the pipes of
  loops that ended, and asks communicators with collectives in flight for
  NCCL's asynchronous error (a collective whose peer died never ends by
  itself), aborting one that has one.

A reached mark means every item before it ran without a fault (a faulted
stream stops before its mark), so a completion needs no query of the driver.
"""

from __future__ import annotations

import collections
import os
import select
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from .._backends import Backend, RawStream
from .._errors import DeviceError, DeviceFaultError
from ._handoff import Handoff, Ticket
from ._loops import Loop, Posts, post
from ._statistics import CompletionStatistics

#: How often the completer thread reads the words and watches for faults
#: while anything is pending.
WATCHDOG_S = 0.02
#: How often it reads the words of runs a loop left to it (runs that have
#: work queued behind them on their stream, which a host function cannot
#: mark any more).
FAST_WATCH_S = 0.001
#: How long the task of a lone await (nothing else of its loop pending)
#: reads its word before it parks: a short kernel is then seen done without
#: a loop turn.  The loop runs nothing else meanwhile, so this stays short.
INLINE_SPIN_S = 20e-6
#: A loop turn longer than this ran other work besides the poller: it does
#: not count against the busy-poll budget, which bounds the turns a loop
#: would otherwise have slept through (measured on an idle loop: a turn of
#: the poller alone takes a few microseconds under asyncio, tens under Trio).
#: Not where the loop's thread runs under a tracer or a profiler
#: (:func:`_turns_slowed`): every turn is long there, other work or none.
BUSY_TURN_S = 100e-6
#: A loop that reads a stream's word at every turn keeps the stream's runs
#: from the completer thread until this long after its last turn, even past
#: its budget's deadline: a busy loop's turns are long, and the runs it would
#: see done at its next turn would otherwise reach its tasks as posts from
#: the thread (a wake-up of the loop each).  A loop that stopped turning has
#: its runs completed by the thread that much later.
LOOP_STALL_S = WATCHDOG_S
#: After the last pending run, keep ticking this long so that a busy program
#: does not pay a wake-up of the thread per run.
_IDLE_GRACE_S = 1.0
#: Pipes in flight at most (each holds two file descriptors until the GPU
#: closes one): past it, a loop's wake-ups come from the completer thread,
#: so a program never runs out of file descriptors because of gpuflow.
MAX_FD_SIGNALS = 256
_EPOLL = getattr(select, "epoll", None)  # Linux; elsewhere the thread wakes loops


class Completable(Protocol):
    """A run, as the completion side sees it (:class:`gpuflow.lowlevel.Run`):
    where its work ends (its stream's lane, its mark's number), and how it
    is finished once the GPU has got there."""

    device: int
    _lane: Lane | None
    _number: int

    def _complete(self, error: BaseException | None, here: object, posts: Posts) -> None:
        """The run's work is done (or failed with ``error``): release what it
        kept, run its callbacks, and wake the tasks parked on it, those of
        loop ``here`` (the loop running this) at once, the others added to
        ``posts`` (one post a loop, made once every run given is complete)."""


class Communicating(Protocol):
    """A communicator, as the completion side sees it (:class:`gpuflow.Communicator`)."""

    @property
    def _busy(self) -> bool:
        """Collectives of it are in flight."""

    def _failure(self) -> BaseException | None:
        """Why the runs that used it fail, once it was aborted."""

    def _poll(self) -> None:
        """Ask the backend for its asynchronous error; abort on one."""

    def abort(self, reason: str) -> None:
        """Make its collectives in flight return (and fail)."""

class Lane:
    """One stream: its marks, and its runs the GPU has not been seen to finish.

    ``issued`` is the number of its last mark; ``read()`` the last one the
    GPU reached; the runs up to ``completed`` were completed.  ``runs``
    holds the others, in mark order.  Where ``unmarked``, a run submitted
    since the last mark owes its stream a mark (its own could not be
    enqueued): its number is ``issued + 1``, and the next mark, whoever
    enqueues it, covers it (:meth:`Completer.mark_owed`).  Mutated under
    the completer's lock; read without it for heuristics (the default
    scheduling policy).
    """

    __slots__ = (
        "completed",
        "completer",
        "device",
        "fast_for",
        "issued",
        "mark",
        "polled_until",
        "raw",
        "reached_at",
        "read",
        "retired",
        "runs",
        "since",
        "unmarked",
        "wake_for",
    )  # fmt: skip

    def __init__(
        self,
        completer: Completer,
        raw: RawStream,
        device: int,
        read: Callable[[], int],
        mark: Callable[[bool], int],
    ) -> None:
        self.completer = completer
        self.raw = raw
        self.device = device
        #: the number the GPU wrote last into the stream's word (a read, no lock)
        self.read = read
        #: enqueue the stream's next mark; its number (``Backend.marker``)
        self.mark = mark
        self.runs: collections.deque[Completable] = collections.deque()
        self.issued = self.completed = read()
        self.unmarked = False  # runs since the last mark owe it one
        #: when a completion of the stream was last seen (or the lane made)
        self.since = time.monotonic()
        self.wake_for = 0  # the mark a pipe's wake-up was armed for
        self.fast_for = 0  # the mark the completer thread watches for a loop
        #: a loop reads the word at every turn: the thread leaves the lane's
        #: runs to it until then (LOOP_STALL_S)
        self.polled_until = 0.0
        #: when the completer thread first saw reached a mark a loop's pipe
        #: will report (it leaves that to the loop for a tick)
        self.reached_at = 0.0
        self.retired = False  # its stream is being destroyed

    def idle(self) -> bool:
        """The GPU has reached the stream's last mark, and no run owes one
        (no lock; the word is read only where the runs seen completed do
        not already reach that mark)."""
        return not self.unmarked and (
            self.completed >= self.issued or self.read() >= self.issued
        )

    def reached(self) -> int:
        """The last mark the GPU reached, as far as the runs it covers go: a
        run owed a mark (``unmarked``) is not reached whatever the word says."""
        return -1 if self.unmarked else self.read()

    def backlog(self) -> int:
        """Marks of the stream the GPU has not reached, the one owed
        counted (no lock)."""
        return self.issued + self.unmarked - self.read()

    def submit(self, run: Completable, foreign: bool = False, polled: bool = True) -> None:
        """Complete ``run`` when the work enqueued so far on the stream is
        done: mark it, right after that work, and hand it to whoever reads
        the word first.  A run no task awaits (``polled`` False) gets a
        silent mark (:meth:`Backend.mark`): the completer thread, or a
        scope that waits for it, reads it.  A failure to mark fails the
        device where it is a device error, and is raised (the run then owes
        its mark: the next one enqueued on the stream covers it).  On a
        destroyed stream, which takes no mark ever again, ``run`` is
        refused (raised, and not pending); so it is where ``foreign``,
        another library's stream, is not marked (nothing of the run is
        there)."""
        d = self.completer
        error: BaseException | None = None
        with d._lock:
            try:
                self.issued = number = self.mark(polled)
                self.unmarked = False  # (that mark covers one owed)
            except BaseException as exc:
                if not isinstance(exc, DeviceError) and (
                    foreign or d._backend.stream_destroyed(self.raw)
                ):
                    if not self.runs:
                        d._lanes.pop(self.raw, None)
                    raise
                number = self.issued + 1  # covered by the next mark
                self.unmarked = True
                error = exc
            run._lane = self
            run._number = number
            runs = self.runs
            if not runs:
                d._active[self] = None
            runs.append(run)
            d._pending += 1
            if not d._armed or d._thread is None:
                d._arm_locked()
        if error is not None:
            if isinstance(error, DeviceError):
                d.fail_device(run.device, error)
            raise error


#: Runs whose marks were reached, in the order of their streams' marks.
Done = list[Completable]


class _FdSignal:
    """A pipe whose write end the GPU closes when it reaches this point."""

    __slots__ = ("fd", "lane", "seen")

    def __init__(self, fd: int, lane: Lane) -> None:
        self.fd = fd  # the read end: open until the signal is handled
        self.lane = lane
        self.seen = False  # the completer saw it fired and unhandled once


def _turns_slowed() -> bool:
    """Whether the calling thread runs under a line tracer, a profiler or a
    ``sys.monitoring`` tool (a debugger, coverage, cProfile, Hypothesis's
    explain phase): its loop's every turn then takes longer than
    :data:`BUSY_TURN_S` with nothing else to run, and counting such turns
    as other work would keep an idle loop polling (and holding the GIL from
    the threads the work waits for) until the run is done.  Asked only
    after a long turn."""
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)  # (Python 3.12+)
    if monitoring is None:
        return False
    get_tool = monitoring.get_tool
    return any(get_tool(tool) is not None for tool in range(6))


class BusyPoll:
    """The budget of one busy poll: it runs out after ``budget`` seconds of
    turns in which the loop ran nothing else.

    Time the loop ran other work in is no busy poll: the budget bounds the
    turns it would otherwise have slept through, and a loop kept busy reads
    the words once a turn and arms no wake-up.  A turn right after a long
    one counts as busy too (Trio runs a batch's tasks in either order: the
    poll's turns alternate long and short while another task works every
    batch)."""

    __slots__ = ("deadline", "ran_other", "turned")

    def __init__(self) -> None:
        self.deadline = 0.0
        self.turned = 0.0  # when the poll last ran
        self.ran_other = False  # and whether the loop ran other work before that

    def start(self, now: float, budget: float) -> None:
        self.turned, self.ran_other = now, False
        self.deadline = now + budget

    def held_until(self, now: float) -> float:
        """Until when the completer thread leaves the polled streams' runs
        to the loop, as of a turn at ``now`` (a lane's ``polled_until``)."""
        return max(self.deadline, now + LOOP_STALL_S)

    def turn(self, now: float) -> None:
        """A turn of the loop ends at ``now`` (the clock is ``time.monotonic``)."""
        gap = now - self.turned
        ran_other = gap > BUSY_TURN_S and not _turns_slowed()
        if ran_other or self.ran_other:
            self.deadline += gap
        self.ran_other = ran_other
        self.turned = now


class Poller:
    """One event loop's side of the bridge: its busy poll, and the epoll set
    of its pipes (one registration with the loop, however many pipes are in
    flight).  Used in the loop's thread only."""

    __slots__ = (
        "busy", "completer", "epoll", "kick", "lanes", "loop", "polling", "signals", "spares",
    )  # fmt: skip

    def __init__(self, completer: Completer, loop: Loop) -> None:
        self.completer = completer
        self.loop = loop
        self.lanes: dict[Lane, None] = {}  # the streams this loop waits on (ordered)
        self.busy = BusyPoll()
        self.polling = False  # the loop runs poll() at every turn now
        self.kick = loop.start_poller(self.poll)
        self.epoll: Any = None
        self.signals: dict[int, _FdSignal] = {}  # read end -> pipe in flight
        # a pipe made ahead, its read end already in the set
        self.spares: list[tuple[int, int]] = []
        if _EPOLL is not None:
            epoll = _EPOLL()
            try:
                loop.watch(epoll.fileno(), self._on_ready)
            except (NotImplementedError, RuntimeError):
                epoll.close()
            else:
                self.epoll = epoll

    def add(self, lane: Lane, budget: float) -> None:
        """A task of this loop waits for a run of ``lane``, to be polled for
        ``budget`` seconds more (or the poll under way, if that is longer)."""
        polling = bool(self.lanes)
        self.lanes[lane] = None
        now = time.monotonic()
        busy = self.busy
        if polling and busy.deadline > now:
            if now + budget > busy.deadline:
                busy.deadline = now + budget
            lane.polled_until = busy.held_until(now)
        elif budget > 0:
            busy.start(now, budget)
            lane.polled_until = busy.held_until(now)
            self.polling = True
            self.kick()
        else:
            self.arm()

    def poll(self) -> bool:
        """Once per loop turn: complete what the words cover; whether to poll
        again next turn (else the wake-ups are armed)."""
        try:
            d = self.completer
            now = time.monotonic()
            busy = self.busy
            busy.turn(now)
            moved = []  # one read of each word a turn
            for lane in self.lanes:
                reached = lane.read()
                if reached > lane.completed:
                    moved.append((lane, reached))
                if lane.unmarked:  # (a mark that failed, among its runs': no one else would)
                    d.mark_owed(lane)
            if moved:
                done = d.advance(moved, now)
                d.polled += len(done)
                d.complete_reached(done, self.loop.target)
                busy.deadline = now + d.busy_poll_s
            for lane in [lane for lane in self.lanes if not lane.runs]:
                del self.lanes[lane]
            if not self.lanes:
                self.polling = False
                return False
            if now < busy.deadline:
                held = busy.held_until(now)
                for lane in self.lanes:
                    lane.polled_until = held
                self.polling = True
                return True
            self.polling = False
            self.arm()
        except BaseException as exc:
            warnings.warn(f"gpuflow: completing runs in the loop failed: {exc!r}", stacklevel=1)
        self.polling = False
        return False

    def arm(self) -> None:
        """Going to sleep: a wake-up for the oldest pending run of each lane."""
        d = self.completer
        for lane in self.lanes:
            lane.polled_until = 0.0  # (no more reads: the thread may take its runs)
            runs = lane.runs
            if not runs:
                continue
            first = runs[0]._number
            if lane.wake_for >= first or lane.fast_for >= first:
                continue  # one is armed already
            # (work queued behind it, its mark owed or not: a pipe would wait for it)
            if first != lane.issued or lane.unmarked or not self._pipe(lane, first):
                d._fast_watch(lane, first)
                d.watched_by_thread += 1
            else:
                d.pipes_armed += 1

    def _pipe(self, lane: Lane, number: int) -> bool:
        """A pipe closed right after mark ``number``, the last of ``lane``'s
        stream; False where none can be had (past the limit, out of file
        descriptors, a loop that cannot watch one, a stream being captured)."""
        if self.epoll is None:
            return False
        d = self.completer
        pipe = self.spares.pop() if self.spares else self._new_pipe()
        if pipe is None:
            return False
        r, w = pipe
        sig = _FdSignal(r, lane)
        with d._lock:
            self.signals[r] = sig
            d._fd_signals += 1
        try:
            enqueued = d._backend.enqueue_close(lane.raw, w)
        except BaseException as exc:
            enqueued = False
            if isinstance(exc, DeviceError):
                d.fail_device(lane.device, exc)
        if enqueued:
            lane.wake_for = number
            lane.reached_at = 0.0
            if not self.spares:  # the next one, made while the GPU works
                spare = self._new_pipe()
                if spare is not None:
                    self.spares.append(spare)
            return True
        with d._lock:  # nothing was enqueued: both ends are ours to close
            ours = self.signals.pop(r, None) is not None  # (a failed device took it)
            if ours:
                d._fd_signals -= 1
        if ours:
            os.close(r)
        os.close(w)
        return False

    def _new_pipe(self) -> tuple[int, int] | None:
        if self.completer._fd_signals >= MAX_FD_SIGNALS:
            return None
        try:
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        self.epoll.register(r, select.EPOLLIN)  # readable once w is closed, not before
        return r, w

    def _on_ready(self) -> None:
        """In the loop's thread: pipes fired.  Never raises."""
        try:
            try:
                events = self.epoll.poll(0)
            except (OSError, ValueError):  # closed after its loop ended
                return
            d = self.completer
            fired: list[int] = []
            with d._lock:
                for fd, _ in events:
                    if self.signals.pop(fd, None) is not None:
                        d._fd_signals -= 1
                        fired.append(fd)
            for fd in fired:
                os.close(fd)  # (also leaves the epoll set)
            if self.poll():
                self.kick()  # runs queued behind may be short: poll again
        except BaseException as exc:
            warnings.warn(f"gpuflow: completing runs in the loop failed: {exc!r}", stacklevel=1)


class Completer:
    """Turns reached marks into completed runs (module docstring)."""

    def __init__(self, backend: Backend, busy_poll_s: float) -> None:
        self._backend = backend
        #: how long a loop polls for completions before it sleeps
        self.busy_poll_s = busy_poll_s
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)  # the thread sleeps on it
        self._lanes: dict[Any, Lane] = {}  # every stream marked, until retired
        self._active: dict[Lane, None] = {}  # the lanes with runs pending
        self._fast: dict[Lane, None] = {}  # lanes the thread watches for a loop
        self._pending = 0
        self._fd_signals = 0  # pipes whose read end is open
        self._pollers: dict[Any, Poller] = {}  # per loop (its target)
        self._closed = False
        self._armed = False  # the thread is ticking
        self._thread: threading.Thread | None = None
        #: per device: awaits waiting for one of its streams to go idle (every
        #: stream busy at the default policy's bound), woken one a stream
        self._stream_waiters: dict[int, Handoff] = {}
        #: how many wait so, over every device (an await of the common case
        #: does not take a stream ahead of them)
        self.waiting = 0
        #: communicators whose async errors the watchdog asks for while busy
        self._comms: weakref.WeakSet[Communicating] = weakref.WeakSet()
        # how completions were seen (CompletionStatistics)
        self.spun = self.polled = self.by_thread = 0
        self.pipes_armed = self.watched_by_thread = 0

    def statistics(self) -> CompletionStatistics:
        """How completions were seen so far (:class:`CompletionStatistics`)."""
        return CompletionStatistics(
            self.spun, self.polled, self.by_thread, self.pipes_armed, self.watched_by_thread
        )

    def lane(self, raw: RawStream, device: int) -> Lane:
        """The lane of ``raw`` (made on first use)."""
        with self._lock:
            return self._lane_locked(raw, device)

    def _lane_locked(self, raw: RawStream, device: int) -> Lane:
        lane = self._lanes.get(raw)
        if lane is None:
            be = self._backend
            lane = self._lanes[raw] = Lane(
                self, raw, device, be.completion_reader(raw), be.marker(raw)
            )
        return lane

    def submit(
        self, raw_stream: RawStream, run: Completable, foreign: bool = False, polled: bool = True
    ) -> None:
        """:meth:`Lane.submit` of ``run`` on ``raw_stream``'s lane (made
        on first use)."""
        lane = self._lanes.get(raw_stream)
        if lane is None:
            lane = self.lane(raw_stream, run.device)
        lane.submit(run, foreign, polled)

    def mark_owed(self, lane: Lane) -> bool:
        """Enqueue the mark ``lane``'s latest runs owe (nothing where none
        does); whether one was enqueued.  Any thread.  Never raises: a
        device error fails the device's runs; any other failure is warned
        about, and the mark stays owed (the completer thread tries again at
        its next tick)."""
        error: Exception | None = None
        with self._lock:
            if not lane.unmarked:
                return False
            try:
                lane.issued = lane.mark(True)
                lane.unmarked = False
                return True
            except Exception as exc:
                error = exc
        if isinstance(error, DeviceError):
            self.fail_device(lane.device, error)
        else:
            warnings.warn(f"gpuflow: enqueueing a completion mark failed: {error!r}", stacklevel=2)
        return False

    def others_polled(self, loop: Loop) -> bool:
        """Other runs of ``loop`` are pending: its poller reads them all, once a turn."""
        poller = loop.poller
        return poller is not None and poller.completer is self and bool(poller.lanes)

    def poll_on(self, loop: Loop, lane: Lane, budget: float | None = None) -> None:
        """A task of ``loop`` (running this) waits for a run of ``lane``;
        the loop polls for it for ``budget`` more (the busy-poll budget
        when None)."""
        poller = loop.poller
        if (
            poller is not None
            and poller.polling
            and lane in poller.lanes
            and poller.completer is self
        ):
            # (read at every turn already: the poll goes on for the budget
            # past its last turn, which is as good as now and costs no clock)
            busy = poller.busy
            limit = busy.turned + (self.busy_poll_s if budget is None else budget)
            if limit > busy.deadline:
                busy.deadline = limit
            return
        if poller is None or poller.completer is not self:
            poller = loop.poller = Poller(self, loop)
            with self._lock:
                self._pollers[loop.target] = poller
        poller.add(lane, self.busy_poll_s if budget is None else budget)

    def watch_communicator(self, comm: Communicating) -> None:
        """Ask ``comm`` for its asynchronous error at every watchdog tick while
        it is busy: a collective whose peer failed never ends by itself, and
        NCCL reports that only when asked.  Any thread."""
        with self._lock:
            self._comms.add(comm)
            self._arm_locked()

    def _arm_locked(self) -> None:
        """The thread ticks from now on (started the first time)."""
        if not self._armed:
            self._armed = True
            self._cv.notify()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="gpuflow-completer", daemon=True
            )
            self._thread.start()

    def _fast_watch(self, lane: Lane, number: int) -> None:
        """The thread watches ``lane`` until its mark ``number`` is reached."""
        with self._lock:
            lane.fast_for = number
            if not self._fast:
                self._cv.notify()
            self._fast[lane] = None
            self._arm_locked()

    def _busy(self) -> bool:
        """Work is in flight (under the lock)."""
        return bool(self._pending or self._fd_signals or any(c._busy for c in self._comms))

    @property
    def pending(self) -> int:
        """Runs handed over whose work has not been seen to finish."""
        return self._pending

    def lanes(self) -> list[Lane]:
        """Every lane the completer keeps now (a snapshot).  Any thread."""
        with self._lock:
            return list(self._lanes.values())

    def pending_by_lane(self) -> list[tuple[Lane, list[Completable]]]:
        """Each lane with runs pending, and those runs in mark order: a
        snapshot.  Any thread."""
        with self._lock:
            return [(lane, list(lane.runs)) for lane in self._active]

    def unreached(self) -> int:
        """Runs handed over whose work the GPU has not reached yet (a read of
        each busy stream's completion word; no driver call): those pending
        that a look now would not find done.  Any thread."""
        count = 0
        for lane, runs in self.pending_by_lane():
            reached = lane.reached()
            count += sum(run._number > reached for run in runs)
        return count

    # -- awaits waiting for an idle stream ---------------------------------------
    def stream_waiters(self, device: int) -> int:
        """How many awaits wait for a stream of ``device`` to go idle (no lock)."""
        waiters = self._stream_waiters.get(device)
        return 0 if waiters is None else len(waiters)

    def join_stream_queue(self, device: int, first: bool = False) -> Ticket:
        """The calling task's place among the awaits waiting for a stream of
        ``device`` to go idle (at the head where ``first``).  Its event is
        set when one of the device's streams has finished every run on it,
        or a stream lease gave one back; the task then looks again."""
        with self._lock:
            waiters = self._stream_waiters.get(device)
            if waiters is None:
                waiters = self._stream_waiters[device] = Handoff()
            self.waiting += 1
            return waiters.join(first)

    def stream_turn(self, device: int, ticket: Ticket) -> bool:
        """Whether it is ``ticket``'s turn to take a stream of ``device``:
        every await that came before it has one (see :class:`Handoff`)."""
        with self._lock:
            return self._stream_waiters[device].first(ticket)

    def stream_not_found(self, device: int, ticket: Ticket) -> bool:
        """``ticket``, whose turn it is, found no idle stream (a run that
        cannot wait took the one it was woken for): whether to look again
        at once (a stream went idle meanwhile, for the await after it)."""
        with self._lock:
            return self._stream_waiters[device].found_nothing(ticket)

    def leave_stream_queue(self, device: int, ticket: Ticket, used: bool) -> None:
        """``ticket``'s task stops waiting: it found a stream (``used``), or
        it was cancelled, and then a wake-up it was given goes to the next."""
        with self._lock:
            handed, nxt = self._stream_waiters[device].leave(ticket)
            self.waiting -= 1
        if nxt is not None:  # (woken before its turn: its turn now)
            nxt.wake()
        if handed and not used:
            self.stream_freed(device)

    def stream_freed(self, device: int) -> None:
        """A stream of ``device`` may be idle now: wake the first await
        waiting for one.  Any thread."""
        if not self.stream_waiters(device):
            return
        with self._lock:
            ticket = self._stream_waiters[device].hand(None)
        if ticket is not None:
            ticket.wake()

    def advance(self, lanes: Iterable[tuple[Lane, int]], now: float) -> Done:
        """Take the runs whose marks the GPU has reached: ``(lane, the
        number its word was read to have reached)``; an await waiting for
        an idle stream is woken for each stream left with nothing pending."""
        done: Done = []
        woken: list[Ticket] | None = None
        with self._lock:
            for lane, reached in lanes:
                runs = lane.runs
                n = 0
                while runs and runs[0]._number <= reached:
                    done.append(runs.popleft())
                    n += 1
                if n:
                    lane.completed = reached
                    lane.since = now
                    self._pending -= n
                    if not runs:
                        self._active.pop(lane, None)
                        if lane.retired:
                            self._lanes.pop(lane.raw, None)
                        waiters = self._stream_waiters.get(lane.device)
                        if waiters:
                            ticket = waiters.hand(None)
                            if ticket is not None:
                                woken = [ticket] if woken is None else [*woken, ticket]
        for ticket in woken or ():
            ticket.wake()
        return done

    def complete_reached(self, done: Done, here: Any = None) -> None:
        """Complete runs whose marks were reached (outside the lock): their
        transfers' staging first, then :meth:`complete`."""
        if not done:
            return
        backend = self._backend
        last = None  # (advance gives each lane's runs together: once a lane)
        for run in done:
            lane = run._lane
            if lane is not None and lane is not last:
                last = lane
                backend.complete_transfers(lane.raw)
        self.complete(done, here)

    def complete(
        self, done: Iterable[Completable], here: object = None, error: BaseException | None = None
    ) -> None:
        """Complete ``done`` (failed with ``error`` where given) and wake their
        tasks: those of loop ``here`` (the loop running this) directly, the
        others with one post per loop.  (No task resumes before all are
        complete: a wake-up only schedules its task.)  The one way a run
        completes: one whose mark was reached, one never submitted (a
        blocking ``sync``, done), one its device failed."""
        posts: Posts = {}
        for run in done:
            run._complete(error, here, posts)
        if posts:
            for target, poster, fns in posts.values():
                post(target, poster, fns)

    def fail_device(self, device: int, error: BaseException) -> None:
        """Fail every pending run of ``device`` (a fault, a reset).

        Its pipes are dropped: their read ends are closed, and the write ends
        that the GPU would have closed are leaked, never closed here (a late
        close by the driver would close whatever reused the number)."""
        done: Done = []
        with self._lock:
            for lane in [lane for lane in self._active if lane.device == device]:
                done.extend(lane.runs)
                self._pending -= len(lane.runs)
                lane.runs.clear()
                lane.unmarked = False  # (no run is left to owe it)
                del self._active[lane]
                self._fast.pop(lane, None)
            dropped = []
            for poller in self._pollers.values():
                for fd in [fd for fd, s in poller.signals.items() if s.lane.device == device]:
                    del poller.signals[fd]
                    self._fd_signals -= 1
                    dropped.append(fd)
        for fd in dropped:
            os.close(fd)
        self.complete(done, None, error)

    def retire_stream(self, raw: RawStream) -> None:
        """``raw`` is about to be destroyed: its lane goes once its runs are
        done (its marks are still written: its work completes; one its runs
        owe is enqueued first).  Any thread (a finalizer); never raises."""
        lane = self._lanes.get(raw)
        if lane is not None and lane.unmarked:
            self.mark_owed(lane)
        with self._lock:
            lane = self._lanes.get(raw)
            if lane is not None:
                lane.retired = True
                if not lane.runs:
                    del self._lanes[raw]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._cv.notify()

    def drain(self, timeout: float) -> bool:
        """Close, and wait up to ``timeout`` s for the thread to complete every
        pending run (and so run their callbacks and release what they kept);
        whether it did."""
        self.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return not self._pending

    # -- the completer thread ----------------------------------------------------
    def _run(self) -> None:
        last_check = time.monotonic()
        idle_since: float | None = None
        marked = False  # this tick enqueued marks runs owed: read them soon
        while True:
            with self._lock:
                if self._closed and not self._pending:
                    return
                if self._busy():
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > _IDLE_GRACE_S:
                    self._armed = False
                if self._fast or marked:
                    timeout: float | None = FAST_WATCH_S
                else:
                    timeout = WATCHDOG_S if self._armed or self._closed else None
                self._cv.wait(timeout)
                if timeout is None:
                    # woken by new work: the grace starts again.  Runs that end
                    # before a tick could see them pending (short kernels, seen
                    # done by their awaits) would otherwise find it long spent,
                    # and each run would wake this thread, which takes the GIL
                    idle_since = None
                active = list(self._active)
            try:
                marked, last_check = self._tick(active, last_check)
            except BaseException as exc:  # pragma: no cover - never kills the thread
                warnings.warn(f"gpuflow: the completer thread failed: {exc!r}", stacklevel=1)
                time.sleep(WATCHDOG_S)
            # (the thread may sleep long now: it must not hold what it saw,
            # such as a retired stream's lane or a finished run, meanwhile)
            del active

    def _tick(self, active: list[Lane], last_check: float) -> tuple[bool, float]:
        """One tick of the completer thread over the lanes with runs
        pending; whether it enqueued marks that runs owed, and when the
        watchdog's checks last ran."""
        now = time.monotonic()
        # marks that failed are owed until now: one a stream
        owed = [x for x in active if x.unmarked and self._mine(x, now) is not None]
        marked = any([self.mark_owed(lane) for lane in owed])
        moved = [
            (x, n)
            for x in active
            if (n := self._mine(x, now)) is not None and n > x.completed
        ]
        done = self.advance(moved, now)
        self.by_thread += len(done)
        self.complete_reached(done)
        if self._fast:
            with self._lock:
                for lane in [x for x in self._fast if not x.runs or x.completed >= x.fast_for]:
                    del self._fast[lane]
        if now - last_check >= WATCHDOG_S:
            last_check = now
            self._watch(active)
            self._reap()
            self._poll_comms()
        return marked, last_check

    @staticmethod
    def _mine(lane: Lane, now: float) -> int | None:
        """How far the completer thread completes ``lane``'s runs now (the
        mark its word was read to have reached), or None: not while a loop
        polls it every turn, nor, for a tick, those a loop's pipe will wake
        it for (a loop that stopped gets them later).  One read decides and
        bounds: a mark the GPU reaches after it is the next tick's to see,
        and then the pipe's tick applies (with two, a mark reached between
        them was taken from the loop its pipe was about to wake)."""
        if lane.polled_until >= now:
            return None
        reached = lane.read()
        runs = lane.runs
        if runs and lane.wake_for >= runs[0]._number and lane.fast_for < runs[0]._number:
            if reached < lane.wake_for:
                lane.reached_at = 0.0
                return reached  # (an earlier run of the lane may be reached)
            if not lane.reached_at:
                lane.reached_at = now
            return reached if now - lane.reached_at >= WATCHDOG_S else None
        return reached

    def _poll_comms(self) -> None:
        with self._lock:
            comms = [c for c in self._comms if c._busy]
        for comm in comms:
            try:
                comm._poll()
            except Exception as exc:  # never kills the completer
                warnings.warn(f"gpuflow: watching {comm!r} failed: {exc!r}", stacklevel=1)

    def _watch(self, lanes: list[Lane]) -> None:
        """Fail the runs of a device that faulted (it reaches no mark).

        Any other failure of a query is warned about and ignored: failing the
        device's runs would release what their work may still be using (a
        leak is better than a dangling pointer)."""
        faulted: dict[int, BaseException] = {}
        for lane in lanes:
            if lane.device in faulted or not lane.runs:
                continue
            try:
                self._backend.query(lane.raw)
            except DeviceFaultError as fault:
                faulted[lane.device] = fault
            except Exception as exc:
                warnings.warn(f"gpuflow: querying a stream failed: {exc!r}", stacklevel=1)
        for device, err in faulted.items():
            self.fail_device(device, err)

    def _reap(self) -> None:
        """Close the pipes of loops that ended (fired ones; spares), and
        forget such a loop's poller once nothing of it is in flight.  Pipes
        fired but not handled by a live loop are left to it: the runs they
        woke for are completed by the words anyway."""
        with self._lock:
            pollers = list(self._pollers.items())
        for target, poller in pollers:
            if not poller.loop.finished():
                continue
            with self._lock:
                fds = list(poller.signals)
                if fds:
                    probe = select.poll()
                    for fd in fds:
                        probe.register(fd, select.POLLIN)
                    for fd, _ in probe.poll(0):
                        del poller.signals[fd]
                        self._fd_signals -= 1
                        os.close(fd)
                if poller.signals:
                    continue
                del self._pollers[target]
                for r, w in poller.spares:  # never enqueued: both ends are ours
                    os.close(r)
                    os.close(w)
                poller.spares.clear()
                if poller.epoll is not None:
                    poller.epoll.close()
