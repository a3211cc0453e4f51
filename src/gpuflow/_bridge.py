"""The completion bridge: the GPU wakes the awaiting task.

A run ends by enqueueing a native signal on its stream (the backend's
``enqueue_signal``: on CUDA a ``sem_post`` host function that needs no GIL)
and handing its :class:`Submission` to the :class:`Dispatcher`.  One
dispatcher thread per runtime waits natively for signals, learns which
submissions finished (signals arrive in stream order, so a FIFO per stream
says which), releases what each retained, and posts to each waiting event
loop through its AnyIO event-loop token with the *non-blocking* post
(``call_soon_threadsafe`` / ``TrioToken.run_sync_soon``): completions that
arrive together reach a loop in one wake-up.  A post to a loop that has
finished is dropped quietly.

While work is pending the dispatcher also keeps a watchdog: a device that
faulted never runs its host functions, so every ``WATCHDOG_S`` it queries the
streams that have pending work, and a sticky fault fails every pending
submission of that device with :class:`DeviceFaultError`.
"""

from __future__ import annotations

import collections
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.lowlevel

from ._backends._base import Backend
from ._errors import DeviceError, DeviceFaultError
from ._loops import Loop, current_loop

WATCHDOG_S = 0.02
#: After the last pending submission, keep the watchdog timer this long so
#: that a busy program does not pay a wake-up per submission.
_IDLE_GRACE_S = 1.0

#: How a completion reaches a waiting task: the loop (or Trio token) to post
#: to, its non-blocking post, and the idempotent wake-up to run there.
Poster = Callable[[Callable[[], object]], object]
Waiter = tuple[Any, Poster, Callable[[], object]]


#: Makes "done" and "take the callbacks" one step against add_done_callback.
_callbacks_lock = threading.Lock()


class Submission:
    """What one run enqueued and must keep alive until the GPU is done with it.

    ``keep`` holds host buffers, staging memory, graphs and leases that
    enqueued work still uses; it is released by the completion (or a fault),
    never earlier, whatever happens to the task that started the run.
    """

    __slots__ = ("device", "done", "error", "keep", "on_done", "waiters")

    def __init__(self, device: int) -> None:
        self.device = device
        self.keep: list[object] = []
        self.done = False
        self.error: BaseException | None = None
        self.waiters: list[Waiter] = []
        self.on_done: list[Callable[[BaseException | None], None]] | None = None

    def add_done_callback(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(error)`` once, on the dispatcher thread when the work is
        done (at once, here, if it already is).  Safe from any thread, also
        while the work completes.  ``fn`` must not block or raise."""
        with _callbacks_lock:
            if not self.done:
                if self.on_done is None:
                    self.on_done = []
                self.on_done.append(fn)
                return
        fn(self.error)

    def _finish(self, error: BaseException | None) -> list[Waiter]:
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
    before it: ``marks`` holds, per signal in flight, how many submissions had
    been appended when it was enqueued (strictly increasing, recorded under
    the dispatcher's lock).  When signals fire, the last mark popped says how
    many submissions are done.  Popping marks in the order they were recorded
    is safe even when two threads enqueue their signals in the other order:
    after ``n`` signals fired, the largest mark among them is at least the
    ``n``-th mark recorded.
    """

    __slots__ = ("appended", "completed", "device", "marks", "since", "subs")

    def __init__(self, device: int) -> None:
        self.device = device
        self.subs: collections.deque[Submission] = collections.deque()
        self.marks: collections.deque[int] = collections.deque()
        self.appended = 0
        self.completed = 0
        #: when the lane last saw a submission finish, or was made (see lanes)
        self.since = time.monotonic()

    def mark(self) -> bool:
        """Record a signal covering everything appended; False if one already does."""
        covered = self.marks[-1] if self.marks else self.completed
        if covered == self.appended:
            return False
        self.marks.append(self.appended)
        return True


class Dispatcher:
    """The one thread that turns native signals into completed submissions.

    Awaited runs share signals: the first run a loop submits in one turn of
    that loop enqueues its signal at once (a lone await waits for nothing
    more) and schedules a flush for the end of the turn; runs that the same
    loop submits before the flush enqueue no signal of their own, the flush
    enqueues one per stream for all of them.  Sixty-four tasks woken together
    thus cost a handful of host functions and dispatcher wake-ups, not 64.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        # only streams with pending submissions: a finished stream is dropped
        self._lanes: dict[Any, _Lane] = {}
        self._pending = 0
        self._closed = False
        self._armed = False  # the thread is on its watchdog timer, no wake needed
        self._thread: threading.Thread | None = None
        # per thread: the loop whose flush is scheduled, and the lanes it will signal
        self._local = threading.local()

    def submit(self, raw_stream: Any, sub: Submission, loop: Loop | None = None) -> None:
        """Complete ``sub`` when the work enqueued so far on ``raw_stream`` is done.

        With ``loop`` (the loop running in this thread), the signal may be
        left to the flush that loop runs at the end of its turn; whoever
        submits that way must call :meth:`flush` if it stops waiting for
        ``sub`` before the loop gets there.
        """
        local = self._local
        with self._lock:
            lane = self._lanes.get(raw_stream)
            if lane is None:
                lane = self._lanes[raw_stream] = _Lane(sub.device)
            lane.subs.append(sub)
            lane.appended += 1
            self._pending += 1
            wake = not self._armed
            self._armed = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="gpuflow-dispatcher", daemon=True
                )
                self._thread.start()
            defer = loop is not None and getattr(local, "flushing", None) is loop.target
            if defer:
                local.dirty[raw_stream] = lane
            else:
                lane.mark()
        if wake:
            self._backend.wake()
        if defer:
            return
        self._signal(raw_stream, lane.device)
        if loop is not None:
            if getattr(local, "dirty", None):
                self.flush()  # left by a loop that ended before its flush ran
            try:
                loop.call_soon(self.flush)
            except RuntimeError:  # the loop is finishing: every run signals alone
                pass
            else:
                local.flushing = loop.target
                local.dirty = {}

    def flush(self) -> None:
        """Enqueue the signals this thread's loop left for the end of its turn.

        Never raises: a failure to enqueue fails the device's pending runs."""
        local = self._local
        local.flushing = None
        dirty: dict[Any, _Lane] = getattr(local, "dirty", {})
        local.dirty = {}
        for raw, lane in dirty.items():
            with self._lock:
                if self._lanes.get(raw) is not lane or not lane.mark():
                    continue  # failed meanwhile, or another signal covers it
            try:
                self._signal(raw, lane.device)
            except DeviceError:
                pass  # a fault: the device's awaits fail with it
            except BaseException as exc:
                warnings.warn(f"gpuflow: could not signal a stream: {exc!r}", stacklevel=1)

    def _signal(self, raw_stream: Any, device: int) -> None:
        """Enqueue the signal of the mark just recorded; a failure fails the device
        (whose runs can no longer be seen to finish) and is raised."""
        try:
            self._backend.enqueue_signal(raw_stream)
        except BaseException as exc:
            self.fail_device(device, exc)
            raise

    @property
    def pending(self) -> int:
        """Submissions handed over whose work has not been seen to finish."""
        return self._pending

    @property
    def lanes(self) -> Mapping[Any, _Lane]:
        """The streams with submissions not yet seen to finish, each with its
        lane: ``len(lane.subs)`` pending submissions, none seen to finish
        since ``lane.since`` (:func:`time.monotonic`).  A stream with nothing
        pending has no lane.  Read without the lock, for heuristics such as
        scheduling: a snapshot that may be stale at once; never modify it."""
        return self._lanes

    def fail_device(self, device: int, error: BaseException) -> None:
        """Fail every pending submission of ``device`` (a fault, a reset)."""
        done: list[tuple[Submission, BaseException | None]] = []
        with self._lock:
            for raw in [r for r, lane in self._lanes.items() if lane.device == device]:
                q = self._lanes.pop(raw).subs
                done.extend((s, error) for s in q)
                self._pending -= len(q)
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

    def _deliver(self, done: list[tuple[Submission, BaseException | None]]) -> None:
        # coalesced: one post per loop, however many of its tasks finished
        posts: dict[int, tuple[Any, Poster, list[Callable[[], object]]]] = {}
        for sub, err in done:
            for target, poster, fn in sub._finish(err):
                entry = posts.get(id(target))
                if entry is None:
                    posts[id(target)] = (target, poster, [fn])
                else:
                    entry[2].append(fn)
        for target, poster, fns in posts.values():
            post(target, poster, fns)

    def _run(self) -> None:
        backend = self._backend
        last_check = time.monotonic()
        idle_since: float | None = None
        while True:
            with self._lock:
                if self._closed and not self._pending:
                    return
                pending = self._pending
                if pending:
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
            done: list[tuple[Submission, BaseException | None]] = []
            signalled: list[tuple[Any, int]] = []
            now = time.monotonic()
            with self._lock:
                idle = []
                for raw, lane in self._lanes.items():
                    n = backend.take_signals(raw)
                    if n:
                        signalled.append((raw, lane.device))
                        marks, upto = lane.marks, lane.completed
                        for _ in range(min(n, len(marks))):
                            upto = marks.popleft()
                        q = lane.subs
                        for _ in range(upto - lane.completed):
                            done.append((q.popleft(), None))
                        if upto != lane.completed:
                            lane.since = now
                        lane.completed = upto
                    if not lane.subs and not lane.marks:
                        idle.append(raw)
                for raw in idle:
                    del self._lanes[raw]
                self._pending -= len(done)
                check = self._pending > 0 and time.monotonic() - last_check >= WATCHDOG_S
                suspects = [(r, lane.device) for r, lane in self._lanes.items()] if check else []
            if done:
                done = self._confirm(done, signalled)
                self._deliver(done)
            if check:
                last_check = time.monotonic()
                self._watch(suspects)

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
