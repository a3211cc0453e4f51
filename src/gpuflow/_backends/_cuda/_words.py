"""Completion words: where the GPU says how far each stream has got.

Every stream gpuflow marks owns a 64-bit *word* in host memory that the
devices can write (mapped, page-locked).  A mark is a
``cuStreamWriteValue64`` of the mark's number into the word, enqueued after
the run's work (its default flags put a memory barrier before the write, so
the run's results are visible once the number is); reading the word is a
plain memory read, with no driver call.  Another stream waits for a mark with
``cuStreamWaitValue64`` (greater or equal).

The memory is gpuflow's own (an anonymous mapping), registered with the
driver rather than allocated by it: freeing page-locked memory waits until
the device is idle, and a context reset would free driver-allocated memory
under a reader; this memory is never freed, and stays readable whatever
happens to the contexts.  Where the driver refuses to register it, the
driver allocates it instead (and it is never freed either).

A word outlives its stream: a destroyed stream's work still completes and
writes it, and another stream may still wait for it, so a word is given to
a new stream only once its old stream's last mark was reached, and
numbering goes on from there (a wait for an old number is then already
satisfied).

A mark no event loop will read (a run no task awaits: ``enqueue_on``, a
release) is *silent*: an event recorded on the stream rather than a write of
the word.  A stream memory operation between two kernels costs the GPU time
(it waits for the work before it to drain, and the next kernel for it) and the
host more than an event, which costs the GPU nothing (docs/performance.md,
"Measurements behind the code").  Reading a silent mark asks the driver
(``cuEventQuery``), which only the completer thread's ticks and the awaits of
scopes do; a later word mark reached covers the silent ones before it.  One
numbering serves both kinds, so the word may lag the stream's last mark:
before a stream is destroyed its word is written up to that mark
(:meth:`WordMarks.seal`), so that the word can serve another stream once it is
reached.

Where the driver refuses stream memory operations, :class:`EventMarks`
keeps an event per mark instead; so it does on another library's stream
(``foreign``), whatever the driver takes.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import mmap
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._codes import CUDA_ERROR_NOT_READY, CUDA_SUCCESS
from ._driver import error_for

if TYPE_CHECKING:
    from ._handles import CudaStream, Dev

#: A stream memory operation: ``(stream, device address, value, flags)`` ->
#: the driver's result.
MemOp = Callable[["CudaStream", int, int, int], int]

_SLAB_WORDS = 512  # 4 KiB: one page
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_DEVICEMAP = 2
_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ


SLAB_BYTES = _SLAB_WORDS * 8

#: Makes ``SLAB_BYTES`` of host memory device-writable for every context:
#: given the address of gpuflow's own page, returns ``(host address, device
#: address)`` of the memory to use (that page, or one the driver allocated).
Register = Callable[[int], tuple[int, int]]


class _Slab:
    __slots__ = ("addr", "dev_addr", "map", "own", "view")

    def __init__(self, register: Register) -> None:
        self.map = mmap.mmap(-1, SLAB_BYTES)  # page-aligned, zeroed
        own = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.addr, self.dev_addr = register(own)
        self.own = self.addr == own
        if self.own:
            self.view = memoryview(self.map).cast("Q")
        else:
            buf = (ctypes.c_char * SLAB_BYTES).from_address(self.addr)
            self.view = memoryview(buf).cast("B").cast("Q")


#: Every slab made, for the life of the process: a stream's work may write a
#: word after its stream and backend are gone.
_SLABS: list[_Slab] = []


class Word:
    """One stream's completion word: its device address and a reader."""

    __slots__ = ("addr", "read")

    def __init__(self, slab: _Slab, index: int) -> None:
        self.addr = slab.dev_addr + 8 * index
        self.read: Callable[[], int] = functools.partial(slab.view.__getitem__, index)


class Words:
    """The words of the process's streams (one set for every backend: the
    memory lives as long as the process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[Word] = []
        #: words of destroyed streams, with the last number enqueued on them
        self._retired: collections.deque[tuple[Word, int]] = collections.deque()

    def take(self, register: Register) -> Word:
        """A word for a new stream (its numbering continues from its value)."""
        with self._lock:
            self._reuse()
            if not self._free:
                slab = _Slab(register)
                _SLABS.append(slab)
                self._free = [Word(slab, i) for i in reversed(range(_SLAB_WORDS))]
            return self._free.pop()

    def give_back(self, word: Word, issued: int) -> None:
        """``word``'s stream is destroyed after its mark ``issued``."""
        with self._lock:
            self._retired.append((word, issued))

    def _reuse(self) -> None:
        for _ in range(len(self._retired)):
            word, issued = self._retired.popleft()
            if word.read() >= issued:
                self._free.append(word)
            else:
                self._retired.append((word, issued))

    def register_all(self, register: Register) -> None:
        """Register every slab again (after a context reset dropped them)."""
        with self._lock:
            for slab in _SLABS:
                if slab.own:  # (the driver's own went with the context: it cannot be)
                    register(slab.addr)


WORDS = Words()


class WordMarks:
    """Marks as writes of the stream's word, waits as waits on it; silent
    marks as events (the module docstring)."""

    name = "word"

    def __init__(
        self, write64: MemOp, wait64: MemOp, events: EventMarks, bound: Any = None
    ) -> None:
        self._write = write64  # cuStreamWriteValue64(stream, addr, value, flags)
        self._wait = wait64  # cuStreamWaitValue64(stream, addr, value, flags)
        self._events = events  # what keeps and asks the events of silent marks
        #: the bindings' ``cuStreamWriteValue64`` itself, where ``write64``
        #: calls it: a mark calls it with nothing between (it is every run's)
        self.bound = bound

    def mark(self, dev: Dev, stream: CudaStream, polled: bool = True) -> int:
        if not polled:
            return self._events.mark(dev, stream)
        return self.write(dev, stream, stream.issued + 1)

    def write(self, dev: Dev, stream: CudaStream, number: int) -> int:
        """Enqueue the write of ``number`` into the stream's word."""
        assert stream.word is not None  # (every stream of ours has one with word marks)
        bound = self.bound
        if bound is not None:
            (rc,) = bound(stream.obj, stream.word.addr, number, 0)
        else:
            rc = self._write(stream, stream.word.addr, number, 0)
        if rc:
            raise error_for(int(rc), "cuStreamWriteValue64", dev)
        stream.issued = stream.worded = number
        return number

    def marker(
        self, stream: CudaStream, tls: Any, mark: Callable[[Any, bool], int]
    ) -> Callable[[bool], int]:
        """Every run's mark on ``stream`` (one of ours, with a word): the
        write of its next number into its word, bound once to the stream.
        Anything not as usual (a fault, a reset, a capture, another
        context current in this thread, a silent mark, a failed write) goes
        through ``mark``, the backend's, which says why."""
        write = self.bound
        assert write is not None and stream.word is not None
        obj, addr, dev = stream.obj, stream.word.addr, stream.dev

        def mark_on(polled: bool = True) -> int:
            if (
                polled
                and dev.fault is None
                and stream.token is dev.token
                and not stream.destroyed
                and stream.capture is None
                and tls.token is dev.token
            ):
                number: int = stream.issued + 1
                (rc,) = write(obj, addr, number, 0)
                if not rc:
                    stream.issued = stream.worded = number
                    return number
            return mark(stream, polled)

        return mark_on

    def seal(self, dev: Dev, stream: CudaStream) -> bool:
        """Before ``stream`` is destroyed (its context current): whether its
        word will reach the stream's last mark, written up to it here where
        the last marks were silent."""
        if stream.worded >= stream.issued:
            return True
        try:
            self.write(dev, stream, stream.issued)
        except Exception:
            return False  # (the word is then never given to another stream)
        return True

    def reader(self, stream: CudaStream) -> Callable[[], int]:
        word = stream.word
        assert word is not None
        read_word = word.read
        silent = stream.mark_events
        events = self._events

        def read() -> int:
            reached = read_word()
            if silent:  # (silent marks not seen reached: the driver is asked)
                return events.reached(stream, reached)
            return reached if reached >= stream.reached else stream.reached

        return read

    def wait(self, dev: Dev, stream: CudaStream, other: CudaStream, number: int) -> int:
        """The driver's result of making ``stream`` wait (0: done or enqueued)."""
        word = other.word
        assert word is not None
        if word.read() >= number:
            return CUDA_SUCCESS
        if other.mark_events:
            rc = self._events.wait(dev, stream, other, number, exact=True)
            if rc is not None:
                return rc
        # (a silent mark seen reached sets ``reached`` before its event goes)
        elif other.reached >= number:
            return CUDA_SUCCESS
        return int(self._wait(stream, word.addr, number, _WAIT_GEQ))


class EventMarks:
    """Marks as events, for a driver that refuses stream memory operations:
    a mark records a pooled event, the reader queries them in order."""

    name = "event"

    def __init__(
        self,
        record: Callable[[Dev, int], int],
        query: Callable[[int], int],
        wait_event: Callable[[int, int, int], int],
        cur: Callable[[Dev], object],
    ) -> None:
        self._record = record
        self._query = query
        self._wait_event = wait_event
        self.make_current = cur  # queries need the device's context current

    def mark(self, dev: Dev, stream: CudaStream, polled: bool = True) -> int:
        number = stream.issued + 1
        event = self._record(dev, stream.handle)
        with stream.mark_lock:  # (a wait on another thread may be looking through them)
            stream.mark_events.append((number, event))
        stream.issued = number
        return number

    def reader(self, stream: CudaStream) -> Callable[[], int]:
        return functools.partial(self.reached, stream)

    def reached(self, stream: CudaStream, passed: int = 0) -> int:
        """The last of ``stream``'s marks seen reached (never raises: a
        failed query is recorded, as a fault where its code is sticky).
        ``passed``: a number the stream's word was read to have reached (the
        events of the marks up to it are known reached unasked)."""
        q = stream.mark_events
        dev = stream.dev
        with stream.mark_lock:
            while q and q[0][0] <= passed:
                dev.events.append(q.popleft()[1])
            if q:
                try:
                    self.make_current(dev)
                except Exception:
                    return max(stream.reached, passed)
            first = True
            while q:
                if stream.token is not dev.token or dev.fault is not None:
                    break  # gone with the context, or never to complete
                # the newest first: where it is reached, so are all (a
                # backlog the completer thread finds at its tick costs one query)
                number, event = q[-1] if first and len(q) > 1 else q[0]
                first = False
                rc = self._query(event)
                if rc == CUDA_ERROR_NOT_READY:
                    if number == q[0][0]:
                        break
                    continue
                if rc != CUDA_SUCCESS:
                    error_for(rc, "cuEventQuery", dev)  # not raised: a sticky code is recorded
                    break
                stream.reached = number  # (before its event goes: see ``wait``)
                while q and q[0][0] <= number:
                    dev.events.append(q.popleft()[1])
            return stream.reached if stream.reached > passed else passed

    def wait(
        self, dev: Dev, stream: CudaStream, other: CudaStream, number: int, exact: bool = False
    ) -> int | None:
        """Make ``stream`` wait for ``other``'s mark ``number`` (the
        driver's result).  ``exact``: only where ``number`` is a mark of
        these events, None where it is not (a mark of the word)."""
        with other.mark_lock:
            for n, event in other.mark_events:
                if n >= number:
                    if exact and n != number:
                        break
                    return self._wait_event(stream.handle, event, 0)
            if other.reached >= number:
                return CUDA_SUCCESS  # reached (its event was recycled)
        return None if exact else CUDA_SUCCESS
