"""CUDA graphs: record a composed operation once, replay it with one call.

:func:`record` runs an operation's ``execute`` with the backend recording
instead of running (stream capture; ``zip`` arms fork onto the capture's own
private streams, which join the capture through events, so branches stay
parallel in the graph).  Nothing is enqueued for real during a capture, so
the array hazards an operation would order itself after are logged instead
(:data:`._hazards.capture_log`) and :func:`replay` applies them to the
stream of every replay.

What cannot be captured is refused with :class:`UsageError` naming it:
allocation (allocate inputs and outputs first, then capture work that
writes into them), host transfers, and running another operation
(``sync``/``await``) from inside the captured one.

The public :class:`gpuflow.Graph` wraps a :class:`Recording`; it lives with
the operations (its launch is one).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._errors import UsageError
from ._execution import ExecutionContext
from ._hazards import Allocation, capture_log, enqueue_ordered
from ._pending import is_pending
from ._run import Run, enqueue
from ._runtime import Runtime, current_device, ensure_runtime, new_stream
from ._stream import Stream
from ._unusual import UNUSUAL

if TYPE_CHECKING:
    from ._operation import DeviceOperation

T = TypeVar("T")


class _CapturePolicy:
    """Forks of a capture go to private streams, never to shared pool streams
    (whose other users' work would be captured too)."""

    def __init__(self, device: int, width: int) -> None:
        self._streams = [new_stream(device) for _ in range(width)]
        self._next = itertools.count()

    def next_stream(self, device: int) -> Stream:
        return self._streams[next(self._next) % len(self._streams)]


@dataclass(frozen=True, eq=False)
class Recording(Generic[T]):
    """A captured executable graph and what its replays need.

    ``keep`` holds everything the captured work refers to (arrays, modules,
    the capture's streams): a replay keeps the recording, so they live as long
    as the graph or a replay in flight.
    """

    raw: Any
    output: T
    device: int
    hazards: list[tuple[Allocation, bool]]
    keep: list[object]
    nodes: int
    runtime: Runtime
    generation: int


def record(op: DeviceOperation[T], stream: Stream | None = None) -> Recording[T]:
    """Capture ``op`` (see :meth:`DeviceOperation.capture`)."""
    rt = ensure_runtime()
    device = current_device() if stream is None else stream.device
    rt.check_fault(device)
    if capture_log.get() is not None:
        raise UsageError("capture() inside a capture")
    cap_stream = stream or new_stream(device)
    policy = _CapturePolicy(device, 3)
    # (nothing to wait for first: every replay is ordered after the work that
    # made its inputs by the hazards the capture logs, and only after that)
    be = rt.backend
    run = Run(device)
    ctx = ExecutionContext(rt, cap_stream, policy, run, capturing=True)
    log: dict[int, tuple[Allocation, bool]] = {}
    lane = cap_stream._lane
    if lane is not None and lane.unmarked:  # (a mark cannot be enqueued while it captures)
        lane.completer.mark_owed(lane)
    token = capture_log.set(log)
    UNUSUAL.begin()  # (runs take the long path, which refuses them in a capture)
    be.begin_capture(cap_stream.raw)
    try:
        out = enqueue(op, cap_stream, run, ctx)
    except BaseException:
        capture_log.reset(token)
        UNUSUAL.end()
        be.end_capture(cap_stream.raw)
        raise
    capture_log.reset(token)
    UNUSUAL.end()
    raw = be.end_capture(cap_stream.raw)
    if is_pending(out):
        raise UsageError("a captured operation cannot produce host data (gf.to_host)")
    return Recording(
        raw, out, device, list(log.values()), [*run.keep, policy, op],
        be.graph_node_count(raw), rt, rt.generation(device),
    )


def check_launch(rec: Recording[Any], ctx: ExecutionContext) -> None:
    """Refuse a replay where the recording cannot run (before anything is enqueued)."""
    if ctx.device != rec.device:
        raise UsageError(
            f"a graph captured on device {rec.device} launched on device {ctx.device}"
        )
    if rec.runtime is not ctx._runtime or rec.generation != ctx._runtime.generation(rec.device):
        raise UsageError("the graph belongs to a device context that was reset or replaced")
    if ctx.capturing:
        raise UsageError("a graph launch cannot itself be captured")


def replay(rec: Recording[T], ctx: ExecutionContext) -> T:
    """Enqueue one replay on ``ctx.stream``, ordered after the arrays' hazards."""
    stream = ctx.stream
    uses = [(alloc, stream, writes) for alloc, writes in rec.hazards]
    enqueue_ordered(ctx.run, uses, ctx.backend.launch_graph, rec.raw, stream.raw)
    return rec.output
