"""The records a backend and the front end pass each other: buffers, kernel
arguments, collectives, devices, activity, and each device's state.

Plain data (named tuples, dataclasses) and the protocols a backend's own
objects satisfy; :mod:`._base` is the interface that takes and gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple, NewType, Protocol, TypeVar

import numpy as np

from .._errors import DeviceFaultError


class RawBuffer(Protocol):
    """Device memory owned by the front end's allocation object."""

    @property
    def device(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def ptr(self) -> int: ...


# A backend's own handles.  The front end keeps them and gives them back to
# the backend that made them, never looking inside: each backend reads its
# own class out of them (a cast where one is given to it), so that a stream
# is never passed where an event is wanted without a type checker saying so.

RawStream = NewType("RawStream", object)
RawStream.__doc__ = "A stream of the backend's (:meth:`Backend.create_stream`)."
RawEvent = NewType("RawEvent", object)
RawEvent.__doc__ = "An event recorded on a stream (:meth:`Backend.record_event`)."
RawKernel = NewType("RawKernel", object)
RawKernel.__doc__ = "A kernel loaded into a device's context (:meth:`Backend.load_kernel`)."
RawGraph = NewType("RawGraph", object)
RawGraph.__doc__ = "A graph a capture made (:meth:`Backend.end_capture`)."
RawPartition = NewType("RawPartition", object)
RawPartition.__doc__ = "A device's SMs set apart (:meth:`Backend.partition_sms`)."
RawComm = NewType("RawComm", object)
RawComm.__doc__ = "A rank's communicator (:meth:`Backend.comm_init`)."

#: An enqueue prepared once and called with each stream it goes to: a
#: launch with its arguments final (:meth:`Backend.prepare_launch`), a
#: collective (:meth:`Backend.prepare_collective`).
Step = Callable[[RawStream], None]

#: A NumPy dtype of any scalar type.
DType = np.dtype[np.generic]
#: A NumPy array in host memory, of any shape and dtype.
HostArray = np.ndarray[tuple[int, ...], np.dtype[np.generic]]


#: The attribute :func:`gpuflow.testing.block_time` sets on a kernel's
#: reference: the seconds each block of the kernel holds a simulated SM (a
#: number, or a function of the kernel's arguments)
BLOCK_TIME_ATTR = "__gpuflow_block_time__"


class ModuleSource(Protocol):
    """What a backend needs of a compiled module to load its kernels."""

    @property
    def source(self) -> str: ...
    @property
    def references(self) -> dict[str, Callable[..., object]]: ...
    @property
    def kernels(self) -> Mapping[str, object]: ...
    def binary_for(self, arch: str) -> bytes: ...


@dataclass(frozen=True, slots=True)
class PointerArg:
    """A pointer parameter: the buffer, typed as the kernel signature says.

    Parameters
    ----------
    buffer
        The backend's buffer.
    dtype
        The element type the signature names.
    count
        How many ``dtype`` elements the array holds.
    writes
        False for a ``const T*`` parameter.
    """

    buffer: RawBuffer
    dtype: DType
    count: int
    writes: bool


KernelArg = PointerArg | np.generic

#: The reductions a communicator knows, by NCCL's ``ncclRedOp_t`` order.
REDUCTIONS = ("sum", "prod", "max", "min", "avg")

#: The element types NCCL moves and reduces (bfloat16 and fp8 have no NumPy dtype).
COMM_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        "int8",
        "uint8",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
)


class CollectiveCall(NamedTuple):
    """One rank's part of a collective or point-to-point transfer, as NCCL takes it.

    ``kind`` is ``"all_reduce"``, ``"broadcast"``, ``"all_gather"``,
    ``"reduce_scatter"``, ``"send"`` or ``"recv"``.  ``elems`` counts
    elements of ``dtype`` as NCCL counts them: what each rank sends for
    ``all_gather``, what each rank receives for ``reduce_scatter``, the
    whole buffer otherwise.  ``send`` is None for ``recv`` (and where the
    rank's send buffer is never read: a broadcast's non-root), ``recv`` None
    for ``send``; both may be the same buffer (in place).  ``op`` is one of
    ``"sum"``, ``"prod"``, ``"max"``, ``"min"``, ``"avg"`` for the reductions;
    ``peer`` the root of a broadcast, the other rank of a send or recv.
    """

    kind: str
    send: RawBuffer | None
    recv: RawBuffer | None
    elems: int
    dtype: DType
    op: str | None = None
    peer: int | None = None


class LaunchLimits(NamedTuple):
    """What one launch may ask of a device: the most blocks along each axis
    of a grid, threads along each axis of a block and threads a block in
    all, and bytes of shared memory a block (what a kernel may opt into,
    static and dynamic together).  A launch past one of them is refused
    before anything is enqueued."""

    max_grid: tuple[int, int, int]
    max_block: tuple[int, int, int]
    max_threads_per_block: int
    max_shared_memory_per_block: int


#: An H100's (and an H200's) limits, read from the driver
#: (``cuDeviceGetAttribute``): what ``sim`` enforces, as such a device would.
H100_LIMITS = LaunchLimits((2**31 - 1, 65535, 65535), (1024, 1024, 64), 1024, 232448)


class DeviceDescription(NamedTuple):
    """What ``python -m gpuflow info`` reports of one device.

    ``compute_capability`` is ``"9.0"`` style, or ``None`` where there is
    none (``sim``); ``total_memory`` is in bytes.
    """

    name: str
    compute_capability: str | None
    total_memory: int


class Activity(NamedTuple):
    """One item of work a stream ran, as a backend with a record saw it.

    ``stream`` is an opaque id, the same for every item of one stream and
    never shared by two streams of the backend
    (:meth:`Backend.activity_stream_id`); ``what`` names the item
    (``"kernel 'saxpy'"``, ``"copy to ..."``, ``"copy from ..."``,
    ``"fill of ..."``, ``"graph of 3 nodes"``, ``"nccl all_reduce"``,
    ``"event wait"``, ``"completion mark"``...); ``start`` and ``end`` are
    :func:`time.perf_counter` seconds of the stream's own clock, right before
    and right after the item ran.  ``tag`` is :data:`activity_tag` as it was
    where the item was enqueued (the timeline's number of the run that
    enqueued it), or None.
    """

    device: int
    stream: int
    what: str
    start: float
    end: float
    tag: int | None = None


#: What the items enqueued in this context are tagged with in an activity
#: record (:attr:`Activity.tag`).  While a timeline records, each run sets
#: its own number here from its start to its end, so that the timeline can
#: put every item the device ran inside the run that enqueued it.
activity_tag: ContextVar[int | None] = ContextVar("gpuflow_activity_tag", default=None)


class DeviceState(Protocol):
    """What every backend keeps per device: its sticky fault, if any."""

    @property
    def fault(self) -> DeviceFaultError | None: ...


D = TypeVar("D", bound=DeviceState)
