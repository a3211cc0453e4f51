"""Lower-level pieces for writing new kinds of operations and for interop.

Subclass :class:`gpuflow.DeviceOperation` and implement ``execute(ctx)``
with the :class:`gpuflow.ExecutionContext` it gets; everything the enqueued work
still uses must be handed to ``ctx.keep``.
"""

from ._backends import Backend as Backend
from ._backends import CollectiveCall as CollectiveCall
from ._backends import LaunchLimits as LaunchLimits
from ._backends import PointerArg as PointerArg
from ._backends import RawBuffer as RawBuffer
from ._backends import RawComm as RawComm
from ._backends import RawEvent as RawEvent
from ._backends import RawGraph as RawGraph
from ._backends import RawKernel as RawKernel
from ._backends import RawPartition as RawPartition
from ._backends import RawStream as RawStream
from ._backends import Step as Step
from ._backends import cuda_probe as cuda_probe
from ._backends import load_backend as load_backend
from ._backends import new_sim_backend as new_sim_backend
from ._backends import register_backend as register_backend
from ._core import CompletionStatistics as CompletionStatistics
from ._core import ExecutionContext as ExecutionContext
from ._core import Run as Run
from ._core import current_backend_object as current_backend_object
from ._core import current_completion_statistics as current_completion_statistics
from ._core import graph_exec_handle as graph_exec_handle
from ._core import pool_streams as pool_streams
from ._interop import ImportedAllocation as ImportedAllocation
from ._interop import StreamAdapter as StreamAdapter
from ._interop import register_stream_adapter as register_stream_adapter

__all__ = [
    "Backend", "CollectiveCall", "LaunchLimits", "PointerArg", "register_backend", "load_backend",
    "cuda_probe", "new_sim_backend",
    "RawBuffer", "RawComm", "RawEvent", "RawGraph", "RawKernel", "RawPartition", "RawStream",
    "Step",
    "current_backend_object",
    "ExecutionContext", "Run", "pool_streams", "graph_exec_handle",
    "ImportedAllocation", "StreamAdapter", "register_stream_adapter",
    "current_completion_statistics", "CompletionStatistics",
]
