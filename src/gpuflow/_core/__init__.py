"""The core: operations, runs, the runtime and its streams, completion.

Everything an ``await op`` touches lives here, at the bottom of the package
(above only the backends and the exception hierarchy): the lazy
:class:`DeviceOperation` and its combinators, a run's life from its start to
its completion (``_run``), the process-wide runtime and its stream pools,
the scheduling policies, the completion side (each stream's lane of marks,
one poller per event loop, the completer thread), the event-loop adapters,
the hazard records that order work on one buffer across streams, captures,
and the hooks the layers above reach in through (the trace, the
cancellation points' watcher, the count of unusual things switched on).

The layers above import the names listed in ``__all__`` from this package,
never its modules.
"""

from . import _cancel_points as cancel_points
from ._execution import ExecutionContext as ExecutionContext
from ._facts import DeviceInfo as DeviceInfo
from ._facts import MemoryStats as MemoryStats
from ._facts import RunInFlight as RunInFlight
from ._facts import current_backend_object as current_backend_object
from ._facts import current_completion_statistics as current_completion_statistics
from ._facts import device_info as device_info
from ._facts import graph_exec_handle as graph_exec_handle
from ._facts import in_flight as in_flight
from ._facts import memory_stats as memory_stats
from ._facts import pool_streams as pool_streams
from ._facts import resource_leaks as resource_leaks
from ._finalizers import finalize_later as finalize_later
from ._finalizers import run_finalized as run_finalized
from ._handoff import Handoff as Handoff
from ._hazards import Allocation as Allocation
from ._hazards import EventPoint as EventPoint
from ._hazards import Point as Point
from ._hazards import Uses as Uses
from ._hazards import capture_log as capture_log
from ._hazards import enqueue_ordered as enqueue_ordered
from ._hazards import hazard_lock as hazard_lock
from ._hazards import order_after as order_after
from ._hazards import usable_stream as usable_stream
from ._hazards import wait_for_uses as wait_for_uses
from ._latency import ENCLOSING as ENCLOSING
from ._latency import LatencyClass as LatencyClass
from ._latency import class_here as class_here
from ._latency import enter_class as enter_class
from ._latency import leave_class as leave_class
from ._loops import current_loop as current_loop
from ._loops import interrupted as interrupted
from ._loops import post as post
from ._loops import refuse_blocking as refuse_blocking
from ._operation import DeviceOperation as DeviceOperation
from ._operation import Graph as Graph
from ._operation import SharedOperation as SharedOperation
from ._operation import callable_name as callable_name
from ._operation import value as value
from ._operation import with_context as with_context
from ._operation import zip as zip
from ._pending import PendingHost as PendingHost
from ._pending import resolve as resolve
from ._plan import ANYWHERE as ANYWHERE
from ._plan import Plan as Plan
from ._plan import enqueue_step as enqueue_step
from ._policy import SchedulingPolicy as SchedulingPolicy
from ._policy import SingleStream as SingleStream
from ._policy import StreamPoolLeastLoaded as StreamPoolLeastLoaded
from ._policy import StreamPoolRoundRobin as StreamPoolRoundRobin
from ._policy import current_latency_class as current_latency_class
from ._policy import latency_class as latency_class
from ._policy import stream_elsewhere as stream_elsewhere
from ._run import Run as Run
from ._run import ended_by as ended_by
from ._run import start_run as start_run
from ._runtime import Runtime as Runtime
from ._runtime import current_backend as current_backend
from ._runtime import current_device as current_device
from ._runtime import current_device_var as current_device_var
from ._runtime import current_runtime as current_runtime
from ._runtime import device_count as device_count
from ._runtime import device_count_option as device_count_option
from ._runtime import discard_runtime as discard_runtime
from ._runtime import ensure_runtime as ensure_runtime
from ._runtime import init_device_contexts as init_device_contexts
from ._runtime import new_stream as new_stream
from ._runtime import reset_device as reset_device
from ._runtime import runtime_started as runtime_started
from ._runtime import use_device as use_device
from ._scoped import enter_scope as enter_scope
from ._scoped import leave_scope as leave_scope
from ._statistics import CompletionStatistics as CompletionStatistics
from ._stream import Stream as Stream
from ._stream_protocols import describe_stream as describe_stream
from ._stream_protocols import stream_at as stream_at
from ._stream_protocols import stream_for as stream_for
from ._stream_protocols import stream_handle as stream_handle
from ._trace import trace as trace
from ._unusual import UNUSUAL as UNUSUAL

__all__ = [
    "ANYWHERE",
    "Plan",
    "Allocation",
    "CompletionStatistics",
    "ENCLOSING",
    "DeviceInfo",
    "DeviceOperation",
    "EventPoint",
    "ExecutionContext",
    "Graph",
    "Handoff",
    "MemoryStats",
    "PendingHost",
    "Point",
    "Run",
    "RunInFlight",
    "Runtime",
    "SchedulingPolicy",
    "SharedOperation",
    "SingleStream",
    "Stream",
    "StreamPoolLeastLoaded",
    "StreamPoolRoundRobin",
    "UNUSUAL",
    "Uses",
    "LatencyClass",
    "callable_name",
    "class_here",
    "cancel_points",
    "capture_log",
    "current_backend",
    "current_backend_object",
    "current_completion_statistics",
    "current_device",
    "current_device_var",
    "current_latency_class",
    "current_loop",
    "current_runtime",
    "describe_stream",
    "device_count",
    "device_info",
    "device_count_option",
    "discard_runtime",
    "ended_by",
    "enter_scope",
    "finalize_later",
    "ensure_runtime",
    "enter_class",
    "graph_exec_handle",
    "enqueue_ordered",
    "enqueue_step",
    "hazard_lock",
    "in_flight",
    "init_device_contexts",
    "interrupted",
    "leave_class",
    "leave_scope",
    "memory_stats",
    "new_stream",
    "pool_streams",
    "order_after",
    "post",
    "latency_class",
    "stream_elsewhere",
    "refuse_blocking",
    "reset_device",
    "resource_leaks",
    "resolve",
    "run_finalized",
    "runtime_started",
    "start_run",
    "stream_at",
    "stream_for",
    "stream_handle",
    "trace",
    "usable_stream",
    "use_device",
    "value",
    "wait_for_uses",
    "with_context",
    "zip",
]
