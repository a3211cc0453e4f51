"""CUDA graphs: capture a composed operation once, replay it with one call.

:meth:`DeviceOperation.capture` runs the operation's ``execute`` with the
backend recording instead of running (stream capture; ``zip`` arms fork onto
the capture's own private streams, which join the capture through events, so
branches stay parallel in the graph).  Nothing is enqueued for real during a
capture, so the array hazards an operation would order itself after are
logged instead and applied to the stream of every replay.

What cannot be captured is refused with :class:`UsageError` naming it:
allocation (allocate inputs and outputs first, then capture work that
writes into them), host transfers, and running another operation
(``sync``/``await``) from inside the captured one.

A :class:`Graph` keeps alive everything the captured work refers to (arrays,
modules) for as long as the graph or a replay in flight lives.
"""

from __future__ import annotations

import itertools
import threading
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._bridge import Submission
from ._context import ExecutionContext
from ._errors import UsageError
from ._operation import DeviceOperation, _as_op, is_pending
from ._runtime import current_device, get_runtime
from ._stream import Stream, new_stream

if TYPE_CHECKING:
    from ._array import _Allocation

T = TypeVar("T")

#: The hazard log of the capture running in this context, if any.
capture_log: ContextVar[dict[int, tuple[_Allocation, bool]] | None] = ContextVar(
    "gpuflow_capture_log", default=None
)


class _CapturePolicy:
    """Forks of a capture go to private streams, never to shared pool streams
    (whose other users' work would be captured too)."""

    def __init__(self, device: int, width: int) -> None:
        self._streams = [new_stream(device) for _ in range(width)]
        self._next = itertools.count()

    def next_stream(self, device: int) -> Stream:
        return self._streams[next(self._next) % len(self._streams)]


class Graph(Generic[T]):
    """A captured operation, replayed by :meth:`launch`.  Thread-safe.

    ``nodes`` is how many nodes the backend's graph has: one per kernel, copy
    or fill captured (the events joining ``zip`` arms are edges, not nodes).
    """

    def __init__(
        self,
        raw: Any,
        output: T,
        device: int,
        hazards: dict[int, tuple[_Allocation, bool]],
        keep: list[object],
        nodes: int,
    ) -> None:
        self._raw = raw
        self._output = output
        self.device = device
        self._hazards = list(hazards.values())
        self._keep = keep
        self._updates: list[DeviceOperation[Any]] = []
        self._lock = threading.Lock()
        self._runtime = get_runtime()
        self._generation = self._runtime.generation(device)
        self.nodes = nodes

    def launch(self) -> DeviceOperation[T]:
        """An operation that replays the graph (after any pending :meth:`update`).

        It produces the captured operation's output handles: the same arrays
        each time, holding the new results.
        """
        return _GraphLaunch(self)

    def update(self, op: DeviceOperation[Any]) -> None:
        """Run ``op`` (an input refresh such as ``gf.copy(new, out=graph_input)``)
        in order before the next launch, on the launch's stream."""
        _as_op(op, "Graph.update()")
        with self._lock:
            self._updates.append(op)

    def __repr__(self) -> str:
        return f"<gpuflow.Graph device={self.device} nodes={self.nodes}>"


class _GraphLaunch(DeviceOperation[T]):
    __slots__ = ("_graph",)

    def __init__(self, graph: Graph[T]) -> None:
        self._graph = graph

    def execute(self, ctx: ExecutionContext) -> T:
        g = self._graph
        if ctx.device != g.device:
            raise UsageError(
                f"a graph captured on device {g.device} launched on device {ctx.device}"
            )
        if g._runtime is not ctx._runtime or g._generation != ctx._runtime.generation(g.device):
            raise UsageError("the graph belongs to a device context that was reset or replaced")
        if ctx.capturing:
            raise UsageError("a graph launch cannot itself be captured")
        with g._lock:
            updates, g._updates = g._updates, []
        for op in updates:
            op.execute(ctx)
        from ._array import hazard_lock  # _array imports this module

        with hazard_lock:  # ordering after the hazards and enqueueing are one step
            for alloc, writes in g._hazards:
                if writes:
                    alloc.before_write(ctx.stream)
                else:
                    alloc.before_read(ctx.stream)
            ctx.backend.launch_graph(g._raw, ctx.stream._raw)
        ctx.keep(g)
        return g._output

    def _label(self) -> str:
        return f"graph launch ({self._graph.nodes} nodes)"

    def _kind(self) -> str:
        return "kernel"


def capture(op: DeviceOperation[T], stream: Stream | None = None) -> Graph[T]:
    """Capture ``op`` into a :class:`Graph` (see :meth:`DeviceOperation.capture`)."""
    _as_op(op, "capture()")
    rt = get_runtime()
    device = current_device() if stream is None else stream.device
    rt.check_fault(device)
    if capture_log.get() is not None:
        raise UsageError("capture() inside a capture")
    cap_stream = stream or new_stream(device)
    policy = _CapturePolicy(device, 3)
    # the capture starts after everything already enqueued on the device's
    # pool, so that replays never race with work that made the inputs
    be = rt.backend
    for s in rt.pool(device):
        if s != cap_stream:
            be.wait_event(cap_stream._raw, be.record_event(s._raw))
    sub = Submission(device)
    ctx = ExecutionContext(rt, cap_stream, policy, sub, capturing=True)
    log: dict[int, tuple[_Allocation, bool]] = {}
    token = capture_log.set(log)
    be.begin_capture(cap_stream._raw)
    try:
        out = op.execute(ctx)
    except BaseException:
        capture_log.reset(token)
        be.end_capture(cap_stream._raw)
        raise
    capture_log.reset(token)
    raw = be.end_capture(cap_stream._raw)
    if is_pending(out):
        raise UsageError("a captured operation cannot produce host data (gf.to_host)")
    return Graph(raw, out, device, log, [*sub.keep, policy, op], be.graph_node_count(raw))


def refuse_in_capture(what: object) -> None:
    """Running another operation from inside a capture would not be captured."""
    if capture_log.get() is not None:
        raise UsageError(f"{what} inside a graph capture: compose the operation instead")
