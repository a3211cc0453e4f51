"""The completion bridge: the GPU wakes the awaiting task.

A run ends by handing its :class:`Submission` to the :class:`Dispatcher`,
which marks the point of the stream it must wait for with a native signal,
one of two kinds:

* **For a run a loop awaits: the GPU wakes the loop itself.**  The signal
  is a pipe; a host function that is libc's ``close`` of its write end runs
  when the GPU reaches it (no GIL, no thread of gpuflow), and the read end,
  in an epoll set that the loop watches (``add_reader``, or a Trio system
  task in ``wait_readable``), becomes readable.  The loop's own selector
  returns, and in the loop's thread the dispatcher learns which submissions
  finished, releases what each retained, and wakes their tasks directly.
  Runs a loop submits in one turn share one signal per stream (the flush at
  the end of the turn), and signals that fire together reach a loop in one
  wake-up.
* **For everything else** (``enqueue_on``, releases, a loop that cannot
  watch file descriptors, or more than :data:`MAX_FD_SIGNALS` pipes in
  flight): the backend's ``enqueue_signal``, a ``sem_post`` host function on
  CUDA, wakes the one dispatcher thread, which posts to waiting loops with
  their non-blocking post (``call_soon_threadsafe`` /
  ``TrioToken.run_sync_soon``).  A post to a loop that has finished is
  dropped quietly.  One such signal is in flight on a stream at a time:
  runs submitted meanwhile get one signal together when it fires (or when
  their stream is destroyed first), so that runs enqueued back to back do
  not each hold the stream for a host function.

While work is pending the dispatcher thread also keeps a watchdog: a device
that faulted never runs its host functions, so every ``WATCHDOG_S`` it
queries the streams that have pending work, and a sticky fault fails every
pending submission of that device with :class:`DeviceFaultError`.  At the
same ticks it completes pipe signals that fired but that their loop will
not see soon (the loop ended, or has not run for a whole tick), so what a
cancelled run kept is released even when nobody runs its loop again, and
it asks the communicators with collectives in flight for NCCL's
asynchronous error (a collective whose peer died never ends by itself):
one that has one is aborted, and every run that used it fails with it.
"""

from __future__ import annotations

import collections
import os
import select
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import anyio
import anyio.lowlevel

from ._backends._base import Backend
from ._errors import DeviceError, DeviceFaultError
from ._loops import Loop, current_loop

WATCHDOG_S = 0.02
#: After the last pending submission, keep the watchdog timer this long so
#: that a busy program does not pay a wake-up per submission.
_IDLE_GRACE_S = 1.0
#: Pipe signals in flight at most (each holds two file descriptors until the
#: GPU closes one): past it, runs signal through the dispatcher thread, so a
#: program never runs out of file descriptors because of gpuflow.
MAX_FD_SIGNALS = 256
_EPOLL = getattr(select, "epoll", None)  # Linux; elsewhere every signal is a semaphore

#: How a completion reaches a waiting task: the loop (or Trio token) to post
#: to, its non-blocking post, and the idempotent wake-up to run there.
Poster = Callable[[Callable[[], object]], object]
Waiter = tuple[Any, Poster, Callable[[], object]]


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


#: Makes "done" and "take the callbacks" one step against add_done_callback.
_callbacks_lock = threading.Lock()


class Submission:
    """What one run enqueued and must keep alive until the GPU is done with it.

    ``keep`` holds host buffers, staging memory, graphs and leases that
    enqueued work still uses; it is released by the completion (or a fault),
    never earlier, whatever happens to the task that started the run.
    """

    __slots__ = ("comms", "device", "done", "error", "keep", "on_done", "waiters")

    def __init__(self, device: int) -> None:
        self.device = device
        #: the communicators whose collectives the run enqueued: a run that
        #: one of them aborted before it was seen done failed
        self.comms: list[Communicating] | None = None
        self.keep: list[object] = []
        self.done = False
        self.error: BaseException | None = None
        self.waiters: list[Waiter] = []
        self.on_done: list[Callable[[BaseException | None], None]] | None = None

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

    def _finish(self, error: BaseException | None) -> list[Waiter]:
        if error is None and self.comms is not None:
            for comm in self.comms:
                error = comm.failure()
                if error is not None:
                    break
        self.error = error
        self.keep = []
        with _callbacks_lock:  # a callback added meanwhile runs once, here or there
            self.done = True
            callbacks, self.on_done = self.on_done, None
        for fn in callbacks or ():
            try:
                fn(error)
            except BaseException as exc:  # never into the dispatcher thread
                warnings.warn(f"gpuflow: a completion callback raised {exc!r}", stacklevel=1)
        return self.waiters

    async def wait(self, loop: Loop | None = None) -> None:
        """Wait (cancellably) until the work is done; raise its device error.

        Parks the task with the running loop's own primitives (``loop``, or
        the current one), so on cancellation the loop's own exception
        propagates at once; the submission still retains its resources until
        the GPU is done.
        """
        if self.done:
            await anyio.lowlevel.checkpoint()
        else:
            if loop is None:
                loop = current_loop()
            wake, park = loop.parker()
            self.waiters.append((loop.target, loop.post, wake))
            # the dispatcher may have finished us between the check and the
            # append; then nobody posts, and we must not wait
            if self.done:
                await anyio.lowlevel.checkpoint()
            else:
                await park()
        if self.error is not None:
            raise self.error


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


class _Lane:
    """The submissions of one stream that the GPU has not been seen to finish.

    Each signal enqueued on the stream covers every submission appended
    before it: its *mark* is how many had been appended when it was enqueued
    (recorded under the dispatcher's lock, so marks grow in the order they
    are recorded).  When a signal fires, every submission up to its mark is
    done.  A pipe signal carries its own mark; a counted signal only says
    how many fired, so ``marks`` keeps theirs FIFO, and popping them in the
    order recorded is safe even when two threads enqueue their signals in
    the other order: after ``n`` signals fired, the largest mark among them
    is at least the ``n``-th mark recorded.
    """

    __slots__ = ("appended", "completed", "covered", "deferred", "device", "marks",
                 "outstanding", "since", "subs")

    def __init__(self, device: int) -> None:
        self.device = device
        self.subs: collections.deque[Submission] = collections.deque()
        self.marks: collections.deque[int] = collections.deque()
        self.appended = 0
        self.completed = 0
        self.covered = 0  # the largest mark recorded
        self.outstanding = 0  # pipe signals whose read end is still open
        #: the runs up to this count were left to the counted signal in
        #: flight, to be covered when it fires (see Dispatcher._signal)
        self.deferred = 0
        #: when the lane last saw a submission finish, or was made (see lanes)
        self.since = time.monotonic()

    def mark(self) -> int | None:
        """Record a signal covering everything appended; None if one already does."""
        if self.covered == self.appended:
            return None
        self.covered = self.appended
        return self.appended

    def advance(self, upto: int, now: float, done: list[tuple[Submission, None]]) -> int:
        """Complete the submissions up to mark ``upto`` into ``done``; how many."""
        n = upto - self.completed
        if n <= 0:
            return 0
        q = self.subs
        for _ in range(n):
            done.append((q.popleft(), None))
        self.completed = upto
        self.since = now
        return n

    def idle(self) -> bool:
        return not self.subs and not self.marks and not self.outstanding


class _FdSignal:
    """A pipe whose write end the GPU closes when it reaches this signal."""

    __slots__ = ("fd", "lane", "mark", "raw", "seen", "taken")

    def __init__(self, fd: int, lane: _Lane, mark: int, raw: Any) -> None:
        self.fd = fd  # the read end: open until the signal is handled
        self.lane = lane
        self.mark = mark
        self.raw = raw
        self.seen = False  # the watchdog saw it fired and unhandled once
        self.taken = False  # its submissions were completed


class _Reader:
    """What one event loop watches for gpuflow: one epoll set holding the
    read ends of that loop's pipe signals (one registration with the loop,
    however many signals are in flight)."""

    __slots__ = ("epoll", "loop", "signals", "spares")

    def __init__(self, epoll: Any, loop: Loop) -> None:
        self.epoll = epoll
        self.loop = loop
        self.signals: dict[int, _FdSignal] = {}  # read end -> signal in flight
        # a pipe made ahead, its read end already in the set (used in the
        # loop's thread only, until the loop ends)
        self.spares: list[tuple[int, int]] = []


Done = list[tuple[Submission, BaseException | None]]


class _Turn(threading.local):
    """Per thread: how the runs its loop submits share signals.

    A run signals at once unless ``recent`` says that this loop signalled a
    run that may still be in the current turn (cleared when a signal of the
    loop fires, or a flush runs: both happen in a later turn).  Then it goes
    into ``dirty`` and the first such run schedules the flush (``call_soon``)
    that signals them all at the end of the turn, one signal per stream.  A
    lone await thus signals at once and schedules nothing."""

    recent: Any = None  # the loop (target) that signalled a run at once
    loop: Loop | None = None  # its adapter
    scheduled = False  # a flush is scheduled on that loop

    def __init__(self) -> None:
        self.dirty: dict[Any, _Lane] = {}  # raw stream -> lane, for the flush


class Dispatcher:
    """Turns native signals into completed submissions (module docstring).

    Awaited runs share signals: the first run a loop submits in one turn of
    that loop enqueues its signal at once (a lone await waits for nothing
    more); runs that the same loop submits after it in that turn enqueue no
    signal of their own, a flush at the end of the turn enqueues one per
    stream for all of them (:class:`_Turn`).  Sixty-four tasks woken
    together thus cost a handful of host functions and wake-ups, not 64.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        # only streams with pending submissions or signals: an idle stream is dropped
        self._lanes: dict[Any, _Lane] = {}
        self._pending = 0
        self._fd_signals = 0  # pipe signals whose read end is open
        # per loop (its target): its reader, or None where it cannot watch fds
        self._readers: dict[Any, _Reader | None] = {}
        self._closed = False
        self._armed = False  # the thread is on its watchdog timer, no wake needed
        self._thread: threading.Thread | None = None
        self._turn = _Turn()
        #: communicators whose async errors the watchdog asks for while busy
        self._comms: weakref.WeakSet[Communicating] = weakref.WeakSet()

    def submit(self, raw_stream: Any, sub: Submission, loop: Loop | None = None) -> None:
        """Complete ``sub`` when the work enqueued so far on ``raw_stream`` is done.

        With ``loop`` (the loop running in this thread), the GPU wakes that
        loop, and the signal may be left to the flush the loop runs at the
        end of its turn; whoever submits that way must call :meth:`flush`
        if it stops waiting for ``sub`` before the loop gets there.
        """
        turn = self._turn
        with self._lock:
            lane = self._lanes.get(raw_stream)
            if lane is None:
                lane = self._lanes[raw_stream] = _Lane(sub.device)
            lane.subs.append(sub)
            lane.appended += 1
            self._pending += 1
            wake = self._arm()
            defer = loop is not None and turn.recent is loop.target
            if defer:
                turn.dirty[raw_stream] = lane
        if wake:
            self._backend.wake()
        if defer:
            assert loop is not None
            if not turn.scheduled:
                try:
                    loop.call_soon(self.flush)
                except RuntimeError:  # the loop is finishing: no end of turn to wait for
                    self.flush()
                else:
                    turn.scheduled = True
            return
        if turn.dirty:
            self.flush()  # left by a loop that ended before its flush ran
        self._signal(raw_stream, lane, loop)
        if loop is not None:
            turn.recent = loop.target
            turn.loop = loop

    def _arm(self) -> bool:
        """Put the dispatcher thread on its watchdog timer (starting it the
        first time); True when it must be woken for that.  Under the lock."""
        wake = not self._armed
        self._armed = True
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="gpuflow-dispatcher", daemon=True
            )
            self._thread.start()
        return wake

    def watch_communicator(self, comm: Communicating) -> None:
        """Ask ``comm`` for its asynchronous error at every watchdog tick while
        it is busy: a collective whose peer failed never ends by itself, and
        NCCL reports that only when asked.  Any thread."""
        with self._lock:
            self._comms.add(comm)
            wake = self._arm()
        if wake:
            self._backend.wake()

    def _busy(self) -> bool:
        """Work is in flight (under the lock)."""
        return bool(self._pending or self._fd_signals or any(c.busy for c in self._comms))

    def flush(self) -> None:
        """Enqueue the signals this thread's loop left for the end of its turn.

        Never raises: a failure to enqueue fails the device's pending runs."""
        turn = self._turn
        turn.recent = None
        turn.scheduled = False
        dirty, turn.dirty = turn.dirty, {}
        for raw, lane in dirty.items():
            try:
                self._signal(raw, lane, turn.loop)
            except DeviceError:
                pass  # a fault: the device's awaits fail with it
            except BaseException as exc:
                warnings.warn(f"gpuflow: could not signal a stream: {exc!r}", stacklevel=1)

    # -- enqueueing signals ---------------------------------------------------
    def _signal(self, raw: Any, lane: _Lane, loop: Loop | None) -> None:
        """Mark everything submitted on ``lane`` so far with one signal (none
        if a signal already covers it); a failure to enqueue fails the device
        (whose runs can no longer be seen to finish) and is raised."""
        reader = self._reader(loop) if loop is not None else None
        if reader is not None:
            pipe = reader.spares.pop() if reader.spares else self._new_pipe(reader)
            if pipe is not None:
                self._signal_fd(raw, lane, reader, *pipe)
                return
        with self._lock:
            if self._lanes.get(raw) is not lane:
                return  # failed meanwhile
            if lane.marks:
                # a counted signal is in flight on the stream: when it fires,
                # the dispatcher thread signals once for everything submitted
                # since, so that back-to-back runs do not each hold the
                # stream for a host function
                lane.deferred = lane.appended
                return
            m = lane.mark()
            if m is None:
                return
            lane.marks.append(m)
        try:
            self._backend.enqueue_signal(raw)
        except BaseException as exc:
            self.fail_device(lane.device, exc)
            raise

    def _signal_deferred(self, raw: Any, lane: _Lane) -> BaseException | None:
        """Signal for the runs left to a counted signal (under the lock, so
        that the stream cannot be retired in between); the error of a
        failed enqueue."""
        m, lane.deferred = lane.deferred, 0
        if m <= lane.covered:
            return None
        lane.covered = m
        lane.marks.append(m)
        try:
            self._backend.enqueue_signal(raw)
        except BaseException as exc:
            return exc
        return None

    def retire_stream(self, raw: Any) -> None:
        """``raw`` is about to be destroyed: runs left to a later signal get
        theirs now, while something can still be enqueued on it.  Any thread
        (a finalizer); never raises."""
        with self._lock:
            lane = self._lanes.get(raw)
            error = self._signal_deferred(raw, lane) if lane is not None else None
        if error is not None and lane is not None:
            self.fail_device(lane.device, error)

    def _new_pipe(self, reader: _Reader) -> tuple[int, int] | None:
        """A pipe whose read end is in ``reader``'s epoll set; None past the
        limit or out of file descriptors (then the other kind of signal)."""
        if self._fd_signals >= MAX_FD_SIGNALS:
            return None
        try:
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        reader.epoll.register(r, select.EPOLLIN)  # readable once w is closed, not before
        return r, w

    def _signal_fd(self, raw: Any, lane: _Lane, reader: _Reader, r: int, w: int) -> None:
        """Mark ``lane`` with a pipe signal (a counted one where the stream
        cannot take a pipe signal)."""
        with self._lock:
            m = lane.mark() if self._lanes.get(raw) is lane else None
            if m is None:
                reader.spares.append((r, w))  # nothing to signal: keep it for the next
                return
            sig = _FdSignal(r, lane, m, raw)
            reader.signals[r] = sig
            lane.outstanding += 1
            self._fd_signals += 1
        error: BaseException | None = None
        try:
            enqueued: bool | None = self._backend.enqueue_close(raw, w)
        except BaseException as exc:
            enqueued = None
            error = exc
        if enqueued:
            # the next signal's pipe, made while the GPU works (never on the
            # path from a submit to its signal's enqueue)
            if not reader.spares:
                pipe = self._new_pipe(reader)
                if pipe is not None:
                    reader.spares.append(pipe)
            return
        # nothing was enqueued: both ends are ours to close
        with self._lock:
            del reader.signals[r]
            self._drop_signal(sig)
            os.close(r)
            os.close(w)
            # the stream cannot take a pipe signal: count one instead (a
            # count with no mark behind it would complete a later lane early)
            counted = error is None and self._lanes.get(raw) is lane
            if counted:
                lane.marks.append(m)
        try:
            if error is not None:
                raise error
            if counted:
                self._backend.enqueue_signal(raw)
        except BaseException as exc:
            self.fail_device(lane.device, exc)
            raise

    def _reader(self, loop: Loop) -> _Reader | None:
        """The reader of ``loop``, registered with it on first use (in its thread)."""
        target = loop.target
        try:
            return self._readers[target]
        except KeyError:
            pass
        reader: _Reader | None = None
        if _EPOLL is not None:
            epoll = _EPOLL()
            made = reader = _Reader(epoll, loop)
            try:
                loop.watch(epoll.fileno(), lambda: self._on_ready(made))
            except (NotImplementedError, RuntimeError):
                epoll.close()
                reader = None
        with self._lock:
            self._readers[target] = reader
        return reader

    # -- completing -------------------------------------------------------------
    def _on_ready(self, reader: _Reader) -> None:
        """In the loop's thread: some of its pipe signals fired.  Never raises."""
        try:
            try:
                events = reader.epoll.poll(0)
            except (OSError, ValueError):  # closed after its loop ended
                return
            turn = self._turn
            if not turn.scheduled:
                turn.recent = None  # a new turn: the next run signals at once
            done: Done = []
            streams: dict[Any, int] = {}
            handled: list[int] = []
            now = time.monotonic()
            with self._lock:
                for fd, _ in events:
                    sig = reader.signals.pop(fd, None)
                    if sig is None:
                        continue  # failed with its device meanwhile
                    self._drop_signal(sig)
                    handled.append(fd)
                    if not sig.taken:
                        self._take(sig, now, done, streams)
            try:
                if done:
                    self._complete(done, streams, reader.loop.target)
            finally:
                # after the wake-ups (off the path to the task), and always: a
                # read end left open would keep the loop's reader ready forever
                for fd in handled:
                    os.close(fd)  # also leaves the epoll set
        except BaseException as exc:
            warnings.warn(f"gpuflow: completing runs in the loop failed: {exc!r}", stacklevel=1)

    def _drop_signal(self, sig: _FdSignal) -> None:
        """Forget a handled signal (under the lock; the caller closes its read
        end, after which its number may be reused); retire its lane."""
        self._fd_signals -= 1
        lane = sig.lane
        lane.outstanding -= 1
        if lane.idle() and self._lanes.get(sig.raw) is lane:
            del self._lanes[sig.raw]

    def _take(self, sig: _FdSignal, now: float, done: Done, streams: dict[Any, int]) -> None:
        """Complete what a fired pipe signal covers (under the lock)."""
        sig.taken = True
        lane = sig.lane
        if self._lanes.get(sig.raw) is not lane:
            return  # its device failed: its submissions went with it
        n = lane.advance(sig.mark, now, done)  # type: ignore[arg-type]
        if n:
            self._pending -= n
            streams[sig.raw] = lane.device
        if lane.idle():
            del self._lanes[sig.raw]

    def _complete(self, done: Done, streams: Mapping[Any, int], here: Any = None) -> None:
        """Finish submissions whose signals fired (outside the lock)."""
        for raw in streams:
            self._backend.signal_fired(raw)
        self._deliver(self._confirm(done, list(streams.items())), here)

    @property
    def pending(self) -> int:
        """Submissions handed over whose work has not been seen to finish."""
        return self._pending

    @property
    def lanes(self) -> Mapping[Any, _Lane]:
        """The streams with submissions not yet seen to finish, each with its
        lane: ``len(lane.subs)`` pending submissions, none seen to finish
        since ``lane.since`` (:func:`time.monotonic`).  A stream with nothing
        pending has no lane, or one with no submissions.  Read without the
        lock, for heuristics such as scheduling: a snapshot that may be
        stale at once; never modify it."""
        return self._lanes

    def fail_device(self, device: int, error: BaseException) -> None:
        """Fail every pending submission of ``device`` (a fault, a reset).

        Its pipe signals are dropped: their read ends are closed, and the
        write ends that the GPU would have closed are leaked, never closed
        here (a late close by the driver would close whatever reused the
        number)."""
        done: Done = []
        with self._lock:
            for raw in [r for r, lane in self._lanes.items() if lane.device == device]:
                q = self._lanes.pop(raw).subs
                done.extend((s, error) for s in q)
                self._pending -= len(q)
            for reader in self._readers.values():
                if reader is None:
                    continue
                for fd in [fd for fd, s in reader.signals.items() if s.lane.device == device]:
                    self._drop_signal(reader.signals.pop(fd))
                    os.close(fd)
        self._deliver(done)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._backend.wake()

    def drain(self, timeout: float) -> None:
        """Close, and wait up to ``timeout`` s for the thread to complete every
        pending run (and so run their callbacks and release what they kept)."""
        self.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _deliver(self, done: Done, here: Any = None) -> None:
        """Finish ``done`` and wake their tasks: those of loop ``here`` (the
        loop running this) directly, the others with one post per loop."""
        direct: list[Callable[[], object]] = []
        posts: dict[int, tuple[Any, Poster, list[Callable[[], object]]]] = {}
        for sub, err in done:
            for target, poster, fn in sub._finish(err):
                if target is here:
                    direct.append(fn)
                    continue
                entry = posts.get(id(target))
                if entry is None:
                    posts[id(target)] = (target, poster, [fn])
                else:
                    entry[2].append(fn)
        for fn in direct:
            fn()
        for target, poster, fns in posts.values():
            post(target, poster, fns)

    # -- the dispatcher thread ----------------------------------------------------
    def _run(self) -> None:
        backend = self._backend
        last_check = time.monotonic()
        idle_since: float | None = None
        while True:
            with self._lock:
                busy = self._busy()
                if self._closed and not self._pending:
                    return
                if busy:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > _IDLE_GRACE_S:
                    self._armed = False
            try:
                backend.wait_signals(WATCHDOG_S if self._armed else None)
            except BaseException as exc:  # pragma: no cover - a backend bug
                warnings.warn(f"gpuflow: waiting for signals failed: {exc!r}", stacklevel=1)
                time.sleep(WATCHDOG_S)
            done: Done = []
            signalled: dict[Any, int] = {}
            now = time.monotonic()
            with self._lock:
                idle = []
                for raw, lane in self._lanes.items():
                    n = backend.take_signals(raw)
                    if n:
                        marks, upto = lane.marks, lane.completed
                        for _ in range(min(n, len(marks))):
                            upto = max(upto, marks.popleft())
                        self._pending -= lane.advance(upto, now, done)  # type: ignore[arg-type]
                        signalled[raw] = lane.device
                    if lane.idle():
                        idle.append(raw)
                for raw in idle:
                    del self._lanes[raw]
                # runs submitted while the counted signal that just fired was
                # in flight were left to it (see _signal): one signal for them
                failed: list[tuple[int, BaseException]] = []
                for raw in signalled:
                    lane = self._lanes.get(raw)  # type: ignore[assignment]
                    if lane is not None and not lane.marks:
                        error = self._signal_deferred(raw, lane)
                        if error is not None:
                            failed.append((lane.device, error))
                busy = self._busy()
                check = busy and now - last_check >= WATCHDOG_S
                suspects = [(r, lane.device) for r, lane in self._lanes.items()] if check else []
                comms = [c for c in self._comms if c.busy] if check else []
            for device, error in failed:  # a fault: its runs fail with it
                self.fail_device(device, error)
            if done:
                self._deliver(self._confirm(done, list(signalled.items())))
            if check:
                last_check = time.monotonic()
                self._watch(suspects)
                self._reap()
                for comm in comms:
                    try:
                        comm.poll()
                    except Exception as exc:  # never kills the dispatcher
                        warnings.warn(f"gpuflow: watching {comm!r} failed: {exc!r}", stacklevel=1)

    def _reap(self) -> None:
        """Complete pipe signals that fired but that their loop has not
        handled for a whole tick (or will never: it ended); forget readers of
        loops that ended once nothing of theirs is in flight."""
        done: Done = []
        streams: dict[Any, int] = {}
        now = time.monotonic()
        with self._lock:
            readers = list(self._readers.items())
        for target, reader in readers:
            if reader is None:
                continue
            ended = reader.loop.finished()
            with self._lock:
                sigs = list(reader.signals.values())
                if sigs:
                    poller = select.poll()
                    for sig in sigs:
                        poller.register(sig.fd, select.POLLIN)
                    fired = {fd for fd, _ in poller.poll(0)}
                    for sig in sigs:
                        if sig.fd not in fired:
                            continue
                        if ended:  # nobody else will: close it here
                            del reader.signals[sig.fd]
                            self._drop_signal(sig)
                            os.close(sig.fd)
                        elif not sig.seen:
                            sig.seen = True  # the loop may get to it: give it a tick
                            continue
                        if not sig.taken:
                            self._take(sig, now, done, streams)
                if ended and not reader.signals:
                    del self._readers[target]
                    for r, w in reader.spares:  # never enqueued: both ends are ours
                        os.close(r)
                        os.close(w)
                    reader.spares.clear()
                    reader.epoll.close()
        if done:
            self._complete(done, streams)

    def _confirm(
        self,
        done: list[tuple[Submission, BaseException | None]],
        streams: list[tuple[Any, int]],
    ) -> list[tuple[Submission, BaseException | None]]:
        """Ask the driver about each signalled stream before reporting success:
        one query a stream a wake-up, and a fault the driver already knows of
        (a host function running after the context died) is never reported
        as success.  Seen on the H200: work already running on another stream
        when a kernel faults finishes normally, and the driver reports the
        fault only afterwards, so that work is rightly a success."""
        faulted: dict[int, BaseException] = {}
        for raw, device in streams:
            fault = self._query(raw)
            if fault is not None:
                faulted.setdefault(device, fault)
        if not faulted:
            return done
        for device, error in faulted.items():
            self.fail_device(device, error)
        return [(s, faulted.get(s.device, err)) for s, err in done]

    def _query(self, raw: Any) -> DeviceFaultError | None:
        """The sticky fault a query of ``raw`` reports, if any.

        Any other failure is warned about and ignored: failing the device's
        runs would release what their work may still be using (a leak is
        better than a dangling pointer), and their signals still come."""
        try:
            self._backend.query(raw)
        except DeviceFaultError as fault:
            return fault
        except Exception as exc:
            warnings.warn(f"gpuflow: querying a stream failed: {exc!r}", stacklevel=1)
        return None

    def _watch(self, streams: list[tuple[Any, int]]) -> None:
        faulted: dict[int, BaseException] = {}
        for raw, device in streams:
            if device in faulted:
                continue
            fault = self._query(raw)
            if fault is not None:
                faulted[device] = fault
        for device, err in faulted.items():
            self.fail_device(device, err)
