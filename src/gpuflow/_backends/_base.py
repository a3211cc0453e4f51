"""The interface between gpuflow's front end and a device backend.

gpuflow has one front end (operations, scheduling, the completion bridge,
lifetimes) and interchangeable backends behind this interface, chosen once by
:func:`gpuflow.init_device_contexts`.  A backend speaks in raw handles
(streams, events, buffers, kernels) and knows nothing of operations; the front
end never touches a driver.

Threading contract: every method may be called from any thread, concurrently.
``free`` and ``destroy_stream`` are also called from finalizers: they must not
raise (report failures as warnings) and must prefer a leak to a dangling
pointer.  Errors raised keep the driver's code (:class:`DeviceError`).

The completion half of the bridge is split here.  A backend numbers the
points of a stream that the front end *marks*: after a run's work,
:meth:`Backend.mark` enqueues the stream's next mark, and when the GPU
reaches it the stream's *completion word* becomes that number.  Reading the
word (:meth:`Backend.completion_reader`) is the fast question "is run n
done": on CUDA the GPU writes the word into pinned host memory, so the
answer is a memory read, with no driver call and no thread in between.
For an event loop that goes to sleep, :meth:`Backend.enqueue_close` closes
a pipe's write end when the GPU reaches it (no GIL on CUDA): the GPU wakes
the loop, whose selector watches the read end.  Another stream can wait
for a mark (:meth:`Backend.wait_mark`), which is how work is ordered after
a run without waiting for whatever its stream ran later.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from .._errors import DeviceFaultError, UsageError
from ._comms import Communicators
from ._records import (
    H100_LIMITS,
    Activity,
    D,
    DeviceDescription,
    DeviceState,
    HostArray,
    KernelArg,
    LaunchLimits,
    ModuleSource,
    RawBuffer,
    RawEvent,
    RawGraph,
    RawKernel,
    RawPartition,
    RawStream,
    Step,
)


class Backend(Communicators, abc.ABC):
    """A device backend.  One instance serves every device of the process.

    What the two backends share lives here once: looking a device up (with
    one message for a device that is not there) and reporting its sticky
    fault.  Everything the front end asks of a backend is a method of this
    class (its communicators' half in :class:`._comms.Communicators`), never
    an attribute found by duck typing.
    """

    name: ClassVar[str]
    #: Whether making a stream can block the calling thread until the device
    #: is idle (CUDA): then the runtime makes the streams it may need when
    #: it starts (its pools' spares, and every latency class's pool).
    setup_waits_for_idle: ClassVar[bool] = False
    #: Whether loading a module waits for the device's running kernels
    #: (CUDA, and ``sim`` as it does): then modules are loaded, into every
    #: context that runs them, when they are compiled or the runtime starts,
    #: never on the way to a launch.
    loads_wait_for_kernels: ClassVar[bool] = False
    #: Whether its streams, buffers and events are the CUDA driver's own, in
    #: the devices' primary contexts: then another CUDA library of the
    #: process (PyTorch, CuPy) can run on its streams and use its buffers.
    cuda_native: ClassVar[bool] = False
    #: Whether it simulates its devices rather than drives them: it makes
    #: as many as asked for, its times are its own clock's, and a fault
    #: ends with a reset (as :mod:`gpuflow`'s ``sim``).
    simulated: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def device_count(self) -> int: ...

    def _lookup(self, devices: Sequence[D], device: int) -> D:
        """``devices[device]``, or UsageError for an ordinal that is not there."""
        if isinstance(device, int) and not isinstance(device, bool) and 0 <= device < len(devices):
            return devices[device]
        raise UsageError(
            f"device {device!r} does not exist: the {self.name} backend has {len(devices)}"
        )

    @abc.abstractmethod
    def device_state(self, device: int) -> DeviceState:
        """The per-device state of ``device`` (through :meth:`_lookup`): the
        same object for the life of the backend (the runtime keeps it).

        Parameters
        ----------
        device
            The device's ordinal.

        Returns
        -------
        DeviceState
        """

    def device_fault(self, device: int) -> DeviceFaultError | None:
        """The sticky fault of ``device``, if one has been seen.

        Parameters
        ----------
        device
            The device's ordinal.

        Returns
        -------
        DeviceFaultError | None
        """
        return self.device_state(device).fault

    @abc.abstractmethod
    def device_arch(self, device: int) -> str:
        """The ``sm_XY`` device code of ``device`` is compiled for.

        Parameters
        ----------
        device
            The device's ordinal.

        Returns
        -------
        str
        """

    def graph_handle(self, graph: RawGraph) -> int:
        """The address of a captured graph's executable form (``CUgraphExec``).

        Parameters
        ----------
        graph
            The backend's captured graph.

        Returns
        -------
        int
        """
        raise UsageError(f"graphs of the {self.name} backend have no CUDA handle")

    def use_after_free_count(self) -> int:
        """How many device accesses to freed memory the backend caught (0 where
        it cannot see them: on CUDA, compute-sanitizer is the detector).

        Returns
        -------
        int
        """
        return 0

    @abc.abstractmethod
    def device_name(self, device: int) -> str:
        """A name of ``device`` for people (``"NVIDIA H200"``, ``"sim device 0"``).

        Parameters
        ----------
        device
            The device's ordinal.

        Returns
        -------
        str
        """

    # -- streams --------------------------------------------------------------
    @abc.abstractmethod
    def create_stream(
        self, device: int, priority: int = 0, partition: RawPartition | None = None
    ) -> RawStream:
        """A new non-blocking stream on ``device``.

        Parameters
        ----------
        device
            The device's ordinal.
        priority
            gpuflow's level: 0 the default, higher more urgent, up to
            :meth:`stream_priorities` (checked by the caller; only a backend
            that has levels above 0 is given one).
        partition
            One of the partitions :meth:`partition_sms` made: the stream
            runs its kernels on those SMs alone.  None: on any SM (only a
            backend that makes partitions is given one).

        Returns
        -------
        object
        """

    def sm_count(self, device: int) -> int | None:
        """How many SMs ``device`` has (None where the backend does not say).

        Parameters
        ----------
        device
            The device's ordinal.

        Returns
        -------
        int or None
        """
        return None

    def partition_sms(self, device: int, sizes: Sequence[int]) -> list[RawPartition]:
        """Reserve SMs of ``device``: one partition of at least ``sizes[i]``
        SMs for each size (rounded up as the device requires), then one of
        the SMs left.  Streams made in a partition (:meth:`create_stream`)
        run on its SMs alone.  Called once per device, at set-up; a backend
        or driver that cannot reserve SMs raises rather than reserve none.

        Parameters
        ----------
        device
            The device's ordinal.
        sizes
            The SMs each partition asks for.

        Returns
        -------
        list
            ``len(sizes) + 1`` partitions, the SMs left last.

        Raises
        ------
        gpuflow.UsageError
            The backend cannot reserve SMs (the default), or the sizes do
            not fit the device (the message says its SMs and the rounding).
        """
        raise UsageError(
            f"the {self.name} backend cannot reserve SMs (reserve_sms): it has no partitions "
            "of a device's SMs (the cuda backend has them, as green contexts)"
        )

    def release_partitions(self, partitions: Sequence[RawPartition]) -> None:
        """``partitions`` (of :meth:`partition_sms`) serve no runtime any
        more and no stream of them is left: destroy them (on CUDA, their
        green contexts).  Default: nothing to release.

        Parameters
        ----------
        partitions
            Partitions of this backend's.
        """

    def live_objects(self) -> dict[str, list[object]]:
        """What the backend holds now for gpuflow, by kind, for the
        quiescence check (:func:`gpuflow.testing.assert_quiescent`):
        ``"partitions"`` (of :meth:`partition_sms`, not released) and, where
        the backend has them, ``"staging"`` (pinned staging buffers still
        busy with a copy) and ``"events"`` (events it made that are neither
        pooled for reuse nor held by anything: lost).  (The streams gpuflow made, gpuflow counts
        itself.)  Default: nothing counted.

        Returns
        -------
        dict[str, list[object]]
        """
        return {}

    def partition_size(self, partition: RawPartition) -> int:
        """How many SMs ``partition`` (of :meth:`partition_sms`) has.

        Parameters
        ----------
        partition
            A partition.

        Returns
        -------
        int
        """
        raise NotImplementedError

    def stream_priorities(self, device: int) -> int:
        """The most urgent stream priority ``device`` takes, in gpuflow's
        levels: 0 is the default, each level above it more urgent (CUDA's
        numbers run the other way: its range from the lowest priority, 0 on
        current GPUs, down to the highest, -5).  0 where the backend has no
        priorities (the default).

        Parameters
        ----------
        device
            The device's ordinal.

        Returns
        -------
        int
        """
        return 0

    @abc.abstractmethod
    def destroy_stream(self, stream: RawStream) -> None:
        """Release a stream; work already enqueued still completes.

        Parameters
        ----------
        stream
            The backend's stream.
        """

    @abc.abstractmethod
    def stream_destroyed(self, stream: RawStream) -> bool:
        """Whether :meth:`destroy_stream` was called on ``stream`` (new work
        on it is refused; what it had still completes).

        Parameters
        ----------
        stream
            The backend's stream.

        Returns
        -------
        bool
        """

    @abc.abstractmethod
    def stream_handle(self, stream: RawStream) -> int:
        """The ``CUstream`` address, for ``__cuda_stream__``.

        Parameters
        ----------
        stream
            The backend's stream.

        Returns
        -------
        int
        """

    @abc.abstractmethod
    def synchronize(self, stream: RawStream) -> None:
        """Block until the stream is idle; DeviceFaultError after a fault.

        Parameters
        ----------
        stream
            The backend's stream.
        """

    @abc.abstractmethod
    def query(self, stream: RawStream) -> bool:
        """True when all work on the stream is done; DeviceFaultError after a fault.

        Parameters
        ----------
        stream
            The backend's stream.

        Returns
        -------
        bool
        """

    # -- events ---------------------------------------------------------------
    @abc.abstractmethod
    def record_event(self, stream: RawStream) -> RawEvent:
        """An event that completes when the stream's current work is done.

        Parameters
        ----------
        stream
            The backend's stream.

        Returns
        -------
        object
        """

    @abc.abstractmethod
    def wait_event(self, stream: RawStream, event: RawEvent) -> None:
        """Later work on ``stream`` waits for ``event`` (any device).

        Parameters
        ----------
        stream
            The backend's stream.
        event
            The backend's event.
        """

    # -- memory ---------------------------------------------------------------
    @abc.abstractmethod
    def alloc(self, device: int, nbytes: int, stream: RawStream) -> RawBuffer:
        """Stream-ordered allocation; OutOfMemoryError when it fails.

        Parameters
        ----------
        device
            The device's ordinal.
        nbytes
            How many bytes.
        stream
            The backend's stream.

        Returns
        -------
        RawBuffer
        """

    @abc.abstractmethod
    def free(self, buffer: RawBuffer, stream: RawStream) -> None:
        """Stream-ordered free, after all work enqueued on ``stream``.

        Parameters
        ----------
        buffer
            The backend's buffer.
        stream
            The backend's stream.
        """

    @abc.abstractmethod
    def copy_from_host(self, dst: RawBuffer, src: HostArray, stream: RawStream) -> None:
        """Copy a C-contiguous host array into ``dst``; ``src`` must stay alive until done.

        Parameters
        ----------
        dst
            Where the data goes.
        src
            Where the data comes from.
        stream
            The backend's stream.
        """

    @abc.abstractmethod
    def copy_to_host(self, dst: HostArray, src: RawBuffer, stream: RawStream) -> None:
        """Copy ``dst.nbytes`` from ``src`` into a C-contiguous host array.

        Parameters
        ----------
        dst
            Where the data goes.
        src
            Where the data comes from.
        stream
            The backend's stream.
        """

    @abc.abstractmethod
    def copy_device(self, dst: RawBuffer, src: RawBuffer, nbytes: int, stream: RawStream) -> None:
        """Device-to-device copy; peer-to-peer when the devices differ.

        Parameters
        ----------
        dst
            Where the data goes.
        src
            Where the data comes from.
        nbytes
            How many bytes.
        stream
            The backend's stream.
        """

    @abc.abstractmethod
    def fill(self, dst: RawBuffer, value: np.generic, count: int, stream: RawStream) -> None:
        """Set ``count`` elements of ``value``'s dtype to ``value``.

        Parameters
        ----------
        dst
            Where the data goes.
        value
            The value each element gets.
        count
            How many elements.
        stream
            The backend's stream.
        """

    @abc.abstractmethod
    def arange(
        self, dst: RawBuffer, start: np.generic, step: np.generic, count: int, stream: RawStream
    ) -> None:
        """Write ``start + i * step`` for ``i < count``, in ``start``'s dtype.

        Parameters
        ----------
        dst
            Where the data goes.
        start
            The first number.
        step
            The distance between two numbers.
        count
            How many elements.
        stream
            The backend's stream.
        """

    # -- kernels --------------------------------------------------------------
    @abc.abstractmethod
    def load_kernel(self, device: int, module: ModuleSource, name: str) -> RawKernel:
        """A launchable handle of kernel ``name`` on ``device`` (cached by the caller).

        Parameters
        ----------
        device
            The device's ordinal.
        module
            The compiled module (:class:`gpuflow.Module`).
        name
            The kernel's name.

        Returns
        -------
        object
        """

    def load_ahead(
        self, device: int, module: ModuleSource | None, partitions: Sequence[RawPartition]
    ) -> None:
        """Load ``module`` (None: the backend's own built-in kernels) into
        ``device``'s own context and the contexts of ``partitions`` (reserved
        SMs' and the SMs left's, of :meth:`partition_sms`), now: what a first
        launch there would otherwise load, waiting for the device's running
        kernels.  Where loads never wait, nothing (the default).

        Parameters
        ----------
        device
            The device's ordinal.
        module
            The compiled module, or None (the built-in kernels).
        partitions
            Partitions of the device's SMs.
        """

    @abc.abstractmethod
    def launch(
        self,
        kernel: RawKernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shmem: int,
        args: Sequence[KernelArg],
        stream: RawStream,
    ) -> None:
        """Enqueue a kernel; LaunchError for a bad configuration.

        Parameters
        ----------
        kernel
            The backend's kernel (``load_kernel``'s).
        grid
            Blocks, per dimension.
        block
            Threads a block, per dimension.
        shmem
            Dynamic shared memory a block, in bytes.
        args
            The kernel's arguments, in its signature's order.
        stream
            The backend's stream.
        """

    def prepare_launch(
        self,
        kernel: RawKernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shmem: int,
        args: Sequence[KernelArg],
    ) -> Step:
        """:meth:`launch` of ``kernel`` as a step: everything but the stream
        fixed, and called with a stream, it enqueues the kernel there, with
        the same checks and errors.  Made once for many launches; a backend
        may prepare the call (the cuda backend packs the arguments once: the
        caller keeps the buffers of ``args`` while it keeps the step).

        Parameters
        ----------
        kernel
            The backend's kernel (``load_kernel``'s).
        grid
            Blocks, per dimension.
        block
            Threads a block, per dimension.
        shmem
            Dynamic shared memory a block, in bytes.
        args
            The kernel's arguments, in its signature's order.

        Returns
        -------
        Step
        """
        launch = self.launch

        def step(stream: RawStream) -> None:
            launch(kernel, grid, block, shmem, args, stream)

        return step

    # -- the native half of the completion bridge -----------------------------
    @abc.abstractmethod
    def mark(self, stream: RawStream, polled: bool = True) -> int:
        """Enqueue ``stream``'s next completion mark; return its number.

        A stream's marks are numbered 1, 2, 3, ... in the order they are
        enqueued (the caller serializes the marks of one stream).  When the
        GPU reaches a mark, everything enqueued on the stream before it is
        done, and the stream's completion word becomes the mark's number.
        A mark not ``polled`` (no event loop will read it: a run no task
        awaits) is *silent*: the GPU need not write the word for it, and the
        backend may mark it more cheaply (the cuda backend records an event:
        no memory operation between kernels); the reader and ``wait_mark``
        still see it reached, and a later mark reached covers it.  A
        faulted device reaches no mark.  Inside a capture: UsageError.

        Parameters
        ----------
        stream
            The backend's stream.
        polled
            Whether an event loop reads the mark (a word) or none does (a silent mark).

        Returns
        -------
        int
        """

    def marker(self, stream: RawStream) -> Callable[[bool], int]:
        """:meth:`mark` of ``stream``, made once for its many marks (called
        with ``polled``): a backend may prepare what every mark of the
        stream repeats.

        Parameters
        ----------
        stream
            The backend's stream.

        Returns
        -------
        Callable[[bool], int]
        """
        return functools.partial(self.mark, stream)

    @abc.abstractmethod
    def completion_reader(self, stream: RawStream) -> Callable[[], int]:
        """A function returning the number of the last mark of ``stream`` the
        GPU has reached (0 before any).  Cheap: a read of memory the GPU
        writes, where the device can (a silent mark not yet seen reached is
        asked of the driver); callable from any thread, never blocks, never
        raises.  A stream keeps its numbering for its whole life.

        Parameters
        ----------
        stream
            The backend's stream.

        Returns
        -------
        Callable[[], int]
        """

    @abc.abstractmethod
    def wait_mark(self, stream: RawStream, other: RawStream, number: int) -> None:
        """Later work on ``stream`` waits until ``other`` (a stream of any
        device of this backend) has reached its mark ``number``.

        Parameters
        ----------
        stream
            The backend's stream.
        other
            The stream whose mark is waited for.
        number
            The mark's number.
        """

    def enqueue_close(self, stream: RawStream, fd: int) -> bool:
        """When the GPU reaches this point of ``stream``, close ``fd`` (once,
        from a thread of the driver, never needing the GIL on a real device).
        False, with nothing enqueued, where this point cannot be marked that
        way (a stream being captured: a graph would close it at every
        replay).  On a fault the close may never happen: ``fd`` is the
        caller's to leak, never to close itself.

        Parameters
        ----------
        stream
            The backend's stream.
        fd
            The file descriptor to close.

        Returns
        -------
        bool
        """
        return False

    def complete_transfers(self, stream: RawStream) -> None:
        """Marks of ``stream`` were seen reached: deliver what the work before
        them must have delivered by the time it is reported done (on CUDA,
        device-to-host copies staged through pinned memory).  Never raises.

        Parameters
        ----------
        stream
            The backend's stream.
        """
        return None

    # -- graphs ---------------------------------------------------------------
    @abc.abstractmethod
    def begin_capture(self, stream: RawStream) -> None:
        """Start recording the work enqueued on ``stream`` instead of running it.

        Parameters
        ----------
        stream
            The backend's stream.
        """

    @abc.abstractmethod
    def end_capture(self, stream: RawStream) -> RawGraph:
        """Stop recording; return an executable graph of what was enqueued.

        Parameters
        ----------
        stream
            The backend's stream.

        Returns
        -------
        object
        """

    @abc.abstractmethod
    def launch_graph(self, graph: RawGraph, stream: RawStream) -> None:
        """Enqueue one replay of a captured graph.

        Parameters
        ----------
        graph
            The backend's captured graph.
        stream
            The backend's stream.
        """

    @abc.abstractmethod
    def graph_node_count(self, graph: RawGraph) -> int:
        """How many nodes a captured graph has: one per kernel, copy or fill
        captured; cross-stream event records and waits are its edges, not nodes.

        Parameters
        ----------
        graph
            The backend's captured graph.

        Returns
        -------
        int
        """

    # -- interop: other libraries' streams and memory --------------------------
    def foreign_stream(
        self, handle: int, device: int, named: bool = False
    ) -> tuple[RawStream, int]:
        """A raw stream for ``handle``, a stream another library owns, and its device.

        ``handle`` is a ``CUstream`` address, or 0, 1 (the legacy default
        stream) or 2 (the per-thread default stream), whose device is
        ``device``.  gpuflow records events on such a stream, makes it wait
        on events (:meth:`record_event`, :meth:`wait_event`), marks it
        (:meth:`mark`: the run of a lone ``await gf.wait_stream(s)``
        completes there, its completion reader, :meth:`query` and
        :meth:`enqueue_close` then work as on any stream), and never
        destroys it.  A call on it may run inside another library's code
        (a DLPack deleter, on any thread): it leaves the calling thread as
        it found it (its current CUDA context).  A handle the backend cannot
        use is a :class:`gpuflow.UsageError`.  ``named``: the library's
        stream object says it is on ``device`` (PyTorch's and CuPy's do); a
        handle resolved there before may then be taken as that same stream
        without asking the driver again.

        Parameters
        ----------
        handle
            Another library's stream handle.
        device
            The device's ordinal.
        named
            Whether the handle was given by name (an int) rather than by an object.

        Returns
        -------
        tuple[RawStream, int]
        """
        raise UsageError(f"backend {self.name!r} cannot use another library's streams")

    def stream_capturing(self, stream: RawStream) -> bool:
        """Whether ``stream`` (gpuflow's or another library's) is being
        captured into a graph now: work enqueued on it would become a node
        of that graph instead of running.

        Parameters
        ----------
        stream
            The backend's stream.

        Returns
        -------
        bool
        """
        return False

    def foreign_buffer(self, ptr: int, nbytes: int, device: int | None) -> RawBuffer:
        """``nbytes`` of device memory at ``ptr`` that another library owns.

        The buffer is usable like one from :meth:`alloc` (kernels, copies),
        except that gpuflow never frees it: :meth:`free` must not be called
        on it.  ``device`` is the device the producer names (None: the
        pointer's own).  Memory that is not device memory of one of the
        backend's devices (host memory, another device's, an address in no
        allocation) is a :class:`gpuflow.UsageError` saying which.

        Parameters
        ----------
        ptr
            The device address.
        nbytes
            How many bytes.
        device
            The device's ordinal.

        Returns
        -------
        RawBuffer
        """
        raise UsageError(f"backend {self.name!r} cannot use another library's memory")

    def launch_limits(self, device: int) -> LaunchLimits:
        """What one launch may ask of ``device`` (grid and block dimensions,
        threads a block, shared memory a block).  gpuflow checks every
        launch against them when it is built, before anything is enqueued.
        The default is an H100's; a backend of other devices says theirs.

        Parameters
        ----------
        device
            The device's ordinal.

        Returns
        -------
        LaunchLimits
        """
        return H100_LIMITS

    def describe_device(self, device: int) -> DeviceDescription:
        """Name, compute capability and memory of ``device``.

        Parameters
        ----------
        device
            The device's ordinal.

        Returns
        -------
        DeviceDescription
        """
        return DeviceDescription(self.device_name(device), None, 0)

    def memory_reserved(self, device: int) -> int | None:
        """Bytes of ``device``'s memory the backend holds now (allocated to
        gpuflow, or kept for reuse), or None where it cannot tell.

        Parameters
        ----------
        device
            The device's ordinal.

        Returns
        -------
        int | None
        """
        return None

    def driver_version(self) -> str | None:
        """The CUDA driver's version (``"13.0"``), or None without a driver.

        Returns
        -------
        str | None
        """
        return None

    # -- a record of what the device ran (tests, the timeline) --------------------
    def start_activity_record(self) -> list[Activity]:
        """Start a record of every item the streams run; return the list it fills.

        Each item is recorded with :data:`activity_tag` as it was where the
        item was enqueued.  Backends that keep no such record raise
        :class:`gpuflow.UsageError`.

        Returns
        -------
        list[Activity]
        """
        raise UsageError(
            f"backend {self.name!r} keeps no record of device activity: "
            "the record is the sim backend's (init_device_contexts(backend='sim'))"
        )

    def stop_activity_record(self, record: list[Activity]) -> None:
        """Stop filling ``record``; nothing is appended to it once this returns.

        Parameters
        ----------
        record
            The activity record (``start_activity_record``'s).
        """
        raise UsageError(f"backend {self.name!r} keeps no record of device activity")

    def update_activity_records(self) -> None:
        """Append to the open records what the device finished since the last
        call, where the backend learns it only when asked (times taken by
        device events); a backend whose streams append as they run has
        nothing to do."""

    def activity_stream_id(self, stream: RawStream) -> int:
        """The id an activity record gives the items of raw ``stream``
        (:attr:`Activity.stream`).

        Parameters
        ----------
        stream
            The backend's stream.

        Returns
        -------
        int
        """
        return id(stream)

    # -- faults ---------------------------------------------------------------
    @abc.abstractmethod
    def reset_device(self, device: int) -> None:
        """Clear a sticky fault; every stream, buffer and kernel of the device
        made before is invalid afterwards (CUDA's primary context reset).

        Parameters
        ----------
        device
            The device's ordinal.
        """

    def close(self) -> None:
        """Release process-wide resources (threads) when the runtime is replaced."""
