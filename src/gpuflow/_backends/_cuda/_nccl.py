"""Communicators of the ``cuda`` backend: NCCL, through nccl4py's bindings.

nccl4py (``pip install 'gpuflow[nccl]'``) is imported on first use, so the
rest of the backend works without it.  Collectives are issued through its
low-level bindings with raw pointers and gpuflow's own stream handle: its
high-level calls would resolve every buffer again, and default to the legacy
stream, and order nothing (gpuflow's hazard tracking orders the buffers
before the call).  NCCL uses the runtime's current device: the device's
primary context (the one gpuflow uses) is made current before each call;
after a call for several devices, whose contexts NCCL makes current in
turn, the driver is asked which context it left current.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._errors import CommunicatorError, UsageError
from .._codes import NCCL_INVALID_USAGE, NCCL_NAMES
from .._records import CollectiveCall, DType

if TYPE_CHECKING:
    from ._backend import CudaBackend
    from ._handles import CudaStream, Dev

_IN_PROGRESS = 7


def _modules() -> tuple[Any, Any]:
    try:
        import nccl.core as core
        from nccl.bindings import nccl as bindings
    except ImportError as exc:
        raise UsageError(
            "communicators on the cuda backend need NCCL's Python bindings: "
            f"pip install 'gpuflow[nccl]' ({exc})"
        ) from exc
    return core, bindings


class NcclComm:
    """One rank's NCCL communicator on one device."""

    __slots__ = ("comm", "dev", "lock", "nranks", "rank", "revoked")

    def __init__(self, comm: Any, dev: Dev, rank: int, nranks: int) -> None:
        self.comm = comm  # nccl.core.Communicator
        self.dev = dev
        self.rank = rank
        self.nranks = nranks
        #: NCCL's calls on one communicator must not overlap (abort from the
        #: watchdog against an enqueue from a task, say)
        self.lock = threading.Lock()
        #: its work in flight was stopped (ncclCommRevoke); its resources
        #: are still NCCL's until it is destroyed
        self.revoked = False

    def __repr__(self) -> str:
        return f"<NCCL communicator rank {self.rank} of {self.nranks} on device {self.dev.index}>"


def _gone(comm: NcclComm) -> CommunicatorError:
    return CommunicatorError(
        f"{comm!r} was aborted or destroyed",
        code=NCCL_INVALID_USAGE,
        name=NCCL_NAMES[NCCL_INVALID_USAGE],
        device=comm.dev.index,
        rank=comm.rank,
    )


def _error(exc: BaseException, what: str, comm: NcclComm | None) -> CommunicatorError:
    code = getattr(exc, "status", None)
    code = int(code) if code is not None else None
    return CommunicatorError(
        f"{what} failed: {exc}",
        code=code,
        name=NCCL_NAMES.get(code) if code is not None else None,
        device=None if comm is None else comm.dev.index,
        rank=None if comm is None else comm.rank,
    )


class NcclComms:
    """What :class:`CudaBackend` does for communicators (kept apart from it)."""

    def __init__(self, backend: CudaBackend) -> None:
        self._be = backend
        self._types: dict[DType, int] | None = None
        self._ops: dict[str, int] = {}
        self._bindings: Any = None

    def _tables(self) -> tuple[Any, dict[DType, int], dict[str, int]]:
        if self._types is not None:
            return self._bindings, self._types, self._ops
        core, b = _modules()
        self._bindings = b
        self._ops = {
            "sum": int(core.SUM), "prod": int(core.PROD), "max": int(core.MAX),
            "min": int(core.MIN), "avg": int(core.AVG),
        }  # fmt: skip
        self._types = {
            np.dtype(name): int(getattr(core, name.upper()))
            for name in ("int8", "uint8", "int32", "uint32", "int64", "uint64",
                         "float16", "float32", "float64")
        }  # fmt: skip
        return b, self._types, self._ops

    def _current(self, dev: Dev) -> None:
        self._be.force_current(dev)

    def _forget_current(self) -> None:
        self._be.thread_state.token = None

    def unique_id(self) -> bytes:
        core, _ = _modules()
        return bytes(core.get_unique_id())

    def init(
        self, devs: Sequence[Dev], ranks: Sequence[int], nranks: int, unique_id: bytes | None
    ) -> list[NcclComm]:
        core, _ = _modules()
        try:
            if unique_id is None:
                comms = core.Communicator.init_all([d.index for d in devs])
            else:
                if not isinstance(unique_id, bytes) or len(unique_id) != 128:
                    raise UsageError(
                        f"unique id {unique_id[:16]!r}... is not an NCCL id (128 bytes from "
                        "gf.new_unique_id() under the cuda backend)"
                    )
                self._current(devs[0])
                comms = [
                    core.Communicator.init(nranks, ranks[0], core.UniqueId.from_bytes(unique_id))
                ]
        except UsageError:
            raise
        except Exception as exc:
            raise _error(exc, "creating the NCCL communicator", None) from exc
        finally:
            self._forget_current()
        return [NcclComm(c, d, r, nranks) for c, d, r in zip(comms, devs, ranks, strict=True)]

    def group(self, calls: Sequence[tuple[NcclComm, CollectiveCall, CudaStream]]) -> None:
        b, types, ops = self._tables()
        held: list[threading.Lock] = []
        first = calls[0][0].dev
        others = False  # a call for another device than the first's
        try:
            for comm, _, _ in calls:
                if comm.lock not in held:
                    comm.lock.acquire()
                    held.append(comm.lock)
                others = others or comm.dev is not first
            for comm, _, _ in calls:
                if comm.revoked or not comm.comm.is_valid:
                    raise _gone(comm)
            self._be.make_current(first)
            if len(calls) == 1:  # one call needs no group: two calls of NCCL's fewer
                comm, call, stream = calls[0]
                self._bound(b, types, ops, comm, call)(stream.handle)
            else:
                b.group_start()
                try:
                    for comm, call, stream in calls:
                        self._bound(b, types, ops, comm, call)(stream.handle)
                finally:
                    b.group_end()
        except CommunicatorError:
            raise
        except Exception as exc:
            raise _error(exc, f"enqueueing {calls[0][1].kind}", calls[0][0]) from exc
        finally:
            # NCCL sets the device of each rank it enqueues for (and perhaps
            # back): where that is another device than the one made current
            # above, the context left current is asked, not assumed.  (For
            # one device NCCL can only make that device's primary context
            # current, the one gpuflow's cache says is: a query saved.)
            if others:
                self._be.learn_current()
            for lock in held:
                lock.release()

    def prepare(self, comm: NcclComm, call: CollectiveCall) -> Callable[[CudaStream], None]:
        """:meth:`group` of ``call`` alone as a step, its arguments resolved
        once: the same lock, checks and errors, and one call of NCCL's a run."""
        b, types, ops = self._tables()
        bound = self._bound(b, types, ops, comm, call)
        lock, nccl_comm, dev = comm.lock, comm.comm, comm.dev
        be = self._be
        live, cur, tls = be.live_device, be.make_current, be.thread_state

        def step(stream: CudaStream) -> None:
            sdev = stream.dev
            if sdev.fault is not None or stream.token is not sdev.token or stream.destroyed:
                live(stream)  # (raises what group() would)
            with lock:
                if comm.revoked or not nccl_comm.is_valid:
                    raise _gone(comm)
                try:
                    if tls.token is not dev.token:  # (what _cur asks first, inline)
                        cur(dev)
                    bound(stream.handle)
                except Exception as exc:
                    raise _error(exc, f"enqueueing {call.kind}", comm) from exc

        return step

    @staticmethod
    def _bound(
        b: Any,
        types: dict[DType, int],
        ops: dict[str, int],
        comm: NcclComm,
        call: CollectiveCall,
    ) -> Callable[[int], object]:
        """NCCL's function for ``call`` on ``comm``, every argument but the
        stream given (NCCL's calls take the communicator and the stream
        last; a communicator's handle stays while it is valid)."""
        c = comm.comm._comm
        t = types[call.dtype]
        recv = 0 if call.recv is None else call.recv.ptr
        send = recv if call.send is None else call.send.ptr
        kind = call.kind
        if kind == "all_reduce":
            return partial(b.all_reduce, send, recv, call.elems, t, ops[call.op or "sum"], c)
        if kind == "broadcast":
            return partial(b.broadcast, send, recv, call.elems, t, call.peer, c)
        if kind == "all_gather":
            return partial(b.all_gather, send, recv, call.elems, t, c)
        if kind == "reduce_scatter":
            return partial(b.reduce_scatter, send, recv, call.elems, t, ops[call.op or "sum"], c)
        if kind == "send":
            return partial(b.send, send, call.elems, t, call.peer, c)
        return partial(b.recv, recv, call.elems, t, call.peer, c)

    def async_error(self, comm: NcclComm) -> CommunicatorError | None:
        b, _, _ = self._tables()
        if not comm.lock.acquire(blocking=False):
            return None  # an enqueue or an abort is under way: ask at the next tick
        try:
            if not comm.comm.is_valid:
                return None
            code = int(b.comm_get_async_error(comm.comm._comm))
        except Exception as exc:
            return _error(exc, "asking NCCL for the communicator's state", comm)
        finally:
            comm.lock.release()
        if code in (0, _IN_PROGRESS):
            return None
        return CommunicatorError(
            f"NCCL reported an asynchronous error on rank {comm.rank}",
            code=code,
            name=NCCL_NAMES.get(code),
            device=comm.dev.index,
            rank=comm.rank,
        )

    def abort(self, comm: NcclComm) -> None:
        """Stop the work in flight, free nothing: ``ncclCommRevoke`` (NCCL
        2.28+) makes its kernels return and leaves the communicator's memory
        in place until :meth:`destroy`, called once the runs that used it are
        done.  Where NCCL has no revoke, ``ncclCommAbort`` at once (which also
        frees: a collective still queued behind other work would then start
        on freed state, so that path is NCCL's older behaviour, not ours)."""
        with comm.lock:
            if comm.revoked or not comm.comm.is_valid:
                return
            try:
                comm.comm.revoke()
                comm.revoked = True
                return
            except Exception:
                pass  # no revoke in this NCCL: abort below
            finally:
                self._forget_current()
        self._release(comm, "aborting", comm.comm.abort)

    def destroy(self, comm: NcclComm) -> None:
        """Free the communicator; its runs are done.  A revoked one is freed
        with ``ncclCommAbort`` (local: a dead peer cannot stall it), any other
        with ``ncclCommDestroy``."""
        if not comm.comm.is_valid:
            return  # aborted already
        how = comm.comm.abort if comm.revoked else comm.comm.destroy
        self._release(comm, "releasing", how)

    def _release(self, comm: NcclComm, what: str, how: Callable[[], object]) -> None:
        """End ``comm`` with ``how``; a failure is a warning (never raised)."""
        with comm.lock:
            try:
                how()
            except Exception as exc:
                warnings.warn(f"gpuflow: {what} {comm!r} failed: {exc!r}", stacklevel=3)
            finally:
                self._forget_current()
