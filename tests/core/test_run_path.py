"""The run path's shape: every hook on it (a scope, a latency class, a
trace, a capture, the cancellation-point watcher, a policy given) is off
again once it is left, and an await then takes its shortest form; a
prepared launch goes where its plan says it is valid.

Whether an await took the policy's path is read from the one function
that path calls (``_run._choose``): what a user sees of it is only speed,
which a test does not time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K

import gpuflow as gf
from gpuflow import testing
from gpuflow._core import _run

pytestmark = pytest.mark.anyio

F32 = np.float32


@pytest.fixture
def policy_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """The operations whose awaits took the policy's path since, in order."""
    took: list[object] = []
    choose = _run._choose

    def counted(op: Any, *args: Any) -> Any:
        took.append(op)
        return choose(op, *args)

    monkeypatch.setattr(_run, "_choose", counted)
    yield took


async def _each_hook(x: gf.DeviceArray, tmp: Path) -> None:
    """Enter and leave every hook on the run path, running work in each."""
    fill = K.slow_fill(x, 1.0, 0.0)
    async with gf.open_stream_lease():
        await fill
    with gf.latency_class(priority=1):
        await fill
    async with gf.open_device_group():
        await fill
    with gf.trace(tmp / "run.json"):
        await fill
    fill.capture()
    await fill.run(gf.StreamPoolLeastLoaded(max_streams=4))

    async def pipeline() -> None:
        await fill

    await testing.cancel_at_every_point(pipeline)


async def test_an_await_takes_its_shortest_form_again_once_every_hook_is_left(
    policy_path: list[object], tmp_path: Path
) -> None:
    x = await gf.zeros(64, F32)
    op = K.slow_fill(x, 2.0, 0.0)
    await op
    assert policy_path == [], "an await with nothing on took the policy's path"
    await _each_hook(x, tmp_path)
    assert policy_path, "the hooks' awaits took the shortest form (the count reads nothing)"
    policy_path.clear()
    for _ in range(3):
        await op
    assert policy_path == [], "a hook left on after its scope: the await takes the long path"
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 2.0, F32))


async def _awaited(op: gf.DeviceOperation[Any]) -> None:
    await op


async def _synced(op: gf.DeviceOperation[Any]) -> None:
    await anyio.to_thread.run_sync(op.sync)


async def _enqueued(op: gf.DeviceOperation[Any]) -> None:
    s = gf.lowlevel.pool_streams()[0]
    op.enqueue_on(s)
    await gf.wait_stream(s)


@pytest.mark.parametrize(
    "run",
    [
        pytest.param(_awaited, id="await"),
        pytest.param(_synced, id="sync"),
        pytest.param(_enqueued, id="enqueue_on"),
    ],
)
async def test_a_prepared_launch_is_made_again_after_a_reset_whichever_way_it_runs(
    run: Callable[[gf.DeviceOperation[Any]], Awaitable[None]],
) -> None:
    """A launch is prepared once for its device context's generation (one
    of scalars only to a call that enqueues it, one of arrays with its
    checks done); after a reset it is made again, never called on the
    context that went, whichever way it runs."""
    plain = K.spin(1, 0.0)  # (scalars only)
    bump = K.bump(await gf.zeros(1, np.int32))
    for op in (plain, bump):
        await run(op)
        await run(op)  # (from what was prepared)
    gf.reset_device()
    await run(plain)  # prepared again, for the new context
    await run(plain)
    with pytest.raises(gf.UsageError, match="reset or replaced"):
        await run(bump)  # its array went with the context: refused, nothing enqueued
    fresh = await gf.zeros(1, np.int32)
    await run(K.bump(fresh))
    assert (await gf.to_host(fresh))[0] == 1


async def _then_step(op: gf.DeviceOperation[Any]) -> object:
    return await gf.value(None).then(lambda _: op)


async def _in_zip(op: gf.DeviceOperation[Any]) -> object:
    return (await gf.zip(op, gf.value(1)))[0]


async def _started_in_a_lease(op: gf.DeviceOperation[Any]) -> object:
    async with gf.open_stream_lease() as lease:
        with gf.latency_class(priority=1):
            return await lease.start_run(op)


async def _synced_out(op: gf.DeviceOperation[Any]) -> object:
    return await anyio.to_thread.run_sync(op.sync)


async def _awaited_out(op: gf.DeviceOperation[Any]) -> object:
    return await op


@pytest.mark.parametrize(
    "run",
    [
        pytest.param(_awaited_out, id="await"),
        pytest.param(_synced_out, id="sync"),
        pytest.param(_then_step, id="then"),
        pytest.param(_in_zip, id="zip"),
        pytest.param(_started_in_a_lease, id="lease-class-start_run"),
    ],
)
async def test_a_launch_of_final_arrays_runs_from_its_plan_after_the_writes_it_reads(
    run: Callable[[gf.DeviceOperation[Any]], Awaitable[object]],
) -> None:
    """A launch of arrays only (no operation among its arguments) is
    prepared once into its plan: its step, the memory it reads and writes,
    and its output.  Each run from that plan, however the launch is run or
    composed, still waits for the writes of what it reads made since on
    another stream, and gives the array it writes."""
    n = 1024
    x = await gf.zeros(n, F32)
    y = await gf.zeros(n, F32)
    saxpy = K.module().saxpy(K.cfg(n), 2.0, x, y, n)  # y += 2 x
    total = 0.0
    for v in (1.0, 3.0):
        # a slow write of x on a stream of its own, not awaited
        K.slow_fill(x, v, 0.1).enqueue_on(gf.new_stream())
        out = await run(saxpy)
        total += 2 * v
        assert out is y
        np.testing.assert_array_equal(await gf.to_host(y), np.full(n, total, F32))
    plan = saxpy._plan
    assert plan.step is not None and plan.output is y
    assert [w for _, w in plan.uses or ()] == [False, True]  # (x read, y written: reads first)
    await testing.assert_quiescent_async(timeout=5.0)


@pytest.mark.parametrize(
    "run",
    [
        pytest.param(_awaited_out, id="await"),
        pytest.param(_synced_out, id="sync"),
        pytest.param(_then_step, id="then"),
        pytest.param(_started_in_a_lease, id="lease-class-start_run"),
    ],
)
async def test_a_copy_between_given_arrays_runs_from_its_plan_after_the_writes_it_reads(
    run: Callable[[gf.DeviceOperation[Any]], Awaitable[object]],
) -> None:
    """``gf.copy(x, out=y)`` of two arrays of the run's device is prepared
    once into its plan; each run from it still waits for the writes of
    ``x`` made since on another stream, and gives ``y``."""
    n = 1024
    x = await gf.zeros(n, F32)
    y = await gf.zeros(n, F32)
    copy = gf.copy(x, out=y)
    for v in (1.0, 3.0):
        K.slow_fill(x, v, 0.1).enqueue_on(gf.new_stream())
        assert await run(copy) is y
        np.testing.assert_array_equal(await gf.to_host(y), np.full(n, v, F32))
    assert copy._plan.step is not None and copy._plan.output is y
    fresh = await gf.zeros(n, F32)
    assert (await gf.copy(x, out=fresh)) is fresh  # (another copy: a plan of its own)
    await testing.assert_quiescent_async(timeout=5.0)


async def test_an_await_that_drops_the_last_array_takes_its_shortest_form(
    policy_path: list[object],
) -> None:
    """``x = await gf.full(...)`` again drops the last ``x``, whose free its
    finalizer leaves queued: the next await does that free first and still
    takes the shortest form (the policy's path is never asked)."""
    x = await gf.full(1024, 1.0, F32)
    for i in range(5):
        x = await gf.full(1024, float(i), F32)
    assert policy_path == []
    np.testing.assert_array_equal(await gf.to_host(x), np.full(1024, 4.0, F32))
    assert testing.pending_runs() == 0
    await testing.assert_quiescent_async(timeout=5.0)
