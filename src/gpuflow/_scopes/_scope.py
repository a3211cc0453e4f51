"""Structured lifetimes: stream leases and device groups.

Every run started inside a scope (in its task or in tasks started from it)
is tracked by the scope through a context variable.  Leaving the scope —
normally, by an exception or by cancellation — waits, shielded, until the
GPU has finished every tracked run, and only then gives back what the scope
held.  Nothing enqueued outlives its scope.  Except for Ctrl-C: a scope
left by the user's interrupt (:func:`._loops.interrupted`) lets it through
at once; what the GPU still uses stays alive until it is done, as for a
cancelled await, and the process's exit waits for it (``_runtime``).
"""

from __future__ import annotations

import atexit
import inspect
import sys
import threading
from collections.abc import Awaitable, Callable, Generator
from types import FrameType, TracebackType
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from .._core import (
    ENCLOSING,
    DeviceOperation,
    Handoff,
    LatencyClass,
    Run,
    Runtime,
    Stream,
    cancel_points,
    class_here,
    current_device,
    current_device_var,
    current_runtime,
    ended_by,
    ensure_runtime,
    enter_class,
    enter_scope,
    interrupted,
    leave_class,
    leave_scope,
    resolve,
    start_run,
)
from .._errors import UsageError, UsageTypeError

T = TypeVar("T")

_PRUNE_AT = 64


class Tracked:
    """The runs started inside a scope that may still be running, and the
    runs it started with ``start_run`` whose failure its exit may owe."""

    __slots__ = ("_runs", "_started")

    def __init__(self) -> None:
        self._runs: list[Run] = []
        self._started: list[StartedRun[Any]] | None = None  # (made at the first)

    def track(self, run: Run) -> None:
        runs = self._runs
        if len(runs) >= _PRUNE_AT:
            runs[:] = [s for s in runs if not s.done]
        runs.append(run)

    def start(self, op: DeviceOperation[T], run: Run, out: object) -> StartedRun[T]:
        """The handle of a run the scope started: tracked (whichever task
        started it) and kept for :meth:`raise_unawaited`."""
        self.track(run)
        handle = StartedRun(op, run, out)
        started = self._started
        if started is None:
            started = self._started = []
        elif len(started) >= _PRUNE_AT:  # (those that can no longer fail unawaited go)
            started[:] = [
                s for s in started if not s._awaited and not (s.done() and s.failed() is None)
            ]
        started.append(handle)
        return handle

    def raise_unawaited(self, exc: BaseException | None) -> None:
        """At the scope's exit, after its runs are done: raise the failures
        of runs it started that nobody awaited, one as it is, several in an
        exception group.  Where the scope is left by an exception ``exc``,
        the group holds it too, as a task group's does when its children
        fail: a cancel scope outside takes its cancellation out of the
        group, and the failures go on."""
        started, self._started = self._started, None
        if started is None:
            return
        errors = [e for s in started if not s._awaited and (e := s.failed()) is not None]
        if not errors:
            return
        if exc is None and len(errors) == 1:
            raise errors[0]
        raise BaseExceptionGroup(
            "runs started in the scope failed and were never awaited",
            errors if exc is None else [exc, *errors],
        )

    async def drain(self) -> None:
        """Wait until every tracked run is done: shielded from cancellation,
        except for runs with collectives, which may wait for a peer for ever:
        a cancellation of the wait for one aborts its communicators (their
        collectives then return), and the wait goes on shielded."""
        try:
            for run in [s for s in self._runs if s._comms is not None]:
                if not run.done:
                    try:
                        await run.wait()
                    except Exception:
                        pass  # the run's own awaiter reports its failure
        except BaseException as exc:
            for run in self._runs:
                if run._comms is not None and not run.done:
                    for comm in run._comms:
                        comm.abort(f"a scope's wait for its collectives {ended_by(exc)}")
            await self._drain_shielded()
            raise
        await self._drain_shielded()

    async def _drain_shielded(self) -> None:
        with anyio.CancelScope(shield=True):
            while self._runs:
                run = self._runs.pop()
                if not run.done:
                    try:
                        await run.wait()
                    except Exception:
                        pass

    def pending(self) -> int:
        return sum(not s.done for s in self._runs)


class StartedRun(Generic[T]):
    """A run a scope started at once, awaited later (see
    :meth:`StreamLease.start_run` and :meth:`DeviceGroup.start_run`).

    Its work is enqueued when it is made; the task goes on meanwhile (host
    work, other runs).  ``await started`` gives the operation's output once
    the GPU is done with it, and may be repeated, from any task of the
    scope's loop: later awaits give the same output.  A cancelled await
    raises the loop's own cancellation at once, as an await of an operation
    does; the run goes on, keeps what it uses, and the scope's exit waits
    for it.  A run that failed raises its error at every await; one that
    failed and was never awaited raises at the scope's exit, so that no
    error is lost.

    Made by ``start_run``; not constructed directly.
    """

    __slots__ = ("_awaited", "_out", "_resolved", "_run", "op")

    def __init__(self, op: DeviceOperation[T], run: Run, out: Any) -> None:
        self.op = op
        self._run = run
        self._out = out
        self._resolved = False
        #: whether a task's await ended with the run's outcome (then that
        #: task was given any failure)
        self._awaited = False

    def done(self) -> bool:
        """Whether the GPU has finished the run (or it failed).  Any thread;
        reads the run's completion word, no driver call.

        Returns
        -------
        bool
        """
        return self._run.reached()

    def failed(self) -> BaseException | None:
        """The run's error, once it is known to have failed; else None.

        Returns
        -------
        BaseException or None
        """
        return self._run.error

    def __await__(self) -> Generator[Any, None, T]:
        watcher = cancel_points.watcher  # (a test's; None otherwise)
        if watcher is not None:
            yield from watcher(cancel_points.IN_FLIGHT, self.op).__await__()
        try:
            yield from self._run.wait().__await__()  # (raises the run's error)
        except BaseException as exc:
            # given the run's failure; a cancelled await was given nothing,
            # and a failure after it is still the scope's to raise
            self._awaited = self._awaited or exc is self._run.error
            raise
        self._awaited = True
        if not self._resolved:  # (host values made concrete once)
            self._out = self._out if self._out is None else resolve(self._out)
            self._resolved = True
        out: T = self._out
        return out

    def __repr__(self) -> str:
        run = self._run
        if run.error is not None:
            state = f"failed: {run.error!r}"
        elif run.reached():
            state = "done"
        else:
            state = f"in flight on device {run.device}"
        return f"<gpuflow.StartedRun of {self.op!r}, {state}>"


def _operation(op: object) -> DeviceOperation[object]:
    if not isinstance(op, DeviceOperation):
        raise UsageTypeError(f"start_run() takes a gpuflow operation, got {type(op).__name__}")
    return op


class _LeasePool:
    """Which pool streams of one device are leased, and by which leases;
    fair, cross-thread waiting."""

    def __init__(self, streams: list[Stream], freed: Callable[[int], None]) -> None:
        self.free = list(streams)
        self.waiters = Handoff()
        self.lock = threading.Lock()
        #: streams taken: by the leases inside, and handed to waiters not yet resumed
        self.held = 0
        #: the leases inside (what the quiescence check and the exit name)
        self.holders: set[StreamLease] = set()
        #: told when a stream goes back to the pool (awaits may wait for one)
        self._freed = freed

    def release(self, stream: Stream, holder: StreamLease | None = None) -> None:
        with self.lock:
            self.holders.discard(holder)  # (None: a stream handed on)
            self.held -= 1
            ticket = self.waiters.hand(stream)
            if ticket is None:
                stream.leased = False
                self.free.append(stream)
            else:
                self.held += 1
        if ticket is None:
            self._freed(stream.device)
        else:
            ticket.wake()

    def _take(self) -> Stream:
        """The free stream the GPU is least busy with: one with nothing
        pending where there is one (a lease must not start behind work it
        does not depend on, such as what a cancelled await left running).
        Under the lock."""
        best = min(range(len(self.free)), key=lambda i: self.free[i].load())
        stream = self.free.pop(best)
        stream.leased = True
        return stream

    async def acquire(self, holder: StreamLease) -> Stream:
        with self.lock:
            if self.free and not self.waiters.waiting():
                self.held += 1
                self.holders.add(holder)
                return self._take()
            ticket = self.waiters.join()
        try:
            await ticket.event.wait()
        except BaseException:
            with self.lock:
                handed, _ = self.waiters.leave(ticket)
            if handed:  # handed over just as we were cancelled: pass it on
                self.release(ticket.value)
            raise
        with self.lock:
            self.waiters.leave(ticket)
            self.holders.add(holder)
        stream: Stream = ticket.value
        return stream


_lease_pools_lock = threading.Lock()


def _lease_pool(rt: Runtime, device: int, priority: int, sms: str | None) -> _LeasePool:
    # kept on the runtime: a replaced runtime takes its pools (and streams) along
    key = (device, rt.generation(device), priority, sms)
    with _lease_pools_lock:
        pool: _LeasePool | None = rt.lease_pools.get(key)
        if pool is None:
            pool = rt.lease_pools[key] = _LeasePool(
                rt.pool(device, priority, sms), rt.completer.stream_freed
            )
        return pool


def held_leases() -> list[StreamLease]:
    """The stream leases of the current runtime inside their ``async with``
    now (each says where it was entered).  Any thread."""
    rt = current_runtime()
    if rt is None:
        return []
    with _lease_pools_lock:
        pools = list(rt.lease_pools.values())
    held: list[StreamLease] = []
    for pool in pools:
        with pool.lock:
            held += pool.holders
    return held


@atexit.register
def _say_held_at_exit() -> None:
    # a lease entered by hand and never left holds its stream until the
    # process ends: say which, as the quiescence check does
    held = held_leases()
    if held:
        print(
            f"gpuflow: {len(held)} stream lease(s) never left (entered, never exited): "
            + "; ".join(map(repr, held)),
            file=sys.stderr,
            flush=True,
        )


def leases_held() -> int:
    """How many stream leases of the current runtime are held now, over every device.

    Any thread.

    Returns
    -------
    int
    """
    rt = current_runtime()
    if rt is None:
        return 0
    with _lease_pools_lock:
        return sum(p.held for p in rt.lease_pools.values())


class StreamLease:
    """One pool stream held by one scope (see :func:`open_stream_lease`).

    Made by :func:`open_stream_lease`; not constructed directly.
    """

    def __init__(self, device: int, cls: LatencyClass) -> None:
        self.device = device
        #: the priority level of its stream (0: the default)
        self.priority = cls.priority
        #: the name of the reserved SMs its stream runs on, or None
        self.sms = cls.sms
        self._class = cls
        self._stream: Stream | None = None
        self._tracked = Tracked()
        self._pool: _LeasePool | None = None
        self._token: Any = None
        self._entered_class: Any = None
        #: None before it is entered; then where (the task, the line), until it ends
        self._where: str | None = None
        self._ended = False

    @property
    def stream(self) -> Stream:
        """The leased stream; operations awaited in the scope run on it, in order."""
        if self._stream is None:
            raise UsageError("the stream lease is not held (use it inside `async with`)")
        return self._stream

    @property
    def _pinned(self) -> Stream | None:
        return self._stream

    def _track(self, run: Run) -> None:
        self._tracked.track(run)

    def start_run(self, op: DeviceOperation[T]) -> StartedRun[T]:
        """Enqueue ``op`` on the leased stream now, and return at once;
        ``await`` the result later (in order with the lease's other runs).

        From a task of the loop that entered the scope, while it is held.
        The scope's exit waits for the run, awaited or not, and raises its
        failure if no task awaited it.

        Parameters
        ----------
        op
            The operation.

        Returns
        -------
        StartedRun
            Awaiting it gives the output once the GPU is done.

        Raises
        ------
        gpuflow.UsageError
            The lease is not held, or a check of the operation failed (each
            names what), before anything is enqueued.
        """
        if self._stream is None:
            raise UsageError("start_run() outside the stream lease's `async with`")
        run, out = start_run(_operation(op), self._stream, self.device, "start_run")
        return self._tracked.start(op, run, out)

    async def __aenter__(self) -> StreamLease:
        if self._where is not None or self._ended:
            raise UsageError(
                f"{self!r} was entered already: a stream lease is entered once "
                "(gf.open_stream_lease() makes another)"
            )
        where = _caller(inspect.currentframe())
        watcher = cancel_points.watcher
        if watcher is not None:
            await watcher(cancel_points.ENTER_LEASE)
        rt = ensure_runtime()
        rt.check_device(self.device)
        cls = self._class
        self._entered_class = enter_class(cls, rt, [self.device])
        try:
            self._pool = _lease_pool(rt, self.device, cls.priority, cls.sms)
            self._stream = await self._pool.acquire(self)
        except BaseException:
            leave_class(self._entered_class)
            raise
        self._where = where
        self._token = enter_scope(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        leave_scope(self._token)
        leave_class(self._entered_class)
        try:
            if not interrupted(exc):
                await self._tracked.drain()
        finally:
            stream, self._stream = self._stream, None
            self._ended = True
            assert self._pool is not None and stream is not None
            self._pool.release(stream, self)
        if not interrupted(exc):
            self._tracked.raise_unawaited(exc)
        watcher = cancel_points.watcher
        if watcher is not None and exc_type is None:
            # where a cancellation that came while the scope was left lands
            # first: right after it, with nothing of the scope left to release
            await watcher(cancel_points.LEAVE_LEASE)

    def __repr__(self) -> str:
        level = f", priority {self.priority}" if self.priority else ""
        level += f", SMs {self.sms!r}" if self.sms is not None else ""
        if self._ended:
            state = "ended"
        elif self._stream is not None:
            state = f"held by {self._where}"
        else:
            state = "not entered"
        return f"<gpuflow.StreamLease of device {self.device}{level}, {state}>"


def _caller(frame: FrameType | None) -> str:
    """Where a scope is entered: the task (its name) and the caller's line."""
    caller = frame.f_back if frame is not None else None
    line = "" if caller is None else (
        f" at {caller.f_code.co_filename}:{caller.f_lineno}"
    )  # fmt: skip
    try:
        task = f"task {anyio.get_current_task().name!r}"
    except Exception:  # (no task: another thread's loop, say)
        task = "a task"
    return task + line


def open_stream_lease(
    device: int | None = None,
    *,
    priority: int = ENCLOSING,
    sms: str | None = ENCLOSING,
    busy_poll_us: float | None = ENCLOSING,
) -> StreamLease:
    """Lease one stream of ``device``'s pool (default: the current device) for a scope.

    ``async with gf.open_stream_lease() as lease:`` — operations awaited in
    the scope, in this task and in tasks it starts, run on ``lease.stream``
    in order (unless given an explicit policy).  Leaving the scope, however
    it is left, waits (shielded) until the GPU has finished what the scope
    enqueued, then returns the stream; left by Ctrl-C, it lets the
    interrupt through at once instead (what the GPU still uses stays alive
    until it is done).  Two leases never hold the same stream; when every
    stream is leased, a new lease waits for one (fairly, FIFO).

    A lease is a latency class (:func:`gpuflow.latency_class`) for the work
    inside it: its stream is one of the pool of the class's level (priority
    and reserved SMs; each level's pool has ``streams_per_device`` streams
    for leases, as the default level's has), and its awaits poll with the
    class's budget.  Made inside a class, it takes that class; what it is
    given (``priority``, ``sms``, ``busy_poll_us``) replaces the class's.

    Entering is a cancellation point; leaving waits shielded from
    cancellation.  A lease is entered once: entering it again, also after
    it ended, is a :class:`gpuflow.UsageError`.

    Parameters
    ----------
    device
        The device's ordinal (None: the current device).
    priority
        The stream's priority level, from 0 (the default) to the device's
        most urgent (higher is more urgent); left out, the enclosing
        class's.
    sms
        The name of SMs reserved at :func:`gpuflow.init_device_contexts`:
        the stream runs its kernels on those alone (None: on the others);
        left out, the enclosing class's.
    busy_poll_us
        The busy-poll budget of the awaits inside it, in microseconds (None:
        the runtime's); left out, the enclosing class's.

    Returns
    -------
    StreamLease
        An async context manager; ``lease.stream`` is the stream inside it.

    Raises
    ------
    gpuflow.UsageError
        ``device`` is not one of the runtime's devices, ``priority`` is
        out of its range, no SMs of that name are reserved, or
        ``busy_poll_us`` is negative (on entry); the lease was entered
        before.
    gpuflow.UsageTypeError
        ``priority`` is not an int, or ``sms`` not a str (on entry).
    """
    cls = class_here(priority, sms, busy_poll_us)
    return StreamLease(current_device() if device is None else device, cls)


class DeviceGroup:
    """A task group for multi-device fan-out (see :func:`open_device_group`).

    Made by :func:`open_device_group`; not constructed directly.
    """

    def __init__(self, devices: list[int], cls: LatencyClass) -> None:
        self.devices = devices
        self._class = cls
        self._tg: anyio.abc.TaskGroup | None = None
        self._tracked = Tracked()
        self._token: Any = None
        self._entered_class: Any = None
        self._next = 0

    #: (no stream: its children's runs go where the policy puts them)
    _pinned = None

    def _track(self, run: Run) -> None:
        self._tracked.track(run)

    def start_soon(
        self,
        fn: Callable[..., Awaitable[Any]],
        *args: object,
        device: int | None = None,
        name: object = None,
    ) -> None:
        """Start ``fn(*args)`` as a child task with ``device`` current.

        ``device=None`` takes the group's devices in turn.  A failure in one
        child cancels the others, as in any AnyIO task group.

        Parameters
        ----------
        fn
            An async function.
        *args
            Its arguments.
        device
            The device current in the child (None: the group's devices in turn).
        name
            The task's name, as AnyIO's ``start_soon`` takes it.

        Raises
        ------
        gpuflow.UsageError
            Outside the group's ``async with``, or a device not in the group.
        """
        device = self._device(device, "start_soon()")
        assert self._tg is not None  # (checked)

        async def child() -> None:
            current_device_var.set(device)
            await fn(*args)

        self._tg.start_soon(child, name=name or getattr(fn, "__qualname__", None))

    def _device(self, device: int | None, what: str) -> int:
        """``device``, or the group's next in turn where None; checked."""
        if self._tg is None:
            raise UsageError(f"{what} outside the device group's `async with`")
        if device is None:
            device = self.devices[self._next % len(self.devices)]
            self._next += 1
        elif device not in self.devices:
            raise UsageError(f"device {device} is not in this group (devices {self.devices})")
        return device

    def start_run(self, op: DeviceOperation[T], *, device: int | None = None) -> StartedRun[T]:
        """Enqueue ``op`` on ``device`` now, and return at once; ``await``
        the result later.

        The run goes where an await would put it (the innermost stream
        lease of the device held by the calling task, else the default
        policy's choice), except that it never waits for a stream: at the
        pool's bound it takes the least-loaded one.  From a task of the
        loop that entered the group, while it is open.  The group's exit
        waits for the run, awaited or not, and raises its failure if no task
        awaited it.

        Parameters
        ----------
        op
            The operation.
        device
            Its device (None: the group's devices in turn).

        Returns
        -------
        StartedRun
            Awaiting it gives the output once the GPU is done.

        Raises
        ------
        gpuflow.UsageError
            Outside the group's ``async with``, a device not in the group, or
            a check of the operation failed (each names what), before
            anything is enqueued.
        """
        device = self._device(device, "start_run()")
        run, out = start_run(_operation(op), None, device, "start_run")
        return self._tracked.start(op, run, out)

    async def __aenter__(self) -> DeviceGroup:
        watcher = cancel_points.watcher
        if watcher is not None:
            await watcher(cancel_points.ENTER_GROUP)
        self._entered_class = enter_class(self._class, ensure_runtime(), self.devices)
        self._token = enter_scope(self)
        self._tg = anyio.create_task_group()
        try:
            await self._tg.__aenter__()
        except BaseException:
            self._tg = None
            leave_scope(self._token)
            leave_class(self._entered_class)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        raised = exc
        try:
            suppressed = await self._tg.__aexit__(exc_type, exc, tb)
        except BaseException as group_exc:
            raised = group_exc
            raise
        finally:
            self._tg = None
            leave_scope(self._token)
            leave_class(self._entered_class)
            if not interrupted(raised):
                await self._tracked.drain()
                self._tracked.raise_unawaited(raised)
        watcher = cancel_points.watcher
        if watcher is not None and exc_type is None:
            await watcher(cancel_points.LEAVE_GROUP)  # (as a stream lease's)
        return suppressed


def open_device_group(
    devices: list[int] | None = None,
    *,
    priority: int = ENCLOSING,
    sms: str | None = ENCLOSING,
    busy_poll_us: float | None = ENCLOSING,
) -> DeviceGroup:
    """An AnyIO task group whose children each run with one device current.

    ``async with gf.open_device_group() as group: group.start_soon(fn, device=d)``.
    ``devices=None`` means every initialised device.  The group exits only
    after every child has finished and the GPU work they enqueued on every
    device is done (a shielded wait, also after a failure or cancellation;
    not after Ctrl-C, which reaches the program at once while what the GPU
    still uses stays alive until it is done).

    A group is a latency class (:func:`gpuflow.latency_class`) for the work
    inside it, its children's included: made inside a class, it takes that
    class; what it is given (``priority``, ``sms``, ``busy_poll_us``)
    replaces the class's, and a child may enter a class of its own.

    Parameters
    ----------
    devices
        The devices' ordinals (None: every device of the runtime).
    priority
        The priority level of the streams its runs take (left out: the
        enclosing class's).
    sms
        The name of the reserved SMs its runs use (left out: the enclosing
        class's).
    busy_poll_us
        The busy-poll budget of its awaits, in microseconds (left out: the
        enclosing class's).

    Returns
    -------
    DeviceGroup
        An async context manager; ``group.start_soon(fn, *args, device=d)``
        starts a child with ``d`` current.

    Raises
    ------
    gpuflow.UsageError
        A device that is not one of the runtime's, or an empty list; on
        entry, a priority out of a device's range, SMs no device reserved
        under that name, or a negative ``busy_poll_us``.
    gpuflow.UsageTypeError
        ``priority`` is not an int, or ``sms`` not a str (on entry).
    """
    rt = ensure_runtime()
    devs = list(rt.devices) if devices is None else [rt.check_device(d) for d in devices]
    if not devs:
        raise UsageError("open_device_group() needs at least one device")
    return DeviceGroup(devs, class_here(priority, sms, busy_poll_us))
