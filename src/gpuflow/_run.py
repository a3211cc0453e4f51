"""The four ways to run an operation: sync, sync_on, enqueue_on, await.

Each run makes one :class:`Submission` and one :class:`ExecutionContext`,
lets the operation enqueue, and then either blocks on the stream (``sync``),
hands the submission to the dispatcher and returns (``enqueue_on``), or
hands it over and awaits the GPU's wake-up (``await``).  Whatever happens
after something was enqueued, the submission keeps what that work uses until
the GPU is done with it.  An await of an operation that only waits for
another library's stream (``gf.wait_stream(s)`` alone) has nothing to
enqueue: its submission is marked on that stream itself, with no context
and no ``execute``.

Structured scopes (stream leases, device groups) see every run started
inside them through a context variable, so that they can wait for it.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from . import _finalizers, _points, _trace
from ._capture import refuse_in_capture
from ._context import ExecutionContext
from ._errors import UsageError, UsageTypeError
from ._hazards import capture_log
from ._loops import current_loop, refuse_blocking
from ._pending import has_map, is_pending, resolve
from ._policy import DEFAULT_POLICY, SchedulingPolicy, StreamPoolLeastLoaded
from ._runtime import Runtime, current_device, get_runtime
from ._stream import Stream
from ._submission import Submission

if TYPE_CHECKING:
    from ._operation import DeviceOperation


class Scope(Protocol):
    """A structured scope that tracks the runs started inside it."""

    def track(self, sub: Submission) -> None: ...

    @property
    def stream(self) -> Stream | None: ...


#: The scopes the current task runs in, innermost last.
current_scopes: ContextVar[tuple[Scope, ...]] = ContextVar("gpuflow_scopes", default=())


def ended_by(exc: BaseException) -> str:
    """How a wait ended, for a message: "was cancelled", or what it raised."""
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return "was cancelled"
    return f"ended by {exc!r}"


class _Pinned:
    """The policy of a run inside a stream lease: every part of it, zip arms
    included, stays on the lease's stream (any other stream of the pool may be
    another scope's lease)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: Stream) -> None:
        self._stream = stream

    def next_stream(self, device: int) -> Stream:
        return self._stream


class _Running:
    """Names a run in an error message; formatted only when one is raised."""

    __slots__ = ("op",)

    def __init__(self, op: DeviceOperation[Any]) -> None:
        self.op = op

    def __str__(self) -> str:
        return f"running {self.op!r}"


def _chosen(policy: SchedulingPolicy, device: int) -> Stream:
    """The stream an explicit ``policy`` gives a run on ``device``."""
    if not callable(getattr(policy, "next_stream", None)):
        # (what isinstance(policy, SchedulingPolicy) asks, without the
        # protocol check's cost: microseconds a run)
        raise UsageTypeError(
            f"policy must be a gf.SchedulingPolicy (with next_stream(device)), "
            f"got {type(policy).__name__}"
        )
    stream = policy.next_stream(device)
    if not isinstance(stream, Stream):
        raise UsageTypeError(
            f"{policy!r}.next_stream() returned {type(stream).__name__}, not a Stream"
        )
    return stream


def _choose(
    op: DeviceOperation[Any], policy: SchedulingPolicy | None, device: int, can_wait: bool
) -> tuple[Stream | None, SchedulingPolicy]:
    """The stream of a run of ``op`` on ``device``, and the policy its zip
    arms fork with: the stream of the innermost stream lease of the device
    where ``policy`` is None, else what ``policy`` (the default policy
    where None) gives.  None for the stream where the policy is a
    :class:`StreamPoolLeastLoaded` with no stream idle (or awaits already
    waiting for one) and the run ``can_wait``: an await then waits for one
    (:func:`_idle_stream`)."""
    if policy is None:
        for scope in reversed(current_scopes.get()):
            s = scope.stream
            # a lease of another device does not apply (a device group's child)
            if s is not None and s.device == device:
                return s, _Pinned(s)
        policy = DEFAULT_POLICY
    if isinstance(policy, StreamPoolLeastLoaded):
        home = op._stream_home(device) if op._has_home else None
        if not can_wait:
            return policy.next_stream(device, home), policy
        if get_runtime().dispatcher.stream_waiters(device):
            return None, policy  # (behind the awaits that came first)
        return policy.idle_stream(device, home), policy
    return _chosen(policy, device), policy


async def _idle_stream(
    op: DeviceOperation[Any], policy: StreamPoolLeastLoaded, device: int
) -> Stream:
    """Wait, in turn with the other awaits of ``device`` that found every
    stream busy, for one of its streams to go idle (cancellable: nothing is
    enqueued yet).  The first in turn looks again at least every
    ``stall_s`` seconds, whoever was to say that a stream went idle."""
    d = get_runtime().dispatcher
    home = op._stream_home(device) if op._has_home else None
    ticket = d.wait_for_stream(device)
    used = False
    try:
        while True:
            # (first after joining: a stream that went idle before woke nobody)
            if d.stream_turn(device, ticket):
                stream = policy.idle_stream(device, home)
                if stream is not None:
                    used = True
                    return stream
                if ticket.handed:  # woken, and a run that could not wait took it
                    d.leave_stream_queue(device, ticket, used=True)
                    ticket = d.wait_for_stream(device, first=True)  # (first again)
            with anyio.move_on_after(policy.stall_s):
                await ticket.event.wait()
    finally:
        d.leave_stream_queue(device, ticket, used)


def _start(
    op: DeviceOperation[Any], stream: Stream | None, policy: SchedulingPolicy | None
) -> tuple[Runtime, Submission, ExecutionContext]:
    """Begin a run of ``op`` on ``stream``, or where none is given, on the
    one :func:`_choose` gives (that cannot wait); the run's zip arms fork
    with ``policy`` (the default policy where None)."""
    if stream is None:
        stream, policy = _choose(op, policy, current_device(), False)
        assert stream is not None
    elif not isinstance(stream, Stream):
        raise UsageTypeError(f"expected a gpuflow Stream, got {type(stream).__name__}")
    rt, sub = _begin(op, stream)
    return rt, sub, ExecutionContext(rt, stream, policy or DEFAULT_POLICY, sub)


def _begin(op: DeviceOperation[Any], stream: Stream) -> tuple[Runtime, Submission]:
    """The checks of a run of ``op`` on ``stream`` and its submission, which
    the scopes the task runs in track from now on."""
    if capture_log.get() is not None:
        refuse_in_capture(_Running(op))
    rt = stream._runtime
    rt.check_startable(stream)
    if _finalizers.queue:  # frees of arrays dropped since the last run
        _finalizers.run_finalized()
    sub = Submission(stream._device)
    for scope in current_scopes.get():
        scope.track(sub)
    return rt, sub


def run_sync(op: DeviceOperation[Any], policy: SchedulingPolicy | None) -> Any:
    refuse_blocking("op.sync()", "in async code, `await op` (or `await op.run(policy)`)")
    return _sync(op, None, policy)


def run_sync_on(op: DeviceOperation[Any], stream: Stream) -> Any:
    refuse_blocking(
        "op.sync_on(stream)",
        "in async code, `op.enqueue_on(stream)` and then `await gf.wait_stream(stream)`",
    )
    return _sync(op, stream, None)


def _traced(
    op: DeviceOperation[Any], how: str, stream: Stream, sub: Submission
) -> _trace.TracedRun:
    traced = _trace.begin(op, how, stream)
    sub.add_done_callback(traced.gpu_done)  # before anyone else can finish it
    return traced


def _sync(
    op: DeviceOperation[Any], stream: Stream | None, policy: SchedulingPolicy | None
) -> Any:
    _rt, sub, ctx = _start(op, stream, policy)
    stream = ctx.stream
    traced = _traced(op, "sync", stream, sub) if _trace.active else None
    # a blocking run is never handed to the dispatcher: count it on its
    # stream, so that the default policy sees that stream as busy meanwhile
    stream.begin_blocking()
    try:
        out = _sync_run(op, stream, sub, ctx, traced)
    except BaseException as exc:
        if traced is not None:
            traced.ended(exc)
        raise
    finally:
        stream.end_blocking()
        stream._runtime.dispatcher.stream_freed(stream.device)
    if traced is not None:
        traced.ended(None)
    return out


def _sync_run(
    op: DeviceOperation[Any],
    stream: Stream,
    sub: Submission,
    ctx: ExecutionContext,
    traced: _trace.TracedRun | None,
) -> Any:
    dispatcher = stream._runtime.dispatcher
    try:
        out = op.execute(ctx)
    except BaseException:
        # what was enqueued finishes before what it uses is released
        try:
            stream.synchronize()
        finally:
            dispatcher.finish(sub)
        raise
    if traced is not None:
        traced.enqueued()
    try:
        stream.synchronize()
    finally:
        dispatcher.finish(sub)
    if sub.error is not None:  # a communicator aborted under the run
        raise sub.error
    return out if out is None else resolve(out)


def run_enqueue_on(op: DeviceOperation[Any], stream: Stream) -> Any:
    rt, sub, ctx = _start(op, stream, None)
    traced = _traced(op, "enqueue_on", stream, sub) if _trace.active else None
    try:
        out = op.execute(ctx)
    except BaseException as exc:
        if traced is not None:
            traced.ended(exc)
        raise
    finally:
        rt.dispatcher.submit(stream._raw, sub, polled=False)  # (no task awaits it)
    if traced is not None:
        traced.ended(None)
    if is_pending(out):
        if has_map(out):
            raise UsageError(
                "enqueue_on() cannot apply map() to host data the GPU is still copying: "
                "use sync_on() or await"
            )
        return resolve(out)
    return out


def _submit_foreign(rt: Runtime, stream: Stream, sub: Submission) -> None:
    """Hand ``sub``, a run on another library's stream, to the dispatcher.
    Where that stream takes no mark, the run (which enqueued nothing) is
    finished with the error."""
    try:
        rt.dispatcher.submit(stream._raw, sub, True)
    except BaseException as exc:
        if not sub.done:  # refused (a fault fails it instead)
            rt.dispatcher.finish(sub, exc)
        raise


async def run_async(op: DeviceOperation[Any], policy: SchedulingPolicy | None = None) -> Any:
    watcher = _points.watcher  # (a test's; None otherwise)
    if watcher is not None:
        await watcher(_points.BEFORE_ENQUEUE, op)
    loop = current_loop()
    # a task whose scope is already cancelled enqueues nothing (as any checkpoint)
    if loop.may_be_cancelled():
        await loop.checkpoint_if_cancelled()
    out: Any = None
    # an operation that waits for another library's stream and does nothing
    # else completes on that stream itself: no stream of ours waits for it,
    # and nothing is enqueued but the run's mark there
    home = op._stream_alone() if op._awaited_alone else None
    if home is not None:
        rt, sub = _begin(op, home)
        sub.hold((op,))  # (what it names is used until the mark is reached)
        traced = _traced(op, "await", home, sub) if _trace.active else None
        if traced is not None:
            traced.enqueued()
        try:
            _submit_foreign(rt, home, sub)
        except BaseException as exc:
            if traced is not None:
                traced.ended(exc)
            raise
    else:
        device = current_device()
        chosen, run_policy = _choose(op, policy, device, True)
        if chosen is None:  # (every stream busy: see StreamPoolLeastLoaded)
            assert isinstance(run_policy, StreamPoolLeastLoaded)
            chosen = await _idle_stream(op, run_policy, device)
        rt, sub, ctx = _start(op, chosen, run_policy)
        stream = ctx.stream
        traced = _traced(op, "await", stream, sub) if _trace.active else None
        try:
            out = op.execute(ctx)
        except BaseException as exc:
            if traced is not None:
                traced.ended(exc)
            try:
                rt.dispatcher.submit(stream._raw, sub)
            except Exception:  # the original failure is the one to report
                pass
            raise
        del ctx  # (what the enqueue used: freed now, not when the GPU is done)
        if traced is not None:
            traced.enqueued()
        rt.dispatcher.submit(stream._raw, sub)
    try:
        if watcher is not None:
            await watcher(_points.IN_FLIGHT, op)
        await sub.wait(loop)
    except BaseException as exc:
        if traced is not None:
            traced.ended(exc)
        if sub.comms is not None and not sub.done:
            # a collective left behind may wait for its peers for ever: abort
            for comm in sub.comms:
                comm.abort(f"the await of {op!r} {ended_by(exc)} before its collectives did")
        raise
    if traced is not None:
        traced.ended(None)
    return out if out is None else resolve(out)
