"""Lazy device operations and the combinators that compose them.

A :class:`DeviceOperation` is a recipe: building one does no work.  Running
it (``sync``, ``sync_on``, ``enqueue_on`` or ``await``) makes an
:class:`ExecutionContext` and calls :meth:`DeviceOperation.execute`, which
enqueues the work on ``ctx.stream`` and returns the output *handle*: arrays
whose contents the GPU may still be writing.  A recipe is reusable and runs
its work again each time, except :meth:`DeviceOperation.shared`.

Host data produced by the device (:func:`to_host`) is only readable when the
run has completed, so inside a run it is a *pending* value (:mod:`._pending`):
``map`` over it is deferred to completion, and ``then`` over it is refused
(await first).

An operation captured into a CUDA graph becomes a :class:`Graph`, whose
launch is itself an operation; the recording and replay machinery is
:mod:`._capture`, the runners :mod:`._run`, the pictures :mod:`._dot`: this
module depends on them, never they on it.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

from .._backends import DType
from .._errors import UsageError, UsageTypeError
from . import _capture, _dot, _run
from ._pending import PendingMap, is_pending
from ._plan import ANYWHERE, Plan, enqueue_step

if TYPE_CHECKING:

    from ._execution import ExecutionContext
    from ._policy import SchedulingPolicy
    from ._stream import Stream

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
U = TypeVar("U")


def callable_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _as_op(x: object, what: str) -> DeviceOperation[object]:
    if not isinstance(x, DeviceOperation):
        raise UsageTypeError(
            f"{what} expected a gpuflow DeviceOperation, got {type(x).__name__}: {x!r:.80} "
            "(wrap plain values with gf.value(x))"
        )
    return x


class DeviceOperation(Generic[T_co]):
    """A lazy recipe of GPU work producing a ``T``.

    Building one does no work.  Each run (``sync()``, ``sync_on(stream)``,
    ``enqueue_on(stream)``, ``await``) does all of it again: awaiting the
    same operation twice launches its kernels twice, and an allocation makes
    a new array each time.  To run it once and hand its output to every
    awaiter, await ``op.shared()`` (its clones, from any task or thread, get
    that one output).

    Subclass it and implement :meth:`execute` for a new kind of work.
    Operations are immutable and may be shared between tasks and threads;
    every run is independent (except :meth:`shared`).
    """

    __slots__ = ("__weakref__",)

    def execute(self, ctx: ExecutionContext) -> T_co:
        """Enqueue this operation's work on ``ctx.stream``; return the output handle.

        The work may still be running when it returns.  Only the four entry
        points (:meth:`~DeviceOperation.sync`, :meth:`~DeviceOperation.sync_on`,
        :meth:`~DeviceOperation.enqueue_on`, ``await``)
        should call it, and combinators on behalf of them.

        Parameters
        ----------
        ctx
            Where the work goes: the run's device, stream and backend.

        Returns
        -------
        T
            The output handle (an array the work may still be writing).
        """
        raise NotImplementedError(f"{type(self).__name__}.execute")

    # -- combinators -------------------------------------------------------------
    def then(self, fn: Callable[[T_co], DeviceOperation[U]]) -> DeviceOperation[U]:
        """Run ``fn(output)``'s operation after this one, on the same stream.

        ``fn`` runs on the host at enqueue time and gets the output handle; it
        must return a DeviceOperation.

        Parameters
        ----------
        fn
            Called with this operation's output, each time the chain runs.

        Returns
        -------
        DeviceOperation
            The output of ``fn``'s operation.

        Raises
        ------
        gpuflow.UsageTypeError
            ``fn`` is not callable (when the chain is built), or returns no
            operation (when it runs).
        """
        if not callable(fn):
            raise UsageTypeError(f"then() expected a callable, got {type(fn).__name__}")
        return _Then(self, fn)

    def map(self, fn: Callable[[T_co], U]) -> DeviceOperation[U]:
        """Transform the output on the host; no GPU work.

        ``fn`` runs at enqueue time on device handles, or once the run is
        done when the output holds host data from :func:`to_host`.

        Parameters
        ----------
        fn
            Called with this operation's output.

        Returns
        -------
        DeviceOperation
            ``fn``'s result.

        Raises
        ------
        gpuflow.UsageTypeError
            ``fn`` is not callable.
        """
        if not callable(fn):
            raise UsageTypeError(f"map() expected a callable, got {type(fn).__name__}")
        return _Map(self, fn)

    def shared(self) -> SharedOperation[T_co]:
        """A clonable operation that runs this one at most once.

        Every run of it (or of its clones), from any task or thread, gets the
        output of the single run, or the same error.  A run on another stream
        waits for the producer's work before it reads.

        Returns
        -------
        SharedOperation
        """
        return SharedOperation(_SharedState(self))

    def unzip(self, n: int) -> tuple[DeviceOperation[Any], ...]:
        """Split an operation producing an ``n``-tuple into ``n`` operations.

        The source runs once, however many parts are run and from where.

        Parameters
        ----------
        n
            How many elements the output tuple has (a positive int).

        Returns
        -------
        tuple[DeviceOperation, ...]
            One operation an element.

        Raises
        ------
        gpuflow.UsageError
            ``n`` is not a positive int.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise UsageError(f"unzip(n) needs a positive int, not {n!r}")
        src = self.shared()
        return tuple(_Pick(src, i, n, "unzip") for i in range(n))

    def first(self) -> DeviceOperation[Any]:
        """The first element of a tuple output.

        Returns
        -------
        DeviceOperation
        """
        return _Pick(self, 0, None, "first")

    def last(self) -> DeviceOperation[Any]:
        """The last element of a tuple output.

        Returns
        -------
        DeviceOperation
        """
        return _Pick(self, -1, None, "last")

    # -- running -------------------------------------------------------------------
    def sync(self, policy: SchedulingPolicy | None = None) -> T_co:
        """Run on a stream chosen by ``policy`` and block until done; return the output.

        Parameters
        ----------
        policy
            Picks the stream (None: the default policy, or the lease's stream).

        Returns
        -------
        T
            The output, its work done.

        Raises
        ------
        gpuflow.UsageError
            Called from a thread running an event loop (that would block the
            loop): ``await`` the operation there.
        gpuflow.DeviceFaultError
            The device has a sticky fault, or the work faulted.
        gpuflow.UsageError
            A check of the operation failed (each names what), before
            anything is enqueued.
        """
        return _run.run_sync(self, policy)  # type: ignore[no-any-return]

    def sync_on(self, stream: Stream) -> T_co:
        """Run on ``stream`` and block until the stream is idle; return the output.

        Parameters
        ----------
        stream
            Where the work goes.

        Returns
        -------
        T
            The output, its work done.

        Raises
        ------
        gpuflow.UsageError
            Called from a thread running an event loop.
        gpuflow.DeviceFaultError
            The device has a sticky fault, or the work faulted.
        gpuflow.UsageError
            A check of the operation failed (each names what), before
            anything is enqueued.
        """
        return _run.run_sync_on(self, stream)  # type: ignore[no-any-return]

    def enqueue_on(self, stream: Stream) -> T_co:
        """Enqueue on ``stream`` and return the output handle without waiting.

        The caller synchronizes the stream before reading results; gpuflow
        keeps what the work uses alive until the GPU is done with it.

        Parameters
        ----------
        stream
            Where the work goes.

        Returns
        -------
        T
            The output handle (its work may still be running).

        Raises
        ------
        gpuflow.DeviceFaultError
            The device has a sticky fault, or the work faulted.
        gpuflow.UsageError
            A check of the operation failed (each names what), before
            anything is enqueued.
        """
        return _run.run_enqueue_on(self, stream)  # type: ignore[no-any-return]

    #: ``await op``: run on a stream chosen by the policy (or the lease) and
    #: await the result.  Cancelling the awaiting task raises the loop's
    #: cancellation at once; work already enqueued finishes on the GPU, and
    #: what it uses is kept alive until then.  (The run's own generator
    #: function, with no call between: every await makes one object.)
    if TYPE_CHECKING:

        def __await__(self) -> Generator[Any, None, T_co]: ...

    else:
        __await__ = _run.await_run

    async def run(self, policy: SchedulingPolicy | None = None) -> T_co:
        """``await op`` with an explicit scheduling policy.

        Parameters
        ----------
        policy
            Picks the stream (None: as ``await op``).

        Returns
        -------
        T
            The output, its work done.

        Raises
        ------
        gpuflow.DeviceFaultError
            The device has a sticky fault, or the work faulted.
        gpuflow.UsageError
            A check of the operation failed (each names what), before
            anything is enqueued.

        Cancelling the awaiting task raises the loop's cancellation at once;
        work already enqueued finishes on the GPU, and what it uses is kept
        alive until then.
        """
        return await _run.RunAwaitable(self, policy)  # type: ignore[no-any-return]

    # -- for the run path ----------------------------------------------------------------
    #: what the run path needs to know of it before it runs it (see
    #: :mod:`._plan`): an operation's own where it has one, made once
    _plan: Plan = ANYWHERE

    def _output_dtype(self) -> DType | None:
        """The dtype of the :class:`DeviceArray` every run of this operation
        produces, where that is known before it runs (None: not known, or
        not an array): a launch taking the operation as an argument checks
        it when the launch is built, not when it runs.

        Returns
        -------
        numpy.dtype or None
        """
        return None

    # -- graphs and pictures ---------------------------------------------------------
    def capture(self, stream: Stream | None = None) -> Graph[T_co]:
        """Capture this operation's work into a replayable :class:`gpuflow.Graph`.

        Parameters
        ----------
        stream
            The stream to capture on (None: a new one of the current device).

        Returns
        -------
        Graph
            Replayed by :meth:`Graph.launch`.

        Raises
        ------
        gpuflow.UsageError
            Work that cannot be captured (an allocation, a copy to the host,
            a wait for another library's stream), naming it; or a capture
            inside a capture.
        """
        return Graph(_capture.record(self, stream))

    def to_dot(self) -> str:
        """This operation's DAG as Graphviz DOT (kernels, copies, joins, shared points).

        Returns
        -------
        str
            DOT text (``dot -Tsvg``).
        """
        return _dot.to_dot(self)

    # -- for to_dot ----------------------------------------------------------------------
    def label(self) -> str:
        """A short description of the operation: its node in :meth:`to_dot`,
        its name in a trace and in its repr.

        Returns
        -------
        str
        """
        return type(self).__name__.lstrip("_")

    def _children(self) -> Sequence[DeviceOperation[object]]:
        """The operations this one runs (a combinator's parts): the edges of
        :meth:`to_dot`.

        Returns
        -------
        Sequence[DeviceOperation]
        """
        return ()

    def _kind(self) -> str:
        """What kind of node it is in :meth:`to_dot` (its shape).

        Returns
        -------
        str
        """
        return "op"

    def _dot_key(self) -> int:
        """Operations with one key are one node of the picture.

        Returns
        -------
        int
        """
        return id(self)

    def __repr__(self) -> str:
        return f"<gpuflow.DeviceOperation {self.label()}>"


class _Value(DeviceOperation[T]):
    __slots__ = ("_x",)

    def __init__(self, x: T) -> None:
        self._x = x

    def execute(self, ctx: ExecutionContext) -> T:
        return self._x

    def label(self) -> str:
        return f"value {type(self._x).__name__}"


def value(x: T) -> DeviceOperation[T]:
    """An operation that produces ``x`` and does no work.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    x
        Any value: a host value, an array, a tuple of them.

    Returns
    -------
    DeviceOperation
        An operation whose output is ``x`` itself, each time it runs.
    """
    return _Value(x)


class _WithContext(DeviceOperation[T]):
    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[ExecutionContext], DeviceOperation[T]]) -> None:
        self._fn = fn

    def execute(self, ctx: ExecutionContext) -> T:
        op = self._fn(ctx)
        if not isinstance(op, DeviceOperation):
            raise UsageTypeError(
                f"with_context: {callable_name(self._fn)} must return a DeviceOperation, "
                f"returned {type(op).__name__}"
            )
        return op.execute(ctx)

    def label(self) -> str:
        return f"with_context {callable_name(self._fn)}"


def with_context(fn: Callable[[ExecutionContext], DeviceOperation[T]]) -> DeviceOperation[T]:
    """An operation built at run time from the :class:`ExecutionContext`.

    Use it to put foreign work (CuPy, PyTorch, cuda.core) on gpuflow's stream:
    ``fn`` gets the context (``ctx.stream`` implements ``__cuda_stream__``,
    for ``torch.cuda.ExternalStream`` and ``cupy.cuda.ExternalStream``) and
    returns an operation, ``gf.value(...)`` for work it did itself.
    :func:`gpuflow.foreign` does this in one line for PyTorch and CuPy, and
    orders the arrays the foreign code uses.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    fn
        Called with the run's :class:`ExecutionContext` each time the
        operation runs; returns the operation to run there.

    Returns
    -------
    DeviceOperation
        The output of the operation ``fn`` returns.

    Raises
    ------
    gpuflow.UsageTypeError
        ``fn`` is not callable (when the operation is built), or returns no
        operation (when it runs).
    """
    if not callable(fn):
        raise UsageTypeError(f"with_context() expected a callable, got {type(fn).__name__}")
    return _WithContext(fn)


class _Then(DeviceOperation[U]):
    __slots__ = ("_fn", "_op")

    def __init__(self, op: DeviceOperation[T], fn: Callable[[T], DeviceOperation[U]]) -> None:
        self._op = op
        self._fn = fn

    def execute(self, ctx: ExecutionContext) -> U:
        # a long chain is nested to the left: walk it down, then run it forward,
        # rather than recursing once per step
        fns = [self._fn]
        op = self._op
        while type(op) is _Then:
            fns.append(op._fn)
            op = op._op
        out: Any = op.execute(ctx)
        stream = ctx.stream
        generation, raw = stream._generation, stream.raw
        for fn in reversed(fns):
            if out is not None and is_pending(out):
                raise UsageError(
                    f"then({callable_name(fn)}): the output holds host data that the GPU is "
                    "still copying (gf.to_host); await the operation first, or use .map()"
                )
            nxt = fn(out)
            if not isinstance(nxt, DeviceOperation):
                raise UsageError(
                    f"then: {callable_name(fn)} must return a DeviceOperation, returned "
                    f"{type(nxt).__name__} (use .map() for a host-side transform)"
                )
            plan = nxt._plan
            if plan.generation == generation and plan.step is not None:
                if plan.uses is None:
                    plan.step(raw)  # (a launch prepared once: a chain's usual step)
                    out = None
                else:
                    out = enqueue_step(plan, stream, ctx.run)
            else:
                out = nxt.execute(ctx)
        return cast(U, out)

    def label(self) -> str:
        return f"then {callable_name(self._fn)}"

    def _children(self) -> Sequence[DeviceOperation[object]]:
        return (self._op,)

    def _kind(self) -> str:
        return "then"


class _Map(DeviceOperation[U]):
    __slots__ = ("_fn", "_op")

    def __init__(self, op: DeviceOperation[T], fn: Callable[[T], U]) -> None:
        self._op = op
        self._fn = fn

    def execute(self, ctx: ExecutionContext) -> U:
        out = self._op.execute(ctx)
        if is_pending(out):
            return PendingMap(self._fn, out)  # type: ignore[return-value]
        return self._fn(out)

    def label(self) -> str:
        return f"map {callable_name(self._fn)}"

    def _children(self) -> Sequence[DeviceOperation[object]]:
        return (self._op,)

    def _kind(self) -> str:
        return "map"


class _Zip(DeviceOperation[tuple[Any, ...]]):
    __slots__ = ("_ops",)

    def __init__(self, ops: tuple[DeviceOperation[object], ...]) -> None:
        self._ops = ops

    def execute(self, ctx: ExecutionContext) -> tuple[Any, ...]:
        outs: list[Any] = []
        forked: list[Stream] = []
        try:
            # every arm's stream is ordered after what was enqueued before the
            # zip *before* any arm enqueues: waiting later would also wait for
            # the arms already enqueued on ctx.stream and serialize them
            arms: list[ExecutionContext] = []
            fork_point = None  # one event on ctx.stream serves every forked arm
            for i in range(len(self._ops)):
                stream = ctx.stream if i == 0 else ctx.fork()
                if stream == ctx.stream:
                    arms.append(ctx)
                    continue
                if stream not in forked:
                    be = ctx.backend
                    if fork_point is None:
                        fork_point = be.record_event(ctx.stream.raw)
                    be.wait_event(stream.raw, fork_point)
                    forked.append(stream)
                arms.append(ctx.with_stream(stream))
            for op, arm in builtins.zip(self._ops, arms, strict=True):
                outs.append(op.execute(arm))
        finally:
            # the join: what follows on ctx.stream sees every arm done
            for s in forked:
                ctx.wait_for(s)
        return tuple(outs)

    def label(self) -> str:
        return f"zip ({len(self._ops)})"

    def _children(self) -> Sequence[DeviceOperation[object]]:
        return self._ops

    def _kind(self) -> str:
        return "join"


@overload
def zip(a: DeviceOperation[T], /) -> DeviceOperation[tuple[T]]: ...
@overload
def zip(a: DeviceOperation[T], b: DeviceOperation[U], /) -> DeviceOperation[tuple[T, U]]: ...
@overload
def zip(*ops: DeviceOperation[object]) -> DeviceOperation[tuple[Any, ...]]: ...
def zip(*ops: DeviceOperation[object]) -> DeviceOperation[tuple[Any, ...]]:
    """Fan-in: one operation producing the tuple of the outputs of ``ops``.

    Independent arms may run on different streams of the pool; the join waits
    on their events, so what follows sees all of them done.

    Any thread: building the operation enqueues nothing; a run of it is
    cancelled as any await is.

    Parameters
    ----------
    *ops
        The operations, one or more.

    Returns
    -------
    DeviceOperation[tuple]
        The outputs, in the order of ``ops``.

    Raises
    ------
    gpuflow.UsageError
        No operation was given.
    gpuflow.UsageTypeError
        An argument is not an operation (naming which).
    """
    if not ops:
        raise UsageError("zip() needs at least one operation")
    for i, op in enumerate(ops):
        _as_op(op, f"zip() argument {i}")
    return _Zip(tuple(ops))


class _SharedState(Generic[T]):
    __slots__ = ("error", "event", "lock", "output", "ready", "source", "started", "stream")

    def __init__(self, source: DeviceOperation[T]) -> None:
        self.source = source
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.started = False
        self.output: T | None = None
        self.error: BaseException | None = None
        self.stream: Stream | None = None
        self.event: Any = None


class SharedOperation(DeviceOperation[T]):
    """An operation that runs its source at most once (see :meth:`DeviceOperation.shared`).

    Thread-safe: clones may be run concurrently from several tasks and threads.

    Made by :meth:`DeviceOperation.shared` (and :meth:`clone`); not
    constructed directly.
    """

    __slots__ = ("_state",)

    def __init__(self, state: _SharedState[T]) -> None:
        self._state = state

    def clone(self) -> SharedOperation[T]:
        """Another handle on the same single run.

        Returns
        -------
        SharedOperation
        """
        return SharedOperation(self._state)

    def execute(self, ctx: ExecutionContext) -> T:
        st = self._state
        with st.lock:
            producer = not st.started
            st.started = True
        if producer:
            try:
                st.output = st.source.execute(ctx)
                st.stream = ctx.stream
                # right after the source: a clone on another stream waits for
                # it, not for whatever its stream runs later
                st.event = ctx.backend.record_event(ctx.stream.raw)
            except BaseException as exc:
                st.error = exc
                raise
            finally:
                st.ready.set()
            return st.output
        st.ready.wait()
        if st.error is not None:
            raise st.error
        assert st.stream is not None
        if st.stream != ctx.stream:
            ctx.backend.wait_event(ctx.stream.raw, st.event)
        return st.output  # type: ignore[return-value]

    def _output_dtype(self) -> DType | None:
        return self._state.source._output_dtype()

    def label(self) -> str:
        return "shared"

    def _children(self) -> Sequence[DeviceOperation[object]]:
        return (self._state.source,)

    def _kind(self) -> str:
        return "shared"

    def _dot_key(self) -> int:
        return id(self._state)


class _Pick(DeviceOperation[object]):
    __slots__ = ("_index", "_n", "_op", "_what")

    def __init__(self, op: DeviceOperation[object], index: int, n: int | None, what: str) -> None:
        self._op = op
        self._index = index
        self._n = n
        self._what = what

    def execute(self, ctx: ExecutionContext) -> Any:
        out = self._op.execute(ctx)
        if isinstance(out, PendingMap):
            return PendingMap(self._pick, out)
        return self._pick(out)

    def _pick(self, out: object) -> Any:
        if not isinstance(out, tuple) or not out:
            raise UsageTypeError(
                f"{self._what}() needs an operation producing a non-empty tuple, "
                f"got {type(out).__name__}"
            )
        if self._n is not None and len(out) != self._n:
            raise UsageError(f"unzip({self._n}) of an operation producing {len(out)} values")
        return out[self._index]

    def label(self) -> str:
        return f"{self._what} [{self._index}]"

    def _children(self) -> Sequence[DeviceOperation[object]]:
        return (self._op,)


class Graph(Generic[T]):
    """A captured operation, replayed by :meth:`launch`.  Thread-safe.

    Made by :meth:`DeviceOperation.capture`.  The graph keeps alive
    everything the captured work refers to (arrays, modules) for as long as
    it or a replay in flight lives.
    """

    def __init__(self, recording: _capture.Recording[T]) -> None:
        #: the backend's graph and what it keeps alive (the record a replay runs)
        self.recording = recording
        self._updates: list[DeviceOperation[object]] = []
        self._lock = threading.Lock()

    @property
    def device(self) -> int:
        """The device the graph was captured on (and replays on)."""
        return self.recording.device

    @property
    def nodes(self) -> int:
        """How many nodes the backend's graph has: one per kernel, copy or fill
        captured (the events joining ``zip`` arms are edges, not nodes)."""
        return self.recording.nodes

    def launch(self) -> DeviceOperation[T]:
        """An operation that replays the graph (after any pending :meth:`update`).

        It produces the captured operation's output handles: the same arrays
        each time, holding the new results.

        Returns
        -------
        DeviceOperation
            The captured operation's output handles.
        """
        return _GraphLaunch(self)

    def update(self, op: DeviceOperation[object]) -> None:
        """Run ``op`` (an input refresh such as ``gf.copy(new, out=graph_input)``)
        in order before the next launch, on the launch's stream.

        Parameters
        ----------
        op
            The refresh; it runs once, before the next launch only.
        """
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
        _capture.check_launch(g.recording, ctx)
        with g._lock:
            updates, g._updates = g._updates, []
        for op in updates:
            op.execute(ctx)
        out = _capture.replay(g.recording, ctx)
        ctx.keep(g)
        return out

    def label(self) -> str:
        return f"graph launch ({self._graph.nodes} nodes)"

    def _kind(self) -> str:
        return "kernel"
