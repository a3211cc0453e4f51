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
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from ._backends._base import Backend

WATCHDOG_S = 0.02
#: After the last pending submission, keep the watchdog timer this long so
#: that a busy program does not pay a wake-up per submission.
_IDLE_GRACE_S = 1.0

Waiter = tuple[Any, Callable[[], object]]


class Submission:
    """What one run enqueued and must keep alive until the GPU is done with it.

    ``keep`` holds host buffers, staging memory, graphs and leases that
    enqueued work still uses; it is released by the completion (or a fault),
    never earlier, whatever happens to the task that started the run.

    Any number of tasks may :meth:`wait` for it (the task that started the
    run, and a scope that drains it on exit): the completion wakes them all.
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
        """Call ``fn(error)`` on the dispatcher thread when the work is done
        (at once, here, if it already is).  ``fn`` must not block or raise."""
        if self.on_done is None:
            self.on_done = []
        self.on_done.append(fn)
        if self.done:
            self.on_done.remove(fn)
            fn(self.error)

    def _finish(self, error: BaseException | None) -> list[Waiter]:
        self.error = error
        self.keep = []
        self.done = True
        callbacks, self.on_done = self.on_done, None
        for fn in callbacks or ():
            try:
                fn(error)
            except BaseException as exc:  # never into the dispatcher thread
                warnings.warn(f"gpuflow: a completion callback raised {exc!r}", stacklevel=1)
        return self.waiters

    async def wait(self) -> None:
        """Wait (cancellably) until the work is done; raise its device error.

        On cancellation the loop's own exception propagates at once; the
        submission still retains its resources until the GPU is done.
        """
        if not self.done:
            token = anyio.lowlevel.current_token()
            event = anyio.Event()
            self.waiters.append((token, event.set))
            # the dispatcher may have finished us between the check and here:
            # a wake-up is idempotent, so a double wake is harmless
            if not self.done:
                await event.wait()
            else:
                await anyio.lowlevel.checkpoint()
        else:
            await anyio.lowlevel.checkpoint()
        if self.error is not None:
            raise self.error


def _post(token: Any, fns: list[Callable[[], object]]) -> None:
    def run_all() -> None:
        for fn in fns:
            fn()

    try:
        token.backend_class.run_sync_soon(run_all, (), token.native_token)
    except anyio.RunFinishedError:
        pass  # the loop is gone and so is whoever waited
    except Exception as exc:
        warnings.warn(f"gpuflow: could not wake an event loop: {exc!r}", stacklevel=1)


class Dispatcher:
    """The one thread that turns native signals into completed submissions."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._fifo: dict[Any, collections.deque[Submission]] = {}
        self._devices: dict[Any, int] = {}
        self._pending = 0
        self._closed = False
        self._armed = False  # the thread is on its watchdog timer, no wake needed
        self._thread: threading.Thread | None = None

    def submit(self, raw_stream: Any, sub: Submission) -> None:
        """Signal the end of ``sub``'s work on ``raw_stream``; complete it when reached."""
        with self._lock:
            q = self._fifo.get(raw_stream)
            if q is None:
                q = self._fifo[raw_stream] = collections.deque()
                self._devices[raw_stream] = sub.device
            q.append(sub)
            self._pending += 1
            wake = not self._armed
            self._armed = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="gpuflow-dispatcher", daemon=True
                )
                self._thread.start()
        try:
            self._backend.enqueue_signal(raw_stream)
        except BaseException as exc:
            with self._lock:
                if sub in q:
                    q.remove(sub)
                    self._pending -= 1
            if not sub.waiters:
                sub._finish(exc)
            raise
        if wake:
            self._backend.wake()

    @property
    def pending(self) -> int:
        """Submissions handed over whose work has not been seen to finish."""
        return self._pending

    def fail_device(self, device: int, error: BaseException) -> None:
        """Fail every pending submission of ``device`` (a fault, a reset)."""
        done: list[tuple[Submission, BaseException | None]] = []
        with self._lock:
            for raw, q in self._fifo.items():
                if self._devices[raw] == device and q:
                    done.extend((s, error) for s in q)
                    self._pending -= len(q)
                    q.clear()
        self._deliver(done)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._backend.wake()

    def _deliver(self, done: list[tuple[Submission, BaseException | None]]) -> None:
        posts: dict[int, tuple[Any, list[Callable[[], object]]]] = {}
        for sub, err in done:
            for token, fn in sub._finish(err):
                entry = posts.get(id(token.native_token))
                if entry is None:
                    posts[id(token.native_token)] = (token, [fn])
                else:
                    entry[1].append(fn)
        for token, fns in posts.values():
            _post(token, fns)

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
            with self._lock:
                for raw, q in self._fifo.items():
                    if not q:
                        continue
                    n = backend.take_signals(raw)
                    for _ in range(min(n, len(q))):
                        done.append((q.popleft(), None))
                self._pending -= len(done)
                check = self._pending > 0 and time.monotonic() - last_check >= WATCHDOG_S
                suspects = [raw for raw, q in self._fifo.items() if q] if check else []
            if done:
                self._deliver(done)
            if check:
                last_check = time.monotonic()
                self._watch(suspects)

    def _watch(self, streams: list[Any]) -> None:
        faulted: dict[int, BaseException] = {}
        for raw in streams:
            device = self._devices[raw]
            if device in faulted:
                continue
            try:
                self._backend.query(raw)
            except Exception as exc:  # a fault, or an unknown failure: either ends the wait
                faulted[device] = exc
        for device, err in faulted.items():
            self.fail_device(device, err)
