"""The ``sim`` backend: a faithful CPU simulation of a CUDA device.

It keeps CUDA's contract so that every test that needs no GPU runs here, in
CI, with the real concurrency of the real thing:

* each stream is a FIFO worker thread; independent streams overlap (a kernel
  reference that sleeps takes time on its stream only);
* events complete in stream order and cross-stream waits block the waiting
  stream, not the host;
* completion marks set the stream's completion word when the stream reaches
  them (in stream order, by the stream itself, as the GPU writes the word),
  and a stream can wait for another's mark; host signals are delivered by a
  separate "driver" thread, never by the thread that enqueued them, so the
  bridge's thread hand-off always runs (both in :mod:`._marks`);
* a stream's worker sleeps on a condition of its own: an item enqueued on one
  stream wakes that stream only, so that many streams scale as many CUDA
  streams do (one condition for all woke every stream at every item);
* a device has SMs (:mod:`._sms`): a kernel runs block by block, each
  block holding an SM for the per-block time its reference gives
  (:func:`gpuflow.testing.block_time`; none where it gives none), and free
  SMs go to the blocks of the most urgent stream first, then in launch
  order; reserved SMs (partitions, as CUDA's green contexts) serve only the
  streams made in them;
* a kernel's reference gets its arrays as :class:`Bounded` views: a slice
  past an array's end is an out-of-bounds access, not one NumPy clips
  silently;
* a kernel whose reference raises is a *sticky fault*: as on CUDA after an
  illegal address, the device stops, nothing queued runs, host signals never
  fire and every query reports the fault until :meth:`reset_device`; as
  measured on two H200s, the fault reaches every device of the process (each
  is reset on its own here; the CUDA driver refuses to reset at all);
* memory is host memory, reserved at allocation (out of memory is reported
  at the call, and is not sticky) and released in stream order; freed memory
  is poisoned and any later access by the device is a fault that names the
  buffer, so a use after free is detected, never silently read;
* capture records the work enqueued on a stream (and on the streams that
  join it through events) and replays it as one item; as in a CUDA graph,
  its nodes are the kernels, copies and fills, and the cross-stream event
  records and waits are its edges;
* on request, each stream keeps a record of the items it runs, with their
  times (:meth:`SimBackend.start_activity_record`);
* communicators follow NCCL's model across simulated devices and across
  processes of one host (:mod:`._comm`): a collective holds its stream
  until every rank has arrived, a missing peer is a hang that only an abort
  ends, and a peer that leaves is NCCL's asynchronous remote error;
* streams have handles and buffers have device addresses that other
  libraries' protocols carry (``__cuda_stream__``, DLPack,
  ``__cuda_array_interface__``): a handle maps back to its stream, and an
  address back to the live buffer that holds it (an address in no live
  buffer is refused, never read as host memory).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import numpy.typing as npt

from ..._errors import (
    CommunicatorError,
    DeviceFaultError,
    LaunchError,
    OutOfMemoryError,
    UsageError,
)
from .._base import Backend
from .._codes import (
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_LAUNCH_FAILED,
    CUDA_ERROR_OUT_OF_MEMORY,
    NAMES,
)
from .._records import (
    BLOCK_TIME_ATTR,
    Activity,
    CollectiveCall,
    DeviceDescription,
    HostArray,
    KernelArg,
    ModuleSource,
    PointerArg,
    RawBuffer,
    RawComm,
    RawEvent,
    RawGraph,
    RawKernel,
    RawPartition,
    RawStream,
    activity_tag,
)
from ._bounded import Bounded
from ._comm import SimComm, SimComms, new_unique_id
from ._loads import Loads
from ._marks import SimCompletion
from ._sms import DEFAULT_SMS, SimPartition, SimSMs

DEFAULT_MEMORY_BYTES = 2 << 30
#: the stream priorities above the default a simulated device takes, as
#: current GPUs (CUDA's range 0 to -5); free SMs go to the most urgent first
SIM_PRIORITIES = 5
_POISON = 0xFF  # every float pattern with all bits set is a NaN; ints read -1
_ADDRESS_ALIGN = 256
#: where device ``i``'s addresses start: 1 TiB of address space a device, so
#: that an address alone names its device (as CUDA's unified addressing does)
_ADDRESS_BASE = 0x7F0000000000
_DEVICE_ADDRESS_BITS = 40
#: stream handles look like addresses (and are never 0, 1 or 2, CUDA's
#: default-stream handles)
_STREAM_HANDLE_BASE = 0x5100000000

Item = Callable[[], None]

# what a graph holds as edges between its nodes, not as nodes (as CUDA's
# stream capture turns cross-stream event records and waits into edges)
_EDGE_ITEMS = frozenset({"event record", "event wait", "mark wait", "host signal"})


#: the stream whose worker the current thread is (a kernel replayed from a
#: graph runs at the priority, and on the SMs, of the stream replaying it)
_worker = threading.local()


@dataclass(eq=False)
class SimDevice:
    index: int
    memory_limit: int
    sms: SimSMs
    memory_used: int = 0
    fault: DeviceFaultError | None = None
    generation: int = 0
    next_address: int = 0

    def __post_init__(self) -> None:
        self.next_address = _ADDRESS_BASE + (self.index << _DEVICE_ADDRESS_BITS)


@dataclass(eq=False)
class SimBuffer:
    device: int
    nbytes: int
    ptr: int
    data: npt.NDArray[np.uint8]
    generation: int
    freed: bool = False

    def __repr__(self) -> str:
        return f"<sim buffer 0x{self.ptr:x} ({self.nbytes} bytes) on device {self.device}>"


class SimView:
    """Another library's memory: ``nbytes`` at an offset of a live sim buffer.

    Its data is a view of the buffer's, so writes through either are seen
    through the other; it is freed (and poisoned) only when the buffer is,
    and a use after that is caught as the buffer's own would be.  gpuflow
    never frees it.
    """

    def __init__(self, parent: SimBuffer, offset: int, nbytes: int) -> None:
        self.parent = parent
        self.device = parent.device
        self.nbytes = nbytes
        self.ptr = parent.ptr + offset
        self.data = parent.data[offset : offset + nbytes]
        self.generation = parent.generation

    @property
    def freed(self) -> bool:
        return self.parent.freed

    def __repr__(self) -> str:
        return f"<sim view 0x{self.ptr:x} ({self.nbytes} bytes) of {self.parent!r}>"


@dataclass(eq=False)
class _Capture:
    items: list[tuple[str, Item]] = field(default_factory=list)
    streams: list[SimStream] = field(default_factory=list)
    #: frees asked for on a captured stream: done when the capture ends, as
    #: the cuda backend does (a free is no part of the graph)
    deferred_frees: list[tuple[RawBuffer, SimStream]] = field(default_factory=list)


@dataclass(eq=False)
class SimEvent:
    device: int
    done: bool = False
    capture: _Capture | None = None


@dataclass(eq=False)
class SimGraph:
    device: int
    items: list[tuple[str, Item]]
    node_count: int


@dataclass(eq=False)
class SimKernel:
    device: int
    name: str
    reference: Callable[..., object]
    generation: int
    #: its module (the source): what a context loads, once
    module: str = ""


class SimStream:
    """One FIFO worker thread; items run in order, outside the backend lock.

    ``cv`` shares the backend's lock: the worker sleeps on it until an item
    arrives, and :meth:`SimBackend.synchronize` until the queue is empty.
    ``word`` is the number of the last completion mark the stream reached,
    ``issued`` the number of the last one enqueued.
    """

    def __init__(
        self,
        backend: SimBackend,
        device: SimDevice,
        priority: int = 0,
        partition: SimPartition | None = None,
    ) -> None:
        self.backend = backend
        self.device = device
        self.partition = partition  # its SMs (None: any of the device's)
        # (what, item, the activity tag where it was enqueued)
        self.queue: collections.deque[tuple[str, Item, int | None]] = collections.deque()
        self.cv = threading.Condition(backend.lock)
        self.word = 0
        self.issued = 0
        self.closed = False
        self.capture: _Capture | None = None
        self.running = False
        self.wakeups = 0  # how often the worker woke (what a test of the herd counts)
        self.priority = priority  # gpuflow's level: 0 the default, higher more urgent
        self.serial = next(backend._stream_serials)
        self.handle = _STREAM_HANDLE_BASE + self.serial * _ADDRESS_ALIGN
        self.thread = threading.Thread(
            target=self._work, name=f"gpuflow-sim-stream-d{device.index}", daemon=True
        )
        self.thread.start()

    def __repr__(self) -> str:
        return f"<sim stream {id(self):#x} on device {self.device.index}>"

    def _work(self) -> None:
        _worker.stream = self
        cv = self.cv
        while True:
            with cv:
                while not self.queue and not self.closed:
                    cv.wait()
                    self.wakeups += 1
                if not self.queue:
                    return
                what, item, tag = self.queue[0]
                live = self.device.fault is None
                generation = self.device.generation
                self.running = live
            if live:
                records = self.backend._records
                if records:
                    self._run_recorded(what, item, generation, records, tag)
                else:
                    self._run(what, item, generation)
            with cv:
                self.queue.popleft()
                self.running = False
                if not self.queue:
                    cv.notify_all()  # synchronize() waits for an empty queue

    def _run(self, what: str, item: Item, generation: int) -> None:
        try:
            item()
        except BaseException as exc:
            self.backend._set_fault(self.device, what, exc, generation)

    def _run_recorded(
        self,
        what: str,
        item: Item,
        generation: int,
        records: tuple[list[Activity], ...],
        tag: int | None,
    ) -> None:
        start = time.perf_counter()
        if what == "completion mark":
            # a mark takes no time: recorded before it is reached, so that
            # whoever sees the word reach it finds it in the record
            self._append(records, Activity(self.device.index, self.serial, what, start, start, tag))
            self._run(what, item, generation)
            return
        self._run(what, item, generation)
        end = time.perf_counter()
        # appended before the item leaves the queue: once the stream is
        # seen idle, the record holds everything it ran
        self._append(records, Activity(self.device.index, self.serial, what, start, end, tag))

    def _append(self, records: tuple[list[Activity], ...], activity: Activity) -> None:
        with self.cv:
            for record in records:
                if any(record is r for r in self.backend._records):
                    record.append(activity)


class SimBackend(Backend):
    """A CPU simulation of ``num_devices`` devices (default 1), each with
    ``memory_bytes`` of memory and ``sms`` SMs (an H200's 132 by default):
    made by :func:`gpuflow.lowlevel.new_sim_backend`."""

    name = "sim"
    loads_wait_for_kernels = True  # (as a driver's: ._loads)
    simulated = True

    def __init__(
        self,
        num_devices: int | None = None,
        *,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        sms: int = DEFAULT_SMS,
    ) -> None:
        n = 1 if num_devices is None else num_devices
        if isinstance(sms, bool) or not isinstance(sms, int) or sms < 1:
            raise UsageError(f"sms must be a number of SMs (an int of 1 or more), not {sms!r}")
        # one lock for the whole simulated device, and conditions on it: this
        # one for events, marks, faults and communicators (what items wait
        # for), one per stream for its queue, one for the driver thread
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self._devices = [SimDevice(i, memory_bytes, SimSMs(sms)) for i in range(n)]
        self._streams: list[SimStream] = []
        self._handles: dict[int, SimStream] = {}  # stream handle -> stream, until destroyed
        self._default_streams: dict[int, SimStream] = {}  # device -> its legacy default stream
        self._partitions: list[SimPartition] = []  # made, not released
        # the buffers not yet freed, by start address (sorted), for foreign_buffer
        self._starts: list[int] = []
        self._live: weakref.WeakValueDictionary[int, SimBuffer] = weakref.WeakValueDictionary()
        self.use_after_free = 0
        self._stream_serials = itertools.count()
        # the open activity records; empty (and free to check) when none is
        self._records: tuple[list[Activity], ...] = ()
        self._comms = SimComms(self)
        # marks, and the driver thread that calls host signals, never a stream
        self._completion = SimCompletion(self)
        #: the modules loaded, and the kernels a load waits for
        self.loads = Loads()

    def _wake_all(self) -> None:
        """Under the lock: something every waiter must see (a fault, a reset, closing)."""
        self.cond.notify_all()
        for s in self._streams:
            s.cv.notify_all()
        self._completion.wake()
        for dev in self._devices:
            dev.sms.wake()

    def close(self) -> None:
        with self.cond:
            self._completion.close()
            for s in self._streams:
                s.closed = True
            self._wake_all()

    # -- devices -------------------------------------------------------------
    @property
    def device_count(self) -> int:
        return len(self._devices)

    def device_name(self, device: int) -> str:
        return f"gpuflow sim device {device}"

    def describe_device(self, device: int) -> DeviceDescription:
        return DeviceDescription(self.device_name(device), None, self._dev(device).memory_limit)

    def _dev(self, device: int) -> SimDevice:
        return self._lookup(self._devices, device)

    def memory_reserved(self, device: int) -> int:
        """Allocated and not yet freed in stream order (the simulation keeps
        no cache of freed memory)."""
        dev = self._dev(device)
        with self.cond:
            return dev.memory_used

    device_state = _dev

    def device_arch(self, device: int) -> str:
        """The simulated device is an H200's architecture: kernels are checked
        by NVRTC for it, and run as their NumPy references."""
        self._dev(device)
        return "sm_90"

    def use_after_free_count(self) -> int:
        with self.cond:
            return self.use_after_free

    def _set_fault(
        self, device: SimDevice, what: str, exc: BaseException, generation: int
    ) -> None:
        if isinstance(exc, DeviceFaultError):
            err = exc
        else:
            code = CUDA_ERROR_ILLEGAL_ADDRESS
            if not isinstance(exc, IndexError | _UseAfterFree):
                code = CUDA_ERROR_LAUNCH_FAILED
            err = DeviceFaultError(
                f"sim device {device.index} faulted in {what}: {exc!r}",
                code=code,
                name=NAMES[code],
                device=device.index,
            )
            err.__cause__ = exc
        with self.cond:
            # an item still running when its device was reset belongs to the
            # context that is gone: its failure must not fault the new one
            if device.fault is None and device.generation == generation:
                device.fault = err
                # as measured on two H200s: after an illegal address on one
                # device, every call on the other fails with the same error
                for other in self._devices:
                    if other is not device and other.fault is None:
                        other.fault = DeviceFaultError(
                            f"sim device {other.index}: the process has a sticky fault "
                            f"from device {device.index}: {err}",
                            code=err.code,
                            name=err.name,
                            device=other.index,
                        )
            self._wake_all()

    def reset_device(self, device: int) -> None:
        dev = self._dev(device)
        with self.cond:
            dev.fault = None
            dev.generation += 1
            dev.memory_used = 0
            for s in self._streams:
                if s.device is dev:
                    # what was queued is gone with the context, as on CUDA
                    while len(s.queue) > (1 if s.running else 0):
                        s.queue.pop()
                    s.capture = None
            self._wake_all()

    # -- streams -------------------------------------------------------------
    def create_stream(
        self, device: int, priority: int = 0, partition: RawPartition | None = None
    ) -> RawStream:
        s = self.new_stream(device, priority, cast(SimPartition | None, partition))
        return RawStream(s)

    def new_stream(
        self, device: int, priority: int = 0, partition: SimPartition | None = None
    ) -> SimStream:
        s = SimStream(self, self._dev(device), priority, partition)
        with self.cond:
            self._streams.append(s)
            self._handles[s.handle] = s
        return s

    def stream_priorities(self, device: int) -> int:
        self._dev(device)
        return SIM_PRIORITIES

    def sm_count(self, device: int) -> int:
        return self._dev(device).sms.count

    def partition_sms(self, device: int, sizes: Sequence[int]) -> list[RawPartition]:
        dev = self._dev(device)
        try:
            parts = dev.sms.partition(device, list(sizes))
        except ValueError as exc:
            raise UsageError(f"cannot reserve SMs on sim device {device}: {exc}") from None
        with self.cond:
            self._partitions += parts
        return [RawPartition(p) for p in parts]

    def release_partitions(self, partitions: Sequence[RawPartition]) -> None:
        with self.cond:
            gone = cast(Sequence[SimPartition], partitions)
            self._partitions = [p for p in self._partitions if p not in gone]

    def live_objects(self) -> dict[str, list[object]]:
        with self.cond:
            return {"partitions": list(self._partitions)}

    def partition_size(self, partition: RawPartition) -> int:
        return len(cast(SimPartition, partition).sms)

    def destroy_stream(self, stream: RawStream) -> None:
        s = cast(SimStream, stream)
        with self.cond:
            s.closed = True
            if s in self._streams:
                self._streams.remove(s)
            self._handles.pop(s.handle, None)
            s.cv.notify_all()

    def stream_destroyed(self, stream: RawStream) -> bool:
        return bool(cast(SimStream, stream).closed)

    def stream_handle(self, stream: RawStream) -> int:
        return int(cast(SimStream, stream).handle)

    def foreign_stream(
        self, handle: int, device: int, named: bool = False
    ) -> tuple[RawStream, int]:
        # (a handle is asked about every time: a dict, no driver call)
        if handle in (0, 1, 2):
            # the default streams (legacy and per-thread are one here): made
            # on first use, one a device, never destroyed
            dev = self._dev(device)
            with self.cond:
                s = self._default_streams.get(dev.index)
            if s is None:
                s = self.new_stream(dev.index)
                with self.cond:
                    s = self._default_streams.setdefault(dev.index, s)
            return RawStream(s), dev.index
        with self.cond:
            found = self._handles.get(handle)
        if found is None:
            raise UsageError(
                f"stream handle 0x{handle:x} is not a live stream of the sim backend "
                "(destroyed, or another backend's)"
            )
        return RawStream(found), found.device.index

    def foreign_buffer(self, ptr: int, nbytes: int, device: int | None) -> SimBuffer | SimView:
        if nbytes == 0:
            # nothing is ever read or written: any address will do (CAI gives 0)
            dev = self._dev(0 if device is None else device)
            return SimBuffer(dev.index, 0, ptr, np.empty(0, np.uint8), dev.generation)
        with self.cond:
            i = bisect.bisect_right(self._starts, ptr) - 1
            buf = self._live.get(self._starts[i]) if i >= 0 else None
        if (
            buf is None
            or buf.freed
            or buf.generation != self._devices[buf.device].generation
            or ptr + nbytes > buf.ptr + buf.nbytes
        ):
            raise UsageError(
                f"0x{ptr:x} ({nbytes} bytes) is not in a live buffer of the sim backend: "
                "not device memory of a simulated device (host memory? freed? "
                "a range past the end of its buffer?)"
            )
        if device is not None and buf.device != device:
            raise UsageError(
                f"0x{ptr:x} is memory of sim device {buf.device}, not of device {device} "
                "as its producer says"
            )
        return SimView(buf, ptr - buf.ptr, nbytes)

    def enqueue_item(
        self, stream: SimStream, what: str, item: Item, capturable: bool = True
    ) -> bool:
        """Enqueue ``item`` (or record it into the stream's capture); False,
        with nothing enqueued, for an item that must not be captured."""
        with self.cond:
            return self.enqueue_locked(stream, what, item, capturable)

    def enqueue_locked(self, stream: SimStream, what: str, item: Item, capturable: bool) -> bool:
        fault = stream.device.fault
        if fault is not None:
            raise fault
        if stream.capture is not None:
            if not capturable:
                return False
            stream.capture.items.append((what, item))
            return True
        stream.queue.append((what, item, activity_tag.get() if self._records else None))
        if len(stream.queue) == 1:
            stream.cv.notify_all()  # the worker sleeps only on an empty queue
        return True

    def synchronize(self, stream: RawStream) -> None:
        s = cast(SimStream, stream)
        with s.cv:
            if s.capture is not None:
                raise UsageError("cannot synchronize a stream while it is being captured")
            while s.queue and s.device.fault is None:
                s.cv.wait()
            if s.device.fault is not None:
                raise s.device.fault

    def stream_capturing(self, stream: RawStream) -> bool:
        s = cast(SimStream, stream)
        with self.cond:
            return s.capture is not None

    def query(self, stream: RawStream) -> bool:
        s = cast(SimStream, stream)
        with self.cond:
            if s.device.fault is not None:
                raise s.device.fault
            return not s.queue

    # -- events --------------------------------------------------------------
    def refuse_destroyed(self, stream: SimStream) -> None:
        # as a CUDA handle of a destroyed stream, which the driver refuses: work
        # queued on a stream whose worker has gone would never run
        if stream.closed:
            raise UsageError(f"{stream!r} was destroyed")

    def record_event(self, stream: RawStream) -> RawEvent:
        s = cast(SimStream, stream)
        self.refuse_destroyed(s)
        ev = SimEvent(s.device.index, capture=s.capture)

        def record() -> None:
            with self.cond:
                ev.done = True
                self.cond.notify_all()

        self.enqueue_item(s, "event record", record)
        return RawEvent(ev)

    def wait_event(self, stream: RawStream, event: RawEvent) -> None:
        s = cast(SimStream, stream)
        ev = cast(SimEvent, event)
        self.refuse_destroyed(s)
        if ev.capture is not None and s.capture is None:
            # as on CUDA: waiting on an event recorded in a capture joins it
            s.capture = ev.capture
            ev.capture.streams.append(s)
        if ev.done and s.capture is None:
            return
        other = self._devices[ev.device]

        def wait() -> None:
            with self.cond:
                while not ev.done and other.fault is None and s.device.fault is None:
                    self.cond.wait()
                if other.fault is not None and not ev.done:
                    raise other.fault

        self.enqueue_item(s, "event wait", wait)

    # -- memory --------------------------------------------------------------
    def alloc(self, device: int, nbytes: int, stream: RawStream) -> SimBuffer:
        dev = self._dev(device)
        size = max(nbytes, 1)
        with self.cond:
            if dev.fault is not None:
                raise dev.fault
            if dev.memory_used + size > dev.memory_limit:
                raise OutOfMemoryError(
                    f"out of memory on sim device {device}: {nbytes} bytes requested, "
                    f"{dev.memory_limit - dev.memory_used} of {dev.memory_limit} free",
                    code=CUDA_ERROR_OUT_OF_MEMORY,
                    name=NAMES[CUDA_ERROR_OUT_OF_MEMORY],
                    device=device,
                )
            dev.memory_used += size
            ptr = dev.next_address
            dev.next_address += (size + _ADDRESS_ALIGN - 1) // _ADDRESS_ALIGN * _ADDRESS_ALIGN
        data = np.empty(size, dtype=np.uint8)
        data.fill(_POISON)  # fresh device memory holds garbage, never zeros
        buf = SimBuffer(device, nbytes, ptr, data, dev.generation)
        with self.cond:
            bisect.insort(self._starts, ptr)
            self._live[ptr] = buf
        return buf

    def free(self, buffer: RawBuffer, stream: RawStream) -> None:
        b = cast(SimBuffer, buffer)
        s = cast(SimStream, stream)
        dev = self._devices[b.device]

        def release() -> None:
            with self.cond:
                if b.generation == dev.generation and not b.freed:
                    dev.memory_used -= max(b.nbytes, 1)
                b.freed = True
                ptr = b.ptr
                if self._live.get(ptr) is b:
                    del self._live[ptr]
                    del self._starts[bisect.bisect_left(self._starts, ptr)]
            b.data.fill(_POISON)

        with self.cond:
            cap = s.capture
            if cap is not None:
                cap.deferred_frees.append((b, s))
                return
        try:
            self.enqueue_item(s, f"free of {buffer!r}", release)
        except DeviceFaultError:
            pass  # the context is gone with its memory; a reset reclaims it
        except Exception as exc:  # a finalizer must not raise
            warnings.warn(f"gpuflow: freeing {buffer!r} failed: {exc!r}", stacklevel=2)

    def check_buffer(self, buffer: SimBuffer | SimView) -> None:
        if buffer.freed:
            with self.cond:
                self.use_after_free += 1
            raise _UseAfterFree(f"use after free of {buffer!r}")
        if buffer.generation != self._devices[buffer.device].generation:
            raise _UseAfterFree(f"{buffer!r} belongs to a context that was reset")

    def copy_from_host(self, dst: RawBuffer, src: HostArray, stream: RawStream) -> None:
        d = cast(SimBuffer | SimView, dst)
        s = cast(SimStream, stream)

        def copy() -> None:
            self.check_buffer(d)
            flat = src.reshape(-1).view(np.uint8)
            d.data[: flat.size] = flat

        self.enqueue_item(s, f"copy to {dst!r}", copy)

    def copy_to_host(self, dst: HostArray, src: RawBuffer, stream: RawStream) -> None:
        sb = cast(SimBuffer | SimView, src)
        s = cast(SimStream, stream)

        def copy() -> None:
            self.check_buffer(sb)
            flat = dst.reshape(-1).view(np.uint8)
            flat[:] = sb.data[: flat.size]

        self.enqueue_item(s, f"copy from {src!r}", copy)

    def copy_device(self, dst: RawBuffer, src: RawBuffer, nbytes: int, stream: RawStream) -> None:
        d = cast(SimBuffer | SimView, dst)
        sb = cast(SimBuffer | SimView, src)
        s = cast(SimStream, stream)

        def copy() -> None:
            self.check_buffer(sb)
            self.check_buffer(d)
            d.data[:nbytes] = sb.data[:nbytes]

        self.enqueue_item(s, f"copy {src!r} -> {dst!r}", copy)

    def fill(self, dst: RawBuffer, value: np.generic, count: int, stream: RawStream) -> None:
        d = cast(SimBuffer | SimView, dst)
        s = cast(SimStream, stream)

        def fill() -> None:
            self.check_buffer(d)
            d.data[: count * value.itemsize].view(value.dtype)[:] = value

        self.enqueue_item(s, f"fill of {dst!r}", fill)

    def arange(
        self, dst: RawBuffer, start: np.generic, step: np.generic, count: int, stream: RawStream
    ) -> None:
        d = cast(SimBuffer | SimView, dst)
        s = cast(SimStream, stream)
        dtype = start.dtype

        def arange() -> None:
            self.check_buffer(d)
            out = d.data[: count * dtype.itemsize].view(dtype)
            out[:] = start + np.arange(count).astype(dtype) * step

        self.enqueue_item(s, f"arange into {dst!r}", arange)

    # -- kernels -------------------------------------------------------------
    def load_kernel(self, device: int, module: ModuleSource, name: str) -> RawKernel:
        ref = module.references.get(name)
        if ref is None:
            raise UsageError(
                f"kernel {name!r} has no NumPy reference: the sim backend runs "
                f"gf.compile(..., references={{{name!r}: fn}})"
            )
        dev = self._dev(device)
        self._load(dev, None, module.source)
        return RawKernel(SimKernel(device, name, ref, dev.generation, module.source))

    def load_ahead(
        self, device: int, module: ModuleSource | None, partitions: Sequence[RawPartition]
    ) -> None:
        if module is None:
            return  # (sim's fills and arange are no kernels of a module)
        dev = self._dev(device)
        for context in (None, *cast(Sequence[SimPartition], partitions)):
            self._load(dev, context, module.source)

    def _load(self, dev: SimDevice, context: SimPartition | None, module: str) -> None:
        """``module`` loaded into ``context`` of ``dev`` (None: its own), as
        the driver loads: once, waiting for the device's running kernels."""
        generation = dev.generation
        self.loads.load(
            dev.index, generation, context, module,
            lambda: dev.fault is not None or dev.generation != generation,
        )  # fmt: skip

    def launch(
        self,
        kernel: RawKernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shmem: int,
        args: Sequence[KernelArg],
        stream: RawStream,
    ) -> None:
        # what the driver refuses (gpuflow's front end refuses it first)
        k = cast(SimKernel, kernel)
        s = cast(SimStream, stream)
        limits = self.launch_limits(k.device)
        threads = block[0] * block[1] * block[2]
        if (
            threads > limits.max_threads_per_block
            or min(grid) < 1
            or min(block) < 1
            or any(n > top for n, top in zip(grid, limits.max_grid, strict=True))
            or any(n > top for n, top in zip(block, limits.max_block, strict=True))
            or shmem > limits.max_shared_memory_per_block
        ):
            raise LaunchError(
                f"kernel {k.name!r}: invalid configuration grid={grid} block={block} "
                f"shmem={shmem} (past the device's launch limits: {limits})",
                code=CUDA_ERROR_INVALID_VALUE,
                name=NAMES[CUDA_ERROR_INVALID_VALUE],
                device=k.device,
            )
        if k.generation != self._devices[k.device].generation:
            raise UsageError(f"kernel {k.name!r} was loaded before its device was reset")

        blocks = grid[0] * grid[1] * grid[2]
        block_s = getattr(k.reference, BLOCK_TIME_ATTR, None)
        dev = self._devices[k.device]
        partition = getattr(s, "partition", None)
        if partition is not None:  # (its first launch there loads it there, as CUDA's)
            self._load(dev, partition, k.module)
        running = self.loads.kernel_running

        def run() -> None:
            with running(dev.index):
                kernel_body()

        def kernel_body() -> None:
            values: list[object] = []
            for a in args:
                if isinstance(a, PointerArg):
                    buf = cast(SimBuffer | SimView, a.buffer)
                    self.check_buffer(buf)
                    view = buf.data[: a.count * a.dtype.itemsize].view(a.dtype).view(Bounded)
                    if not a.writes:
                        view = view.view(Bounded)
                        view.flags.writeable = False
                    values.append(view)
                else:
                    values.append(a.item())
            seconds = block_s(*values) if callable(block_s) else block_s or 0.0
            on = getattr(_worker, "stream", s)
            generation = dev.generation
            if dev.sms.run(
                blocks, float(seconds), on.priority, on.partition,
                lambda: dev.fault is not None or dev.generation != generation,
            ):  # fmt: skip
                k.reference(*values)  # (not on a device that faulted or was reset meanwhile)
            for a in args:
                if isinstance(a, PointerArg):
                    self.check_buffer(cast(SimBuffer | SimView, a.buffer))

        self.enqueue_item(s, f"kernel {k.name!r}", run)

    # -- completion marks and host signals (._marks) -------------------------
    def mark(self, stream: RawStream, polled: bool = True) -> int:
        return self._completion.mark(cast(SimStream, stream))

    def completion_reader(self, stream: RawStream) -> Callable[[], int]:
        return self._completion.reader(cast(SimStream, stream))

    def wait_mark(self, stream: RawStream, other: RawStream, number: int) -> None:
        s = cast(SimStream, stream)
        self._completion.wait(s, cast(SimStream, other), number)

    def enqueue_close(self, stream: RawStream, fd: int) -> bool:
        return self._completion.enqueue_close(cast(SimStream, stream), fd)

    # -- communicators -------------------------------------------------------------
    def comm_unique_id(self) -> bytes:
        return new_unique_id()

    def comm_init(
        self, devices: Sequence[int], ranks: Sequence[int], nranks: int, unique_id: bytes | None
    ) -> list[RawComm]:
        comms = self._comms.init([self._dev(d) for d in devices], ranks, nranks, unique_id)
        return [RawComm(c) for c in comms]

    def comm_group(self, calls: Sequence[tuple[RawComm, CollectiveCall, RawStream]]) -> None:
        self._comms.group([(cast(SimComm, c), call, cast(SimStream, s)) for c, call, s in calls])

    def comm_async_error(self, comm: RawComm) -> CommunicatorError | None:
        return cast(SimComm, comm).error

    def comm_abort(self, comm: RawComm) -> None:
        self._comms.abort(cast(SimComm, comm))

    def comm_destroy(self, comm: RawComm) -> None:
        self._comms.destroy(cast(SimComm, comm))

    # -- graphs ----------------------------------------------------------------
    def begin_capture(self, stream: RawStream) -> None:
        s = cast(SimStream, stream)
        with self.cond:
            if s.capture is not None:
                raise UsageError("the stream is already being captured")
            s.capture = _Capture(streams=[s])

    def end_capture(self, stream: RawStream) -> RawGraph:
        s_ = cast(SimStream, stream)
        with self.cond:
            cap = s_.capture
            if cap is None:
                raise UsageError("the stream is not being captured")
            for s in cap.streams:
                s.capture = None
        for buffer, s in cap.deferred_frees:
            self.free(buffer, RawStream(s))
        nodes = sum(1 for what, _item in cap.items if what not in _EDGE_ITEMS)
        return RawGraph(SimGraph(s_.device.index, list(cap.items), nodes))

    def launch_graph(self, graph: RawGraph, stream: RawStream) -> None:
        g = cast(SimGraph, graph)
        s = cast(SimStream, stream)

        def replay() -> None:
            for _what, item in g.items:
                item()

        self.enqueue_item(s, f"graph of {g.node_count} nodes", replay)

    def graph_node_count(self, graph: RawGraph) -> int:
        return int(cast(SimGraph, graph).node_count)

    # -- the activity record ----------------------------------------------------
    def start_activity_record(self) -> list[Activity]:
        """Start recording every item the streams run; return the list that fills.

        Each stream's own worker thread appends one :class:`Activity` per item
        it runs (a graph replay is one item), with times taken on that thread
        right around the item, and before the item leaves the stream's queue:
        once a stream is idle (synchronized, or a run on it awaited), every item
        it ran while the record was open is in the list, except possibly the
        host signal that reported the run complete.  A completion mark is in the
        list before the stream reaches it (with no duration: it takes none).
        An item is recorded when the record was open both when it started and
        when it ended, with the :data:`activity_tag` of where it was enqueued
        if the record was open then too.  Items a faulted device skips are not
        recorded.  Several records may be open.
        """
        record: list[Activity] = []
        with self.cond:
            self._records = (*self._records, record)
        return record

    def stop_activity_record(self, record: list[Activity]) -> None:
        with self.cond:
            self._records = tuple(r for r in self._records if r is not record)

    def activity_stream_id(self, stream: RawStream) -> int:
        return int(cast(SimStream, stream).serial)


class _UseAfterFree(Exception):
    pass
