"""gpuflow: lazy, composable GPU operations awaited under structured concurrency.

Build DeviceOperation recipes (kernels, copies, allocations joined with
then, zip, unzip, shared), then run them with op.sync() or `await op` under
asyncio or Trio (through AnyIO).  A recipe runs its work each time it is run;
op.shared() runs it once.  An await never blocks the event loop: while the
loop is busy it reads the GPU's completion marks once a turn, and when idle it
sleeps until the GPU wakes it.  GPU work of other libraries joins in without
copies.

The API by topic (help(gpuflow.NAME) tells more of each):

  operations     DeviceOperation, SharedOperation, Graph, value, with_context, zip
  arrays         DeviceArray, zeros, ones, full, empty, zeros_like, ones_like,
                 full_like, empty_like, arange, from_host, to_host, copy,
                 memory_stats, MemoryStats
  kernels        compile, compile_async, Module, Kernel, LaunchConfig
  devices        init_device_contexts, current_backend, current_device,
                 device_count, device_info, DeviceInfo, use_device, new_stream,
                 reset_device, Stream, ExecutionContext
  scheduling     SchedulingPolicy, StreamPoolLeastLoaded, StreamPoolRoundRobin,
                 SingleStream, latency_class, LatencyClass, current_latency_class
  scopes         open_stream_lease, StreamLease, open_device_group, DeviceGroup,
                 StartedRun
  interop        from_dlpack (other libraries' arrays), wait_stream (their
                 streams, awaited), foreign (their code, on gpuflow's stream)
  communicators  open_communicator, Communicator, RankInfo, new_unique_id,
                 bootstrap_mpi, spawn_ranks
  errors         GpuflowError > UsageError > UsageTypeError;
                 GpuflowError > DeviceError > DeviceFaultError,
                 OutOfMemoryError, LaunchError, CommunicatorError;
                 GpuflowError > CompileError
  diagnostics    trace (a timeline of the runs), in_flight (what runs now, and
                 what each waits for), RunInFlight
  submodules     gpuflow.lowlevel (new kinds of operations, backends, raw
                 handles), gpuflow.testing (checks for test suites)

Modules whose names start with an underscore are private: import from
gpuflow, gpuflow.lowlevel and gpuflow.testing only.
"""

from . import lowlevel as lowlevel
from . import testing as testing
from ._comm import Communicator as Communicator
from ._comm import RankInfo as RankInfo
from ._comm import bootstrap_mpi as bootstrap_mpi
from ._comm import new_unique_id as new_unique_id
from ._comm import open_communicator as open_communicator
from ._comm import spawn_ranks as spawn_ranks
from ._core import DeviceInfo as DeviceInfo
from ._core import DeviceOperation as DeviceOperation
from ._core import ExecutionContext as ExecutionContext
from ._core import Graph as Graph
from ._core import LatencyClass as LatencyClass
from ._core import MemoryStats as MemoryStats
from ._core import RunInFlight as RunInFlight
from ._core import SchedulingPolicy as SchedulingPolicy
from ._core import SharedOperation as SharedOperation
from ._core import SingleStream as SingleStream
from ._core import Stream as Stream
from ._core import StreamPoolLeastLoaded as StreamPoolLeastLoaded
from ._core import StreamPoolRoundRobin as StreamPoolRoundRobin
from ._core import current_backend as current_backend
from ._core import current_device as current_device
from ._core import current_latency_class as current_latency_class
from ._core import device_count as device_count
from ._core import device_info as device_info
from ._core import in_flight as in_flight
from ._core import init_device_contexts as init_device_contexts
from ._core import latency_class as latency_class
from ._core import memory_stats as memory_stats
from ._core import new_stream as new_stream
from ._core import reset_device as reset_device
from ._core import trace as trace
from ._core import use_device as use_device
from ._core import value as value
from ._core import with_context as with_context
from ._core import zip as zip
from ._errors import CommunicatorError as CommunicatorError
from ._errors import CompileError as CompileError
from ._errors import DeviceError as DeviceError
from ._errors import DeviceFaultError as DeviceFaultError
from ._errors import GpuflowError as GpuflowError
from ._errors import LaunchError as LaunchError
from ._errors import OutOfMemoryError as OutOfMemoryError
from ._errors import UsageError as UsageError
from ._errors import UsageTypeError as UsageTypeError
from ._interop import foreign as foreign
from ._interop import from_dlpack as from_dlpack
from ._interop import wait_stream as wait_stream
from ._kernels import Kernel as Kernel
from ._kernels import LaunchConfig as LaunchConfig
from ._kernels import Module as Module
from ._kernels import compile as compile
from ._kernels import compile_async as compile_async
from ._memory import DeviceArray as DeviceArray
from ._memory import arange as arange
from ._memory import copy as copy
from ._memory import empty as empty
from ._memory import empty_like as empty_like
from ._memory import from_host as from_host
from ._memory import full as full
from ._memory import full_like as full_like
from ._memory import ones as ones
from ._memory import ones_like as ones_like
from ._memory import to_host as to_host
from ._memory import zeros as zeros
from ._memory import zeros_like as zeros_like
from ._scopes import DeviceGroup as DeviceGroup
from ._scopes import StartedRun as StartedRun
from ._scopes import StreamLease as StreamLease
from ._scopes import open_device_group as open_device_group
from ._scopes import open_stream_lease as open_stream_lease

__version__ = "0.1.0.dev0"

__all__ = [
    # operations and running them
    "DeviceOperation", "SharedOperation", "Graph", "value", "with_context", "zip",
    # arrays
    "DeviceArray", "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like",
    "empty_like", "arange", "from_host", "to_host", "copy", "memory_stats", "MemoryStats",
    # kernels
    "compile", "compile_async", "Module", "Kernel", "LaunchConfig",
    # devices, streams, scheduling, scopes
    "init_device_contexts", "current_backend", "current_device", "device_count",
    "device_info", "DeviceInfo", "use_device", "new_stream", "reset_device", "Stream",
    "ExecutionContext",
    "SchedulingPolicy", "StreamPoolLeastLoaded", "StreamPoolRoundRobin", "SingleStream",
    "latency_class", "LatencyClass", "current_latency_class",
    "open_stream_lease", "StreamLease", "open_device_group", "DeviceGroup", "StartedRun",
    # other libraries' arrays, streams and code
    "from_dlpack", "wait_stream", "foreign",
    # communicators
    "open_communicator", "Communicator", "RankInfo", "new_unique_id", "bootstrap_mpi",
    "spawn_ranks",
    # errors
    "GpuflowError", "UsageError", "UsageTypeError", "DeviceError", "DeviceFaultError",
    "OutOfMemoryError", "LaunchError", "CommunicatorError", "CompileError",
    # a timeline of the runs, and what is in flight now
    "trace", "in_flight", "RunInFlight",
]


def _fixup_module_metadata(public: str, names: list[str], namespace: dict[str, object]) -> None:
    """Present what the private modules define as ``public.Name`` (as Trio
    does): tracebacks, reprs, ``help()`` and pickles name the module a user
    imports, not the private one that happens to define it."""
    seen: set[int] = set()

    def fix(obj: object) -> None:
        module = getattr(obj, "__module__", None)
        if id(obj) in seen or not isinstance(module, str) or not module.startswith("gpuflow._"):
            return
        seen.add(id(obj))
        obj.__module__ = public
        if isinstance(obj, type):  # its methods too, as help() and inspect see them
            for attr in vars(obj).values():
                if isinstance(attr, type) or hasattr(attr, "__code__"):  # a class, a function
                    fix(attr)

    for name in names:
        fix(namespace[name])


# the package first: a name both it and a submodule offer reads `gpuflow.Name`
_fixup_module_metadata(__name__, __all__, globals())
_fixup_module_metadata(lowlevel.__name__, lowlevel.__all__, vars(lowlevel))
_fixup_module_metadata(testing.__name__, testing.__all__, vars(testing))
del _fixup_module_metadata
