"""Communicators of the ``sim`` backend: NCCL's model, on simulated devices.

The ranks of one communicator may be simulated devices of one process, or
processes of one host (each with its own sim backend): they meet in a
directory, which the unique id names.  What NCCL does, the sim does:

* a collective is an item of its rank's stream, and it runs when the stream
  reaches it: it posts the rank's part (a file, written whole, then renamed)
  and then *waits*, holding its stream, until every rank's part of the same
  collective is there, as an NCCL kernel spins until its peers arrive;
* a rank that never arrives makes the others wait for ever: a missing peer
  is a hang, which only :meth:`abort` ends (the waiting items return, with
  nothing written);
* a rank that leaves (its process died, or it aborted or destroyed its
  communicator) while another waits for its part is NCCL's asynchronous
  ``ncclRemoteError`` on the waiting rank, read by
  :meth:`SimComms.async_error`; the wait goes on until an abort, as an NCCL
  kernel's does.  A rank holds an ``flock`` on its file for its life: the
  kernel drops it when the process ends, however it ends, so a peer that
  can take the lock knows the rank is gone;
* ranks that disagree on a collective (another kind, count, type, reduction
  or root) get ``ncclInvalidUsage`` asynchronously and wait: NCCL itself
  may hang or compute garbage there, the sim names the disagreement;
* a send waits until its receiver has taken the data, a recv until its
  sender has posted it; a rank's send to itself is refused unless its recv
  is in the same group (``ncclInvalidUsage``, as NCCL 2.28 answers on the
  H200).

Reductions are NumPy's over the ranks' parts in rank order.  The parts stay
in the directory until the last rank leaves, which removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import pickle
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._errors import CommunicatorError, UsageError
from .._codes import NCCL_INVALID_USAGE, NCCL_NAMES, NCCL_REMOTE_ERROR
from .._records import CollectiveCall, DType, HostArray

if TYPE_CHECKING:
    from ._backend import SimBackend, SimDevice, SimStream

_ID_PREFIX = b"gpuflow-sim-nccl\0"
#: how long a waiting rank sleeps between looks, at first and at most
_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.005
#: how often a waiting rank checks that the ranks it waits for are still there
_LIVENESS_S = 0.05
#: how long a joining rank retries a rank lock that is taken: a probe of
#: another rank (_gone) holds it for microseconds, a joined rank for good
_JOIN_PROBE_S = 0.1


def new_unique_id() -> bytes:
    """A fresh meeting directory, named by the id."""
    return _ID_PREFIX + tempfile.mkdtemp(prefix="gpuflow-sim-nccl-").encode()


def _root_of(unique_id: bytes) -> str:
    if not isinstance(unique_id, bytes) or not unique_id.startswith(_ID_PREFIX):
        raise UsageError(
            f"unique id {unique_id[:24]!r}... was not made by the sim backend "
            "(gf.new_unique_id() under init_device_contexts(backend='sim'))"
        )
    root = unique_id[len(_ID_PREFIX) :].decode()
    if not os.path.isdir(root):
        raise UsageError(
            f"the sim communicator {root!r} is gone (every rank of it left, or another host)"
        )
    return root


def _write(path: str, payload: object) -> None:
    """Write ``payload`` to ``path`` whole: a reader sees all of it or nothing."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def _read(path: str) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def _gone(path: str) -> bool:
    """True when the rank whose lock file is ``path`` has left (its lock is free)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False  # not joined yet
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # drops the lock, if we took it
    return True


def _reduce(parts: list[HostArray], op: str, dtype: DType) -> Any:
    st = np.stack(parts)
    if op == "sum":
        return st.sum(axis=0, dtype=dtype)
    if op == "prod":
        return st.prod(axis=0, dtype=dtype)
    if op == "max":
        return st.max(axis=0)
    if op == "min":
        return st.min(axis=0)
    # avg: the sum divided by the ranks, truncated for integers (as NCCL's)
    return (st.sum(axis=0, dtype=dtype) / len(parts)).astype(dtype)


class SimComm:
    """One rank's communicator."""

    def __init__(
        self, backend: SimBackend, root: str, rank: int, nranks: int, device: SimDevice
    ) -> None:
        self.backend = backend
        self.root = root
        self.rank = rank
        self.nranks = nranks
        self.device = device
        self._seq = itertools.count()
        # the transfers to and from each peer so far, which name the next one
        self._sends: dict[int, itertools.count[int]] = {}
        self._recvs: dict[int, itertools.count[int]] = {}
        self._lock = threading.Lock()
        self.aborted = False
        self.error: CommunicatorError | None = None
        self._fd: int | None = None

    def __repr__(self) -> str:
        return f"<sim communicator rank {self.rank} of {self.nranks} on device {self.device.index}>"

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    # -- joining and leaving --------------------------------------------------------
    def join(self) -> None:
        path = self._path(f"rank-{self.rank}")
        # the rank's file appears already locked: a rank asking whether this
        # one left (_gone) must never find it there and free, which it would
        # take for a rank gone (the last rank "out" then removed the
        # directory under this one, which waited for the others for ever)
        try:
            fd, fresh = tempfile.mkstemp(dir=self.root, prefix=f".rank-{self.rank}-")
        except FileNotFoundError:
            raise UsageError(f"the sim communicator {self.root!r} is gone") from None
        fcntl.flock(fd, fcntl.LOCK_EX)  # (a file no one else has opened)
        try:
            os.link(fresh, path)
        except FileExistsError:  # the rank was here before: its file, if it left
            os.close(fd)
            fd = self._take_over(path)
        finally:
            os.unlink(fresh)
        self._fd = fd

    def _take_over(self, path: str) -> int:
        """The lock of a rank's existing file, where the rank left."""
        fd = os.open(path, os.O_RDWR)
        # another rank asking whether this one left takes the lock for a few
        # microseconds (_gone): only a lock held past that is another holder
        deadline = time.monotonic() + _JOIN_PROBE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(_POLL_FIRST_S)
                    continue
                os.close(fd)
                raise UsageError(
                    f"rank {self.rank} of this communicator has already joined (another "
                    "process or communicator holds it)"
                ) from None

    def wait_joined(self) -> None:
        """Block until every rank has joined (NCCL's initialisation is collective)."""
        names = [self._path(f"rank-{r}") for r in range(self.nranks)]
        delay = _POLL_FIRST_S
        while not all(os.path.exists(n) for n in names):
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    def leave(self) -> None:
        """Give the rank up; the last rank out removes the directory."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        os.close(fd)
        if all(_gone(self._path(f"rank-{r}")) for r in range(self.nranks)):
            shutil.rmtree(self.root, ignore_errors=True)

    # -- enqueueing -----------------------------------------------------------------
    def parts(self, call: CollectiveCall) -> tuple[Callable[[], None], Callable[[], None]]:
        """The two halves of one call on the stream, its place in the order
        taken now: posting what the rank gives, then waiting for what it
        takes.  The calls of one group on one stream post everything before
        any waits, as NCCL's fused kernel for a group does (a send and a
        recv of one group never wait for each other)."""
        if call.kind == "send":
            assert call.peer is not None
            n = next(self._sends.setdefault(call.peer, itertools.count()))
            path = self._path(f"p{self.rank}-{call.peer}-{n}")
            return (lambda: self._post_send(call, path)), (lambda: self._sent(call, path))
        if call.kind == "recv":
            assert call.peer is not None
            n = next(self._recvs.setdefault(call.peer, itertools.count()))
            path = self._path(f"p{call.peer}-{self.rank}-{n}")
            return (lambda: None), (lambda: self._recv(call, path))
        k = next(self._seq)
        return (lambda: self._post(call, k)), (lambda: self._collective(call, k))

    # -- on the stream ----------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool], peers: Callable[[], list[int]], what: str) -> bool:
        """Spin (sleeping) until ``ready()``; False when aborted or the device
        faulted first.  ``peers()`` names the ranks still awaited."""
        delay = _POLL_FIRST_S
        next_check = time.monotonic() + _LIVENESS_S
        while True:
            if self.aborted or self.device.fault is not None:
                return False
            if ready():
                return True
            now = time.monotonic()
            if now >= next_check and self.error is None:
                next_check = now + _LIVENESS_S
                left = [p for p in peers() if _gone(self._path(f"rank-{p}"))]
                if left:
                    self._fail(
                        NCCL_REMOTE_ERROR,
                        f"rank {left[0]} left the communicator (its process ended, or it "
                        f"aborted or destroyed the communicator) while rank {self.rank} "
                        f"waited for it in {what}",
                    )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    def _fail(self, code: int, message: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = CommunicatorError(
                    message,
                    code=code,
                    name=NCCL_NAMES[code],
                    device=self.device.index,
                    rank=self.rank,
                )

    def _data(self, buf: Any, count: int, dtype: DType) -> Any:
        self.backend.check_buffer(buf)
        return buf.data[: count * dtype.itemsize].view(dtype)

    @staticmethod
    def _head(call: CollectiveCall) -> tuple[Any, ...]:
        """What every rank of a collective must agree on."""
        return (call.kind, call.elems, call.dtype.str, call.op, call.peer)

    def _post(self, call: CollectiveCall, k: int) -> None:
        sending = call.send is not None and (call.kind != "broadcast" or call.peer == self.rank)
        data = b""
        if sending:
            data = self._data(call.send, self._send_count(call), call.dtype).tobytes()
        _write(self._path(f"c{k}-{self.rank}"), (self._head(call), data))

    def _collective(self, call: CollectiveCall, k: int) -> None:
        head = self._head(call)
        names = [self._path(f"c{k}-{r}") for r in range(self.nranks)]
        what = f"{call.kind} #{k}"
        if not self._wait(
            lambda: all(os.path.exists(n) for n in names),
            lambda: [r for r, n in enumerate(names) if not os.path.exists(n)],
            what,
        ):
            return
        try:
            parts = [_read(n) for n in names]
        except OSError:
            if self.aborted:  # the last rank out removed the directory meanwhile
                return
            raise
        for r, (other, _) in enumerate(parts):
            if other != head:
                self._fail(
                    NCCL_INVALID_USAGE,
                    f"{what}: rank {self.rank} issued {_describe(head)}, rank {r} "
                    f"{_describe(other)}",
                )
                self._wait(lambda: False, lambda: [], what)  # as NCCL: no way out but abort
                return
        arrays = [np.frombuffer(d, call.dtype) for _, d in parts]
        if call.kind == "all_reduce":
            assert call.op is not None
            out = _reduce(arrays, call.op, call.dtype)
        elif call.kind == "broadcast":
            assert call.peer is not None
            out = arrays[call.peer]
        elif call.kind == "all_gather":
            out = np.concatenate(arrays)
        else:  # reduce_scatter
            assert call.op is not None
            full = _reduce(arrays, call.op, call.dtype)
            out = full[self.rank * call.elems : (self.rank + 1) * call.elems]
        assert call.recv is not None
        self._data(call.recv, out.size, call.dtype)[:] = out

    def _send_count(self, call: CollectiveCall) -> int:
        """How many elements of its send buffer a rank contributes."""
        return call.elems * self.nranks if call.kind == "reduce_scatter" else call.elems

    def _post_send(self, call: CollectiveCall, path: str) -> None:
        assert call.send is not None
        data = self._data(call.send, call.elems, call.dtype).tobytes()
        _write(path, (call.elems, call.dtype.str, data))

    def _sent(self, call: CollectiveCall, path: str) -> None:
        peer = call.peer
        assert peer is not None
        self._wait(lambda: not os.path.exists(path), lambda: [peer], f"send to {peer}")

    def _recv(self, call: CollectiveCall, path: str) -> None:
        peer = call.peer
        assert peer is not None and call.recv is not None
        if not self._wait(lambda: os.path.exists(path), lambda: [peer], f"recv from {peer}"):
            return
        try:
            count, dtype, data = _read(path)
            os.remove(path)  # the sender's wait ends
        except OSError:
            if self.aborted:
                return
            raise
        if (count, dtype) != (call.elems, call.dtype.str):
            self._fail(
                NCCL_INVALID_USAGE,
                f"recv from rank {call.peer}: {call.elems} {call.dtype} expected, "
                f"{count} {np.dtype(dtype)} sent",
            )
            return
        self._data(call.recv, count, call.dtype)[:] = np.frombuffer(data, call.dtype)


def _refused(comm: SimComm, message: str) -> CommunicatorError:
    return CommunicatorError(
        message,
        code=NCCL_INVALID_USAGE,
        name=NCCL_NAMES[NCCL_INVALID_USAGE],
        device=comm.device.index,
        rank=comm.rank,
    )


def _describe(head: tuple[Any, ...]) -> str:
    kind, count, dtype, op, peer = head
    extra = f" ({op})" if op else (f" (root {peer})" if kind == "broadcast" else "")
    return f"{kind} of {count} {np.dtype(dtype)}{extra}"


class SimComms:
    """What :class:`SimBackend` does for communicators (kept apart from it)."""

    def __init__(self, backend: SimBackend) -> None:
        self._backend = backend

    def init(
        self,
        devices: Sequence[SimDevice],
        ranks: Sequence[int],
        nranks: int,
        unique_id: bytes | None,
    ) -> list[SimComm]:
        root = _root_of(unique_id if unique_id is not None else new_unique_id())
        comms = [
            SimComm(self._backend, root, r, nranks, d) for d, r in zip(devices, ranks, strict=True)
        ]
        joined: list[SimComm] = []
        try:
            for c in comms:
                c.join()
                joined.append(c)
        except BaseException:
            for c in joined:
                c.leave()
            raise
        for c in comms:
            c.wait_joined()
        return comms

    def group(self, calls: Sequence[tuple[SimComm, CollectiveCall, SimStream]]) -> None:
        be = self._backend
        selves: dict[int, int] = {}
        for comm, call, _stream in calls:
            if comm.aborted or comm._fd is None:
                raise _refused(comm, f"{comm!r} was aborted or destroyed")
            if call.kind in ("send", "recv") and call.peer == comm.rank:
                selves[id(comm)] = selves.get(id(comm), 0) + (1 if call.kind == "send" else -1)
        for comm, _call, _stream in calls:
            if selves.get(id(comm)):
                # as NCCL: a rank's transfer to itself is matched inside its group
                raise _refused(
                    comm, f"rank {comm.rank}: a send to itself and its recv must be in one group"
                )
        # one item a stream: its calls post, then wait (see SimComm.parts)
        by_stream: dict[int, tuple[SimStream, list[str], list[tuple[Callable[[], None], ...]]]] = {}
        sends: list[tuple[int, tuple[Callable[[], None], ...]]] = []
        for comm, call, stream in calls:
            entry = by_stream.setdefault(id(stream), (stream, [], []))
            entry[1].append(call.kind)
            # a send's wait ends when its peer's recv took the data: the
            # waits of sends come last, so that the recvs of the group run
            parts = comm.parts(call)
            if call.kind == "send":
                sends.append((id(stream), parts))
            else:
                entry[2].append(parts)

        for key, send in sends:
            by_stream[key][2].append(send)
        comms = {id(c): c for c, _call, _stream in calls}.values()
        for stream, kinds, halves in by_stream.values():

            def item(halves: list[tuple[Callable[[], None], ...]] = halves) -> None:
                if any(c.aborted for c in comms):
                    return  # NCCL's aborted kernels return at once
                for post, _ in halves:
                    post()
                for _, finish in halves:
                    finish()

            be.enqueue_item(stream, "nccl " + " + ".join(kinds), item)

    @staticmethod
    def abort(comm: SimComm) -> None:
        comm.aborted = True
        with contextlib.suppress(Exception):
            comm.leave()

    @staticmethod
    def destroy(comm: SimComm) -> None:
        try:
            comm.leave()
        except Exception as exc:  # never raises
            warnings.warn(f"gpuflow: destroying {comm!r} failed: {exc!r}", stacklevel=2)
