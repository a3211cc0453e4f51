"""Completion in the ``sim`` backend: the words its streams write, and its driver thread.

The simulation's counterpart of the cuda backend's ``_words`` and
``_native``, and held to the same contract:

* a completion mark is an item of its stream: when the stream reaches it,
  the stream's own worker sets the stream's word to the mark's number, in
  stream order, as the GPU writes the word into host memory.  A loop reads
  the word as an attribute, with no lock and no call, as it reads pinned
  memory on a GPU; it never sees a number the stream has not reached;
* a silent mark (one no task awaits) is a mark like any other here: what
  the cuda backend does differently (an event, not a write of the word) is
  cheaper on a GPU, and its reader and waits answer as for any mark;
* a stream waits for another's mark as an item that holds the waiting
  stream, never the host (``cuStreamWaitValue64``), and fails with the
  other device's fault where that device stops before the mark;
* a host signal (a sleeping loop's wake-up: the write end of its pipe,
  closed) is handed by the stream's worker to one driver thread, which
  calls it: never the stream's thread, never the thread that enqueued it, as
  CUDA runs host functions on a thread of its own.  A device that faults
  stops its streams before they reach it, so a faulted stream's signals
  never fire.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._errors import UsageError

if TYPE_CHECKING:
    from ._backend import SimBackend


class SimCompletion:
    """What :class:`SimBackend` does for completion marks and host signals
    (kept apart from it).  :meth:`mark`, :meth:`reader`, :meth:`wait` and
    :meth:`enqueue_close` are safe from any thread; :meth:`wake` and
    :meth:`close` are called with the backend's lock held."""

    def __init__(self, backend: SimBackend) -> None:
        self._backend = backend
        #: the driver thread sleeps on it (the backend's lock, as every condition of the sim)
        self._driver_cv = threading.Condition(backend.lock)
        #: what host signals do, run in order by the driver thread (under the lock)
        self.driver_queue: collections.deque[Callable[[], None]] = collections.deque()
        self._closed = False
        self.driver = threading.Thread(target=self._drive, name="gpuflow-sim-driver", daemon=True)
        self.driver.start()

    def _drive(self) -> None:
        with self._driver_cv:
            while True:
                while not self.driver_queue and not self._closed:
                    self._driver_cv.wait()
                if self._closed:
                    return
                deliver = self.driver_queue.popleft()
                deliver()

    def wake(self) -> None:
        """Under the lock: the driver thread sees what changed (a fault, a reset, closing)."""
        self._driver_cv.notify_all()

    def close(self) -> None:
        """Under the lock: the driver thread ends (signals still queued never fire)."""
        self._closed = True
        self._driver_cv.notify_all()

    # -- marks ------------------------------------------------------------------
    def mark(self, stream: Any) -> int:
        be = self._backend
        be.refuse_destroyed(stream)  # as the cuda backend refuses it
        cond = be.cond
        with cond:
            if stream.capture is not None:
                raise UsageError("a completion mark cannot be captured into a graph")
            number: int = stream.issued + 1

            def reach() -> None:
                with cond:
                    stream.word = number
                    cond.notify_all()  # mark waits

            be.enqueue_locked(stream, "completion mark", reach, False)
            stream.issued = number
            return number

    @staticmethod
    def reader(stream: object) -> Callable[[], int]:
        reader: Callable[[], int] = functools.partial(getattr, stream, "word")
        return reader

    def wait(self, stream: Any, other: Any, number: int) -> None:
        be = self._backend
        be.refuse_destroyed(stream)
        if other.word >= number and stream.capture is None:
            return  # reached: nothing to wait for
        peer = other.device
        cond = be.cond

        def wait() -> None:
            with cond:
                while other.word < number and peer.fault is None and stream.device.fault is None:
                    cond.wait()
                if peer.fault is not None and other.word < number:
                    raise peer.fault

        be.enqueue_item(stream, "mark wait", wait)

    # -- host signals -------------------------------------------------------------
    def _host_signal(self, deliver: Callable[[], None]) -> Callable[[], None]:
        """The stream item of a host signal: it hands ``deliver`` to the
        driver thread, which runs it (under the lock), never the stream."""

        def signal() -> None:
            with self._driver_cv:
                self.driver_queue.append(deliver)
                self._driver_cv.notify()

        return signal

    def enqueue_close(self, stream: Any, fd: int) -> bool:
        be = self._backend
        be.refuse_destroyed(stream)
        # a captured close would run again at every replay
        return be.enqueue_item(
            stream, "host signal", self._host_signal(lambda: os.close(fd)), capturable=False
        )
