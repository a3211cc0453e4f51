"""The activity record on CUDA: what gpuflow's streams ran, timed by CUDA events.

While a record is open (a timeline records, or ``gf.testing.record_activity``),
each kernel, copy, fill and graph replay enqueued on one of gpuflow's own
streams is bracketed by two timing events; not on another library's stream,
and not during a capture, where an event would become a node of the graph.
Event records, waits and completion marks are not timed.  An item's events
are read once the second is done, when the record is brought up to date
(:meth:`Timer.update`): each device has a reference event, recorded on its
private stream (idle) and waited for when the device's first item is timed,
whose host time is known to within that wait (some microseconds); an
event's host time is the reference's plus ``cuEventElapsedTime`` from it.
Tracing must never fail the work it watches: an event that cannot be made
or recorded leaves its item untimed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

from .._codes import CUDA_ERROR_NOT_READY
from .._records import Activity, activity_tag
from ._handles import CudaStream, Dev, Token


class _Reference(NamedTuple):
    dev: Dev
    token: Token  # the life of the context it belongs to
    event: int
    host: float  # perf_counter seconds at which the device recorded it


class Timed(NamedTuple):
    """One item between its two events (``end`` 0 until it is enqueued)."""

    dev: Dev
    token: Token
    stream: int
    what: str
    tag: int | None
    start: int
    end: int


class Timer:
    """The open records of one backend and the items timed for them."""

    def __init__(self, cu: ModuleType, native: Any, cur: Callable[[Dev], object]) -> None:
        self._cu = cu
        self._n = native
        self.make_current = cur
        #: the open records: empty (and free to check) when none is
        self.records: tuple[list[Activity], ...] = ()
        self._lock = threading.Lock()
        self._pending: list[Timed] = []
        self._refs: dict[int, _Reference] = {}

    def open(self) -> list[Activity]:
        record: list[Activity] = []
        with self._lock:
            self.records = (*self.records, record)
        return record

    def close(self, record: list[Activity]) -> None:
        with self._lock:
            self.records = tuple(r for r in self.records if r is not record)
            if self.records:
                return
            pending, self._pending = self._pending, []
            refs, self._refs = list(self._refs.values()), {}
        for item in pending:  # a recorded event may be destroyed: freed once done
            self._destroy(item.dev, item.token, item.start, item.end)
        for ref in refs:
            self._destroy(ref.dev, ref.token, ref.event)

    # -- on the thread that enqueues, with the stream's context current ----------------
    def start(self, dev: Dev, stream: CudaStream, what: str) -> Timed | None:
        """Record the start of an item about to be enqueued on ``stream``."""
        if stream.capture is not None or stream.foreign:
            return None
        try:
            if self._reference(dev) is None:
                return None
            ev = self._event()
        except Exception:
            return None
        if self._n.event_record(ev, stream.handle):
            self._destroy(dev, dev.token, ev)
            return None
        return Timed(dev, dev.token, stream.handle, what, activity_tag.get(), ev, 0)

    def end(self, timed: Timed | None) -> None:
        """Record the end of an item just enqueued, and keep it until it is done."""
        if timed is None:
            return
        try:
            ev = self._event()
        except Exception:
            ev = 0
        if not ev or self._n.event_record(ev, timed.stream):
            self._destroy(timed.dev, timed.token, timed.start, ev)
            return
        with self._lock:
            if self.records:
                self._pending.append(timed._replace(end=ev))
                return
        self._destroy(timed.dev, timed.token, timed.start, ev)  # closed meanwhile

    def drop(self, timed: Timed | None) -> None:
        """The item was not enqueued after all (its enqueue failed)."""
        if timed is not None:
            self._destroy(timed.dev, timed.token, timed.start)

    # -- any thread ----------------------------------------------------------------------
    def update(self) -> None:
        """Append every timed item whose end is done to the open records."""
        with self._lock:
            records = self.records
            pending, self._pending = self._pending, []
            kept: list[Timed] = []
            done: list[Activity] = []
            elapsed = self._cu.cuEventElapsedTime
            for item in pending:
                dev = item.dev
                ref = self._refs.get(dev.index)
                if (
                    item.token is not dev.token
                    or dev.fault is not None
                    or ref is None
                    or ref.token is not item.token
                ):
                    continue  # gone with its context (or faulted): leaked, never destroyed
                try:
                    self.make_current(dev)
                except Exception:
                    continue  # its context cannot be made current: leaked
                rc = self._n.event_query(item.end)
                if rc == CUDA_ERROR_NOT_READY:
                    kept.append(item)
                    continue
                if rc == 0:
                    err0, ms0 = elapsed(ref.event, item.start)
                    err1, ms1 = elapsed(ref.event, item.end)
                    if not int(err0) and not int(err1):
                        done.append(Activity(
                            dev.index, item.stream, item.what,
                            ref.host + ms0 / 1e3, ref.host + ms1 / 1e3, item.tag,
                        ))  # fmt: skip
                self._destroy(dev, item.token, item.start, item.end)
            self._pending = kept
            for record in records:
                record.extend(done)

    # -- helpers ---------------------------------------------------------------------------
    def _event(self) -> int:
        err, ev = self._cu.cuEventCreate(0)  # timing enabled
        if int(err):
            raise RuntimeError(f"cuEventCreate: {int(err)}")
        return int(ev)

    def _reference(self, dev: Dev) -> _Reference | None:
        """The device's reference event, made now if this life of its context
        has none: recorded on its idle private stream and waited for."""
        with self._lock:
            ref = self._refs.get(dev.index)
        if ref is not None and ref.token is dev.token:
            return ref
        ev = self._event()
        t0 = time.perf_counter()
        if self._n.event_record(ev, dev.side) or self._n.stream_synchronize(dev.side):
            self._destroy(dev, dev.token, ev)
            return None
        t1 = time.perf_counter()
        # the device took it between the two readings, on a stream with nothing before it
        ref = _Reference(dev, dev.token, ev, (t0 + t1) / 2)
        with self._lock:
            old = self._refs.get(dev.index)
            if old is not None and old.token is dev.token:
                new, ref = ref, old  # made meanwhile on another thread: keep that one
                self._destroy(dev, dev.token, new.event)
            else:
                self._refs[dev.index] = ref
        return ref

    def _destroy(self, dev: Dev, token: Token, *events: int) -> None:
        if token is not dev.token or dev.fault is not None:
            return  # a context that is gone or faulted: leak rather than dangle
        try:
            self.make_current(dev)
            for ev in events:
                if ev:
                    self._cu.cuEventDestroy(ev)
        except Exception:
            pass  # an event left behind: what tracing costs, never a failure
