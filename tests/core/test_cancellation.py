"""Cancellation safety under asyncio and Trio.

Cancelling a task that awaits an operation raises the loop's own
cancellation at once; what the task has not enqueued yet is never enqueued;
what was enqueued cannot be recalled, so it finishes on the GPU while every
buffer it uses stays alive (``sim`` poisons freed memory and counts every
device access to it: a buffer freed early is a use after free, never a
silent read).  The hypothesis suite at the end cancels random pipelines at
random points and checks, after every case, that gpuflow is quiescent: no
run pending, no lease held, no use after free, no threads left behind.

``GPUFLOW_SOAK_EXAMPLES`` sets the number of hypothesis cases per event loop
(default 125: 250 cases in CI); raise it for a soak on the GPU.
"""

from __future__ import annotations

import gc
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gpuflow as gf
from gpuflow import testing

F32 = np.float32
I32 = np.int32
N = 256
M = K.module()
#: how late "promptly" may be: a loop wake-up, with a generous margin
PROMPT = 0.15


def slow_fill(x: Any, v: float, seconds: float, n: int = N) -> gf.DeviceOperation[Any]:
    return M.slow_fill(K.cfg(n), x, v, n, int(seconds * 1e9))


def bump(c: gf.DeviceArray) -> gf.DeviceOperation[Any]:
    return M.count(gf.LaunchConfig(1, 1), c)


async def count(c: gf.DeviceArray) -> int:
    return int((await gf.to_host(c))[0])


# -- the task gets the loop's own cancellation, at once --------------------------------------------


@pytest.mark.anyio
async def test_cancelling_an_await_raises_the_loops_cancellation_promptly() -> None:
    x = await gf.zeros(N, F32)
    op = slow_fill(x, 5.0, 0.5)
    caught: list[tuple[BaseException, float]] = []

    async def waiter(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        try:
            await op
        except BaseException as exc:
            caught.append((exc, time.perf_counter()))
            raise

    async with anyio.create_task_group() as tg:
        await tg.start(waiter)
        await anyio.sleep(0.05)
        t_cancel = time.perf_counter()
        tg.cancel_scope.cancel()
    (exc, t), = caught
    # the loop's own exception, not wrapped nor replaced
    assert type(exc) is anyio.get_cancelled_exc_class()
    assert t - t_cancel < PROMPT, f"cancellation reached the task after {t - t_cancel:.3f} s"
    # the kernel could not be recalled: it finishes and its result is there
    np.testing.assert_array_equal(await gf.to_host(x), np.full(N, 5, F32))


@pytest.mark.anyio
async def test_many_tasks_on_many_streams_are_cancelled_at_once() -> None:
    xs = [await gf.zeros(N, F32) for _ in range(8)]
    ops = [slow_fill(x, float(i), 0.3) for i, x in enumerate(xs)]
    late: list[float] = []

    async def waiter(i: int) -> None:
        try:
            await ops[i]  # round robin: the eight runs spread over the pool
        except anyio.get_cancelled_exc_class():
            late.append(time.perf_counter() - t_cancel)
            raise

    t_cancel = math.inf
    async with anyio.create_task_group() as tg:
        for i in range(len(xs)):
            tg.start_soon(waiter, i)
        await anyio.sleep(0.03)
        t_cancel = time.perf_counter()
        tg.cancel_scope.cancel()
    assert len(late) == len(xs) and max(late) < PROMPT
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(await gf.to_host(x), np.full(N, i, F32))


# -- what was not enqueued is never enqueued -------------------------------------------------------


@pytest.mark.anyio
async def test_later_awaits_of_a_cancelled_task_are_never_enqueued() -> None:
    c = await gf.zeros(1, I32)
    x = await gf.zeros(N, F32)

    async def steps() -> None:
        await slow_fill(x, 1.0, 0.15)
        await bump(c)
        await bump(c).then(lambda _: bump(c))

    with anyio.move_on_after(0.03) as scope:
        await steps()
    assert scope.cancelled_caught
    await gf.to_host(x)  # ordered after the slow kernel
    await anyio.sleep(0.05)
    assert await count(c) == 0
    await steps()  # the control: run to the end, the three bumps happen
    assert await count(c) == 3


@pytest.mark.anyio
async def test_an_already_cancelled_task_enqueues_nothing() -> None:
    c = await gf.zeros(1, I32)
    host_calls: list[str] = []

    def then_fn(_: Any) -> gf.DeviceOperation[Any]:
        host_calls.append("then")
        return bump(c)

    with anyio.CancelScope() as scope:
        scope.cancel()
        await bump(c)
    assert scope.cancelled_caught
    with anyio.move_on_after(0) as scope:
        await bump(c).then(then_fn)
    assert scope.cancelled_caught
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0):
            await gf.to_host(bump(c))
    await anyio.sleep(0.05)
    assert host_calls == []
    assert await count(c) == 0


@pytest.mark.anyio
async def test_a_cancelled_outer_scope_stops_a_run_and_a_shield_inside_it_does_not() -> None:
    """Whether a run may start is asked of every scope out to the first
    shielded one, as AnyIO's and Trio's checkpoints ask it."""
    c = await gf.zeros(1, I32)

    async def run_bump() -> None:
        await bump(c)

    async def in_a_task_group() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_bump)  # (the group's scope and the task's, inside)

    for inner in (run_bump, in_a_task_group):
        with anyio.CancelScope() as outer:
            outer.cancel()
            with anyio.CancelScope():  # not cancelled itself
                await inner()
        assert outer.cancelled_caught
    with anyio.CancelScope() as outer:
        outer.cancel()
        with anyio.CancelScope(shield=True):
            await run_bump()
    await anyio.sleep(0.05)
    assert await count(c) == 1  # the shielded run ran; the two before did not


# -- every buffer stays alive until the GPU is done ------------------------------------------------


def _pipeline(src: np.ndarray, seconds: float) -> gf.DeviceOperation[np.ndarray]:
    """Two zip arms (one slow, on another stream) joined by a kernel, read back."""
    n = src.size
    slow = gf.zeros(n, F32).then(lambda a: slow_fill(a, 2.0, seconds, n))
    return gf.to_host(
        gf.zip(slow, gf.copy(gf.from_host(src))).then(
            lambda t: M.vadd(K.cfg(n), t[0], t[1], gf.zeros(n, F32), n)
        )
    )


@pytest.mark.anyio
async def test_dropping_every_reference_after_cancelling_frees_nothing_early() -> None:
    src = np.arange(N, dtype=F32)
    for _ in range(3):
        op = _pipeline(src, 0.1)
        with anyio.move_on_after(0.02) as scope:
            await op
        assert scope.cancelled_caught
        del op  # the arrays now live only in work still running on the GPU
        gc.collect()
    await testing.assert_quiescent_async(timeout=5)
    assert testing.use_after_free_count() == 0
    # and the device is in order: a following run computes the right thing
    np.testing.assert_array_equal(await _pipeline(src, 0.01), src + 2)


async def _cancel_a_run_over_fresh_arrays() -> None:
    x = await gf.from_host(np.full(N, 3, F32))
    y = await gf.zeros(N, F32)
    out = await gf.zeros(N, F32)
    op = slow_fill(y, 4.0, 0.1).then(lambda yy: M.vadd(K.cfg(N), x, yy, out, N))
    with anyio.move_on_after(0.02) as scope:
        await op
    assert scope.cancelled_caught
    # returning drops the user's arrays while the slow kernel still writes y


@pytest.mark.anyio
async def test_arrays_dropped_while_a_slow_kernel_still_writes_them() -> None:
    for _ in range(3):
        await _cancel_a_run_over_fresh_arrays()
        gc.collect()
    await testing.assert_quiescent_async(timeout=5)
    assert testing.use_after_free_count() == 0


def _fail(_: Any) -> gf.DeviceOperation[Any]:
    raise ValueError("failed half-way")


@pytest.mark.anyio
async def test_a_run_failing_half_way_keeps_what_it_enqueued_alive() -> None:
    c = await gf.zeros(1, I32)
    # the slow kernel is enqueued, then building the rest of the recipe fails
    op = gf.zeros(N, F32).then(lambda x: slow_fill(x, 1.0, 0.3)).then(_fail)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="half-way"):
        await op
    assert time.perf_counter() - t0 < 0.2, "the failure waited for the GPU"
    del op
    gc.collect()
    # inside a lease, the exit waits for what the failed run enqueued
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="half-way"):
        async with gf.open_stream_lease():
            await gf.zeros(N, F32).then(lambda x: slow_fill(x, 1.0, 0.3)).then(_fail)
    assert time.perf_counter() - t0 >= 0.3 - 0.01
    await testing.assert_quiescent_async(timeout=5)
    await bump(c)  # and the device works on
    assert await count(c) == 1


def test_asyncio_native_cancellation() -> None:
    import asyncio

    async def main() -> None:
        x = await gf.zeros(N, F32)
        op = slow_fill(x, 2.0, 0.4)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(op.run(), 0.05)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await op
        task = asyncio.ensure_future(op.run())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.perf_counter() - t0 < 0.4, "native cancellation waited for the GPU"
        np.testing.assert_array_equal(await gf.to_host(x), np.full(N, 2, F32))

    asyncio.run(main())
    testing.assert_quiescent(timeout=5)


def test_trio_native_cancellation() -> None:
    import trio

    async def main() -> None:
        x = await gf.zeros(N, F32)
        op = slow_fill(x, 3.0, 0.4)
        t0 = time.perf_counter()
        with trio.move_on_after(0.05) as scope:
            await op
        assert scope.cancelled_caught
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(0.05):
                await op
        assert time.perf_counter() - t0 < 0.4, "native cancellation waited for the GPU"
        np.testing.assert_array_equal(await gf.to_host(x), np.full(N, 3, F32))

    trio.run(main)
    testing.assert_quiescent(timeout=5)


# -- move_on_after, fail_after, shields ------------------------------------------------------------


@pytest.mark.anyio
async def test_fail_after_around_an_await() -> None:
    x = await gf.zeros(N, F32)
    op = slow_fill(x, 1.0, 0.4)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            await op
    assert time.perf_counter() - t0 < 0.05 + PROMPT
    # a generous deadline lets it complete with its result
    with anyio.fail_after(5):
        got = await gf.to_host(slow_fill(x, 2.0, 0.02))
    np.testing.assert_array_equal(got, np.full(N, 2, F32))


@pytest.mark.anyio
async def test_move_on_after_around_an_await() -> None:
    x = await gf.zeros(N, F32)
    got: list[np.ndarray] = []
    op = gf.to_host(slow_fill(x, 1.0, 0.4))
    t0 = time.perf_counter()
    with anyio.move_on_after(0.05) as scope:
        got.append(await op)
    assert scope.cancelled_caught and got == []
    assert time.perf_counter() - t0 < 0.05 + PROMPT
    with anyio.move_on_after(5) as scope:
        got.append(await gf.to_host(slow_fill(x, 3.0, 0.02)))
    assert not scope.cancelled_caught
    np.testing.assert_array_equal(got[0], np.full(N, 3, F32))


@pytest.mark.anyio
async def test_a_shielded_await_completes_inside_a_cancelled_scope() -> None:
    x = await gf.zeros(N, F32)
    got: list[np.ndarray] = []
    with anyio.move_on_after(0.02) as outer:
        with anyio.CancelScope(shield=True):
            got.append(await gf.to_host(slow_fill(x, 6.0, 0.1)))
        await anyio.sleep(1)  # the outer cancellation lands here
    assert outer.cancelled_caught
    np.testing.assert_array_equal(got[0], np.full(N, 6, F32))


@pytest.mark.anyio
async def test_the_outer_deadline_wins_over_an_inner_fail_after() -> None:
    x = await gf.zeros(N, F32)
    op = slow_fill(x, 1.0, 0.3)
    with anyio.move_on_after(0.03) as outer:
        with anyio.fail_after(5):
            await op
    assert outer.cancelled_caught  # a cancellation, not a TimeoutError


# -- hypothesis: random pipelines cancelled at random points ---------------------------------------

SOAK_EXAMPLES = int(os.environ.get("GPUFLOW_SOAK_EXAMPLES", "125"))
#: small arrays keep every case cheap; the hazards are the same
PN = 64
_VALUES = st.integers(0, 4)


def _plans(with_common: bool) -> st.SearchStrategy[Any]:
    leaves = [
        st.tuples(st.just("src"), _VALUES),
        st.tuples(st.just("full"), _VALUES),
        st.tuples(st.just("slow"), _VALUES, st.sampled_from([0, 1, 3, 8, 15])),
    ]
    if with_common:
        leaves.append(st.tuples(st.just("common")))

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.tuples(st.just("scale"), children, st.integers(-2, 3)),
            st.tuples(st.just("add"), children, children),
            st.tuples(st.just("copy"), children),
            st.tuples(st.just("xdev"), children),
            st.tuples(st.just("twice"), children),
            st.tuples(st.just("unzip"), children, children),
            st.tuples(st.just("first"), children, children),
            st.tuples(st.just("map"), children),
        )

    return st.recursive(st.one_of(leaves), extend, max_leaves=6)


_TIMEOUTS = st.none() | st.floats(0.0, 0.02)
_JOBS = st.lists(st.tuples(_plans(True), _TIMEOUTS, st.booleans()), min_size=1, max_size=3)
_CASES = st.tuples(_plans(False), _JOBS, _TIMEOUTS)


@dataclass
class _Env:
    common: gf.SharedOperation[Any]
    common_expected: np.ndarray
    other_device: int


def _build(plan: Any, env: _Env | None) -> tuple[gf.DeviceOperation[Any], np.ndarray]:
    """The operation of ``plan`` and the float32 array it must produce."""
    cfg = K.cfg(PN)
    kind = plan[0]
    if kind == "src":
        return gf.from_host(np.full(PN, plan[1], F32)), np.full(PN, plan[1], F32)
    if kind == "full":
        return gf.full(PN, float(plan[1]), dtype=F32), np.full(PN, plan[1], F32)
    if kind == "slow":
        v, ms = plan[1], plan[2]
        op = gf.zeros(PN, F32).then(lambda x: slow_fill(x, float(v), ms / 1000, PN))
        return op, np.full(PN, v, F32)
    if kind == "common":
        assert env is not None
        return env.common.clone(), env.common_expected
    a, ea = _build(plan[1], env)

    def vadd(t: tuple[Any, ...]) -> gf.DeviceOperation[Any]:
        return M.vadd(cfg, t[0], t[1], gf.zeros(PN, F32), PN)

    if kind == "scale":
        s = plan[2]
        return gf.copy(a).then(lambda y: M.scale(cfg, y, float(s), PN)), ea * F32(s)
    if kind == "copy":
        return gf.copy(a), ea
    if kind == "xdev":
        dev = 0 if env is None else env.other_device
        return gf.copy(gf.copy(a, device=dev), device=0), ea
    if kind == "twice":
        shared = a.shared()
        return gf.zip(shared, shared.clone()).then(vadd), ea + ea
    if kind == "map":
        return a.map(lambda x: x), ea
    b, eb = _build(plan[2], env)
    if kind == "add":
        return gf.zip(a, b).then(vadd), ea + eb
    if kind == "unzip":
        pa, pb = gf.zip(a, b).unzip(2)
        return gf.zip(pb, pa).then(vadd), ea + eb
    if kind == "first":
        return gf.zip(a, b).first(), ea
    raise AssertionError(kind)


async def _run_case(case: Any, other_device: int) -> int:
    """Run one case; return how many of its jobs completed (the rest were cancelled)."""
    common_plan, jobs, outer = case
    common_op, common_expected = _build(common_plan, None)
    env = _Env(common_op.shared(), common_expected, other_device)
    results: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    async def job(i: int, plan: Any, timeout: float | None, leased: bool) -> None:
        op, expected = _build(plan, env)
        final = gf.to_host(op)
        with anyio.move_on_after(math.inf if timeout is None else timeout):
            if leased:
                async with gf.open_stream_lease():
                    results[i] = (await final, expected)
            else:
                results[i] = (await final, expected)

    with anyio.move_on_after(math.inf if outer is None else outer):
        async with anyio.create_task_group() as tg:
            for i, (plan, timeout, leased) in enumerate(jobs):
                tg.start_soon(job, i, plan, timeout, leased)
    if outer is None:  # nothing cancelled the jobs without a timeout of their own
        assert {i for i, j in enumerate(jobs) if j[1] is None} <= set(results)
    for got, expected in results.values():
        np.testing.assert_array_equal(got, expected)
    return len(results)


@pytest.mark.timeout(max(120, SOAK_EXAMPLES // 4))  # a soak of thousands of cases takes minutes
def test_random_pipelines_cancelled_at_random_points(
    anyio_backend_name: str, anyio_backend_options: dict[str, Any]
) -> None:
    other_device = max(gf.open_device_group().devices)
    threads_before = threading.active_count()

    @settings(
        max_examples=SOAK_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_CASES)
    def check(case: Any) -> None:
        completed = anyio.run(
            _run_case, case, other_device,
            backend=anyio_backend_name, backend_options=anyio_backend_options,
        )  # fmt: skip
        event(f"{len(case[1]) - completed} of {len(case[1])} jobs cancelled")
        gc.collect()
        testing.assert_quiescent(timeout=5)  # runs resolved, no lease, no use after free
        assert threading.active_count() <= threads_before + 2, "threads are piling up"

    check()


@pytest.mark.anyio
async def test_an_await_cancelled_in_flight_is_not_woken_when_its_run_completes() -> None:
    """The task of an await cancelled while its run is in flight goes on to
    wait for something else; the run's completion, later, must not wake it
    there (Trio's task, rescheduled, would return from that other wait
    early)."""
    x = await gf.zeros(N, F32)
    with anyio.move_on_after(0.02) as scope:
        await K.slow_fill(x, 1.0, 0.2)
    assert scope.cancelled_caught
    nobody_sets = anyio.Event()
    t0 = time.monotonic()
    with anyio.move_on_after(0.5):
        await nobody_sets.wait()  # (the run completes meanwhile)
    assert time.monotonic() - t0 >= 0.45, "the task was woken by the cancelled await's run"
    await testing.assert_quiescent_async()
