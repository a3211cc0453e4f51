"""The completion bridge: the GPU wakes the loop; signals shared by a turn.

An awaited run is signalled by a pipe whose write end the GPU closes and
whose read end the loop watches: the loop's own thread completes the run and
wakes the task, with no post from another thread.  The first run a loop
submits in one turn enqueues its signal at once and schedules a flush for
the end of the turn; the runs submitted after it in that turn are signalled
by the flush, one signal per stream.  Whatever ends a turn early (a
cancellation, a loop that closes before its flush runs, a loop that never
runs again), no run is left without a signal, and no file descriptor is
left open.

These tests drive the dispatcher and the loop adapters themselves, so they
import the private modules that hold them (``_bridge``, ``_runtime``,
``_loops``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import anyio
import kernels as K
import numpy as np
import pytest

import gpuflow as gf
from gpuflow._bridge import Submission
from gpuflow._runtime import get_runtime

F32 = np.float32


def count_signals(monkeypatch: pytest.MonkeyPatch, kind: str = "") -> list[Any]:
    """Record every signal the backend is asked to enqueue (the stream it goes
    on), of both kinds, or of one (``"fd"`` or ``"counted"``)."""
    backend = get_runtime().backend
    calls: list[Any] = []
    enqueue, enqueue_close = backend.enqueue_signal, backend.enqueue_close

    def counted(raw: Any) -> None:
        calls.append(raw)
        enqueue(raw)

    def closing(raw: Any, fd: int) -> bool:
        calls.append(raw)
        return enqueue_close(raw, fd)

    if kind != "fd":
        monkeypatch.setattr(backend, "enqueue_signal", counted)
    if kind != "counted":
        monkeypatch.setattr(backend, "enqueue_close", closing)
    return calls


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_until(cond: Any, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


needs_proc = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="counts file descriptors in /proc"
)


@pytest.mark.anyio
async def test_the_gpu_wakes_the_loop_with_no_post_from_another_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuflow import _bridge  # the post a dispatcher thread would make

    x = await gf.zeros(64, F32)
    fd_signals = count_signals(monkeypatch, "fd")
    counted = count_signals(monkeypatch, "counted")
    posts: list[Any] = []
    real_post = _bridge.post

    def recorded(*args: Any) -> None:
        posts.append(args)
        real_post(*args)

    monkeypatch.setattr(_bridge, "post", recorded)
    seen_on: list[int] = []
    finish = Submission._finish

    def noted(sub: Submission, err: BaseException | None) -> Any:
        seen_on.append(threading.get_ident())
        return finish(sub, err)

    monkeypatch.setattr(Submission, "_finish", noted)
    for i in range(20):
        await K.slow_fill(x, float(i), 0.001)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 19.0, F32))
    assert len(fd_signals) >= 20 and counted == [] and posts == []
    assert set(seen_on) == {threading.get_ident()}  # completed in the loop's own thread


@pytest.mark.anyio
async def test_a_signal_completes_only_the_runs_submitted_before_it() -> None:
    # on one stream: a short run, then (its signal already enqueued) a long
    # one; the short run's signal must not complete the long one
    one = gf.SingleStream()
    x = await gf.zeros(64, F32)
    y = await gf.zeros(64, F32)
    backend = get_runtime().backend
    idle_after: dict[str, bool] = {}

    async def run(name: str, op: gf.DeviceOperation[Any]) -> None:
        await op.run(one)
        idle_after[name] = backend.query(one.stream.raw)  # its work is the stream's last

    with anyio.fail_after(5):  # the long run waits for a flush: one must come
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "short", K.slow_fill(x, 1.0, 0.02))
            await anyio.sleep(0.005)  # submitted by now, and still running
            await run("long", K.slow_fill(y, 2.0, 0.2))
    assert idle_after == {"short": False, "long": True}
    np.testing.assert_array_equal(await gf.to_host(y), np.full(64, 2.0, F32))


@needs_proc
@pytest.mark.anyio
async def test_awaits_leave_no_file_descriptor_open() -> None:
    counters = [await gf.zeros(1, np.int32) for _ in range(32)]
    before = open_fds()  # the loop's reader is open by now

    async def worker(c: gf.DeviceArray) -> None:
        for _ in range(10):
            await K.module().count(gf.LaunchConfig(1, 1), c)

    async with anyio.create_task_group() as tg:
        for c in counters:
            tg.start_soon(worker, c)
    for c in counters:
        assert int((await gf.to_host(c))[0]) == 10
    wait_until(lambda: open_fds() <= before, f"{open_fds() - before} descriptors left open")


@pytest.mark.anyio
async def test_past_the_pipe_limit_runs_signal_through_the_dispatcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuflow import _bridge  # the limit itself

    monkeypatch.setattr(_bridge, "MAX_FD_SIGNALS", 1)
    counted = count_signals(monkeypatch, "counted")
    arrays = [await gf.zeros(16, F32) for _ in range(16)]
    pool = gf.StreamPoolRoundRobin()

    async def worker(a: gf.DeviceArray) -> None:
        for r in range(4):
            await K.slow_fill(a, float(r + 1), 0.002).run(pool)

    async with anyio.create_task_group() as tg:
        for a in arrays:
            tg.start_soon(worker, a)
    for a in arrays:
        np.testing.assert_array_equal(await gf.to_host(a), np.full(16, 4.0, F32))
    assert counted, "every run took a pipe although the limit is one in flight"


@pytest.mark.anyio
async def test_tasks_woken_together_share_signals(monkeypatch: pytest.MonkeyPatch) -> None:
    tasks, rounds = 32, 4
    counters = [await gf.zeros(1, np.int32) for _ in range(tasks)]
    signals = count_signals(monkeypatch)

    # the pool's four streams, whatever the default policy would add under load
    pool = gf.StreamPoolRoundRobin()

    async def worker(c: gf.DeviceArray) -> None:
        for _ in range(rounds):
            await K.module().count(gf.LaunchConfig(1, 1), c).run(pool)

    async with anyio.create_task_group() as tg:
        for c in counters:
            tg.start_soon(worker, c)
    for c in counters:
        assert int((await gf.to_host(c))[0]) == rounds
    awaits = tasks * rounds
    # the 32 tasks start in one turn: one signal at once, one per stream at the flush
    assert len(signals) <= awaits - (tasks - 1 - 4), (len(signals), awaits)


@pytest.mark.anyio
async def test_a_run_cancelled_in_the_turn_it_was_submitted_still_completes() -> None:
    x = await gf.zeros(64, F32)
    y = await gf.zeros(64, F32)
    scopes: list[anyio.CancelScope] = []
    ready = anyio.Event()

    async def victim() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            ready.set()
            await K.slow_fill(y, 2.0, 0.05)
        assert scope.cancelled_caught

    async def canceller() -> None:  # often in the same turn as the victim's submit
        await ready.wait()
        scopes[0].cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(_await, K.slow_fill(x, 1.0, 0.05))
        tg.start_soon(victim)
        tg.start_soon(canceller)
    # the cancelled run's work still ran, and its signal came: nothing is left pending
    np.testing.assert_array_equal(await gf.to_host(y), np.full(64, 2.0, F32))
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 1.0, F32))


async def _await(op: gf.DeviceOperation[Any]) -> None:
    await op


class _DroppingLoop:
    """A loop (as gpuflow's loop adapters present one) that ends before
    running what was scheduled on it.  By default it cannot watch file
    descriptors (so its runs signal the dispatcher thread); with
    ``watches=True`` it accepts a reader and never calls it."""

    def __init__(self, *, watches: bool = False, ended: bool = False) -> None:
        self.dropped: list[Any] = []
        self.watched: list[int] = []
        self._watches = watches
        self.ended = ended

    def watch(self, fd: int, on_ready: Any) -> None:
        if not self._watches:
            raise NotImplementedError
        self.watched.append(fd)

    def finished(self) -> bool:
        return self.ended

    @property
    def target(self) -> Any:
        return self

    def call_soon(self, fn: Any) -> None:
        self.dropped.append(fn)

    post = call_soon

    def parker(self) -> Any:
        raise AssertionError("nothing parks on this loop")


def _wait_done(sub: Submission, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not sub.done:
        assert time.monotonic() < deadline, "the run never completed"
        time.sleep(0.001)


def test_runs_left_by_a_loop_that_never_flushed_are_signalled() -> None:
    rt = get_runtime()
    dispatcher = rt.dispatcher
    stream = gf.new_stream()
    x = gf.zeros(16, F32).sync()
    dead = _DroppingLoop()
    first, second, third = Submission(0), Submission(0), Submission(0)
    K.slow_fill(x, 1.0, 0.01).enqueue_on(stream)
    dispatcher.submit(stream.raw, first, dead)  # signals at once, schedules nothing
    assert dead.dropped == []
    K.slow_fill(x, 2.0, 0.01).enqueue_on(stream)
    dispatcher.submit(stream.raw, second, dead)  # left for a flush, which it schedules
    assert len(dead.dropped) == 1
    _wait_done(first)
    stream.synchronize()
    time.sleep(0.05)
    assert not second.done  # no signal covers it yet
    # the next loop of this thread signals what the dead one left, then its own run
    live = _DroppingLoop()
    dispatcher.submit(stream.raw, third, live)
    _wait_done(second)
    _wait_done(third)
    assert second.error is None and third.error is None
    assert live.dropped == []  # a lone run in its turn schedules no flush
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(16, 2.0, F32))


def test_an_explicit_flush_signals_a_deferred_run() -> None:
    dispatcher = get_runtime().dispatcher
    stream = gf.new_stream()
    loop = _DroppingLoop()
    a, b = Submission(0), Submission(0)
    dispatcher.submit(stream.raw, a, loop)
    dispatcher.submit(stream.raw, b, loop)
    _wait_done(a)
    time.sleep(0.05)
    assert not b.done
    dispatcher.flush()  # what a cancelled await does before it raises
    _wait_done(b)


class _Sentinel:
    """Something only a run's submission keeps alive."""


def keep_until_done(sentinel: _Sentinel) -> gf.DeviceOperation[None]:
    def enqueue(ctx: Any) -> gf.DeviceOperation[None]:
        ctx.keep(sentinel)
        return gf.value(None)

    return gf.with_context(enqueue)


@needs_proc
def test_a_loop_that_never_runs_again_has_its_runs_completed_all_the_same() -> None:
    # a loop that stopped (not closed) with a cancelled run in flight: the
    # watchdog completes what the GPU finished, a tick later than the loop would
    dispatcher = get_runtime().dispatcher
    stream = gf.new_stream()
    x = gf.zeros(16, F32).sync()
    stopped = _DroppingLoop(watches=True)
    before = open_fds()
    sentinel = _Sentinel()
    alive = weakref.ref(sentinel)
    sub = Submission(0)
    sub.keep.append(sentinel)
    del sentinel
    K.slow_fill(x, 3.0, 0.05).enqueue_on(stream)
    dispatcher.submit(stream.raw, sub, stopped)
    assert len(stopped.watched) == 1  # the loop was given its reader
    assert alive() is not None and not sub.done
    _wait_done(sub)
    assert sub.error is None and alive() is None
    # its read end waits for the loop (the fd number is the loop's to reuse);
    # once the loop has ended, the watchdog closes it and the reader too
    stopped.ended = True
    wait_until(lambda: open_fds() <= before, "the ended loop's descriptors stayed open")
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(16, 3.0, F32))


def test_a_stream_with_only_a_signal_left_in_flight_counts_as_idle() -> None:
    # a stopped loop's run completed by the watchdog leaves its signal's read
    # end (and so the stream's lane) until the loop runs again: the default
    # policy must still see the stream as idle, not as stalled
    dispatcher = get_runtime().dispatcher
    pool = gf.lowlevel.pool_streams()
    x = gf.zeros(16, F32).sync()
    sub = Submission(0)
    stopped = _DroppingLoop(watches=True)
    dispatcher.submit(pool[0].raw, sub, stopped)
    _wait_done(sub)
    assert pool[0].raw in dispatcher.lanes  # the signal's read end waits for its loop
    for s in pool[1:]:
        K.slow_fill(x, 1.0, 0.5).enqueue_on(s)
    policy = gf.StreamPoolLeastLoaded()
    time.sleep(policy.stall_s * 3)  # every busy stream stalls
    assert {policy.next_stream(0) for _ in pool} == {pool[0]}
    assert gf.lowlevel.pool_streams() == pool  # nothing stalled needed a new stream
    stopped.ended = True  # the watchdog closes what it left


def test_a_stream_dropped_with_work_in_flight_keeps_what_the_work_uses() -> None:
    # the stream is destroyed (its finalizer) while the dispatcher's watchdog
    # may be querying it
    x = gf.zeros(64, F32).sync()
    rounds = 10
    for i in range(rounds):
        sentinel = _Sentinel()
        alive = weakref.ref(sentinel)
        # the stream goes with the last reference to it, right after the enqueue
        K.slow_fill(x, float(i), 0.1).then(lambda _x, s=sentinel: keep_until_done(s)).enqueue_on(
            gf.new_stream()
        )
        del sentinel
        time.sleep(0.03)  # a watchdog round or more; the work has 70 ms to go
        assert alive() is not None, f"round {i}: released while its work was running"
    deadline = time.monotonic() + 5
    while get_runtime().dispatcher.pending:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(64, rounds - 1, F32))


def test_a_query_failure_that_is_no_fault_fails_no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = get_runtime()
    stream = gf.new_stream()
    x = gf.zeros(16, F32).sync()
    sentinel = _Sentinel()
    alive = weakref.ref(sentinel)
    query = rt.backend.query

    def failing(raw: Any) -> bool:
        if raw is stream.raw:
            raise gf.DeviceError("cuStreamQuery failed (a transient error)")
        return query(raw)

    monkeypatch.setattr(rt.backend, "query", failing)
    with pytest.warns(UserWarning, match="querying a stream failed"):
        K.slow_fill(x, 5.0, 0.5).then(lambda _x, s=sentinel: keep_until_done(s)).enqueue_on(stream)
        del sentinel  # the run's submission holds the last reference
        time.sleep(0.1)  # several watchdog rounds query the stream meanwhile
        assert alive() is not None
        stream.synchronize()
        deadline = time.monotonic() + 5
        while rt.dispatcher.pending:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    monkeypatch.undo()
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(16, 5.0, F32))


def test_no_loop_is_running_here() -> None:
    from gpuflow._loops import current_loop, running_loop_name  # the machinery itself

    assert running_loop_name() is None
    with pytest.raises(gf.UsageError, match="needs a running asyncio or Trio event loop"):
        current_loop()


@pytest.mark.anyio
async def test_the_loop_adapter_is_the_running_loops(
    anyio_backend_name: str, anyio_backend_options: dict[str, Any]
) -> None:
    from gpuflow._loops import current_loop, running_loop_name  # the machinery itself

    assert running_loop_name() == anyio_backend_name
    loop = current_loop()
    assert current_loop() is loop  # chosen once for the loop, not per call
    assert loop.target is anyio.lowlevel.current_token().native_token
    if anyio_backend_name == "asyncio":  # the uvloop runs really are on uvloop
        on_uvloop = type(loop.target).__module__.startswith("uvloop")
        assert on_uvloop == anyio_backend_options.get("use_uvloop", False)
    woken: list[str] = []
    wake, park = loop.parker()

    def from_another_thread() -> None:
        loop.post(lambda: woken.append("posted"))
        loop.post(wake)

    t = threading.Thread(target=from_another_thread)
    t.start()
    with anyio.fail_after(5):
        await park()
    t.join()
    assert woken == ["posted"]
    wake()  # a second wake-up is harmless


def test_a_process_that_exits_completes_its_pending_runs_first() -> None:
    # what a run keeps is released (and its callbacks run) before the
    # interpreter goes away, not from a daemon thread during finalization
    code = r"""
import gpuflow as gf, kernels as K
from gpuflow.lowlevel import Submission
gf.init_device_contexts(backend="sim")
x = gf.zeros(16, "float32").sync()
stream = gf.new_stream()
K.slow_fill(x, 1.0, 0.3).enqueue_on(stream)
sub = Submission(0)
sub.add_done_callback(lambda err: print("released before exit", flush=True))
from gpuflow._runtime import get_runtime
get_runtime().dispatcher.submit(stream.raw, sub)
print("exiting", flush=True)
"""
    tests = str(Path(__file__).parent)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, tests]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["exiting", "released", "before", "exit"], proc.stdout


@pytest.mark.sim_only  # the record of what the streams ran is the simulator's
def test_back_to_back_enqueue_on_runs_share_the_signal_in_flight() -> None:
    stream = gf.new_stream()
    x = gf.zeros(16, F32).sync()
    subs = []
    with gf.testing.record_activity() as activity:
        for i in range(30):
            sub = Submission(0)
            K.slow_fill(x, float(i), 0.002).enqueue_on(stream)
            get_runtime().dispatcher.submit(stream.raw, sub)
            subs.append(sub)
        for sub in subs:
            _wait_done(sub)
    signals = [a for a in activity if a.what == "host signal"]
    # one in flight at a time, the next for everything submitted meanwhile:
    # far fewer host functions holding the stream than runs
    assert 1 <= len(signals) <= 10, len(signals)
    assert all(sub.error is None for sub in subs)


def test_a_stream_dropped_right_after_its_runs_still_signals_them() -> None:
    x = gf.zeros(16, F32).sync()
    stream = gf.new_stream()
    subs = [Submission(0) for _ in range(3)]
    for i, sub in enumerate(subs):
        K.slow_fill(x, float(i), 0.05).enqueue_on(stream)
        get_runtime().dispatcher.submit(stream.raw, sub)
    # the last references (the array's hazard state keeps its writer stream):
    # the stream is destroyed now, and the runs left to a later signal must
    # get theirs before (nothing can be enqueued on a destroyed stream)
    ref = weakref.ref(stream)
    del stream, x
    assert ref() is None
    for sub in subs:
        _wait_done(sub)
    assert all(sub.error is None for sub in subs)
