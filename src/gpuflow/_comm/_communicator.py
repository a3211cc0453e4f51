"""Communicators: NCCL's collectives as device operations, with a lifetime.

A :class:`Communicator` joins ranks, one a device: every device of this
process (:func:`open_communicator` with devices), or one device of each of
several processes that met through a unique id (a :class:`RankInfo`, made by
:func:`bootstrap_mpi`, :func:`spawn_ranks` or by hand).  Its collectives are
:class:`DeviceOperation`\\ s like kernels: they run on the run's stream, order
themselves after the writes they read and before later uses through hazard
tracking, compose with ``then`` and ``zip``, and are awaited without blocking
the loop.  The parts of one collective on several devices of this process
are issued in one NCCL group.

A collective waits on the GPU for its peers, and a peer may never come (its
process died, it never got there, it failed).  gpuflow never lets that wait
become a hang of the program:

* an await of a collective that ends before the collective does (the loop's
  cancellation, a deadline) *aborts* the communicator: its kernels return,
  the runs pending on it fail with :class:`CommunicatorError`, and the task
  gets the loop's own cancellation at once;
* leaving the communicator's scope with an error or a cancellation while
  collectives are pending aborts it too; leaving it normally waits for them,
  and a cancellation of that wait aborts;
* the completer's watchdog asks NCCL for the communicator's asynchronous
  error (a peer that left, a network failure) every tick while collectives
  are pending, and aborts it when there is one: every pending await fails
  with that error, whichever task awaits it;
* an abort frees nothing the GPU may still use: it stops the work in flight
  (the backend's ``comm_abort``: NCCL's revoke), the communicator itself is
  released only when its scope ends and the runs that used it are done, and
  arrays are freed in stream order after the aborted work, as always;
* each rank runs the communicator's collectives in the order they were
  issued, whatever stream each is on, as NCCL requires of every rank.

An aborted communicator refuses further collectives (with the error that
aborted it) and is logged on the ``gpuflow`` logger; its scope raises that
error when it is left with no other exception.
"""

from __future__ import annotations

import logging
import math
import operator
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from .._backends import COMM_DTYPES, REDUCTIONS, CollectiveCall, DType, RawComm, Step
from .._core import (
    DeviceOperation,
    Plan,
    Point,
    Run,
    Runtime,
    current_device,
    ended_by,
    enqueue_ordered,
    ensure_runtime,
    order_after,
    stream_elsewhere,
)
from .._errors import CommunicatorError, UsageError, UsageTypeError
from .._memory import DeviceArray, allocate, as_dtype, as_shape, resolve_array
from .._scopes import Tracked
from ._bootstrap import RankInfo
from ._threads import off_loop

if TYPE_CHECKING:
    from .._core import ExecutionContext, Stream

_log = logging.getLogger("gpuflow")
T = TypeVar("T")


def open_communicator(
    devices: Sequence[int] | RankInfo | None = None, *, device: int | None = None
) -> Communicator:
    """A communicator for a scope: ``async with gf.open_communicator(...) as comm:``.

    * ``gf.open_communicator()`` or ``gf.open_communicator([0, 1])``: one rank
      per device of this process (every device, or those given, rank ``i``
      on ``devices[i]``); a collective takes one array a device and makes
      one a device, issued together in one NCCL group.
    * ``gf.open_communicator(info)`` with a :class:`RankInfo`: this process is
      rank ``info.rank`` of ``info.nranks`` processes, on ``device`` (default:
      the current device); entering waits until every rank has joined.

    Leaving the scope waits for the collectives it issued, then destroys the
    communicator.  Leaving with an error or a cancellation while collectives
    are pending aborts it instead (its collectives' kernels return): nothing
    is left waiting for a peer, and nothing the GPU uses is freed early.

    Parameters
    ----------
    devices
        The devices of this process's ranks (None: every device), or the
        :class:`RankInfo` of a rank of several processes.
    device
        With a :class:`RankInfo`: the rank's device (None: the current one).

    Returns
    -------
    Communicator
        An async context manager.

    Raises
    ------
    gpuflow.UsageError
        A device that is not one of the runtime's, none, or one named twice;
        ``device=`` without a :class:`RankInfo`; a rank out of range.
    gpuflow.UsageTypeError
        A :class:`RankInfo` whose fields are not ints and bytes.
    gpuflow.CommunicatorError
        The ranks could not join (on entry).
    """
    rt = ensure_runtime()
    if isinstance(devices, RankInfo):
        info = devices
        for name, v in (("rank", info.rank), ("nranks", info.nranks)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise UsageTypeError(f"RankInfo.{name} must be an int, not {v!r}")
        if not 0 <= info.rank < info.nranks:
            raise UsageError(f"rank {info.rank} is not one of {info.nranks} ranks")
        if not isinstance(info.unique_id, bytes):
            raise UsageTypeError(
                f"RankInfo.unique_id must be bytes (gf.new_unique_id()), "
                f"not {type(info.unique_id).__name__}"
            )
        dev = rt.check_device(current_device() if device is None else device)
        return Communicator(rt, [dev], [info.rank], info.nranks, info.unique_id)
    if device is not None:
        raise UsageError("device= is for a rank of several processes (a RankInfo); give devices")
    devs = list(rt.devices) if devices is None else [rt.check_device(d) for d in devices]
    if not devs:
        raise UsageError("open_communicator() needs at least one device")
    if len(set(devs)) != len(devs):
        raise UsageError(f"devices {devs} name a device twice (one rank a device)")
    return Communicator(rt, devs, list(range(len(devs))), len(devs), None)


class Communicator:
    """Ranks that run collectives together (see :func:`open_communicator`).

    Its operations may be built and run from any task or thread of the
    process while the scope is open.  In a communicator of this process's
    devices, every collective takes (and makes) a sequence of arrays, one
    per rank in rank order; with one rank per process, one array.

    Made by :func:`open_communicator`; not constructed directly.
    """

    def __init__(
        self,
        runtime: Runtime,
        devices: list[int],
        ranks: list[int],
        nranks: int,
        unique_id: bytes | None,
    ) -> None:
        self._rt = runtime
        self.devices: tuple[int, ...] = tuple(devices)
        """The devices of this process's ranks, in rank order."""
        self.ranks: tuple[int, ...] = tuple(ranks)
        """This process's ranks (one a device of :attr:`devices`)."""
        self.nranks = nranks
        """How many ranks the communicator has, over every process."""
        self._uid = unique_id
        self._multi = unique_id is None
        self._raw: list[RawComm] | None = None
        self._closed = False
        self._error: CommunicatorError | None = None  # set once: the abort
        self._lock = threading.Lock()
        #: the last run that used it on each stream: runs of one stream end in
        #: order, so these are what the scope's end waits for
        self._last: dict[Stream, Run] = {}
        #: the stream of each local rank's latest collective, and the run that
        #: issued it: the next one, on any stream, is ordered after it (under
        #: the hazard lock)
        self._tails: dict[int, tuple[Stream, Point | None]] = {}
        #: the same streams by device: what its collectives' plan tells the
        #: default policy to look at first (read without the hazard lock: a
        #: stale one is only another stream, and any is correct)
        self._latest: dict[int, Stream] = {}
        #: the plan of every collective of it (one object, however many)
        self._collectives_plan = Plan(prefer=self._latest)

    # -- what it is ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank (a communicator of several processes)."""
        if self._multi and len(self.ranks) != 1:
            raise UsageError(f"this communicator has ranks {self.ranks} in this process")
        return self.ranks[0]

    @property
    def error(self) -> CommunicatorError | None:
        """Why the communicator was aborted, once it was (else None)."""
        return self._error

    @property
    def raw(self) -> tuple[Any, ...]:
        """The backend's own communicators, one per rank of this process
        (empty while the communicator is not open), for code that calls the
        backend directly (:mod:`gpuflow.lowlevel`), as :attr:`Stream.raw`."""
        return tuple(self._raw or ())

    def __repr__(self) -> str:
        state = "open" if self._raw is not None else "closed"
        if self._error is not None:
            state = "aborted"
        return f"<gpuflow.Communicator ranks {list(self.ranks)} of {self.nranks} ({state})>"

    # -- the scope ----------------------------------------------------------------------
    async def __aenter__(self) -> Communicator:
        if self._raw is not None or self._closed:
            raise UsageError("a communicator is entered once (open a new one)")
        be = self._rt.backend
        # joining waits for every rank: off the loop, and abandoned (never
        # waited for at exit) if the wait is cancelled; what it makes then
        # is released when it is made
        self._raw = await off_loop(
            lambda: be.comm_init(self.devices, self.ranks, self.nranks, self._uid),
            abandoned=self._destroy,
        )
        # from now on the watchdog asks it for errors at each tick it is busy
        self._rt.completer.watch_communicator(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is not None and self._busy:
                self.abort(f"its scope {ended_by(exc)} with collectives pending")
            pending = Tracked()
            for sub in list(self._last.values()):
                pending.track(sub)
            await pending.drain()
        finally:
            self._closed = True
            raws, self._raw = self._raw, None
            if raws is not None:  # its runs are done: nothing of it is in use
                # NCCL's destroy waits for the other ranks of this host: a
                # cancellation leaves it to finish in its thread
                await off_loop(lambda: self._destroy(raws))
        if exc is None and self._error is not None:
            raise self._error

    def _destroy(self, raws: list[RawComm] | None) -> None:
        for raw in raws or ():
            self._rt.backend.comm_destroy(raw)

    # -- failing ------------------------------------------------------------------------
    def abort(self, reason: str = "aborted by the program") -> None:
        """Abort: the collectives in flight return (their runs fail with
        :class:`CommunicatorError`), later ones are refused.  Idempotent; any
        thread.

        Parameters
        ----------
        reason
            What the error of the failed runs says.
        """
        self._fail(
            CommunicatorError(
                f"communicator of ranks {list(self.ranks)} (of {self.nranks}) aborted: {reason}",
                device=self.devices[0],
                rank=self.ranks[0],
            )
        )

    def _fail(self, error: CommunicatorError) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            raws = list(self._raw or ())
        _log.warning("gpuflow: %s", error)
        for raw in raws:
            self._rt.backend.comm_abort(raw)

    # -- for the bridge: Run.comms and the completer's watchdog ------------------
    @property
    def _busy(self) -> bool:
        """Collectives of it are in flight (the watchdog asks while they are)."""
        return any(not s.done for s in list(self._last.values()))

    def _failure(self) -> CommunicatorError | None:
        """The error a run that used it fails with, once it was aborted.

        Returns
        -------
        CommunicatorError or None
        """
        return self._error

    def _poll(self) -> None:
        """Ask the backend for an asynchronous error; abort on one.  Completer thread.

        Returns
        -------
        None
        """
        for raw in list(self._raw or ()):
            err = self._rt.backend.comm_async_error(raw)
            if err is not None:
                self._fail(
                    CommunicatorError(
                        f"{err} (gpuflow aborted the communicator)",
                        code=err.code,
                        name=err.name,
                        device=err.device,
                        rank=err.rank,
                    )
                )
                return

    # -- issuing ------------------------------------------------------------------------
    def _usable(self) -> list[Any]:
        if self._error is not None:
            raise self._error
        if self._raw is None:
            raise UsageError(
                "the communicator is not open: use it inside `async with gf.open_communicator()`"
            )
        return self._raw

    def _started(self, stream: Stream, sub: Run) -> None:
        """``sub`` enqueued collectives of this communicator, ending on ``stream``."""
        self._last[stream] = sub
        comms = sub._comms
        if comms is None:
            sub._comms = [self]
        elif self not in comms:
            comms.append(self)

    # -- the collectives ------------------------------------------------------------------
    def all_reduce(self, x: object, op: str = "sum", *, out: object = None) -> DeviceOperation[Any]:
        """Reduce ``x`` over the ranks (``"sum"``, ``"prod"``, ``"max"``,
        ``"min"``, ``"avg"``); every rank gets the result, in a new array or
        in ``out`` (``out=x``: in place).

        Parameters
        ----------
        x
            The rank's array (or an operation producing it); in a
            communicator of several devices of this process, a sequence of
            them, one a device in the order of :attr:`devices`.
        op
            ``"sum"``, ``"prod"``, ``"max"``, ``"min"`` or ``"avg"``.
        out
            Where the result goes (an array, or one a device; None: new arrays).

        Returns
        -------
        DeviceOperation
            The result array (a list of them, one a device, where ``x`` was a
            sequence).

        Raises
        ------
        gpuflow.UsageError
            Arguments the collective cannot take (a dtype NCCL cannot pass,
            shapes that do not fit, a rank out of range, a communicator not
            open), when the operation is built.
        gpuflow.CommunicatorError
            When it runs: the communicator was aborted (a peer left, a
            deadline, :meth:`abort`).
        """
        return _Collective(self, "all_reduce", x, out, op=_reduction(op))

    def broadcast(self, x: object, root: int = 0, *, out: object = None) -> DeviceOperation[Any]:
        """Every rank gets rank ``root``'s ``x`` (the other ranks' ``x`` is not
        read: it gives the shape and type), in a new array or ``out``.

        Parameters
        ----------
        x
            The rank's array (or an operation producing it); in a
            communicator of several devices of this process, a sequence of
            them, one a device in the order of :attr:`devices`.
        root
            The rank whose ``x`` every rank gets.
        out
            Where the result goes (an array, or one a device; None: new arrays).

        Returns
        -------
        DeviceOperation
            The result array (a list of them, one a device, where ``x`` was a
            sequence).

        Raises
        ------
        gpuflow.UsageError
            Arguments the collective cannot take (a dtype NCCL cannot pass,
            shapes that do not fit, a rank out of range, a communicator not
            open), when the operation is built.
        gpuflow.CommunicatorError
            When it runs: the communicator was aborted (a peer left, a
            deadline, :meth:`abort`).
        """
        return _Collective(self, "broadcast", x, out, peer=self._rank_arg(root, "root"))

    def all_gather(self, x: object, *, out: object = None) -> DeviceOperation[Any]:
        """Every rank gets every rank's ``x``, stacked in rank order: shape
        ``(nranks, *x.shape)``.

        Parameters
        ----------
        x
            The rank's array (or an operation producing it); in a
            communicator of several devices of this process, a sequence of
            them, one a device in the order of :attr:`devices`.
        out
            Where the result goes (an array, or one a device; None: new arrays).

        Returns
        -------
        DeviceOperation
            The result array (a list of them, one a device, where ``x`` was a
            sequence).

        Raises
        ------
        gpuflow.UsageError
            Arguments the collective cannot take (a dtype NCCL cannot pass,
            shapes that do not fit, a rank out of range, a communicator not
            open), when the operation is built.
        gpuflow.CommunicatorError
            When it runs: the communicator was aborted (a peer left, a
            deadline, :meth:`abort`).
        """
        return _Collective(self, "all_gather", x, out)

    def reduce_scatter(
        self, x: object, op: str = "sum", *, out: object = None
    ) -> DeviceOperation[Any]:
        """Reduce ``x`` (shape ``(nranks, *s)``) over the ranks; rank ``r``
        gets row ``r`` of the result (shape ``s``).

        Parameters
        ----------
        x
            The rank's array (or an operation producing it); in a
            communicator of several devices of this process, a sequence of
            them, one a device in the order of :attr:`devices`.
        op
            ``"sum"``, ``"prod"``, ``"max"``, ``"min"`` or ``"avg"``.
        out
            Where the result goes (an array, or one a device; None: new arrays).

        Returns
        -------
        DeviceOperation
            The result array (a list of them, one a device, where ``x`` was a
            sequence).

        Raises
        ------
        gpuflow.UsageError
            Arguments the collective cannot take (a dtype NCCL cannot pass,
            shapes that do not fit, a rank out of range, a communicator not
            open), when the operation is built.
        gpuflow.CommunicatorError
            When it runs: the communicator was aborted (a peer left, a
            deadline, :meth:`abort`).
        """
        return _Collective(self, "reduce_scatter", x, out, op=_reduction(op))

    def send(self, x: object, peer: int) -> DeviceOperation[None]:
        """Send ``x`` to rank ``peer``, which receives it with :meth:`recv`.

        It completes when the peer has taken it.  Between devices of this
        process, issue both in one :meth:`group`.

        Parameters
        ----------
        x
            The rank's array (or an operation producing it); in a
            communicator of several devices of this process, a sequence of
            them, one a device in the order of :attr:`devices`.
        peer
            The receiving rank.

        Returns
        -------
        DeviceOperation[None]

        Raises
        ------
        gpuflow.UsageError
            Arguments the collective cannot take (a dtype NCCL cannot pass,
            shapes that do not fit, a rank out of range, a communicator not
            open), when the operation is built.
        gpuflow.CommunicatorError
            When it runs: the communicator was aborted (a peer left, a
            deadline, :meth:`abort`).
        """
        return _Collective(self, "send", x, None, peer=self._rank_arg(peer, "peer"))

    def recv(
        self,
        peer: int,
        *,
        out: Any = None,
        shape: Any = None,
        dtype: Any = None,
        device: int | None = None,
    ) -> DeviceOperation[DeviceArray]:
        """Receive what rank ``peer`` sends, into ``out`` or a new array of
        ``shape`` and ``dtype`` (on ``device``, in a communicator of this
        process's devices: which rank receives).

        Parameters
        ----------
        peer
            The sending rank.
        out
            The array to receive into (None: a new one of ``shape`` and ``dtype``).
        shape, dtype
            The new array's (with no ``out``).
        device
            The receiving device, in a communicator of this process's devices.

        Returns
        -------
        DeviceOperation[DeviceArray]

        Raises
        ------
        gpuflow.UsageError
            Arguments the collective cannot take (a dtype NCCL cannot pass,
            shapes that do not fit, a rank out of range, a communicator not
            open), when the operation is built.
        gpuflow.CommunicatorError
            When it runs: the communicator was aborted (a peer left, a
            deadline, :meth:`abort`).
        """
        if (out is None) == (shape is None):
            raise UsageError("recv() takes out=, or shape= and dtype= for a new array")
        like = None
        if out is None:
            like = (as_shape(shape), as_dtype(dtype if dtype is not None else np.float32), device)
            if like[1] not in COMM_DTYPES:
                raise UsageError(_dtype_message(like[1]))
        return _Collective(self, "recv", None, out, peer=self._rank_arg(peer, "peer"), like=like)

    def group(self, *ops: DeviceOperation[object]) -> DeviceOperation[tuple[Any, ...]]:
        """Issue several collectives and transfers as one NCCL group (a send
        and its recv between this process's devices, several collectives in
        one launch); produces the tuple of their outputs.

        Parameters
        ----------
        *ops
            Collectives and transfers of this communicator.

        Returns
        -------
        DeviceOperation[tuple]
            Their outputs, in order.

        Raises
        ------
        gpuflow.UsageTypeError
            An argument that is not a collective of this communicator.
        gpuflow.UsageError
            No operation.
        """
        for i, op in enumerate(ops):
            if not isinstance(op, _Collective):
                raise UsageTypeError(
                    f"group() argument {i} is {type(op).__name__}, not a collective "
                    "of a communicator"
                )
        if not ops:
            raise UsageError("group() needs at least one collective")
        return _Group(tuple(ops))  # type: ignore[arg-type]

    def _rank_arg(self, r: object, what: str) -> int:
        if not isinstance(r, int) or isinstance(r, bool):
            raise UsageTypeError(f"{what} must be an int rank, not {r!r}")
        if not 0 <= r < self.nranks:
            raise UsageError(f"{what} {r} is not one of the {self.nranks} ranks")
        return r


def _reduction(op: object) -> str:
    if op not in REDUCTIONS:
        raise UsageError(f"reduction {op!r} is not one of {', '.join(REDUCTIONS)}")
    return str(op)


def _dtype_message(dt: DType) -> str:
    names = ", ".join(sorted(str(t) for t in COMM_DTYPES))
    return f"dtype {dt} cannot be communicated: NCCL moves {names}"


class _Prepared(NamedTuple):
    """One collective made ready: its calls, the uses to order, its output;
    for one call on the run's stream, kept for the next runs there, the
    backend's step of it (:meth:`Backend.prepare_collective`)."""

    calls: list[tuple[Communicator, int, CollectiveCall, Stream]]
    reads: list[tuple[DeviceArray, Stream]]
    writes: list[tuple[DeviceArray, Stream]]
    output: Any
    step: Step | None = None


class _Checked(NamedTuple):
    """What a collective's checks found, kept for its next runs where its
    arrays are given (not operations, no output to allocate): a training
    loop's all-reduce of the same gradients is checked once."""

    x: Any  # the input and out as given (lists: their items then)
    out: Any
    parts: tuple[tuple[int, int, DeviceArray | None, DeviceArray | None, bool, CollectiveCall], ...]
    output: Any

    def holds(self, x: object, out: object) -> bool:
        return _same(x, self.x) and _same(out, self.out)


def _given(v: object) -> Any:
    """``v`` as what was checked keeps it: a list's items (a list may change after)."""
    return tuple(v) if type(v) is list else v


def _same(v: Any, kept: Any) -> bool:
    if type(v) is not list:
        return v is kept
    # (every run of a collective checked before asks: item by item, in C)
    return len(v) == len(kept) and all(map(operator.is_, v, kept))


def _plain(v: object) -> bool:
    """None, an array, or a list or tuple of arrays: nothing a run resolves anew."""
    if type(v) is list or type(v) is tuple:
        return all(type(a) is DeviceArray for a in v)
    return v is None or type(v) is DeviceArray


#: the streams a collective remembers its calls for, and keeps alive (a
#: device's pool rotates over 4 by default; a run on a stream past these
#: starts the memory anew)
_MEMO_STREAMS = 8


class _Collective(DeviceOperation[Any]):  # (its output depends on its kind)
    __slots__ = (
        "_checked", "_comm", "_like", "_memo", "_op", "_out", "_peer", "_plan", "_what", "_x",
    )  # fmt: skip

    def __init__(
        self,
        comm: Communicator,
        what: str,
        x: object,
        out: object,
        *,
        op: str | None = None,
        peer: int | None = None,
        like: tuple[tuple[int, ...], DType, int | None] | None = None,
    ) -> None:
        self._comm = comm
        self._what = what  # the call's kind (``kind`` is the picture's)
        self._x = x
        self._out = out
        self._op = op
        self._peer = peer
        self._like = like
        #: its rank's previous collective's stream, looked at first
        self._plan = comm._collectives_plan
        self._checked: _Checked | None = None
        #: runs' calls from what was checked, by the run's stream, where they
        #: all went on that stream: a later run from it on that stream
        #: makes them (awaits the default policy spreads over the pool's
        #: streams each find theirs)
        self._memo: tuple[_Checked, dict[Stream, _Prepared]] | None = None

    @property
    def _p2p(self) -> bool:
        return self._what in ("send", "recv")

    def execute(self, ctx: ExecutionContext) -> Any:
        if len(self._comm.devices) > 1 and self._p2p:
            # NCCL: one thread driving several devices issues both ends together
            raise UsageError(
                f"{self._what}() between devices of one process must be issued with its "
                "match in one comm.group(comm.send(...), comm.recv(...))"
            )
        p = self._prepare(ctx)
        _enqueue_group(ctx, [p])
        return p.output

    def label(self) -> str:
        return self._what + (f" ({self._op})" if self._op else "")

    def _kind(self) -> str:
        return "kernel"

    # -- getting the arrays ready ------------------------------------------------------------
    def _check(self, arr: DeviceArray, what: str) -> DeviceArray:
        if arr.device not in self._comm.devices:
            raise UsageError(
                f"{self._what}: {what} {arr!r} is on device {arr.device}, which has no rank "
                f"in this communicator (devices {list(self._comm.devices)})"
            )
        if arr.dtype not in COMM_DTYPES:
            raise UsageError(f"{self._what}: {_dtype_message(arr.dtype)}")
        return arr

    def _per_rank(self, x: object, ctx: ExecutionContext, what: str) -> dict[int, DeviceArray]:
        """The arrays of the local ranks taking part, by local rank, checked."""
        comm = self._comm
        if not comm._multi or self._p2p:
            arr = self._check(self._resolve(x, ctx, what), what)
            return {comm.devices.index(arr.device): arr}
        if type(x) is not list and type(x) is not tuple:
            if isinstance(x, DeviceArray | DeviceOperation) or not isinstance(x, Sequence):
                raise UsageTypeError(
                    f"{self._what}() {what} must be a sequence of {len(comm.devices)} arrays, "
                    f"one for each device of the communicator {list(comm.devices)}"
                )
        items = list(x)
        if len(items) != len(comm.devices):
            raise UsageError(
                f"{self._what}() {what} has {len(items)} arrays for {len(comm.devices)} ranks "
                f"(devices {list(comm.devices)})"
            )
        arrays = [self._check(self._resolve(a, ctx, what), what) for a in items]
        first = arrays[0]
        for i, (arr, dev) in enumerate(zip(arrays, comm.devices, strict=True)):
            if arr.device != dev:
                raise UsageError(
                    f"{self._what}() {what}: {arr!r} is on device {arr.device}, but rank {i}'s "
                    f"device is {dev}"
                )
            if arr.shape != first.shape or arr.dtype != first.dtype:
                raise UsageError(
                    f"{self._what}() {what} differs across ranks: rank 0 has {first.shape} "
                    f"{first.dtype}, rank {i} {arr.shape} {arr.dtype}"
                )
        return dict(enumerate(arrays))

    def _resolve(self, x: object, ctx: ExecutionContext, what: str) -> DeviceArray:
        return resolve_array(x, ctx, f"{self._what}() {what}")

    def _out_shape(self, x: DeviceArray) -> tuple[int, ...]:
        n = self._comm.nranks
        if self._what == "all_gather":
            return (n, *x.shape)
        if self._what == "reduce_scatter":
            if not x.shape or x.shape[0] != n:
                raise UsageError(
                    f"reduce_scatter: the input's first dimension must be the {n} ranks, "
                    f"got shape {x.shape}"
                )
            return x.shape[1:]
        return x.shape

    def _receiver(self) -> int:
        """The local rank of a recv into a new array."""
        comm = self._comm
        assert self._like is not None
        dev = self._like[2]
        if dev is None:
            if comm._multi:
                raise UsageError("recv() in a communicator of several devices needs device=")
            return 0
        if dev not in comm.devices:
            raise UsageError(
                f"recv(): device {dev} has no rank in this communicator "
                f"(devices {list(comm.devices)})"
            )
        return comm.devices.index(dev)

    def _prepare(self, ctx: ExecutionContext) -> _Prepared:
        comm = self._comm
        comm._usable()
        what = self._what
        if ctx.capturing:
            raise UsageError(f"{what}: collectives cannot be captured into a graph")
        checked = self._checked
        if checked is not None and checked.holds(self._x, self._out):
            memo = self._memo
            if memo is not None and memo[0] is checked:
                known = memo[1].get(ctx.stream)
                if known is not None:
                    # its arrays, on that stream's device, were usable then and
                    # are while a run may start on the stream (a reset of the
                    # device refuses the runs of every stream it had)
                    return known
            return self._from_checked(ctx, checked)
        xs = {} if self._x is None else self._per_rank(self._x, ctx, "input")
        outs = {} if self._out is None else self._per_rank(self._out, ctx, "out")
        for arr in outs.values():
            if arr.readonly:
                raise UsageError(f"{what}: out {arr!r} is read-only memory of another library")
        if what == "recv" and not outs:
            ranks = [self._receiver()]
        else:
            ranks = sorted(xs or outs)

        calls: list[tuple[Communicator, int, CollectiveCall, Stream]] = []
        reads: list[tuple[DeviceArray, Stream]] = []
        writes: list[tuple[DeviceArray, Stream]] = []
        results: list[Any] = []
        parts = []
        allocated = False
        for i in ranks:
            x: DeviceArray | None = xs.get(i)
            o: DeviceArray | None = outs.get(i)
            dev = comm.devices[i]
            if dev == ctx.device:
                stream = ctx.stream
            else:  # another device's part: on a stream the default policy gives, in the class
                stream = _part_stream(comm, i, dev)
            if o is None and what == "recv":
                assert self._like is not None
                o = allocate(ctx, self._like[0], self._like[1], stream)
                allocated = True
            elif o is None and what != "send":
                assert x is not None
                o = allocate(ctx, self._out_shape(x), x.dtype, stream)
                allocated = True
            elif o is not None and x is not None:
                want = self._out_shape(x)
                if o.shape != want or o.dtype != x.dtype:
                    raise UsageError(
                        f"{what}: out is {o.shape} {o.dtype}, the result is {want} {x.dtype}"
                    )
            ref = x if x is not None else o
            assert ref is not None
            count = math.prod(ref.shape[1:]) if what == "reduce_scatter" else ref.size
            read = x is not None and (what != "broadcast" or self._peer == comm.ranks[i])
            if read:
                assert x is not None
                reads.append((x, stream))
            if o is not None:
                writes.append((o, stream))
            call = CollectiveCall(
                what,
                x._allocation.buffer if read and x is not None else None,
                None if o is None else o._allocation.buffer,
                count,
                ref.dtype,
                self._op,
                self._peer,
            )  # fmt: skip
            calls.append((comm, i, call, stream))
            results.append(o)
            parts.append((i, dev, x, o, read, call))
        if what == "send":
            output: Any = None
        elif comm._multi and not self._p2p:
            output = tuple(results)
        else:
            output = results[0]
        if not allocated and _plain(self._x) and _plain(self._out):
            self._checked = _Checked(_given(self._x), _given(self._out), tuple(parts), output)
        return _Prepared(calls, reads, writes, output)

    def _from_checked(self, ctx: ExecutionContext, checked: _Checked) -> _Prepared:
        """The run's calls from what an earlier run checked: only the arrays'
        usability (a device reset since) and the streams are the run's own
        (a run on a stream where one ran from what was checked takes that run's,
        in :meth:`_prepare`)."""
        memo = self._memo
        here = ctx.device
        comm = self._comm
        what = self._what
        calls: list[tuple[Communicator, int, CollectiveCall, Stream]] = []
        reads: list[tuple[DeviceArray, Stream]] = []
        writes: list[tuple[DeviceArray, Stream]] = []
        local = True
        for i, dev, x, o, read, call in checked.parts:
            if dev == here:
                stream = ctx.stream
            else:  # a stream the policy gives, maybe another at the next run
                stream = _part_stream(comm, i, dev)
                local = False
            if x is not None:
                x._check_usable(ctx, what)
                if read:
                    reads.append((x, stream))
            if o is not None:
                if o is not x:
                    o._check_usable(ctx, what)
                writes.append((o, stream))
            calls.append((comm, i, call, stream))
        step = None
        if local and len(calls) == 1:  # (one rank of this process: the usual case)
            comm_, i, call, _s = calls[0]
            step = ctx._runtime.backend.prepare_collective(comm_._usable()[i], call)
        prepared = _Prepared(calls, reads, writes, checked.output, step)
        if local:
            if memo is None or memo[0] is not checked or len(memo[1]) >= _MEMO_STREAMS:
                self._memo = memo = (checked, {})
            memo[1][ctx.stream] = prepared
        return prepared


def _part_stream(comm: Communicator, i: int, dev: int) -> Stream:
    """The stream of local rank ``i``'s part of a run on another device: as
    the default policy gives a collective its stream (its rank's previous
    collective's, where that is idle)."""
    tail = comm._tails.get(i)
    return stream_elsewhere(dev, None if tail is None else tail[0])


class _Group(DeviceOperation[tuple[Any, ...]]):
    __slots__ = ("_ops",)

    def __init__(self, ops: tuple[_Collective, ...]) -> None:
        self._ops = ops

    def execute(self, ctx: ExecutionContext) -> tuple[Any, ...]:
        prepared = [op._prepare(ctx) for op in self._ops]
        _enqueue_group(ctx, prepared)
        return tuple(p.output for p in prepared)

    def label(self) -> str:
        return f"nccl group ({len(self._ops)})"

    def _children(self) -> Sequence[DeviceOperation[object]]:
        return self._ops


def _enqueue_group(ctx: ExecutionContext, prepared: list[_Prepared]) -> None:
    """Order the uses and enqueue the calls, as one group; join the other
    devices' streams back into the run's."""
    one = prepared[0].step if len(prepared) == 1 else None
    calls = [c for p in prepared for c in p.calls] if len(prepared) > 1 else prepared[0].calls
    be = ctx._runtime.backend
    run = ctx.run

    def enqueue() -> None:
        # a rank runs its collectives in the order they were issued, as NCCL
        # requires of every rank (two on different streams could otherwise
        # run in one order on one rank and the other order on another): after
        # the previous one itself, not whatever its stream ran later
        for comm, i, _call, s in calls:
            tails = comm._tails
            tail = tails.get(i)
            if tail is not None and tail[0] is not s:
                order_after(be, s, tail[0], tail[1])
            tails[i] = (s, run)
            comm._latest[s.device] = s
        if one is not None:  # (one call on the run's stream, run again: its step)
            one(calls[0][3].raw)
        else:
            be.comm_group([(comm._usable()[i], call, s.raw) for comm, i, call, s in calls])

    uses = [(arr._allocation, s, False) for p in prepared for arr, s in p.reads]
    uses += [(arr._allocation, s, True) for p in prepared for arr, s in p.writes]
    enqueue_ordered(run, uses, enqueue)
    here = ctx.stream
    if len(calls) == 1:  # (one device's rank: nothing to join)
        comm, _i, _call, s = calls[0]
        if s is not here:
            ctx.wait_for(s)
        comm._started(here, run)
        return
    joined: list[Stream] = []
    comms: list[Communicator] = []
    for comm, _i, _call, s in calls:
        if s is not here and s not in joined:
            joined.append(s)
            ctx.wait_for(s)
        if comm not in comms:
            comms.append(comm)
    for comm in comms:
        comm._started(here, run)
