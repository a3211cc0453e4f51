"""Lower-level pieces for writing new kinds of operations and for interop.

Subclass :class:`gpuflow.DeviceOperation` and implement ``execute(ctx)``
with the :class:`gpuflow.ExecutionContext` it gets; everything the enqueued work
still uses must be handed to ``ctx.keep``.
"""

from __future__ import annotations

from ._backends import Backend as Backend
from ._backends import CollectiveCall as CollectiveCall
from ._backends import PointerArg as PointerArg
from ._backends import SimBackend
from ._backends import cuda_probe as cuda_probe
from ._backends import load_backend as load_backend
from ._backends import register_backend as register_backend
from ._core import CompletionStatistics as CompletionStatistics
from ._core import ExecutionContext as ExecutionContext
from ._core import Graph, Stream, current_device, ensure_runtime
from ._core import Run as Run
from ._interop import ImportedAllocation as ImportedAllocation
from ._interop import StreamAdapter as StreamAdapter
from ._interop import register_stream_adapter as register_stream_adapter

__all__ = [
    "Backend", "CollectiveCall", "PointerArg", "register_backend", "load_backend", "cuda_probe",
    "new_sim_backend",
    "current_backend_object",
    "ExecutionContext", "Run", "pool_streams", "graph_exec_handle",
    "ImportedAllocation", "StreamAdapter", "register_stream_adapter",
    "current_completion_statistics", "CompletionStatistics",
]


def new_sim_backend(
    num_devices: int | None = None, *, memory_bytes: int = 2 << 30, sms: int = 132
) -> Backend:
    """A ``sim`` backend of the sizes given: what ``init_device_contexts(backend="sim")``
    makes with the defaults.

    ``gf.init_device_contexts(backend=gf.lowlevel.new_sim_backend(2, sms=16))``
    simulates two devices of 16 SMs each: a small device, whose SMs a few
    blocks fill (see :func:`gpuflow.testing.block_time`).  The runtime that
    takes it closes it.  Any thread.

    Parameters
    ----------
    num_devices
        How many devices (None: 1).
    memory_bytes
        Each device's memory (2 GiB by default); an allocation past it is an
        out-of-memory error, as on a GPU.
    sms
        Each device's SMs (132 by default, an H200's).

    Returns
    -------
    Backend

    Raises
    ------
    gpuflow.UsageError
        ``sms`` is not a positive int.
    """
    return SimBackend(num_devices, memory_bytes=memory_bytes, sms=sms)


def current_backend_object() -> Backend:
    """The backend instance serving this process (raw handles, for interop and benchmarks).

    Any thread.

    Returns
    -------
    Backend
        The current runtime's (made with the defaults where there is none yet).
    """
    return ensure_runtime().backend


def pool_streams(device: int | None = None) -> list[Stream]:
    """The pool streams of ``device`` (default: the current one) now: the
    ``streams_per_device`` made at initialisation, then those the default
    policy (:class:`gpuflow.StreamPoolLeastLoaded`) added under load.

    Any thread.

    Parameters
    ----------
    device
        The device's ordinal (None: the current device).

    Returns
    -------
    list[Stream]

    Raises
    ------
    gpuflow.UsageError
        ``device`` is not one of the runtime's devices.
    """
    rt = ensure_runtime()
    return list(rt.streams(rt.check_device(current_device() if device is None else device)))


def graph_exec_handle(graph: Graph[object]) -> int:
    """The ``CUgraphExec`` address of a graph captured on the ``cuda`` backend.

    Any thread.

    Parameters
    ----------
    graph
        A graph made by :meth:`gpuflow.DeviceOperation.capture`.

    Returns
    -------
    int

    Raises
    ------
    gpuflow.UsageError
        The graph is not the ``cuda`` backend's.
    """
    return ensure_runtime().backend.graph_handle(graph.recording.raw)


def current_completion_statistics() -> CompletionStatistics:
    """How the runs of this runtime were seen complete so far: by the
    awaiting task's inline read, by a loop's poller, or by the completer
    thread, and how many sleeping wake-ups were armed.  Take it before and
    after a piece of work to see what its busy-poll budget bought
    (``busy_poll_us``, :func:`gpuflow.init_device_contexts`).  Any thread.

    Returns
    -------
    CompletionStatistics
        The counts so far (a snapshot).
    """
    return ensure_runtime().completer.statistics()
