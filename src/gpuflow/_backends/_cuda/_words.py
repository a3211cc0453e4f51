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
    """Marks as writes of the stream's word, waits as waits on it."""

    name = "word"

    def __init__(self, write64: MemOp, wait64: MemOp, bound: Any = None) -> None:
        self._write = write64  # cuStreamWriteValue64(stream, addr, value, flags)
        self._wait = wait64  # cuStreamWaitValue64(stream, addr, value, flags)
        #: the bindings' ``cuStreamWriteValue64`` itself, where ``write64``
        #: calls it: a mark calls it with nothing between (it is every run's)
        self._bound = bound

    def mark(self, dev: Dev, stream: CudaStream) -> int:
        number = stream.issued + 1
        assert stream.word is not None  # (every stream of ours has one with word marks)
        bound = self._bound
        if bound is not None:
            (rc,) = bound(stream.obj, stream.word.addr, number, 0)
        else:
            rc = self._write(stream, stream.word.addr, number, 0)
        if rc:
            raise error_for(int(rc), "cuStreamWriteValue64", dev)
        stream.issued = number
        return number

    def reader(self, stream: CudaStream) -> Callable[[], int]:
        assert stream.word is not None
        return stream.word.read

    def wait(self, dev: Dev, stream: CudaStream, other: CudaStream, number: int) -> int:
        """The driver's result of making ``stream`` wait (0: done or enqueued)."""
        word = other.word
        assert word is not None
        if word.read() >= number:
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
        self._cur = cur  # queries need the device's context current

    def mark(self, dev: Dev, stream: CudaStream) -> int:
        number = stream.issued + 1
        stream.mark_events.append((number, self._record(dev, stream.handle)))
        stream.issued = number
        return number

    def reader(self, stream: CudaStream) -> Callable[[], int]:
        return functools.partial(self.reached, stream)

    def reached(self, stream: CudaStream) -> int:
        """The last of ``stream``'s marks seen reached (never raises: a
        failed query is recorded, as a fault where its code is sticky)."""
        q = stream.mark_events
        dev = stream.dev
        with stream.mark_lock:
            if q:
                try:
                    self._cur(dev)
                except Exception:
                    return stream.reached
            while q:
                if stream.token is not dev.token or dev.fault is not None:
                    return stream.reached  # gone with the context, or never to complete
                number, event = q[0]
                rc = self._query(event)
                if rc == CUDA_ERROR_NOT_READY:
                    break
                if rc != CUDA_SUCCESS:
                    error_for(rc, "cuEventQuery", dev)  # not raised: a sticky code is recorded
                    break
                q.popleft()
                dev.events.append(event)
                stream.reached = number
            return stream.reached

    def wait(self, dev: Dev, stream: CudaStream, other: CudaStream, number: int) -> int:
        with other.mark_lock:
            for n, event in other.mark_events:
                if n >= number:
                    return self._wait_event(stream.handle, event, 0)
        return CUDA_SUCCESS  # reached (its event was recycled)
