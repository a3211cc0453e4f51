"""The completion bridge: completion words read while busy, the GPU's wake-up when idle.

Every run ends with a mark on its stream: the GPU writes the run's number
into the stream's completion word.  A loop with runs pending reads the words
once per turn and completes what they cover, in its own thread; once no run
has completed for the busy-poll budget, it arms a wake-up (a pipe the GPU
closes right after the oldest pending run, or, where work is already queued
behind that run, the completer thread watching the word) and sleeps.
Whatever ends a loop early (a cancellation, a loop that stops or ends), no
run is left pending, and no file descriptor is left open.

These tests drive the completer and the loop adapters themselves, so they
import the private modules that hold them (``_completion``, ``_runtime``,
``_loops``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K
from helpers.completion import F32, needs_proc, open_fds, reinit, wait_until

import gpuflow as gf
from gpuflow._core import _loops
from gpuflow._core._loops import current_loop
from gpuflow._core._run import Run
from gpuflow._core._runtime import ensure_runtime


def count_pipes(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every pipe wake-up the backend is asked to enqueue (its stream)."""
    backend = ensure_runtime().backend
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
    wake-up was armed and the completer thread completed no run: the
    loop's own reads saw every run done.  Returns the statistics now."""
    after = gf.lowlevel.current_completion_statistics()
    assert pipes == []
    assert (after.by_thread, after.watched_by_thread) == (
        before.by_thread, before.watched_by_thread
    ), (before, after)
    return after


def record_posts(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every wake-up posted to a loop from another thread."""
    from gpuflow._core import _completion  # the post the completer thread makes
    from gpuflow._core._loops import post as real_post

    posts: list[Any] = []

    def recorded(*args: Any) -> None:
        posts.append(args)
        real_post(*args)

    monkeypatch.setattr(_completion, "post", recorded)
    return posts


def completing_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen_on: list[int] = []
    complete = Run._complete

    def noted(run: Run, err: BaseException | None, here: Any, posts: Any) -> None:
        seen_on.append(threading.get_ident())
        complete(run, err, here, posts)

    monkeypatch.setattr(Run, "_complete", noted)
    return seen_on








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
    real_spin = _run._spin_inline

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

    monkeypatch.setattr(_run, "_spin_inline", spying)
    other = Run(0)  # never submitted: finished by hand below

    async def other_await() -> None:
        await other.wait()
        resumed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_await)
        await anyio.wait_all_tasks_blocked()  # parked in its await
        ensure_runtime().completer.complete([other])  # woken: it resumes at a later turn
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
    real_spin = _run._spin_inline

    def spin_once_done(run: Any, loop: Any, lane: Any) -> bool:
        # sim's device is a thread of this process: the spin, holding the
        # GIL, would see it done only by chance; here it always does
        while lane.read() < run._number:
            time.sleep(1e-4)
        return real_spin(run, loop, lane)

    monkeypatch.setattr(_run, "_spin_inline", spin_once_done)
    if between != "sleeps":
        share = 1.0 if between == "computes" else 0.1  # (of the time, the thread ran)
        t0 = time.perf_counter()
        monkeypatch.setattr(
            _run, "_thread_usage", lambda: ((time.perf_counter() - t0) * share, 0)
        )
    yields = [0]
    counting = [False]
    loop = current_loop()
    checkpoint = loop.checkpoint  # (the one the await yields at: its loop's)

    async def counted() -> None:
        yields[0] += counting[0]
        await checkpoint()

    monkeypatch.setattr(loop, "checkpoint", counted)
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
    # a run no loop awaits: the completer thread completes it
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
    # hundreds; turns short of the completer thread's 20 ms, which would
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
@pytest.mark.alone  # (a loop starved of the CPU is one the completer thread serves)
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
@pytest.mark.alone  # (a loop starved of the CPU is one the completer thread serves)
async def test_the_completer_thread_leaves_a_busy_loops_runs_to_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # turns of 3 ms (other tasks' CPU work) and runs of 1 ms: every run is
    # done well before the turn that reads its word.  The loop reads it
    # there all the same: the completer thread, ticking meanwhile, leaves a
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
async def test_awaits_of_short_runs_do_not_wake_the_completer_thread_each(
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
    completer = ensure_runtime().completer
    busy = completer._busy
    monkeypatch.setattr(
        completer, "_busy",
        lambda: busy() and threading.current_thread() is not completer._thread,
    )
    real_wait = completer._cv.wait
    rearmed: list[float] = []  # wake-ups of the sleeping thread

    def counted(timeout: float | None = None) -> bool:
        woke = real_wait(timeout)
        if timeout is None:
            rearmed.append(time.monotonic())
        return woke

    monkeypatch.setattr(completer._cv, "wait", counted)
    deadline = time.monotonic() + 5.0
    while completer._armed:  # asleep first
        assert time.monotonic() < deadline, "the completer thread never went to sleep"
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
    """A word's reader whose every read by the completer thread gives what
    its previous read found: as if the GPU reached each mark between two
    reads the thread makes.  The loop's reads are the word's own."""
    last = [read()]

    def lagging() -> int:
        now = read()
        if threading.current_thread().name != "gpuflow-completer":
            return now
        seen, last[0] = last[0], now
        return seen

    return lagging


@pytest.mark.anyio
async def test_a_mark_reached_while_the_thread_looks_is_left_to_the_pipe_that_wakes_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The completer thread decides whether a stream's runs are its to
    complete, and how far, from one read of its word: a mark the GPU
    reaches while the thread looks (here at every look) is left, for a
    tick, to the loop that the mark's pipe wakes, busy as that loop is, and
    no wake-up is posted from the thread."""
    reinit(busy_poll_us=0)  # (a pipe for every await)
    one = gf.SingleStream()
    x = await gf.zeros(64, F32).run(one)
    lane = ensure_runtime().completer._lanes[one.stream.raw]
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
    backend = ensure_runtime().backend
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
                lane = one.stream._lane
                assert lane is not None
                with monkeypatch.context() as m:

                    def refuse(polled: bool = True) -> int:
                        raise RuntimeError("the mark was refused")

                    m.setattr(lane, "mark", refuse)  # (the stream's marks, made once)
                    with pytest.raises(RuntimeError, match="the mark was refused"):
                        K.slow_fill(y, 2.0, 1.5).enqueue_on(one.stream)
                assert lane.unmarked
    assert idle_after == {"short": False}
    # woken at its own end: the completer thread watched its word, since a
    # host function armed once the long run was queued would wait for it
    # (1.65 s; a margin of 0.85 s for a loaded machine)
    assert took["short"] < 0.8, took
    assert pipes == []
    await gf.to_host(y).run(one)
    np.testing.assert_array_equal(await gf.to_host(y), np.full(64, 2.0, F32))


@pytest.mark.alone  # (bounds the time it takes)
@pytest.mark.anyio
async def test_a_run_left_to_the_thread_as_the_loop_sleeps_is_seen_done_at_its_end() -> None:
    # a short run with a long one queued behind it: once the loop's budget
    # is spent it sleeps, and the completer thread watches the short run's
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


@pytest.mark.parametrize("busy_poll_us", [0, 50_000])
@pytest.mark.anyio
async def test_a_run_queued_behind_another_on_its_stream_completes_at_its_own_mark(
    busy_poll_us: float,
) -> None:
    """Two awaited runs on one stream: the GPU reaching the first run's mark
    completes the first alone, never the second, whose work (a slower fill,
    then its copy to the host) is still to come."""
    reinit(busy_poll_us=busy_poll_us)
    policy = gf.SingleStream()
    a, b = await gf.zeros(64, F32).run(policy), await gf.zeros(64, F32).run(policy)
    first_done = anyio.Event()
    second: list[np.ndarray] = []

    async def first() -> None:
        await gf.to_host(K.slow_fill(a, 1.0, 0.1)).run(policy)
        first_done.set()

    async def then_second() -> None:
        second.append(await gf.to_host(K.slow_fill(b, 2.0, 0.3)).run(policy))
        assert first_done.is_set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await anyio.sleep(0.02)  # (the first run is in flight on the stream)
        tg.start_soon(then_second)
    np.testing.assert_array_equal(second[0], np.full(64, 2.0, F32))


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
async def test_past_the_pipe_limit_the_completer_thread_wakes_the_loop(
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


