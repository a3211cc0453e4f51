"""The completion bridge: completion words read while busy, the GPU's wake-up when idle.

Every run ends with a mark on its stream: the GPU writes the run's number
into the stream's completion word.  A loop with runs pending reads the words
once per turn and completes what they cover, in its own thread; once no run
has completed for the busy-poll budget, it arms a wake-up (a pipe the GPU
closes right after the oldest pending run, or, where work is already queued
behind that run, the dispatcher thread watching the word) and sleeps.
Whatever ends a loop early (a cancellation, a loop that stops or ends), no
run is left pending, and no file descriptor is left open.

These tests drive the dispatcher and the loop adapters themselves, so they
import the private modules that hold them (``_bridge``, ``_runtime``,
``_loops``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import anyio
import kernels as K
import numpy as np
import pytest

import gpuflow as gf
from gpuflow._core import _loops
from gpuflow._core._loops import current_loop
from gpuflow._core._run import Run
from gpuflow._core._runtime import get_runtime

F32 = np.float32


def reinit(busy_poll_us: float) -> None:
    """The fixture's runtime again, with another busy-poll budget."""
    backend = gf.current_backend()
    gf.init_device_contexts(
        backend=backend, num_devices=2 if backend == "sim" else None, busy_poll_us=busy_poll_us
    )


def count_pipes(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every pipe wake-up the backend is asked to enqueue (its stream)."""
    backend = get_runtime().backend
    calls: list[Any] = []
    enqueue_close = backend.enqueue_close

    def closing(raw: Any, fd: int) -> bool:
        calls.append(raw)
        return enqueue_close(raw, fd)

    monkeypatch.setattr(backend, "enqueue_close", closing)
    return calls


async def watched_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[float], gf.DeviceArray, list[Any]]:
    """A runtime with a 2 ms budget, the record of its loop's turns (:func:`count_turns`),
    an array and the record of its pipe wake-ups."""
    reinit(busy_poll_us=2_000)
    turns = count_turns(monkeypatch)
    x = await gf.zeros(64, F32)
    return turns, x, count_pipes(monkeypatch)


def count_turns(monkeypatch: pytest.MonkeyPatch, lone_awaits: bool = True) -> list[float]:
    """Record when each turn of the current loop reads a word: its poller's,
    and (``lone_awaits``) a lone await's own, which reads it at its own
    turns first, the poller taking the rest of the budget over where
    another await starts.  Before the loop's first await of the runtime
    (which makes its poller)."""
    from gpuflow._core import _completion  # the poller itself

    turns: list[float] = []
    poll = _completion.Poller.poll

    def counted_poll(self: Any) -> bool:
        turns.append(time.monotonic())
        return poll(self)

    monkeypatch.setattr(_completion.Poller, "poll", counted_poll)
    if not lone_awaits:
        return turns
    loop = current_loop()
    checkpoint = loop.checkpoint

    async def counted_checkpoint() -> None:
        await checkpoint()
        turns.append(time.monotonic())

    monkeypatch.setattr(loop, "checkpoint", counted_checkpoint)
    return turns


def not_traced() -> None:
    """Skip a test of a busy loop's turns under a tracer or a profiler
    (coverage, a debugger): there every turn counts against the budget, by
    design, and a busy loop arms its wake-ups like an idle one."""
    from gpuflow._core import _completion

    if _completion._turns_slowed():
        pytest.skip("a tracer or a profiler runs: every turn counts against the budget")


@contextlib.asynccontextmanager
async def other_task_working(turn_s: float) -> AsyncIterator[None]:
    """While the block runs, another task of the loop does ``turn_s`` of CPU
    work between two checkpoints: the loop's turns are that long."""
    busy = True

    async def work() -> None:
        while busy:
            time.sleep(turn_s)
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(work)
        try:
            yield
        finally:
            busy = False


async def watched_runtime(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[gf.DeviceArray, list[Any], Any]:
    """A runtime with the default 200 us budget, an array, the record of
    its pipe wake-ups and the completion statistics so far."""
    reinit(busy_poll_us=200)
    x = await gf.zeros(64, F32)
    return x, count_pipes(monkeypatch), gf.lowlevel.current_completion_statistics()


def seen_by_the_loop_alone(before: Any, pipes: list[Any]) -> Any:
    """Assert that since ``before`` (completion statistics) no sleeping
    wake-up was armed and the dispatcher thread completed no run: the
    loop's own reads saw every run done.  Returns the statistics now."""
    after = gf.lowlevel.current_completion_statistics()
    assert pipes == []
    assert (after.by_thread, after.watched_by_thread) == (
        before.by_thread, before.watched_by_thread
    ), (before, after)
    return after


def record_posts(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every wake-up posted to a loop from another thread."""
    from gpuflow._core import _completion  # the post the dispatcher thread makes
    from gpuflow._core._loops import post as real_post

    posts: list[Any] = []

    def recorded(*args: Any) -> None:
        posts.append(args)
        real_post(*args)

    monkeypatch.setattr(_completion, "post", recorded)
    return posts


def completing_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen_on: list[int] = []
    complete = Run.complete

    def noted(run: Run, err: BaseException | None, here: Any, posts: Any) -> None:
        seen_on.append(threading.get_ident())
        complete(run, err, here, posts)

    monkeypatch.setattr(Run, "complete", noted)
    return seen_on


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


# -- poll while busy ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("busy_poll_us", "pipes_per_await"),
    # polling for as long as any of these runs takes: no host function at all;
    # polling off: one pipe an await, closed by the GPU
    [(2_000_000, 0), (0, 1)],
)
@pytest.mark.anyio
async def test_the_loop_itself_completes_its_runs_polling_or_sleeping(
    busy_poll_us: float, pipes_per_await: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reinit(busy_poll_us=busy_poll_us)
    x = await gf.zeros(64, F32)
    pipes = count_pipes(monkeypatch)
    posts = record_posts(monkeypatch)
    seen_on = completing_threads(monkeypatch)
    for i in range(20):
        await K.slow_fill(x, float(i), 0.001)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 19.0, F32))
    # no post from another thread: the loop read the words, or its pipe woke it
    assert len(pipes) == 21 * pipes_per_await and posts == []
    assert set(seen_on) == {threading.get_ident()}  # completed in the loop's own thread


@pytest.mark.anyio
async def test_one_read_of_each_word_a_turn_however_many_runs_are_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuflow._core import _completion  # the poller itself

    reinit(busy_poll_us=2_000_000)
    pool = gf.StreamPoolRoundRobin()  # 32 tasks on the pool's four streams
    turns: list[int] = []
    reads: list[int] = [0]  # the reads of words made by the poller (not by hazards)
    polling = [False]
    poll = _completion.Poller.poll

    def counted_poll(self: Any) -> bool:
        for lane in self.lanes:
            if not getattr(lane.read, "counted", False):
                lane.read = _counting(lane.read, reads, polling)
        turns.append(len(self.lanes))
        polling[0] = True
        try:
            return poll(self)
        finally:
            polling[0] = False

    monkeypatch.setattr(_completion.Poller, "poll", counted_poll)  # (before the loop's first await)
    counters = [await gf.zeros(1, np.int32) for _ in range(32)]

    async def worker(c: gf.DeviceArray) -> None:
        for _ in range(4):
            # (a kernel long enough that many are pending at once on every backend)
            await K.module().count(gf.LaunchConfig(1, 1), c).then(
                lambda _c: K.slow_fill(f, 1.0, 0.0005, 16)
            ).run(pool)

    f = await gf.zeros(16, F32)
    async with anyio.create_task_group() as tg:
        for c in counters:
            tg.start_soon(worker, c)
    for c in counters:
        assert int((await gf.to_host(c))[0]) == 4
    assert turns and max(turns) <= 4 + 2  # the pool's streams (and the to_host's)
    assert reads[0] <= sum(turns), (reads[0], sum(turns))


@pytest.mark.anyio
async def test_an_await_does_not_spin_while_another_await_of_its_loop_is_in_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a lone await reads its word inline before it parks (spins).  With
    another await of its loop in progress, here one woken and not resumed
    yet, a spin would hold that task, which would submit its next work only
    after it: awaits of short kernels from many tasks reached the GPU one at
    a time."""
    from gpuflow._core import _run  # the inline spin itself

    reinit(busy_poll_us=2_000_000)
    x = await gf.zeros(64, F32)
    spins: list[bool] = []  # per call of spin: was the other task resumed by then
    inline_reads: list[bool] = []
    resumed = anyio.Event()
    real_spin = _run._spin

    def spying(run: Any, loop: Any, lane: Any) -> bool:
        spins.append(resumed.is_set())
        read = lane.read

        def counted() -> int:
            inline_reads.append(resumed.is_set())
            return int(read())

        lane.read = counted
        try:
            return real_spin(run, loop, lane)
        finally:
            lane.read = read

    monkeypatch.setattr(_run, "_spin", spying)
    other = Run(0)  # never submitted: finished by hand below

    async def other_await() -> None:
        await other.wait()
        resumed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_await)
        await anyio.wait_all_tasks_blocked()  # parked in its await
        get_runtime().dispatcher.finish(other)  # woken: it resumes at a later turn
        await K.slow_fill(x, 1.0, 0.0)  # submitted and awaited before that
    assert True not in spins  # (no spin began after the other await resumed)
    assert inline_reads == []  # the other await was in progress: no inline read
    # alone, an await spins (the spy sees it)
    await K.slow_fill(x, 2.0, 0.0)
    assert inline_reads and all(inline_reads)


@pytest.mark.anyio
@pytest.mark.parametrize("between", ["sleeps", "computes", "is kept from running"])
async def test_a_lone_await_owes_its_loop_a_turn_after_a_millisecond_of_running(
    between: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone await whose run is done when it looks yields to its loop once
    its task has not let the loop run for ``YIELD_EVERY_S``: between awaits
    that computed (the loop thread ran all along, the loop never turned) it
    yields every time, as where the system kept the thread from running;
    between awaits that slept (the loop turned, in its selector) it does
    not, for a turn after an idle gap costs as much as a short run (under
    uvloop, whose ready callbacks gpuflow cannot see, it does not yield in
    their stead either).

    The thread's CPU time and waits are the system's where it slept; where
    it ran or was kept from running they are made up (that much CPU time,
    no wait), for a machine's other load would make them so only by chance."""
    from gpuflow._core import _run

    reinit(busy_poll_us=2_000_000)
    x = await gf.zeros(64, F32)
    real_spin = _run._spin

    def spin_once_done(run: Any, loop: Any, lane: Any) -> bool:
        # sim's device is a thread of this process: the spin, holding the
        # GIL, would see it done only by chance; here it always does
        while lane.read() < run.number:
            time.sleep(1e-4)
        return real_spin(run, loop, lane)

    monkeypatch.setattr(_run, "_spin", spin_once_done)
    if between != "sleeps":
        share = 1.0 if between == "computes" else 0.1  # (of the time, the thread ran)
        t0 = time.perf_counter()
        monkeypatch.setattr(
            _run, "_thread_usage", lambda: ((time.perf_counter() - t0) * share, 0)
        )
    yields = [0]
    counting = [False]
    checkpoint = anyio.lowlevel.checkpoint  # (the one the await yields at)

    async def counted() -> None:
        yields[0] += counting[0]
        await checkpoint()

    monkeypatch.setattr(anyio.lowlevel, "checkpoint", counted)
    rounds = 4
    for i in range(-1, rounds):  # (the first, uncounted, as the others began)
        if between == "sleeps":
            await anyio.sleep(0.01)
        else:  # the loop does not turn
            time.sleep(0.005)
        counting[0] = i >= 0
        await K.slow_fill(x, float(i), 0.0)
        counting[0] = False
    assert yields[0] == (0 if between == "sleeps" else rounds)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, rounds - 1.0, F32))


@pytest.mark.anyio
async def test_a_lone_await_past_its_spin_reads_its_word_at_its_own_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past its inline spin, a lone await reads its word once per loop turn
    itself: the turn that sees the run done resumes it, with no future, no
    wake-up and no poller; the loop's other tasks run at every turn."""
    reinit(busy_poll_us=2_000_000)
    polls = count_turns(monkeypatch, lone_awaits=False)
    x = await gf.zeros(64, F32)
    before = gf.lowlevel.current_completion_statistics()
    turns = [0]
    awaited = anyio.Event()

    async def other_task() -> None:
        while not awaited.is_set():
            turns[0] += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_task)
        await K.slow_fill(x, 1.0, 0.03)  # far longer than the inline spin
        awaited.set()
    after = gf.lowlevel.current_completion_statistics()
    assert after.polled - before.polled == 1 and after.spun == before.spun
    assert polls == []  # the loop's poller never ran
    assert after.pipes_armed == before.pipes_armed
    assert turns[0] > 10  # the other task ran throughout
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 1.0, F32))


@pytest.mark.anyio
async def test_a_lone_await_hands_its_word_to_the_poller_when_another_await_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lone await that reads its own word stops once another await of its
    loop starts: the poller reads both words once a turn from then on, for
    what is left of the budget; neither waits for the other."""
    from gpuflow._core import _run

    reinit(busy_poll_us=2_000_000)
    handed: list[tuple[float, bool]] = []
    poll_alone = _run._poll_alone

    def spied(run: Run, loop: Any, lane: Any) -> Generator[Any, None, float]:
        left = yield from poll_alone(run, loop, lane)
        handed.append((left, run.done))
        return left

    monkeypatch.setattr(_run, "_poll_alone", spied)
    x = await gf.zeros(64, F32)
    y = await gf.zeros(64, F32)
    handed.clear()
    took: dict[str, float] = {}

    async def timed(name: str, op: gf.DeviceOperation[Any]) -> None:
        t0 = time.monotonic()
        await op
        took[name] = time.monotonic() - t0

    async with anyio.create_task_group() as tg:
        tg.start_soon(timed, "slow", K.slow_fill(x, 1.0, 0.3))
        await anyio.sleep(0.02)  # the slow await reads its own word meanwhile
        await timed("fast", K.slow_fill(y, 2.0, 0.0))
    # the slow await handed over with time left, before its run was done
    assert handed and handed[0][1] is False and 0 < handed[0][0] <= 2.0, handed
    assert took["fast"] < 0.2 and took["slow"] >= 0.3, took
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 1.0, F32))
    np.testing.assert_array_equal(await gf.to_host(y), np.full(64, 2.0, F32))


def _counting(read: Any, count: list[int], polling: list[bool]) -> Any:
    def counted() -> int:
        if polling[0] and threading.current_thread() is threading.main_thread():
            count[0] += 1
        return int(read())

    counted.counted = True  # type: ignore[attr-defined]
    return counted


@pytest.mark.anyio
async def test_the_completion_statistics_say_how_each_run_was_seen_done() -> None:
    stats = gf.lowlevel.current_completion_statistics

    def since(before: gf.lowlevel.CompletionStatistics) -> dict[str, int]:
        after = stats()
        names = ("spun", "polled", "by_thread", "pipes_armed", "watched_by_thread")
        return {n: getattr(after, n) - getattr(before, n) for n in names}

    async def awaits(busy_poll_us: float, n: int) -> dict[str, int]:
        """What ``n`` awaits of a 2 ms kernel under that budget counted."""
        reinit(busy_poll_us=busy_poll_us)
        x = await gf.zeros(64, F32)
        before = stats()
        for _ in range(n):
            await K.slow_fill(x, 1.0, 0.002)
        return since(before)

    # polling for longer than any of these runs: the loop saw each one done
    seen = await awaits(2_000_000, 5)
    assert seen["spun"] + seen["polled"] == 5 and seen["polled"] >= 1, seen
    assert seen["by_thread"] == seen["pipes_armed"] == seen["watched_by_thread"] == 0, seen
    # polling off: each await sleeps on a wake-up the GPU fires, then the
    # loop's poller completes the run
    seen = await awaits(0, 3)
    assert seen["polled"] == 3 and seen["spun"] == seen["by_thread"] == 0, seen
    assert seen["pipes_armed"] + seen["watched_by_thread"] == 3, seen
    if sys.platform.startswith("linux"):  # (pipes in an epoll set the loop watches)
        assert seen["pipes_armed"] == 3, seen
    # a run no loop awaits: the dispatcher thread completes it
    s = gf.new_stream()
    x = await gf.zeros(64, F32)
    before = stats()
    K.slow_fill(x, 2.0, 0.002).enqueue_on(s)
    wait_until(lambda: since(before)["by_thread"] == 1, "the thread completes the run")
    assert since(before) == {
        "spun": 0, "polled": 0, "by_thread": 1, "pipes_armed": 0, "watched_by_thread": 0
    }


# -- sleep when idle ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_long_await_spins_at_most_the_budget_then_sleeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    turns, x, pipes = await watched_turns(monkeypatch)
    cpu = time.process_time()
    t0 = time.monotonic()
    await K.slow_fill(x, 1.0, 0.5)
    took = time.monotonic() - t0
    cpu = time.process_time() - cpu
    # it polled for about the budget after the submit, armed one pipe, slept
    # until the GPU closed it, then polled once more
    assert len(pipes) == 1
    spun = [t for t in turns if t < t0 + 0.25]
    assert spun and spun[-1] - t0 < 0.1, spun[-1] - t0
    assert len(turns) - len(spun) <= 3
    assert took >= 0.5 and cpu < 0.25 * took, (cpu, took)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 1.0, F32))


@contextlib.contextmanager
def every_call_slowed(how: str, by_s: float) -> Iterator[None]:
    """Every Python call (a coroutine resumed too) takes ``by_s`` longer, as
    under a tracer: ``sys.settrace`` (this thread; a debugger, coverage on
    Python < 3.12, Hypothesis's explain phase there) or a ``sys.monitoring``
    tool (Python 3.12+; every thread)."""

    def spin(*_: Any) -> None:
        end = time.perf_counter() + by_s
        while time.perf_counter() < end:
            pass

    if how == "settrace":
        sys.settrace(spin)
        try:
            yield
        finally:
            sys.settrace(None)
        return
    mon = getattr(sys, "monitoring", None)
    if mon is None:
        pytest.skip("sys.monitoring is Python 3.12+")
    tool = 4  # (free: 0-2 and 5 are named for debuggers, coverage, profilers, optimizers)
    events = mon.events.PY_START | mon.events.PY_RESUME
    mon.use_tool_id(tool, "gpuflow's tests")
    try:
        mon.register_callback(tool, mon.events.PY_START, spin)
        mon.register_callback(tool, mon.events.PY_RESUME, spin)
        mon.set_events(tool, events)
        yield
    finally:
        mon.set_events(tool, 0)
        mon.register_callback(tool, mon.events.PY_START, None)
        mon.register_callback(tool, mon.events.PY_RESUME, None)
        mon.free_tool_id(tool)


@pytest.mark.anyio
@pytest.mark.parametrize("tracer", ["settrace", "monitoring"])
async def test_a_traced_loop_spins_at_most_the_budget_however_long_its_turns(
    monkeypatch: pytest.MonkeyPatch, tracer: str
) -> None:
    # under a tracer (a debugger, coverage, Hypothesis's explain phase) every
    # turn of an idle loop takes longer than a turn that ran other work:
    # those turns still count against the budget, and the await sleeps once
    # it is spent instead of polling (and holding the GIL from the threads
    # its work waits for) until the run is done
    turns, x, pipes = await watched_turns(monkeypatch)
    t0 = time.monotonic()
    with every_call_slowed(tracer, 50e-6):
        await K.slow_fill(x, 1.0, 0.5)
    assert time.monotonic() - t0 >= 0.5
    # turns of a few hundred microseconds or more (several calls each): the
    # 2 ms budget is a few of them (polled through, a 0.5 s run would be
    # hundreds; turns short of the dispatcher thread's 20 ms, which would
    # take the run from a loop that stopped turning)
    assert len(pipes) == 1
    assert len([t for t in turns if t > t0]) <= 20, len(turns)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 1.0, F32))


@pytest.mark.anyio
async def test_long_awaits_of_two_tasks_are_polled_for_the_budget_then_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # two awaits at once: the loop's poller reads both words once a turn for
    # the budget, then arms a wake-up on each stream and the loop sleeps
    reinit(busy_poll_us=2_000)
    x = await gf.zeros(64, F32)
    y = await gf.zeros(64, F32)
    pipes = count_pipes(monkeypatch)

    async def leased(op: gf.DeviceOperation[Any]) -> None:
        async with gf.open_stream_lease():  # (a stream of its own)
            await op

    cpu = time.process_time()
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(leased, K.slow_fill(x, 1.0, 0.5))
        tg.start_soon(leased, K.slow_fill(y, 2.0, 0.5))
    took = time.monotonic() - t0
    cpu = time.process_time() - cpu
    assert len(pipes) == 2 and pipes[0] is not pipes[1], pipes
    assert took >= 0.5 and cpu < 0.25 * took, (cpu, took)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 1.0, F32))
    np.testing.assert_array_equal(await gf.to_host(y), np.full(64, 2.0, F32))


@pytest.mark.anyio
async def test_a_loop_busy_with_other_work_polls_past_the_budget_and_arms_no_wake_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the budget bounds the turns an otherwise idle loop spins; a loop whose
    # turns run other work reads the words once a turn for as long as it
    # takes, and never pays for a wake-up
    not_traced()
    x, pipes, before = await watched_runtime(monkeypatch)
    async with other_task_working(0.0005):
        await K.slow_fill(x, 1.0, 0.03)
    after = seen_by_the_loop_alone(before, pipes)
    assert after.polled - before.polled == 1
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 1.0, F32))


@pytest.mark.anyio
async def test_the_dispatcher_thread_leaves_a_busy_loops_runs_to_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # turns of 3 ms (other tasks' CPU work) and runs of 1 ms: every run is
    # done well before the turn that reads its word.  The loop reads it
    # there all the same: the dispatcher thread, ticking meanwhile, leaves a
    # loop that is still turning its runs (its completions would come as
    # posts from another thread, each a wake-up of the loop)
    not_traced()
    x, pipes, before = await watched_runtime(monkeypatch)

    async def awaits() -> None:
        for _ in range(40):
            await K.slow_fill(x, 1.0, 0.001)

    async with other_task_working(0.003), anyio.create_task_group() as tg:
        for _ in range(2):  # (not alone: the loop's poller reads the words)
            tg.start_soon(awaits)
    after = seen_by_the_loop_alone(before, pipes)
    assert after.polled + after.spun - before.polled - before.spun == 80


@pytest.mark.anyio
async def test_awaits_of_short_runs_do_not_wake_the_dispatcher_thread_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The thread ticks while runs are pending and for a grace after, then
    # sleeps until new work wakes it.  On a GPU a short kernel is seen done
    # by its own await before the woken thread looks, so the thread never
    # sees a run pending; here it is made to see none.  Once asleep, it must
    # be woken by the first run only and tick through a new grace, not be
    # woken (taking the GIL from the loop) by every run.
    from gpuflow._core import _completion  # the grace, and the thread's wait

    monkeypatch.setattr(_completion, "_IDLE_GRACE_S", 0.05)
    x = await gf.zeros(64, F32)
    dispatcher = get_runtime().dispatcher
    busy = dispatcher._busy
    monkeypatch.setattr(
        dispatcher, "_busy",
        lambda: busy() and threading.current_thread() is not dispatcher._thread,
    )
    real_wait = dispatcher._cv.wait
    rearmed: list[float] = []  # wake-ups of the sleeping thread

    def counted(timeout: float | None = None) -> bool:
        woke = real_wait(timeout)
        if timeout is None:
            rearmed.append(time.monotonic())
        return woke

    monkeypatch.setattr(dispatcher._cv, "wait", counted)
    deadline = time.monotonic() + 5.0
    while dispatcher._armed:  # asleep first
        assert time.monotonic() < deadline, "the dispatcher thread never went to sleep"
        await anyio.sleep(0.01)
    rearmed.clear()
    t0 = time.monotonic()
    runs = 200
    for _ in range(runs):
        await K.module().scale(K.cfg(64), x, 1.0, 64)
    took = time.monotonic() - t0
    # woken once, then again at most once a grace spent ticking
    assert 1 <= len(rearmed) <= 1 + took / 0.05, (len(rearmed), runs, took)


def reads_lagging_in_the_thread(read: Callable[[], int]) -> Callable[[], int]:
    """A word's reader whose every read by the dispatcher thread gives what
    its previous read found: as if the GPU reached each mark between two
    reads the thread makes.  The loop's reads are the word's own."""
    last = [read()]

    def lagging() -> int:
        now = read()
        if threading.current_thread().name != "gpuflow-dispatcher":
            return now
        seen, last[0] = last[0], now
        return seen

    return lagging


@pytest.mark.anyio
async def test_a_mark_reached_while_the_thread_looks_is_left_to_the_pipe_that_wakes_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dispatcher thread decides whether a stream's runs are its to
    complete, and how far, from one read of its word: a mark the GPU
    reaches while the thread looks (here at every look) is left, for a
    tick, to the loop that the mark's pipe wakes, busy as that loop is, and
    no wake-up is posted from the thread."""
    reinit(busy_poll_us=0)  # (a pipe for every await)
    one = gf.SingleStream()
    x = await gf.zeros(64, F32).run(one)
    lane = get_runtime().dispatcher._lanes[one.stream.raw]
    lane.read = reads_lagging_in_the_thread(lane.read)
    posts = record_posts(monkeypatch)
    pipes = count_pipes(monkeypatch)
    # (the loop's turns last 15 ms: it sees each pipe up to then, inside
    # the thread's tick of 20 ms, which a tick after the mark may fall in)
    async with other_task_working(0.015):
        for i in range(12):
            await K.slow_fill(x, float(i), 0.001).run(one)
    np.testing.assert_array_equal(await gf.to_host(x).run(one), np.full(64, 11.0, F32))
    assert len(pipes) == 13
    assert posts == []


@pytest.mark.parametrize("behind", ["marked", "owing its mark"])
@pytest.mark.anyio
async def test_a_fast_await_is_not_held_by_slow_work_queued_behind_it(
    monkeypatch: pytest.MonkeyPatch, behind: str
) -> None:
    # on one stream: a short run, then (its mark already enqueued) a long one,
    # with its own mark or (where that failed) owing the stream's next; the
    # loop polls for 50 ms, long after the long run was queued
    reinit(busy_poll_us=50_000)
    one = gf.SingleStream()
    x = await gf.zeros(64, F32)
    y = await gf.zeros(64, F32)
    backend = get_runtime().backend
    took: dict[str, float] = {}
    idle_after: dict[str, bool] = {}

    async def run(name: str, op: gf.DeviceOperation[Any]) -> None:
        t0 = time.monotonic()
        await op.run(one)
        took[name] = time.monotonic() - t0
        idle_after[name] = backend.query(one.stream.raw)  # its work is the stream's last

    enqueued = anyio.Event()

    def short(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        enqueued.set()  # (the run is submitted before its task next yields)
        return K.slow_fill(x, 1.0, 0.15)

    pipes = count_pipes(monkeypatch)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "short", gf.with_context(short))
            await enqueued.wait()  # submitted by now, and still running
            if behind == "marked":
                K.slow_fill(y, 2.0, 1.5).enqueue_on(one.stream)
            else:
                lane = one.stream.lane
                assert lane is not None
                with monkeypatch.context() as m:

                    def refuse(polled: bool = True) -> int:
                        raise RuntimeError("the mark was refused")

                    m.setattr(lane, "mark", refuse)  # (the stream's marks, made once)
                    with pytest.raises(RuntimeError, match="the mark was refused"):
                        K.slow_fill(y, 2.0, 1.5).enqueue_on(one.stream)
                assert lane.unmarked
    assert idle_after == {"short": False}
    # woken at its own end: the dispatcher thread watched its word, since a
    # host function armed once the long run was queued would wait for it
    # (1.65 s; a margin of 0.85 s for a loaded machine)
    assert took["short"] < 0.8, took
    assert pipes == []
    await gf.to_host(y).run(one)
    np.testing.assert_array_equal(await gf.to_host(y), np.full(64, 2.0, F32))


@pytest.mark.anyio
async def test_a_run_left_to_the_thread_as_the_loop_sleeps_is_seen_done_at_its_end() -> None:
    # a short run with a long one queued behind it: once the loop's budget
    # is spent it sleeps, and the dispatcher thread watches the short run's
    # word every millisecond; the loop no longer reads it, so the thread
    # does not wait for a loop that is not turning before it takes the run
    reinit(busy_poll_us=200)
    one = gf.SingleStream()
    x = await gf.zeros(64, F32)
    y = await gf.zeros(64, F32)
    stats = gf.lowlevel.current_completion_statistics
    took: list[float] = []

    async def timed(op: gf.DeviceOperation[Any]) -> None:
        t0 = time.monotonic()
        await op.run(one)
        took.append(time.monotonic() - t0)

    before = stats()
    for _ in range(3):
        enqueued = anyio.Event()

        def short(ctx: gf.ExecutionContext, enqueued: anyio.Event = enqueued) -> Any:
            enqueued.set()  # (the run is submitted before its task next yields)
            return K.slow_fill(x, 1.0, 0.004)

        async with anyio.create_task_group() as tg:
            tg.start_soon(timed, gf.with_context(short))
            await enqueued.wait()  # submitted, and being polled for
            K.slow_fill(y, 2.0, 0.05).enqueue_on(one.stream)
        await gf.to_host(y).run(one)  # (the next short run queues behind nothing)
    after = stats()
    assert after.watched_by_thread - before.watched_by_thread >= 3, (before, after)
    # each within a few milliseconds of its 4 ms, not LOOP_STALL_S (20 ms) later
    assert min(took) < 0.014, took
    await gf.wait_stream(one.stream)


@pytest.mark.parametrize("busy_poll_us", [0, 200, 50_000])
@pytest.mark.anyio
async def test_fast_awaits_started_with_slow_ones_finish_at_their_own_end(
    busy_poll_us: float,
) -> None:
    """Eight tasks start together on the default policy, four with short
    kernels and four with long ones: no short await waits for a long kernel,
    whatever stream it shares and whether its loop polls or sleeps."""
    reinit(busy_poll_us=busy_poll_us)
    slow, fast = 0.6, 0.001
    took: dict[int, float] = {}

    async def request(i: int) -> None:
        seconds = slow if i % 2 else fast
        op = gf.zeros(64, F32).then(lambda a: K.slow_fill(a, float(i), seconds))
        t0 = time.monotonic()
        out = await gf.to_host(op)
        took[i] = time.monotonic() - t0
        assert out[0] == i

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(request, i)
    fast_took = sorted(took[i] for i in range(0, 8, 2))
    assert fast_took[-1] < slow / 2, fast_took


@needs_proc
@pytest.mark.anyio
async def test_awaits_leave_no_file_descriptor_open() -> None:
    reinit(busy_poll_us=0)  # every await takes a pipe
    counters = [await gf.zeros(1, np.int32) for _ in range(32)]
    before = open_fds()  # the loop's epoll set is open by now

    async def worker(c: gf.DeviceArray) -> None:
        for _ in range(10):
            await K.module().count(gf.LaunchConfig(1, 1), c)

    async with anyio.create_task_group() as tg:
        for c in counters:
            tg.start_soon(worker, c)
    for c in counters:
        assert int((await gf.to_host(c))[0]) == 10
    wait_until(lambda: open_fds() <= before + 2, f"{open_fds() - before} descriptors left open")


@pytest.mark.anyio
async def test_past_the_pipe_limit_the_dispatcher_thread_wakes_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuflow._core import _completion  # the limit itself

    reinit(busy_poll_us=0)
    monkeypatch.setattr(_completion, "MAX_FD_SIGNALS", 1)
    posts = record_posts(monkeypatch)
    arrays = [await gf.zeros(16, F32) for _ in range(16)]
    pool = gf.StreamPoolRoundRobin()

    async def worker(a: gf.DeviceArray) -> None:
        for r in range(4):
            await K.slow_fill(a, float(r + 1), 0.002).run(pool)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for a in arrays:
                tg.start_soon(worker, a)
    for a in arrays:
        np.testing.assert_array_equal(await gf.to_host(a), np.full(16, 4.0, F32))
    assert posts, "every run took a pipe although the limit is one in flight"


@pytest.mark.anyio
async def test_a_run_cancelled_as_it_was_submitted_still_completes() -> None:
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
    # the cancelled run's work still ran, and it was completed: nothing is left pending
    np.testing.assert_array_equal(await gf.to_host(y), np.full(64, 2.0, F32))
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 1.0, F32))


@pytest.mark.anyio
@pytest.mark.parametrize("trap", ["yielded", "public"])
async def test_a_parked_await_wakes_with_its_run_and_raises_its_cancellation(
    trap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under Trio a parked await yields Trio's own request to its scheduler
    (where Trio keeps it as this release does), else calls
    ``wait_task_rescheduled``; under asyncio it parks on a future.  Every way,
    the GPU's wake-up resumes it, and a cancellation raises at the await."""
    reinit(busy_poll_us=0)  # no spin, no poll: every await of unfinished work parks
    loop = current_loop()
    if isinstance(loop, _loops._Trio):
        if trap == "public":
            monkeypatch.setattr(loop, "_trap", None)
        else:
            assert loop._trap is not None, "Trio's park request was not found"
    parks: list[object] = []
    park = type(loop).park

    def counted(self: Any) -> Any:
        parks.append(p := park(self))
        return p

    monkeypatch.setattr(type(loop), "park", counted)
    x = await gf.zeros(64, F32)
    parks.clear()
    await K.slow_fill(x, 1.0, 0.05)
    assert len(parks) == 1
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 1.0, F32))
    parks.clear()
    reached = False
    with anyio.move_on_after(0.05) as scope:
        await K.slow_fill(x, 2.0, 0.5)
        reached = True
    assert scope.cancelled_caught and not reached
    assert len(parks) == 1
    # the cancelled run's work is not recalled: it ends, and is completed
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 2.0, F32))


async def _await(op: gf.DeviceOperation[Any]) -> None:
    await op


# -- loops that stop, streams that go, processes that exit --------------------------------------


class _StoppedLoop:
    """A loop (as gpuflow's loop adapters present one) that never runs again:
    it accepts a poller and a file descriptor to watch, and calls neither."""

    def __init__(self) -> None:
        self.watched: list[int] = []
        self.kicks = 0
        self.ended = False
        self.yielded = self.asked = self.slept_cpu = 0.0
        self.slept_waits = 0
        self.awaiting = 0
        self.checkpoint_if_cancelled: Any = anyio.lowlevel.checkpoint_if_cancelled
        self.checkpoint: Any = anyio.lowlevel.checkpoint
        self.may_be_cancelled: Any = lambda: True
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
    # a loop that stopped (not closed) with a run awaited: the dispatcher
    # thread completes what the GPU finished, a tick later than the loop would
    reinit(busy_poll_us=busy_poll_us)
    dispatcher = get_runtime().dispatcher
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
    be = get_runtime().backend
    be.wait_event(stream.raw, be.record_event(other.raw))
    dispatcher.submit(stream.raw, sub)
    assert sub.lane is not None
    dispatcher.watch(stopped, sub.lane)  # what an await does before it parks
    assert len(stopped.watched) == 1  # the loop was given its epoll set
    if busy_poll_us == 0:
        assert sub.lane.wake_for == sub.number  # a pipe was armed, on the run's stream
    assert alive() is not None and not sub.done
    _wait_done(sub)
    assert sub.error is None and alive() is None
    # what it left open waits for the loop (the fd numbers are the loop's to
    # reuse); once the loop has ended, the dispatcher thread closes it all
    stopped.ended = True
    wait_until(lambda: open_fds() <= before, "the ended loop's descriptors stayed open")
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(16, 3.0, F32))


def test_a_stream_whose_runs_the_gpu_finished_is_idle_before_anyone_looks() -> None:
    # a run no loop ever completes (its loop stopped) still leaves its stream
    # idle to the default policy once the GPU has reached its mark
    dispatcher = get_runtime().dispatcher
    pool = gf.lowlevel.pool_streams()
    x = gf.zeros(16, F32).sync()
    sub = Run(0)
    dispatcher.submit(pool[0].raw, sub)
    wait_until(sub.reached, "the GPU never reached the mark")
    for s in pool[1:]:
        K.slow_fill(x, 1.0, 0.5).enqueue_on(s)
    policy = gf.StreamPoolLeastLoaded(max_streams=len(pool))
    assert {policy.next_stream(0) for _ in pool} == {pool[0]}
    _wait_done(sub)


def test_runs_no_loop_awaits_hold_their_stream_for_no_host_function() -> None:
    if gf.current_backend() != "sim":
        pytest.skip("the record of what the streams ran is the simulator's")
    stream = gf.new_stream()
    x = gf.zeros(16, F32).sync()
    subs = []
    with gf.testing.record_activity() as activity:
        for i in range(30):
            sub = Run(0)
            K.slow_fill(x, float(i), 0.002).enqueue_on(stream)
            get_runtime().dispatcher.submit(stream.raw, sub)
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
    lane: Any = stream.lane
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
    dispatcher = get_runtime().dispatcher
    lane: Any = dispatcher.lane(raw, 0)
    mark = lane.mark  # (the stream's marks, made once)

    def refuse(polled: bool = True) -> int:
        raise RuntimeError("the mark was refused")

    lane.mark = refuse
    try:
        dispatcher.submit(raw, sub)
    except RuntimeError as exc:
        assert "the mark was refused" in str(exc)
    else:
        raise AssertionError("the refused mark was not raised")
    finally:
        lane.mark = mark
    assert sub.lane is not None and sub.lane.raw is raw and sub.lane.unmarked


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "beside another await"])
@pytest.mark.anyio
async def test_an_await_of_a_run_that_owes_its_mark_enqueues_it(alone: bool) -> None:
    """A run whose mark could not be enqueued owes it: an await of the run
    enqueues it (a lone one before it spins, the loop's poller at its
    turn), rather than leave the run pending until the busy-poll budget runs
    out and the loop arms a wake-up."""
    reinit(busy_poll_us=2_000_000)
    stream = gf.new_stream()
    lane = stream.lane
    assert lane is not None
    x = await gf.zeros(16, F32)
    y = await gf.zeros(16, F32)
    stats = gf.lowlevel.current_completion_statistics
    before = stats()

    async def another() -> None:
        await K.slow_fill(y, 3.0, 0.3)  # (on a pool stream)

    K.slow_fill(x, 1.0, 0.02).enqueue_on(stream)  # marked at once: the stream was idle
    lane.polled_until = time.monotonic() + 60  # (keeps the dispatcher thread from the lane)
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


def test_runs_no_loop_awaits_have_their_owed_mark_enqueued_by_the_dispatcher_thread() -> None:
    stream = gf.new_stream()
    lane = stream.lane
    assert lane is not None
    x = gf.zeros(16, F32).sync()
    K.slow_fill(x, 1.0, 0.01).enqueue_on(stream)  # marked at once: the stream was idle
    sub = Run(0)
    K.slow_fill(x, 2.0, 0.05).enqueue_on(stream)
    _submit_owing(stream.raw, sub)
    assert sub.number == lane.issued + 1
    _wait_done(sub)  # nothing else here enqueues the mark it owes
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(16, 2.0, F32))


def test_a_synchronize_enqueues_the_mark_its_streams_runs_owe() -> None:
    """After ``stream.synchronize()`` every run enqueued on the stream before
    it is seen done at the next read of its word, owed mark or not."""
    stream = gf.new_stream()
    lane = stream.lane
    assert lane is not None
    x = gf.zeros(16, F32).sync()
    K.slow_fill(x, 1.0, 0.02).enqueue_on(stream)
    lane.polled_until = time.monotonic() + 60  # (keeps the dispatcher thread from the lane)
    try:
        K.slow_fill(x, 2.0, 0.001).enqueue_on(stream)
        _submit_owing(stream.raw, Run(0))
        owed = lane.issued + 1
        stream.synchronize()
        assert not lane.unmarked and lane.read() >= owed
    finally:
        lane.polled_until = 0.0
    wait_until(lambda: not get_runtime().dispatcher.pending, "the runs never completed")


def test_a_stream_dropped_with_a_mark_owed_enqueues_it_first() -> None:
    x = gf.zeros(16, F32).sync()
    stream = gf.new_stream()
    lane = stream.lane
    assert lane is not None
    K.slow_fill(x, 1.0, 0.02).enqueue_on(stream)
    lane.polled_until = time.monotonic() + 60  # (keeps the dispatcher thread from the lane)
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
        time.sleep(0.03)  # a dispatcher tick or more; the work has 70 ms to go
        assert alive() is not None, f"round {i}: released while its work was running"
    deadline = time.monotonic() + 5
    while get_runtime().dispatcher.pending:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(64, rounds - 1, F32))


def test_a_stream_dropped_right_after_its_runs_still_completes_them() -> None:
    x = gf.zeros(16, F32).sync()
    stream = gf.new_stream()
    subs = [Run(0) for _ in range(3)]
    for i, sub in enumerate(subs):
        K.slow_fill(x, float(i), 0.05).enqueue_on(stream)
        get_runtime().dispatcher.submit(stream.raw, sub)
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
        time.sleep(0.1)  # several dispatcher ticks query the stream meanwhile
        assert alive() is not None
        stream.synchronize()
        deadline = time.monotonic() + 5
        while rt.dispatcher.pending:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    monkeypatch.undo()
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(16, 5.0, F32))


def test_a_process_that_exits_completes_its_pending_runs_first() -> None:
    # what a run keeps is released (and its callbacks run) before the
    # interpreter goes away, not from a daemon thread during finalization
    code = r"""
import gpuflow as gf, kernels as K
from gpuflow.lowlevel import Run
gf.init_device_contexts(backend="sim")
x = gf.zeros(16, "float32").sync()
stream = gf.new_stream()
K.slow_fill(x, 1.0, 0.3).enqueue_on(stream)
sub = Run(0)
sub.add_done_callback(lambda err: print("released before exit", flush=True))
from gpuflow._core._runtime import get_runtime
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


# -- the busy-poll budget ----------------------------------------------------------------------


def test_the_busy_poll_budget_comes_from_the_argument_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuflow._core._runtime import DEFAULT_BUSY_POLL_US  # the documented default

    backend = gf.current_backend()
    monkeypatch.delenv("GPUFLOW_BUSY_POLL_US", raising=False)
    gf.init_device_contexts(backend=backend)
    assert get_runtime().dispatcher.busy_poll_s == DEFAULT_BUSY_POLL_US / 1e6
    monkeypatch.setenv("GPUFLOW_BUSY_POLL_US", "35.5")
    gf.init_device_contexts(backend=backend)
    assert get_runtime().dispatcher.busy_poll_s == pytest.approx(35.5e-6)
    gf.init_device_contexts(backend=backend, busy_poll_us=0)  # the argument wins
    assert get_runtime().dispatcher.busy_poll_s == 0
    monkeypatch.setenv("GPUFLOW_BUSY_POLL_US", "fast")
    with pytest.raises(gf.UsageError, match="GPUFLOW_BUSY_POLL_US='fast'"):
        gf.init_device_contexts(backend=backend)
    monkeypatch.delenv("GPUFLOW_BUSY_POLL_US")
    for bad in (-1, float("nan"), "10", True):
        with pytest.raises(gf.UsageError, match="busy_poll_us"):
            gf.init_device_contexts(backend=backend, busy_poll_us=bad)  # type: ignore[arg-type]
    # the runtime in use is still the last good one
    assert get_runtime().dispatcher.busy_poll_s == 0


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
        get_runtime().dispatcher.submit(stream.raw, sub)
    woken: list[str] = []

    def parked() -> int:
        extra = sub.more_parked
        return (sub.parked is not None) + (len(extra) if extra else 0)

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
                get_runtime().dispatcher.finish(sub)
        while other.is_alive():
            await anyio.sleep(0.001)
    assert sorted(woken) == ["first", "other loop", "second"]
    assert parked() == 0  # (nothing of the tasks is held past the run)


@pytest.mark.anyio
async def test_a_task_does_not_park_on_a_run_finished_as_it_parks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run may finish between an await's last look and its parking
    (the dispatcher thread completes it meanwhile): the await then goes on
    at once; it must not park, since nobody would wake it."""
    loop = current_loop()
    sub = Run(0)  # never submitted: finished by hand, as the task parks
    real_park = type(loop).park

    def finishing_park(self: Any) -> Any:
        get_runtime().dispatcher.finish(sub)
        return real_park(self)

    monkeypatch.setattr(type(loop), "park", finishing_park)
    with anyio.fail_after(5):
        await sub.wait()
    assert sub.done and sub.parked is None


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
    rt = get_runtime()
    raw = rt.backend.create_stream(0)
    rt.backend.destroy_stream(raw)
    before = rt.dispatcher.pending
    sub = Run(0)
    with pytest.raises(gf.UsageError, match="destroyed"):
        rt.dispatcher.submit(raw, sub)
    assert rt.dispatcher.pending == before and sub.lane is None
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
