"""The bootstrap: how the ranks of a communicator of several processes meet.

A :class:`RankInfo` says which rank a process is and the unique id its
ranks share: made by :func:`bootstrap_mpi` (MPI's ranks), by
:func:`spawn_ranks` (processes started here, one a rank), or by hand from
:func:`new_unique_id`.  :func:`gpuflow.open_communicator` takes it.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

from .._core import ensure_runtime, init_device_contexts, refuse_blocking
from .._errors import UsageError, UsageTypeError


class RankInfo(NamedTuple):
    """This process's place in a communicator of several processes.

    ``unique_id`` is the bytes one rank made with :func:`new_unique_id` and
    handed to every other (over MPI, a pipe, a file): the ranks meet by it.

    Parameters
    ----------
    rank
        This process's rank, from 0.
    nranks
        How many ranks, one a process.
    unique_id
        The id the ranks meet by.
    """

    rank: int
    nranks: int
    unique_id: bytes


def new_unique_id() -> bytes:
    """A new id for the ranks of one communicator to meet by.

    One rank makes it and hands it to the others (any channel: it is bytes).
    It belongs to the current backend: a ``sim`` id names a meeting place on
    this host, a ``cuda`` id is NCCL's ``ncclUniqueId``.

    Any thread.

    Returns
    -------
    bytes
    """
    return ensure_runtime().backend.comm_unique_id()


def bootstrap_mpi(comm: Any = None, *, root: int = 0) -> RankInfo:
    """This process's :class:`RankInfo` in an MPI job, the id broadcast from ``root``.

    ``comm`` is an mpi4py communicator (default ``MPI.COMM_WORLD``); every
    process of it must call this (it is an MPI broadcast).  Needs mpi4py and
    an MPI library (the ``mpich`` wheel has one, with ``mpiexec``).

    Any thread; it blocks in MPI's broadcast until every process of ``comm``
    calls it.

    Parameters
    ----------
    comm
        An mpi4py communicator (None: ``MPI.COMM_WORLD``).
    root
        The rank that makes the id.

    Returns
    -------
    RankInfo

    Raises
    ------
    gpuflow.UsageError
        mpi4py cannot be imported.
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise UsageError(f"bootstrap_mpi() needs mpi4py: pip install mpi4py mpich ({exc})") from exc
    c = MPI.COMM_WORLD if comm is None else comm
    uid = new_unique_id() if c.Get_rank() == root else None
    uid = c.bcast(uid, root=root)
    return RankInfo(c.Get_rank(), c.Get_size(), uid)


class _RankLines(io.TextIOBase):
    """A rank's ``sys.stdout`` or ``sys.stderr``: whole lines, each prefixed
    with the rank and written to the file descriptor in one ``write`` (the
    ranks share the parent's terminal or pipe, and a line written in two
    pieces is cut by another rank's)."""

    def __init__(self, rank: int, fd: int) -> None:
        super().__init__()
        self._prefix = f"[rank {rank}] "
        self._fd = fd
        self._partial = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
            if lines:
                out = "".join(f"{self._prefix}{line}\n" for line in lines)
                os.write(self._fd, out.encode(errors="replace"))
        return len(text)

    def flush(self) -> None:
        pass  # (a line goes out whole, once it ends: a flush must not cut it)

    def end(self) -> None:
        """The rank ends: a last line with no newline goes out."""
        with self._lock:
            if self._partial:
                os.write(self._fd, f"{self._prefix}{self._partial}\n".encode(errors="replace"))
                self._partial = ""


def _rank_main(
    fn: Callable[..., Any],
    info: RankInfo,
    backend: str,
    num_devices: int,
    conn: Any,
    args: tuple[Any, ...],
) -> None:
    outputs = []
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None:
            stream.flush()
            lines = _RankLines(info.rank, stream.fileno())
            setattr(sys, name, lines)
            outputs.append(lines)
    try:
        init_device_contexts(
            backend=backend, num_devices=num_devices, default_device=info.rank % num_devices
        )
        conn.send(("ok", fn(info, *args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        for lines in outputs:
            lines.end()


def spawn_ranks(
    fn: Callable[..., Any], nranks: int, *args: object, timeout: float | None = None
) -> list[Any]:
    """Run ``fn(info, *args)`` in ``nranks`` new processes, one a rank; their results.

    What a rank prints (``sys.stdout``, ``sys.stderr``) reaches this
    process's output a whole line at a time, each line prefixed with
    ``[rank N]``.  Each process is started fresh (multiprocessing's
    ``spawn``), initialises
    the backend of this process with device ``rank % device_count`` current,
    and gets its :class:`RankInfo` (a new id, made here).  ``fn`` and
    ``args`` must be picklable (a module-level function).  Blocks until every
    rank has ended: :class:`ChildProcessError` names the ranks that raised
    (with their tracebacks) or died, :class:`TimeoutError` the ranks still
    running after ``timeout`` seconds (they are killed); the error's
    ``results`` has the results of the ranks that ended well.  Not from inside an
    event loop (it blocks).

    Parameters
    ----------
    fn
        Called as ``fn(info, *args)`` in each rank's process.
    nranks
        How many processes, one a rank (a positive int).
    *args
        More arguments of ``fn``.
    timeout
        Seconds to wait for every rank (None: no limit).

    Returns
    -------
    list
        ``fn``'s results, in rank order.

    Raises
    ------
    ChildProcessError
        Ranks raised or died (``RanksFailedError``, which names them).
    TimeoutError
        Ranks were still running after ``timeout`` (they are killed).
    gpuflow.UsageError
        ``nranks`` is not a positive int, or it is called in a thread that
        runs an event loop.
    gpuflow.UsageTypeError
        ``fn`` is not callable.
    """
    refuse_blocking(
        "spawn_ranks()",
        "in async code, run it in a worker thread: "
        "`await anyio.to_thread.run_sync(gf.spawn_ranks, fn, nranks)`",
    )
    if not isinstance(nranks, int) or isinstance(nranks, bool) or nranks < 1:
        raise UsageError(f"spawn_ranks() needs a positive int of ranks, not {nranks!r}")
    if not callable(fn):
        raise UsageTypeError(f"spawn_ranks() expected a callable, got {type(fn).__name__}")
    rt = ensure_runtime()
    uid = rt.backend.comm_unique_id()
    mp = multiprocessing.get_context("spawn")
    procs = []
    for r in range(nranks):
        recv, send = mp.Pipe(duplex=False)
        p = mp.Process(
            target=_rank_main,
            args=(fn, RankInfo(r, nranks, uid), rt.backend.name, len(rt.devices), send, args),
            name=f"gpuflow-rank-{r}",
        )
        p.start()
        send.close()
        procs.append((p, recv))
    deadline = None if timeout is None else time.monotonic() + timeout
    results: list[Any] = []
    failures: list[str] = []
    late: list[int] = []
    for r, (p, recv) in enumerate(procs):
        got = None
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if recv.poll(remaining):
            try:
                got = recv.recv()
            except EOFError:
                got = None
        p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            late.append(r)
            p.kill()
            p.join()
        elif got is None:
            failures.append(f"rank {r} died (exit code {p.exitcode})")
        elif got[0] == "error":
            failures.append(f"rank {r} raised:\n{got[1]}")
        results.append(None if got is None or got[0] != "ok" else got[1])
    if late:
        raise TimeoutError(f"ranks {late} were still running after {timeout} s (killed)")
    if failures:
        raise RanksFailedError("\n".join(failures), results)
    return results


class RanksFailedError(ChildProcessError):
    """Ranks of :func:`spawn_ranks` raised or died; ``results`` holds every
    rank's result (None for those that failed)."""

    def __init__(self, message: str, results: list[Any]) -> None:
        super().__init__(message)
        self.results = results
