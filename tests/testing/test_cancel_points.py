"""``gf.testing.cancel_at_every_point``: a pipeline cancelled at each of its points.

The first run counts the points (two per await: before the work is
enqueued, and while the GPU runs it; one at each boundary of a stream
lease or a device group); each later run cancels exactly one of them, with
the loop's own cancellation.  After each, gpuflow must be at rest and the
pipeline's own check must pass; the first failure names the point, the
operation there and the pipeline's line.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuflow as gf
from gpuflow import testing
from gpuflow._core import _cancel_points

pytestmark = pytest.mark.anyio

F32 = np.float32
I32 = np.int32
M = K.module()


def line_of(marker: str) -> int:
    """The line of this file that ends with the comment ``# <marker>``."""
    lines = inspect.getsource(inspect.getmodule(line_of)).splitlines()  # type: ignore[arg-type]
    (number,) = [i + 1 for i, text in enumerate(lines) if text.endswith(f"# {marker}")]
    return number


async def test_a_pipeline_of_n_awaits_has_two_points_each_and_runs_once_per_point() -> None:
    c = await gf.zeros(1, I32)
    runs = 0

    async def pipeline() -> None:
        nonlocal runs
        runs += 1
        x = await gf.zeros(64, F32)  # first await
        await K.slow_fill(x, 1.0, 0.01)
        await M.count(gf.LaunchConfig(1, 1), c)
        await gf.to_host(x)
        await gf.copy(x)

    report = await testing.cancel_at_every_point(pipeline)
    assert report.points == 2 * 5  # before and after each await's enqueue
    assert report.runs == 11 == runs
    assert [p.index for p in report.sites] == list(range(1, 11))
    first = line_of("first await")
    for i, site in enumerate(report.sites):
        assert site.where.startswith(f"{__file__}:{first + i // 2} (in "), site.where
        assert site.where.endswith("pipeline)")
        assert site.what.startswith("awaiting <gpuflow.DeviceOperation ")
        phase = "before it is enqueued" if i % 2 == 0 else "while the GPU runs it"
        assert site.what.endswith(phase), site.what
    assert "full (64,) float32" in report.sites[0].what
    assert "kernel count" in report.sites[4].what, report.sites[4].what
    assert str(report.sites[0]).startswith("point 1: awaiting <gpuflow.DeviceOperation full")
    assert _cancel_points.watcher is None  # nothing is left to pay for


async def test_each_point_names_the_task_that_reached_it() -> None:
    async def step(x: gf.DeviceArray) -> None:
        await K.slow_fill(x, 1.0, 0.001)

    async def pipeline() -> None:
        x = await gf.zeros(64, F32)
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(step, x, name=f"worker {i}")

    report = await testing.cancel_at_every_point(pipeline)
    steps = [p for p in report.sites if "slow_fill" in p.what]
    assert sorted({p.task for p in steps}) == ["worker 0", "worker 1", "worker 2"]
    assert all(p.where.endswith("(in test_each_point_names_the_task_that_reached_it.<locals>"
                                ".step)") for p in steps)
    assert str(steps[0]).endswith(f" in task {steps[0].task!r}")


async def test_each_run_is_cancelled_exactly_at_its_point() -> None:
    # op i adds one to a device counter; the host log says how far the
    # pipeline got.  Cancelled before op i is enqueued: the counter stays at
    # i.  Cancelled while op i runs: the task stops there, and op i still
    # finishes on the GPU (the counter reaches i + 1 once the GPU is waited for).
    c = await gf.zeros(1, I32)
    y = await gf.zeros(256, F32)
    log: list[int] = []
    seen: list[tuple[list[int], int]] = []

    async def pipeline() -> None:
        log.clear()
        await gf.copy(gf.zeros(1, I32), out=c)
        for i in range(3):
            log.append(i)
            await M.count(gf.LaunchConfig(1, 1), c).then(lambda _: K.slow_fill(y, 1.0, 0.02))
            log.append(-i - 1)

    async def check() -> None:
        seen.append((list(log), int((await gf.to_host(c))[0])))

    report = await testing.cancel_at_every_point(pipeline, check=check)
    assert report.points == 8 and report.runs == 9
    expected = [
        ([0, -1, 1, -2, 2, -3], 3),  # not cancelled
        ([], 3),  # point 1: before the reset of the counter is enqueued
        ([], 0),  # point 2: while the reset runs
    ]
    for i in range(3):
        done = [x for j in range(i) for x in (j, -j - 1)]
        expected.append(([*done, i], i))  # point 3 + 2i: op i is never enqueued
        expected.append(([*done, i], i + 1))  # 4 + 2i: it is, and finishes on the GPU
    assert seen == expected


async def test_scope_boundaries_are_points_and_a_correct_pipeline_passes() -> None:
    x = await gf.zeros(256, F32)

    async def child() -> None:
        await K.slow_fill(await gf.zeros(256, F32), 2.0, 0.01)  # the child's await

    async def pipeline() -> None:
        async with gf.open_stream_lease():  # the lease
            await K.slow_fill(x, 1.0, 0.02)
        async with gf.open_device_group([0]) as group:
            group.start_soon(child)

    report = await testing.cancel_at_every_point(pipeline)
    whats = [p.what for p in report.sites]
    assert report.points == 10  # the lease 2 and one await, the group 2 and the child's 2 awaits
    assert whats[0] == "entering a stream lease"
    assert whats[3].startswith("leaving a stream lease")
    assert whats[4] == "entering a device group"
    assert whats[9].startswith("leaving a device group")
    lease, awaited = line_of("the lease"), line_of("the child's await")
    assert [p.where.split(" ")[0] for p in report.sites] == [
        f"{__file__}:{n}" for n in [lease, lease + 1, lease + 1, lease, lease + 2,
                                    *[awaited] * 4, lease + 2]
    ]  # fmt: skip
    assert testing.leases_held() == 0


async def test_a_lease_entered_by_hand_and_left_open_fails_naming_the_point() -> None:
    x = await gf.zeros(256, F32)
    leases: list[gf.StreamLease] = []

    async def pipeline() -> None:
        lease = gf.open_stream_lease()
        await lease.__aenter__()  # lease.__aenter__
        leases.append(lease)
        await K.slow_fill(x, 1.0, 0.01)  # the open lease
        await lease.__aexit__(None, None, None)
        leases.remove(lease)

    with pytest.raises(AssertionError) as caught:
        await testing.cancel_at_every_point(pipeline)
    message = str(caught.value)
    line = line_of("the open lease")
    assert message.startswith(
        "cancelled at point 2 of 4 (awaiting <gpuflow.DeviceOperation kernel"
    ), message
    assert "before it is enqueued" in message
    assert f"at {__file__}:{line} (in " in message
    # the lease is named: its task and the line that entered it
    held = "gpuflow is not quiescent: 1 stream lease(s) still held: <gpuflow.StreamLease of "
    assert held in message, message
    assert message.endswith(f"at {__file__}:{line_of('lease.__aenter__')}>"), message
    assert _cancel_points.watcher is None
    for lease in leases:  # gpuflow's own suite ends every test at rest
        await lease.__aexit__(None, None, None)


async def test_a_broken_invariant_fails_with_the_point_and_the_checks_own_error() -> None:
    accounts = {"a": 10, "b": 0}

    async def transfer() -> None:
        x = await gf.zeros(64, F32)
        accounts["a"] -= 1
        await K.slow_fill(x, 1.0, 0.01)  # money in flight
        accounts["b"] += 1

    def check() -> None:
        total = accounts["a"] + accounts["b"]
        accounts.update(a=10, b=0)
        assert total == 10, f"{10 - total} lost"

    with pytest.raises(AssertionError) as caught:
        await testing.cancel_at_every_point(transfer, check=check)
    message = str(caught.value)
    # points 1, 2 are the zeros' await: the first one that loses money is 3
    assert message.startswith("cancelled at point 3 of 4 (awaiting <gpuflow.DeviceOperation")
    assert f"{__file__}:{line_of('money in flight')} (in " in message
    assert "check() failed: AssertionError: 1 lost" in message
    assert isinstance(caught.value.__cause__, AssertionError)

    async def safe_transfer() -> None:
        x = await gf.zeros(64, F32)
        accounts["a"] -= 1
        try:
            await K.slow_fill(x, 1.0, 0.01)
        finally:
            accounts["b"] += 1

    report = await testing.cancel_at_every_point(safe_transfer, check=check)
    assert report.points == 4


async def test_a_pipeline_that_raises_something_else_when_cancelled_fails() -> None:
    async def pipeline() -> None:
        x = await gf.zeros(64, F32)
        try:
            await K.slow_fill(x, 1.0, 0.01)
        except anyio.get_cancelled_exc_class():
            raise RuntimeError("cleanup went wrong") from None

    with pytest.raises(AssertionError, match=re.escape(
        "cancelled at point 3 of 4 (awaiting <gpuflow.DeviceOperation kernel"
    )) as caught:  # fmt: skip
        await testing.cancel_at_every_point(pipeline)
    assert str(caught.value).endswith(
        "the pipeline raised RuntimeError('cleanup went wrong') instead of the cancellation"
    )
    assert isinstance(caught.value.__cause__, RuntimeError)


async def test_a_pipeline_that_swallows_the_cancellation_fails_naming_the_point() -> None:
    async def swallow() -> Any:
        try:
            return await gf.to_host(gf.ones(4, dtype=F32))  # swallowed here
        except anyio.get_cancelled_exc_class():
            return None

    with pytest.raises(AssertionError, match=re.escape(
        "cancelled at point 1 of 2 (awaiting <gpuflow.DeviceOperation"
    )) as caught:  # fmt: skip
        await testing.cancel_at_every_point(swallow)
    message = str(caught.value)
    assert f"test_cancel_points.py:{line_of('swallowed here')} (in " in message
    assert message.endswith(
        "the pipeline returned None instead of ending with the cancellation: it swallowed "
        "the event loop's cancellation (an `except` of anyio.get_cancelled_exc_class(), "
        "BaseException or a bare `except:` that does not raise it again)"
    )

    # held back by a shield around the pipeline's own code, the cancellation
    # never reached it: returning normally is then what it should do
    async def shielded() -> Any:
        with anyio.CancelScope(shield=True):
            return await gf.to_host(gf.ones(4, dtype=F32))

    report = await testing.cancel_at_every_point(shielded)
    assert report.points == 2


async def test_a_pipeline_that_fails_uncancelled_says_so() -> None:
    async def pipeline() -> None:
        await gf.zeros(4, F32)
        raise ValueError("bad")

    with pytest.raises(AssertionError, match=re.escape(
        "the pipeline, run without a cancellation (to count its points): "
        "the pipeline raised ValueError('bad')"
    )):  # fmt: skip
        await testing.cancel_at_every_point(pipeline)


async def test_run_left_pending_past_the_timeout_fails_and_the_check_is_sync_or_async() -> None:
    stream = gf.new_stream()
    calls: list[str] = []

    async def pipeline() -> None:
        x = await gf.zeros(64, F32)
        K.slow_fill(x, 1.0, 0.4).enqueue_on(stream)  # left running

    with pytest.raises(AssertionError, match=r"run without a cancellation .*: gpuflow is not "
                       r"quiescent: 1 run\(s\) still pending after 0.05 s"):  # fmt: skip
        await testing.cancel_at_every_point(pipeline, timeout=0.05)
    await testing.assert_quiescent_async()

    def sync_check() -> None:
        calls.append("sync")

    async def async_check() -> None:
        await gf.zeros(4, F32)  # (gpuflow awaits in the check are no points)
        calls.append("async")

    async def quick() -> None:
        await gf.zeros(4, F32)

    assert (await testing.cancel_at_every_point(quick, check=sync_check)).runs == 3
    assert (await testing.cancel_at_every_point(quick, check=async_check)).runs == 3
    assert calls == ["sync"] * 3 + ["async"] * 3


async def test_a_run_that_never_reaches_its_point_fails_rather_than_passes() -> None:
    """A pipeline whose points differ from run to run leaves a point
    untested in the run meant to cancel it there: that fails, naming it."""
    runs = [0]

    async def fewer_later() -> None:
        runs[0] += 1
        await gf.zeros(4, F32)
        if runs[0] == 1:  # (only the run that counts the points)
            await gf.zeros(4, F32)

    with pytest.raises(AssertionError, match=re.escape(
        "cancelled at point 3 of 4, which this run never reached (it reached 2: its points "
        "depend on timing?): it ended uncancelled"
    )):  # fmt: skip
        await testing.cancel_at_every_point(fewer_later)


async def test_two_checks_at_once_each_count_and_cancel_their_own_points_to_the_end() -> None:
    """Two ``cancel_at_every_point`` running at once, in two tasks: the one
    that ends first leaves the other counting and cancelling its own points
    until it ends too."""

    async def short() -> None:
        await gf.zeros(4, F32)

    async def long() -> None:
        for _ in range(4):
            await gf.zeros(4, F32)
            await anyio.sleep(0.005)  # (so that it outlives the short one)

    reports: dict[str, testing.CancellationReport] = {}

    async def check(name: str, pipeline: Any) -> None:
        reports[name] = await testing.cancel_at_every_point(pipeline)

    async with anyio.create_task_group() as tg:
        tg.start_soon(check, "short", short)
        tg.start_soon(check, "long", long)
    assert (reports["short"].points, reports["long"].points) == (2, 8)
    assert reports["long"].runs == 9
    assert _cancel_points.watcher is None  # (and none is left installed after both)


async def test_the_callers_own_cancellation_is_not_swallowed() -> None:
    async def pipeline() -> None:
        await gf.zeros(4, F32)
        await anyio.sleep(10)

    with anyio.move_on_after(0.1) as outer:
        await testing.cancel_at_every_point(pipeline)
    assert outer.cancelled_caught
    assert _cancel_points.watcher is None


async def test_what_is_not_an_async_function_is_refused() -> None:
    with pytest.raises(gf.UsageTypeError, match="not an awaitable"):
        await testing.cancel_at_every_point(lambda: 3)  # type: ignore[arg-type,return-value]
    with pytest.raises(gf.UsageTypeError, match="takes an async function"):
        await testing.cancel_at_every_point(3)  # type: ignore[arg-type]
    with pytest.raises(gf.UsageError, match="timeout"):
        await testing.cancel_at_every_point(lambda: anyio.sleep(0), timeout=0)


async def test_concurrent_tasks_of_the_pipeline_all_have_points() -> None:
    async def worker(i: int) -> None:
        x = await gf.zeros(64, F32)
        await K.slow_fill(x, float(i), 0.01 * (i + 1))

    async def pipeline() -> None:
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(worker, i)

    report = await testing.cancel_at_every_point(pipeline)
    assert report.points == 12


@settings(max_examples=6, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(shape=st.lists(st.integers(1, 300), min_size=1, max_size=2), steps=st.integers(1, 3))
async def test_random_shapes_and_lengths_under_hypothesis(shape: list[int], steps: int) -> None:
    async def pipeline() -> Any:
        x = await gf.zeros(tuple(shape), F32)
        for _ in range(steps - 1):
            x = await gf.copy(x)
        return x

    report = await testing.cancel_at_every_point(pipeline)
    assert report.points == 2 * steps


async def test_nothing_a_cancelled_run_allocated_outlives_it() -> None:
    # the event loop may keep the cancellation it raised (asyncio's task
    # does), with a traceback through the pipeline's frames: their arrays
    # must not stay alive with it, or every check of memory would see a leak
    before = gf.memory_stats()
    live: list[int] = []

    async def pipeline() -> None:
        async with gf.open_stream_lease():
            x = await gf.from_host(np.ones(1000, F32))
            y = await gf.copy(x)
            await K.slow_fill(y, 1.0, 0.01)

    def check() -> None:
        now = gf.memory_stats()
        live.append(now.live_allocations - before.live_allocations)
        assert now.in_use_bytes == before.in_use_bytes

    report = await testing.cancel_at_every_point(pipeline, check=check)
    assert live == [0] * report.runs and report.runs == 9
