"""The completion side where loops stop, streams go and processes exit; the
busy-poll budget; the loop adapters.

Whatever ends a loop early (a cancellation, a loop that stops or ends), no
run is left pending, and no file descriptor is left open.  These tests drive
the completer and the loop adapters themselves, so they import the private
modules that hold them (``_completion``, ``_runtime``, ``_loops``).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K
from helpers import simulated
from helpers.completion import F32, needs_proc, open_fds, reinit, wait_until

import gpuflow as gf
from gpuflow._core._loops import current_loop
from gpuflow._core._run import Run
from gpuflow._core._runtime import ensure_runtime

# -- loops that stop, streams that go, processes that exit --------------------------------------


class _StoppedLoop:
    """A loop (as gpuflow's loop adapters present one) that never runs again:
    it accepts a poller and a file descriptor to watch, and calls neither."""

    def __init__(self) -> None:
        self.watched: list[int] = []
        self.kicks = 0
        self.ended = False
        self.yielded = self.asked = self.slept_cpu = 0.0
        self.parked = False
        self.slept_waits = 0
        self.awaiting = 0
        self.checkpoint_if_cancelled: Any = anyio.lowlevel.checkpoint_if_cancelled
        self.checkpoint: Any = anyio.lowlevel.checkpoint
        self.may_be_cancelled: Any = lambda: True
        self.current_task: Any = lambda: None
        self.ready_check_s = 0.0
        self.target: Any = self
        self.poller: Any = None

    def fast_paths(self) -> dict[str, bool]:
        return {}

    def others_ready(self) -> bool:
        return True

    def running_in(self, ident: int) -> bool:
        return False

    def start_poller(self, poll: Any) -> Any:
        def kick() -> None:
            self.kicks += 1

        return kick

    def watch(self, fd: int, on_ready: Any) -> None:
        self.watched.append(fd)

    def finished(self) -> bool:
        return self.ended

    def call_soon(self, fn: Any) -> None:
        raise AssertionError("nothing is scheduled on this loop")

    post = call_soon

    def park(self) -> Any:
        raise AssertionError("nothing parks on this loop")

    def wake(self, park: Any) -> None:
        raise AssertionError("nothing parks on this loop")


def _wait_done(sub: Run, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not sub.done:
        assert time.monotonic() < deadline, "the run never completed"
        time.sleep(0.001)


class _Sentinel:
    """Something only a run's submission keeps alive."""


def keep_until_done(sentinel: _Sentinel) -> gf.DeviceOperation[None]:
    def enqueue(ctx: Any) -> gf.DeviceOperation[None]:
        ctx.keep(sentinel)
        return gf.value(None)

    return gf.with_context(enqueue)


@needs_proc
@pytest.mark.parametrize("busy_poll_us", [0, 200])
def test_a_loop_that_never_runs_again_has_its_runs_completed_all_the_same(
    busy_poll_us: float,
) -> None:
    # a loop that stopped (not closed) with a run awaited: the completer
    # thread completes what the GPU finished, a tick later than the loop would
    reinit(busy_poll_us=busy_poll_us)
    completer = ensure_runtime().completer
    stream = gf.new_stream()
    x = gf.zeros(16, F32).sync()
    stopped = _StoppedLoop()
    before = open_fds()
    sentinel = _Sentinel()
    alive = weakref.ref(sentinel)
    sub = Run(0)
    sub.hold((sentinel,))
    del sentinel
    # the run's stream waits for slow work elsewhere (so that the run is the
    # only one on its stream: a sleeping loop's wake-up is a pipe on it)
    other = gf.new_stream()
    K.slow_fill(x, 3.0, 0.05).enqueue_on(other)
    be = ensure_runtime().backend
    be.wait_event(stream.raw, be.record_event(other.raw))
    completer.submit(stream.raw, sub)
    assert sub._lane is not None
    completer.poll_on(stopped, sub._lane)  # what an await does before it parks
    assert len(stopped.watched) == 1  # the loop was given its epoll set
    if busy_poll_us == 0:
        assert sub._lane.wake_for == sub._number  # a pipe was armed, on the run's stream
    assert alive() is not None and not sub.done
    _wait_done(sub)
    assert sub.error is None and alive() is None
    # what it left open waits for the loop (the fd numbers are the loop's to
    # reuse); once the loop has ended, the completer thread closes it all
    stopped.ended = True
    wait_until(lambda: open_fds() <= before, "the ended loop's descriptors stayed open")
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(16, 3.0, F32))


def test_a_stream_whose_runs_the_gpu_finished_is_idle_before_anyone_looks() -> None:
    # a run no loop ever completes (its loop stopped) still leaves its stream
    # idle to the default policy once the GPU has reached its mark
    completer = ensure_runtime().completer
    pool = gf.lowlevel.pool_streams()
    x = gf.zeros(16, F32).sync()
    sub = Run(0)
    completer.submit(pool[0].raw, sub)
    wait_until(sub.reached, "the GPU never reached the mark")
    for s in pool[1:]:
        K.slow_fill(x, 1.0, 0.5).enqueue_on(s)
    policy = gf.StreamPoolLeastLoaded(max_streams=len(pool))
    assert {policy.next_stream(0) for _ in pool} == {pool[0]}
    _wait_done(sub)


def test_runs_no_loop_awaits_hold_their_stream_for_no_host_function() -> None:
    if not simulated():
        pytest.skip("the record of what the streams ran is the simulator's")
    stream = gf.new_stream()
    x = gf.zeros(16, F32).sync()
    subs = []
    with gf.testing.record_activity() as activity:
        for i in range(30):
            sub = Run(0)
            K.slow_fill(x, float(i), 0.002).enqueue_on(stream)
            ensure_runtime().completer.submit(stream.raw, sub)
            subs.append(sub)
        for sub in subs:
            _wait_done(sub)
    whats = [a.what for a in activity]
    assert "host signal" not in whats
    # each of ours and each enqueue_on run is marked at once, right after its work
    assert whats.count("completion mark") == 60
    assert all(sub.error is None for sub in subs)


def test_a_use_on_another_stream_waits_for_its_run_not_for_later_work() -> None:
    """Every run is marked right after its work, also one enqueued on a
    stream that has runs pending: a use of its output on another stream
    waits for that run, not for a long kernel enqueued after it."""
    stream, other = gf.new_stream(), gf.new_stream()
    x = gf.zeros(16, F32).sync()
    sevens = gf.full(16, 7.0, F32).sync()
    junk = gf.zeros(16, F32).sync()
    K.slow_fill(junk, 1.0, 0.05).enqueue_on(stream)  # the stream has a run pending
    gf.copy(sevens, out=x).enqueue_on(stream)
    K.slow_fill(junk, 2.0, 1.0).enqueue_on(stream)  # long, and x is not its
    t0 = time.perf_counter()
    got = gf.to_host(x).sync_on(other)
    took = time.perf_counter() - t0
    assert took < 0.5, f"the read of x waited {took:.2f} s for a kernel that does not use it"
    np.testing.assert_array_equal(got, np.full(16, 7.0, F32))
    stream.synchronize()


@pytest.mark.anyio
async def test_silent_marks_and_marks_a_loop_reads_share_a_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Runs no task awaits (``enqueue_on``) get silent marks, awaited runs
    marks a loop reads, in one numbering on one stream: a use on another
    stream waits for the run it uses, whichever kind its mark is, and never
    for a long kernel enqueued after it; the awaits see their runs done."""
    kinds: list[bool] = []
    one = gf.SingleStream()
    stream = one.stream
    lane: Any = stream._lane
    mark = lane.mark  # (the stream's marks, made once)

    def spy(polled: bool = True) -> int:
        kinds.append(polled)
        return int(mark(polled))

    monkeypatch.setattr(lane, "mark", spy)
    x, y, z, junk = [await gf.zeros(16, F32) for _ in range(4)]
    sevens = await gf.full(16, 7.0, F32)
    kinds.clear()
    with anyio.fail_after(10):
        K.slow_fill(junk, 1.0, 0.05).enqueue_on(stream)  # silent
        gf.copy(sevens, out=x).enqueue_on(stream)  # silent
        await gf.copy(x, out=y).run(one)  # read by the loop, x's copy reached before it
        gf.copy(y, out=z).enqueue_on(stream)  # silent, after a mark of the word
        K.slow_fill(junk, 2.0, 1.0).enqueue_on(stream)  # long: no use below is its
        t0 = time.perf_counter()
        for arr in (x, y, z):
            got = await gf.to_host(arr).run(gf.SingleStream())
            np.testing.assert_array_equal(got, np.full(16, 7.0, F32))
        took = time.perf_counter() - t0
        assert took < 0.5, f"the reads waited {took:.2f} s for a kernel they do not use"
        assert kinds[:5] == [False, False, True, False, False], kinds
        await anyio.to_thread.run_sync(stream.synchronize)
    monkeypatch.undo()
    await gf.testing.assert_quiescent_async(timeout=5.0)


def _submit_owing(raw: Any, sub: Run) -> None:
    """Submit ``sub`` on the raw stream ``raw`` with its mark refused once (a
    failure that is no device's fault): raised, and the run, pending, owes
    the stream's next mark.  (Given the raw stream: the frames the error
    keeps do not keep a :class:`gpuflow.Stream` alive.)"""
    completer = ensure_runtime().completer
    lane: Any = completer.lane(raw, 0)
    mark = lane.mark  # (the stream's marks, made once)

    def refuse(polled: bool = True) -> int:
        raise RuntimeError("the mark was refused")

    lane.mark = refuse
    try:
        completer.submit(raw, sub)
    except RuntimeError as exc:
        assert "the mark was refused" in str(exc)
    else:
        raise AssertionError("the refused mark was not raised")
    finally:
        lane.mark = mark
    assert sub._lane is not None and sub._lane.raw is raw and sub._lane.unmarked


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "beside another await"])
@pytest.mark.anyio
async def test_an_await_of_a_run_that_owes_its_mark_enqueues_it(alone: bool) -> None:
    """A run whose mark could not be enqueued owes it: an await of the run
    enqueues it (a lone one before it spins, the loop's poller at its
    turn), rather than leave the run pending until the busy-poll budget runs
    out and the loop arms a wake-up."""
    reinit(busy_poll_us=2_000_000)
    stream = gf.new_stream()
    lane = stream._lane
    assert lane is not None
    x = await gf.zeros(16, F32)
    y = await gf.zeros(16, F32)
    stats = gf.lowlevel.current_completion_statistics
    before = stats()

    async def another() -> None:
        await K.slow_fill(y, 3.0, 0.3)  # (on a pool stream)

    K.slow_fill(x, 1.0, 0.02).enqueue_on(stream)  # marked at once: the stream was idle
    lane.polled_until = time.monotonic() + 60  # (keeps the completer thread from the lane)
    try:
        sub = Run(0)
        K.slow_fill(x, 2.0, 0.001).enqueue_on(stream)
        _submit_owing(stream.raw, sub)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                if not alone:
                    tg.start_soon(another)
                    await anyio.sleep(0.01)  # its await is in progress
                await sub.wait()
    finally:
        lane.polled_until = 0.0
    after = stats()
    assert after.pipes_armed == before.pipes_armed, (before, after)
    assert after.watched_by_thread == before.watched_by_thread, (before, after)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(16, 2.0, F32))


def test_runs_no_loop_awaits_have_their_owed_mark_enqueued_by_the_completer_thread() -> None:
    stream = gf.new_stream()
    lane = stream._lane
    assert lane is not None
    x = gf.zeros(16, F32).sync()
    K.slow_fill(x, 1.0, 0.01).enqueue_on(stream)  # marked at once: the stream was idle
    sub = Run(0)
    K.slow_fill(x, 2.0, 0.05).enqueue_on(stream)
    _submit_owing(stream.raw, sub)
    assert sub._number == lane.issued + 1
    _wait_done(sub)  # nothing else here enqueues the mark it owes
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(16, 2.0, F32))


def test_a_synchronize_enqueues_the_mark_its_streams_runs_owe() -> None:
    """After ``stream.synchronize()`` every run enqueued on the stream before
    it is seen done at the next read of its word, owed mark or not."""
    stream = gf.new_stream()
    lane = stream._lane
    assert lane is not None
    x = gf.zeros(16, F32).sync()
    K.slow_fill(x, 1.0, 0.02).enqueue_on(stream)
    lane.polled_until = time.monotonic() + 60  # (keeps the completer thread from the lane)
    try:
        K.slow_fill(x, 2.0, 0.001).enqueue_on(stream)
        _submit_owing(stream.raw, Run(0))
        owed = lane.issued + 1
        stream.synchronize()
        assert not lane.unmarked and lane.read() >= owed
    finally:
        lane.polled_until = 0.0
    wait_until(lambda: not ensure_runtime().completer.pending, "the runs never completed")


def test_a_stream_dropped_with_a_mark_owed_enqueues_it_first() -> None:
    x = gf.zeros(16, F32).sync()
    stream = gf.new_stream()
    lane = stream._lane
    assert lane is not None
    K.slow_fill(x, 1.0, 0.02).enqueue_on(stream)
    lane.polled_until = time.monotonic() + 60  # (keeps the completer thread from the lane)
    try:
        sub = Run(0)
        _submit_owing(stream.raw, sub)
        ref = weakref.ref(stream)
        del stream, x
        gf.memory_stats()  # (a safe point: the stream's finalizer's work, here or in the reaper)
        assert ref() is None
        wait_until(lambda: lane.retired, "the dropped stream was never retired")
        assert not lane.unmarked  # enqueued before the stream went
    finally:
        lane.polled_until = 0.0
    _wait_done(sub)
    assert sub.error is None


def test_a_stream_dropped_with_work_in_flight_keeps_what_the_work_uses() -> None:
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
        time.sleep(0.03)  # a completer tick or more; the work has 70 ms to go
        assert alive() is not None, f"round {i}: released while its work was running"
    deadline = time.monotonic() + 5
    while ensure_runtime().completer.pending:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(64, rounds - 1, F32))


def test_a_stream_dropped_right_after_its_runs_still_completes_them() -> None:
    x = gf.zeros(16, F32).sync()
    stream = gf.new_stream()
    subs = [Run(0) for _ in range(3)]
    for i, sub in enumerate(subs):
        K.slow_fill(x, float(i), 0.05).enqueue_on(stream)
        ensure_runtime().completer.submit(stream.raw, sub)
    # the last references (the array's hazard state keeps its writer stream,
    # and so does the free of its memory, until it is enqueued at the next
    # safe point, here memory_stats): the stream is destroyed then; its marks
    # are still reached
    ref = weakref.ref(stream)
    del stream, x
    gf.memory_stats()
    assert ref() is None
    for sub in subs:
        _wait_done(sub)
    assert all(sub.error is None for sub in subs)


def test_a_query_failure_that_is_no_fault_fails_no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = ensure_runtime()
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
        time.sleep(0.1)  # several completer ticks query the stream meanwhile
        assert alive() is not None
        stream.synchronize()
        deadline = time.monotonic() + 5
        while rt.completer.pending:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    monkeypatch.undo()
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(16, 5.0, F32))


def test_a_process_that_exits_completes_its_pending_runs_first() -> None:
    # what a run keeps is released (and its callbacks run) before the
    # interpreter goes away, not from a daemon thread during finalization
    code = r"""
import gpuflow as gf
from helpers import kernels as K
from gpuflow.lowlevel import Run
gf.init_device_contexts(backend="sim")
x = gf.zeros(16, "float32").sync()
stream = gf.new_stream()
K.slow_fill(x, 1.0, 0.3).enqueue_on(stream)
sub = Run(0)
sub.add_done_callback(lambda err: print("released before exit", flush=True))
from gpuflow._core._runtime import ensure_runtime
ensure_runtime().completer.submit(stream.raw, sub)
print("exiting", flush=True)
"""
    tests = str(Path(__file__).parents[1])
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, tests]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["exiting", "released", "before", "exit"], proc.stdout


# -- the busy-poll budget ----------------------------------------------------------------------


def test_the_busy_poll_budget_comes_from_the_argument_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuflow._core._latency import DEFAULT_BUSY_POLL_US  # the documented default

    backend = gf.current_backend()
    monkeypatch.delenv("GPUFLOW_BUSY_POLL_US", raising=False)
    gf.init_device_contexts(backend=backend)
    assert ensure_runtime().completer.busy_poll_s == DEFAULT_BUSY_POLL_US / 1e6
    monkeypatch.setenv("GPUFLOW_BUSY_POLL_US", "35.5")
    gf.init_device_contexts(backend=backend)
    assert ensure_runtime().completer.busy_poll_s == pytest.approx(35.5e-6)
    gf.init_device_contexts(backend=backend, busy_poll_us=0)  # the argument wins
    assert ensure_runtime().completer.busy_poll_s == 0
    monkeypatch.setenv("GPUFLOW_BUSY_POLL_US", "fast")
    with pytest.raises(gf.UsageError, match="GPUFLOW_BUSY_POLL_US='fast'"):
        gf.init_device_contexts(backend=backend)
    monkeypatch.delenv("GPUFLOW_BUSY_POLL_US")
    for bad in (-1, float("nan"), "10", True):
        with pytest.raises(gf.UsageError, match="busy_poll_us"):
            gf.init_device_contexts(backend=backend, busy_poll_us=bad)  # type: ignore[arg-type]
    # the runtime in use is still the last good one
    assert ensure_runtime().completer.busy_poll_s == 0


# -- the loop adapters -------------------------------------------------------------------------


def test_no_loop_is_running_here() -> None:
    from gpuflow._core._loops import current_loop, running_loop_name  # the machinery itself

    assert running_loop_name() is None
    with pytest.raises(gf.UsageError, match="needs a running asyncio or Trio event loop"):
        current_loop()


@pytest.mark.anyio
async def test_the_loop_adapter_is_the_running_loops(
    anyio_backend_name: str, anyio_backend_options: dict[str, Any]
) -> None:
    from gpuflow._core._loops import current_loop, running_loop_name  # the machinery itself

    assert running_loop_name() == anyio_backend_name
    loop = current_loop()
    assert current_loop() is loop  # chosen once for the loop, not per call
    assert loop.target is anyio.lowlevel.current_token().native_token
    if anyio_backend_name == "asyncio":  # the uvloop runs really are on uvloop
        on_uvloop = type(loop.target).__module__.startswith("uvloop")
        assert on_uvloop == anyio_backend_options.get("use_uvloop", False)
    woken: list[str] = []
    park = loop.park()

    def wake() -> None:
        loop.wake(park)

    def from_another_thread() -> None:
        loop.post(lambda: woken.append("posted"))
        loop.post(wake)

    t = threading.Thread(target=from_another_thread)
    t.start()
    with anyio.fail_after(5):
        await park
    t.join()
    assert woken == ["posted"]
    wake()  # a second wake-up is harmless


@pytest.mark.anyio
async def test_a_park_woken_before_its_task_yields_leaves_the_loop_sound(
    anyio_backend_name: str, anyio_backend_options: dict[str, Any]
) -> None:
    """What completes a run may wake its park in the same step of the task
    that made it, before the task yields: a completion read inline, a fault
    while the run's mark is enqueued (a run whose task then raises and ends
    without awaiting the park).  Woken first, the await returns at once; a
    park woken and never awaited leaves its task free to end, and the loop
    runs on (on Trio, a task rescheduled while it ran was queued to run
    again after it had ended: Trio's run failed with an internal error).
    Run in a loop of its own, so that a loop broken by it fails here."""

    async def program() -> int:
        loop = current_loop()
        park = loop.park()
        loop.wake(park)
        assert park.done()
        with anyio.fail_after(5):
            await park  # at once: nothing would wake it again
        ended = 0

        async def woken_then_ends() -> None:
            nonlocal ended
            loop.wake(loop.park())
            ended += 1

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(woken_then_ends)
        for _ in range(5):  # turns of the loop after those tasks ended
            await anyio.sleep(0)
        return ended

    def in_a_loop_of_its_own() -> int:
        return anyio.run(program, backend=anyio_backend_name, backend_options=anyio_backend_options)

    ended = await anyio.to_thread.run_sync(in_a_loop_of_its_own)
    assert ended == 5


@pytest.mark.anyio
@pytest.mark.parametrize("ended_by", ["the GPU", "a finish by hand"])
async def test_every_task_waiting_for_one_run_is_woken_once_it_is_done(
    ended_by: str, anyio_backend_name: str, anyio_backend_options: dict[str, Any]
) -> None:
    """Two tasks of this loop and one of a loop in another thread wait for
    the same run (as a scope's exit and the run's own await may): its
    completion wakes all three, this loop's directly and the other's through
    a post.  The run is either completed by the GPU (seen done by this
    loop's poller) or finished by hand, as a blocking run or a fault is."""
    stream = gf.new_stream()
    x = await gf.zeros(16, F32)
    sub = Run(0)
    if ended_by == "the GPU":
        K.slow_fill(x, 1.0, 0.3).enqueue_on(stream)
        ensure_runtime().completer.submit(stream.raw, sub)
    woken: list[str] = []

    def parked() -> int:
        extra = sub._more_parked
        return (sub._parked is not None) + (len(extra) if extra else 0)

    async def wait(name: str) -> None:
        await sub.wait()
        woken.append(name)

    def in_another_loop() -> None:
        anyio.run(wait, "other loop", backend=anyio_backend_name,
                  backend_options=anyio_backend_options)

    other = threading.Thread(target=in_another_loop, daemon=True)  # (a bug: it hangs)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, "first")
            tg.start_soon(wait, "second")
            await anyio.wait_all_tasks_blocked()
            other.start()
            while parked() < 3:
                await anyio.sleep(0.001)
            assert not sub.done and not woken
            if ended_by != "the GPU":
                ensure_runtime().completer.complete([sub])
        while other.is_alive():
            await anyio.sleep(0.001)
    assert sorted(woken) == ["first", "other loop", "second"]
    assert parked() == 0  # (nothing of the tasks is held past the run)


@pytest.mark.anyio
async def test_a_task_does_not_park_on_a_run_finished_as_it_parks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run may finish between an await's last look and its parking
    (the completer thread completes it meanwhile): the await then goes on
    at once; it must not park, since nobody would wake it."""
    loop = current_loop()
    sub = Run(0)  # never submitted: finished by hand, as the task parks
    real_park = type(loop).park

    def finishing_park(self: Any) -> Any:
        ensure_runtime().completer.complete([sub])
        return real_park(self)

    monkeypatch.setattr(type(loop), "park", finishing_park)
    with anyio.fail_after(5):
        await sub.wait()
    assert sub.done and sub._parked is None


@pytest.mark.anyio
async def test_the_loop_adapter_says_whether_another_task_is_ready(
    anyio_backend_name: str, anyio_backend_options: dict[str, Any]
) -> None:
    """What an await whose run is done asks before it runs on without a
    loop turn: another task ready now is seen (a loop that cannot tell,
    uvloop, says so every time, and is asked rarely)."""
    from gpuflow._core._loops import current_loop  # the machinery itself

    loop = current_loop()
    blind = anyio_backend_options.get("use_uvloop", False)
    await anyio.sleep(0.01)
    alone = loop.others_ready()
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.sleep, 0)
        ready = loop.others_ready()  # (it has not run yet)
    assert ready
    assert alone is blind  # alone, only a blind loop says another is ready


@pytest.mark.anyio
async def test_a_poller_runs_once_a_turn_while_it_asks_to() -> None:
    from gpuflow._core._loops import current_loop  # the machinery itself

    loop = current_loop()
    calls: list[int] = []
    other: list[int] = []

    def poll() -> bool:
        calls.append(len(other))
        return len(calls) < 5

    kick = loop.start_poller(poll)
    kick()  # (harmless while it runs)
    for i in range(20):
        other.append(i)
        await anyio.lowlevel.checkpoint()
    # five turns, interleaved with the other task's (in either order within
    # a batch of Trio's, which runs tasks in random order), then it stopped
    assert len(calls) == 5 and calls == sorted(calls) and len(set(calls)) >= 3
    kick()  # started again
    for _ in range(20):
        await anyio.lowlevel.checkpoint()
    assert len(calls) == 6


def test_a_run_submitted_on_a_destroyed_stream_is_refused_not_left_pending() -> None:
    # no mark will ever come on a destroyed stream: a run left pending there
    # would keep what it holds, and gpuflow busy, for ever
    rt = ensure_runtime()
    raw = rt.backend.create_stream(0)
    rt.backend.destroy_stream(raw)
    before = rt.completer.pending
    sub = Run(0)
    with pytest.raises(gf.UsageError, match="destroyed"):
        rt.completer.submit(raw, sub)
    assert rt.completer.pending == before and sub._lane is None
    gf.testing.assert_quiescent(timeout=1.0)


@pytest.mark.anyio
async def test_a_stream_dropped_with_runs_in_flight_leaves_nothing_behind() -> None:
    """A ``new_stream()`` stream dropped while its runs are in flight is
    retired: its work completes, and then nothing of it stays in the
    completion machinery (its backend stream goes with the last run)."""
    x = await gf.zeros(64, F32)
    s = gf.new_stream()
    K.slow_fill(x, 1.0, 0.1).enqueue_on(s)
    raw = weakref.ref(s.raw)
    del s, x  # (x's last writer was s: the array kept it)
    gc.collect()
    assert raw() is not None  # in flight: the run keeps it
    await gf.testing.assert_quiescent_async()
    gc.collect()
    assert raw() is None, "the dropped stream is still held once its runs completed"
