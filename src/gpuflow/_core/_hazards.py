"""Hazard tracking: which stream last wrote an allocation, which read it since.

An :class:`Allocation` is one device buffer and its hazard state.  An
operation that uses it on another stream orders itself after the last write
(read-after-write) or after every use since (write-after-read,
write-after-write), and work that stays on one stream pays nothing.  Each
use is remembered with *where* on its stream it happened (a :class:`Point`):
the run that made it, whose mark the GPU writes right after the run's work
(or, for a ``zip`` arm, the event of its join), so that the wait is for that
use, never for whatever its stream ran later; a use already known to be
done costs no wait at all.  A use whose point is not known yet (its run is
still being enqueued) is waited for with an event recorded when asked.
When the last array of an allocation goes, it is freed *in stream order*,
after every use that was enqueued: nothing the GPU still reads is freed
early.  The free is enqueued at the next safe point (a run starting, the
reaper thread), never inside the finalizer itself, which
may run on a thread holding a lock the free needs (:mod:`._finalizers`).

Inside a graph capture nothing runs, so uses are logged instead
(:data:`capture_log`) and every replay is ordered after them.

Another library's use of the memory (an array exported through DLPack, once
its consumer lets go of it) is known only as an event on that library's
stream (:meth:`Allocation.after_foreign`): every later use, and the free,
waits for it; it counts as a write, since the consumer may have written.
One event a stream is kept (a later one covers an earlier one), so an array
exported again and again keeps a bounded set.

The allocations gpuflow made itself are counted, per device, in their
runtime's :class:`MemoryLedger` (what :func:`gpuflow.memory_stats` reports
as in use); another library's memory is not.
"""

from __future__ import annotations

import collections
import sys
import threading
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from .._errors import UsageError
from ._finalizers import finalize_later

if TYPE_CHECKING:
    from .._backends import Backend, RawBuffer, RawEvent, RawStream
    from ._stream import Stream


class Point(Protocol):
    """Where on a stream a use of an allocation happened (a run's
    :class:`gpuflow.lowlevel.Run`, an :class:`EventPoint`)."""

    def _order(self, backend: Backend, stream: RawStream, on: RawStream) -> bool:
        """Make later work on raw ``stream`` wait for this point of raw
        ``on`` (nothing where it is known to be done); False where this
        point cannot say where on ``on`` it is."""

    def _wait_noted(self, on: Stream, point: Point | None) -> None:
        """This point's work was ordered after ``point`` of ``on`` (what
        ``gf.in_flight()`` says a run may wait for)."""


class EventPoint:
    """A use followed, on its stream, by an event recorded right after it."""

    __slots__ = ("event",)

    def __init__(self, event: RawEvent) -> None:
        self.event = event

    def _order(self, backend: Backend, stream: RawStream, on: RawStream) -> bool:
        backend.wait_event(stream, self.event)
        return True

    def _wait_noted(self, on: Stream, point: Point | None) -> None:
        pass


def order_after(
    backend: Backend, stream: Stream, on: Stream, point: Point | None, waiter: Point | None = None
) -> None:
    """Make later work on ``stream`` wait for the use at ``point`` of ``on``
    (for a use with no known point, for everything enqueued on ``on``);
    ``waiter``, the run whose work it is, notes the wait."""
    if on == stream:
        return
    if waiter is not None:
        waiter._wait_noted(on, point)
    if point is None or not point._order(backend, stream.raw, on.raw):
        final = on._final  # (a destroyed stream takes no new event)
        backend.wait_event(stream.raw, final[0] if final else backend.record_event(on.raw))


#: The hazard log of the capture running in this context, if any: allocation
#: id -> (allocation, whether the captured work writes it).
capture_log: ContextVar[dict[int, tuple[Allocation, bool]] | None] = ContextVar(
    "gpuflow_capture_log", default=None
)

def refuse_in_capture(what: object) -> None:
    """Running another operation from inside a capture would not be captured."""
    if capture_log.get() is not None:
        raise UsageError(f"{what} inside a graph capture: compose the operation instead")


#: Ordering a use after an allocation's hazards and enqueueing that use must be
#: one step: another thread recording the allocation's last write in between
#: would not see this use, and its work would race with it.  A run's work
#: takes it in :func:`enqueue_ordered`, from its first ``before_read`` or
#: ``before_write`` until its work is enqueued; one lock for every
#: allocation, because a launch orders itself after several, in any order.
hazard_lock = threading.RLock()

T = TypeVar("T")

#: A use of memory by a run's work: the allocation, the stream the work is
#: enqueued on, and whether it writes there (else it only reads).
Use = tuple["Allocation", "Stream", bool]


def enqueue_ordered(
    run: Point | None, uses: Iterable[Use], enqueue: Callable[..., T], *args: object
) -> T:
    """Order the uses of a run's work after the hazards they meet, then
    enqueue the work (``enqueue(*args)``): the one place a run's work is
    ordered (a launch, a copy, a graph replay, another library's work, a
    collective), as one step under :data:`hazard_lock`.  A read waits for the
    last write (and other libraries' uses since); a write waits for that
    write and for every read since.  The uses are ordered as given: reads
    before writes, so that memory both read and written is last a write.
    Any thread; what ``enqueue`` raises propagates."""
    with hazard_lock:
        for alloc, stream, writes in uses:
            if writes:
                alloc.before_write(stream, run)
            else:
                alloc.before_read(stream, run)
        return enqueue(*args)

_NO_FOREIGN: Mapping[Hashable, Any] = MappingProxyType({})


class MemoryLedger:
    """The bytes and the number of live allocations a runtime made, per device.

    An allocation is counted when it is made and uncounted when its last
    array goes (its finalizer, on any thread, even inside a garbage
    collection that interrupted a count): both only append to a queue,
    which is folded into the totals under a lock when they are read (and
    now and then when allocating, so that it stays short).  Nothing waits
    for a lock in a finalizer, and no update is lost.
    """

    __slots__ = ("_changes", "_lock", "_totals")

    #: fold the queue when allocating once it is this long
    _FOLD_AT = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (device, bytes, allocations) changes not folded yet; deque appends
        #: and pops are atomic, so finalizers append without the lock
        self._changes: collections.deque[tuple[int, int, int]] = collections.deque()
        self._totals: dict[int, tuple[int, int]] = {}  # device -> (bytes, allocations)

    def allocated(self, device: int, nbytes: int) -> None:
        self._changes.append((device, nbytes, 1))
        if len(self._changes) >= self._FOLD_AT:
            self.totals(device)

    def freed(self, device: int, nbytes: int) -> None:
        """Any thread, finalizers included; never blocks, never raises."""
        self._changes.append((device, -nbytes, -1))

    def totals(self, device: int) -> tuple[int, int]:
        """``(bytes, allocations)`` live on ``device`` now."""
        changes = self._changes
        with self._lock:
            totals = self._totals
            # only what is queued now: a finalizer may append meanwhile
            for _ in range(len(changes)):
                d, nbytes, count = changes.popleft()
                b, c = totals.get(d, (0, 0))
                totals[d] = (b + nbytes, c + count)
            return totals.get(device, (0, 0))


class Allocation:
    """One device buffer and its hazard state.  Freed in stream order on GC.

    ``before_read``/``before_write`` are called under :data:`hazard_lock`,
    together with the enqueue of the use they order; ``run`` is the run
    that makes the use (its :class:`Point`), None outside a run.
    ``ledger`` counts the buffer as gpuflow's own memory until it is freed
    (None: memory gpuflow did not allocate).
    """

    __slots__ = (
        "backend",
        "buffer",
        "foreign",
        "generation",
        "ledger",
        "readers",
        "readonly",
        "synced",
        "writer",
        "wrote",
    )  # fmt: skip

    def __init__(
        self,
        backend: Backend,
        buffer: RawBuffer,
        stream: Stream,
        point: Point | None = None,
        ledger: MemoryLedger | None = None,
    ) -> None:
        self.backend = backend
        self.buffer = buffer
        self.ledger = ledger
        if ledger is not None:
            ledger.allocated(buffer.device, buffer.nbytes)
        self.generation = stream._generation
        self.writer: Stream = stream  # the allocation itself is ordered on it
        self.wrote: Point | None = point  # where on it
        self.synced: set[Stream] = {stream}  # streams already ordered after the last write
        #: the streams that read it since the last write, each with where
        self.readers: dict[Stream, Point | None] = {}
        #: events of other libraries' uses since the last write, the latest of
        #: each of their streams, each a write for ordering (``synced`` streams
        #: have waited for them); replaced, never changed in place
        self.foreign: Mapping[Hashable, Any] = _NO_FOREIGN
        self.readonly = False  # memory another library lent read-only

    def after_foreign(self, stream: Hashable, event: object) -> None:
        """Another library used the memory on ``stream`` (any key naming it), up
        to ``event`` recorded there: every later use and the free wait for it.
        Any thread.

        Parameters
        ----------
        stream
            The other library's stream (a raw handle or any key naming it).
        event
            An event recorded there after its use.
        """
        with hazard_lock:
            self.foreign = {**self.foreign, stream: event}
            self.synced = set()

    def before_read(self, stream: Stream, run: Point | None = None) -> None:
        """Order a read on ``stream`` after the last write (under the hazard
        lock, with the enqueue of the read).

        Parameters
        ----------
        stream
            Where the read is enqueued.
        run
            The run the read belongs to (what a later write waits for), or
            None: the stream's work enqueued so far.
        """
        log = capture_log.get()
        if log is not None:  # captured work runs at replay: the launch orders it
            log.setdefault(id(self), (self, False))
            return
        with hazard_lock:
            if stream not in self.synced:
                be = self.backend
                for ev in self.foreign.values():
                    be.wait_event(stream.raw, ev)
                order_after(be, stream, self.writer, self.wrote, run)
                self.synced.add(stream)
            # the latest read of a stream stands for the earlier ones: its
            # point comes after them on that stream
            self.readers[stream] = run

    def before_write(self, stream: Stream, run: Point | None = None) -> None:
        """Order a write on ``stream`` after the last write and every read
        since (under the hazard lock, with the enqueue of the write).

        Parameters
        ----------
        stream
            Where the write is enqueued.
        run
            The run the write belongs to (what later uses wait for), or
            None: the stream's work enqueued so far.
        """
        log = capture_log.get()
        if log is not None:
            log[id(self)] = (self, True)
            return
        with hazard_lock:
            if self.writer is stream and not self.readers and self.foreign is _NO_FOREIGN:
                # written last on this stream, and used nowhere since: the
                # stream's order is the whole order (a loop writing the same
                # output run after run), and only the point moves
                self.wrote = run
                return
            wait_for_uses(self, stream, run)
            self.writer = stream
            self.wrote = run
            self.synced = {stream}
            self.readers = {}
            self.foreign = _NO_FOREIGN

    def __del__(self) -> None:
        if sys.is_finalizing():
            # the process is going away with its memory, and a daemon thread
            # (a stream, the driver) may be frozen holding a lock: never hang
            return
        ledger = self.ledger
        if ledger is not None:  # (also when the memory is leaked)
            ledger.freed(self.buffer.device, self.buffer.nbytes)
        finalize_later(_free, self.buffer, self.uses())

    def uses(self) -> Uses:
        """Every use so far, for a finalizer to hand on (the allocation is
        gone by the time they are waited for).

        Returns
        -------
        Uses
        """
        return Uses(self.backend, self.synced, self.foreign, self.writer, self.wrote, self.readers)


class UseState(Protocol):
    """What records an allocation's uses: a live :class:`Allocation`, or the
    :class:`Uses` a dropped one left."""

    @property
    def backend(self) -> Backend: ...
    @property
    def synced(self) -> set[Stream]: ...
    @property
    def foreign(self) -> Mapping[Hashable, Any]: ...
    @property
    def writer(self) -> Stream: ...
    @property
    def wrote(self) -> Point | None: ...
    @property
    def readers(self) -> dict[Stream, Point | None]: ...


def wait_for_uses(uses: UseState, stream: Stream, waiter: Point | None = None) -> None:
    """Make later work on ``stream`` wait for every use ``uses`` records
    (without making it a use; ``waiter``: the run whose work waits, which
    notes it).  Under :data:`hazard_lock` for a live allocation."""
    backend = uses.backend
    if stream not in uses.synced:
        for ev in uses.foreign.values():
            backend.wait_event(stream.raw, ev)
        order_after(backend, stream, uses.writer, uses.wrote, waiter)
    for s, point in uses.readers.items():
        order_after(backend, stream, s, point, waiter)


class Uses(NamedTuple):
    """An allocation's uses (its hazard state), as it was when it went."""

    backend: Backend
    synced: set[Stream]
    foreign: Mapping[Hashable, Any]
    writer: Stream
    wrote: Point | None
    readers: dict[Stream, Point | None]


def usable_stream(backend: Backend, stream: Stream) -> Stream:
    """``stream``, or where it was destroyed, the first stream of its
    device's pool.  A collection that finds a stream and an array it wrote
    unreachable together runs the stream's finalizer first, so its
    retirement is queued before the free: the free then goes on a live
    stream, after the same uses."""
    if backend.stream_destroyed(stream.raw):
        return stream._runtime.pool(stream.device)[0]
    return stream


def _free(buffer: RawBuffer, uses: Uses) -> None:
    """Free a dropped allocation's buffer on its last writer's stream, after
    every use (an allocation's finalizer, done later: :mod:`._finalizers`)."""
    writer = uses.writer
    rt = writer._runtime
    if not rt.current(writer):
        return  # the context is gone with its memory: leak, never dangle
    try:
        stream = usable_stream(uses.backend, writer)
        wait_for_uses(uses, stream)
        uses.backend.free(buffer, stream.raw)
    except Exception as exc:
        warnings.warn(f"gpuflow: could not free {buffer!r}: {exc!r}", stacklevel=1)
