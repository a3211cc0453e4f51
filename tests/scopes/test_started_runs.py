"""Runs started now and awaited later: ``lease.start_run(op)`` and ``group.start_run(op)``.

A started run's work is enqueued at once and the task goes on; awaiting
the handle gives the output when the GPU is done, as often as asked.  The
scope it belongs to waits for it at its exit whether or not it was
awaited, and a failure nobody awaited is raised there.  Observed through
what the device wrote and semantic time bounds, as the other scope tests.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K
from helpers import simulated

import gpuflow as gf

pytestmark = pytest.mark.anyio

F32 = np.float32
N = 256
#: slack on "it waited for the kernel" (clock and scheduling jitter)
EARLY = 0.01
#: generous bound on "and not much longer": the completion path's latency
LATE = 0.15


def fault_op() -> gf.DeviceOperation[Any]:
    module = K.fault_module()
    module.binary_for(gf.lowlevel.current_backend_object().device_arch(0))  # compiled now
    return module.null_write(gf.LaunchConfig(1, 32), 32)


def reset_after_fault() -> None:
    # on cuda the test runs in a child process of its own (the fault is sticky)
    if simulated():
        gf.reset_device(0)


async def test_a_started_run_overlaps_the_tasks_host_work() -> None:
    x = await gf.zeros(N, F32)
    async with gf.open_stream_lease() as lease:
        t0 = time.perf_counter()
        started = lease.start_run(K.slow_fill(x, 2.0, 0.3))
        assert time.perf_counter() - t0 < 0.1  # enqueued, not waited for
        assert not started.done()
        time.sleep(0.3)  # the task's own work on the host meanwhile
        out = await started
        took = time.perf_counter() - t0
    # one after the other would take 0.6 s
    assert 0.3 - EARLY <= took < 0.3 + LATE, f"host work and the run took {took:.3f} s"
    assert out is x and started.done()
    assert (await gf.to_host(x) == 2.0).all()


async def test_a_started_run_gives_its_output_to_every_await() -> None:
    x = await gf.arange(N, dtype=F32)
    async with gf.open_stream_lease() as lease:
        started = lease.start_run(gf.to_host(K.slow_fill(x, 3.0, 0.1)))
        got: list[np.ndarray] = []

        async def wait() -> None:
            got.append(await started)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(wait)
        again = await started
    assert isinstance(again, np.ndarray) and (again == 3.0).all()
    assert all(a is again for a in got) and len(got) == 3  # one output, made once


async def test_the_scope_waits_at_its_exit_for_a_run_nobody_awaited() -> None:
    x = await gf.zeros(N, F32)
    t0 = time.perf_counter()
    async with gf.open_stream_lease() as lease:
        started = lease.start_run(K.slow_fill(x, 1.0, 0.2))
    took = time.perf_counter() - t0
    assert took >= 0.2 - EARLY, f"the lease was left {took:.3f} s after a 0.2 s run started"
    assert started.done() and started.failed() is None
    assert (await gf.to_host(x) == 1.0).all()


async def test_a_cancelled_await_of_a_started_run_leaves_the_run_to_its_scope() -> None:
    x = await gf.zeros(N, F32)
    t0 = time.perf_counter()
    async with gf.open_stream_lease() as lease:
        started = lease.start_run(K.slow_fill(x, 4.0, 0.3))
        with anyio.move_on_after(0.05) as scope:
            await started
        assert scope.cancelled_caught  # the loop's own cancellation, at once
        assert time.perf_counter() - t0 < 0.05 + LATE
        assert not started.done()
    assert time.perf_counter() - t0 >= 0.3 - EARLY  # the exit waited for the run
    assert (await gf.to_host(x) == 4.0).all()  # nothing it used was freed early
    assert await started is x  # and it can still be awaited


async def test_a_device_group_starts_a_run_on_each_device() -> None:
    xs: dict[int, gf.DeviceArray] = {}
    t0 = time.perf_counter()
    async with gf.open_device_group() as group:
        started = []
        for d in group.devices:
            with gf.use_device(d):
                xs[d] = await gf.zeros(N, F32)
            started.append(group.start_run(K.slow_fill(xs[d], float(d + 1), 0.2), device=d))
        assert time.perf_counter() - t0 < 0.2  # every run enqueued, none waited for
        outs = [await s for s in started]
    assert outs == [xs[d] for d in group.devices]
    for d in group.devices:
        with gf.use_device(d):
            assert (await gf.to_host(xs[d]) == float(d + 1)).all()


@pytest.mark.faults_device
async def test_a_failed_run_nobody_awaited_is_raised_at_the_scope_exit() -> None:
    try:
        with pytest.raises(gf.DeviceFaultError, match="ILLEGAL_ADDRESS"):
            async with gf.open_stream_lease() as lease:
                started = lease.start_run(fault_op())
        assert started.failed() is not None
    finally:
        reset_after_fault()


@pytest.mark.sim_only  # (the fault made to come before the run's mark: sim's own timing)
async def test_a_started_run_the_device_fails_before_its_mark_is_enqueued_fails_at_its_await(
) -> None:
    be = gf.lowlevel.current_backend_object()

    def once_faulted(_out: object) -> gf.DeviceOperation[None]:
        # (still enqueueing the run: the kernel has faulted before its mark)
        deadline = time.monotonic() + 5
        while be.device_fault(0) is None:
            assert time.monotonic() < deadline, "the kernel did not fault"
            time.sleep(0.001)
        return gf.value(None)

    try:
        async with gf.open_stream_lease() as lease:
            started = lease.start_run(fault_op().then(once_faulted))  # (returns: no raise)
            assert isinstance(started.failed(), gf.DeviceFaultError)
            with pytest.raises(gf.DeviceFaultError, match="ILLEGAL_ADDRESS"):
                await started
    finally:
        reset_after_fault()


@pytest.mark.faults_device
async def test_a_failed_run_awaited_is_raised_by_the_await_not_again_at_the_exit() -> None:
    try:
        async with gf.open_stream_lease() as lease:
            started = lease.start_run(fault_op())
            with pytest.raises(gf.DeviceFaultError, match="ILLEGAL_ADDRESS"):
                await started
            with pytest.raises(gf.DeviceFaultError):
                await started  # every await says so
    finally:
        reset_after_fault()


@pytest.mark.faults_device
async def test_a_scope_left_by_an_error_raises_it_with_the_unawaited_failure() -> None:
    try:
        with pytest.raises(BaseExceptionGroup) as info:
            async with gf.open_device_group() as group:
                group.start_run(fault_op(), device=0)
                raise ValueError("the scope's own error")
        # neither is lost (the group's own error comes in the task group's group)
        assert info.value.subgroup(ValueError) is not None
        assert info.value.subgroup(gf.DeviceFaultError) is not None
    finally:
        reset_after_fault()


async def test_start_run_needs_an_open_scope_and_an_operation() -> None:
    lease = gf.open_stream_lease()
    with pytest.raises(gf.UsageError, match=r"start_run\(\) outside the stream lease"):
        lease.start_run(gf.zeros(4, F32))
    group = gf.open_device_group()
    with pytest.raises(gf.UsageError, match=r"start_run\(\) outside the device group"):
        group.start_run(gf.zeros(4, F32))
    async with gf.open_stream_lease() as lease:
        with pytest.raises(gf.UsageTypeError, match="takes a gpuflow operation, got ndarray"):
            lease.start_run(np.zeros(4))  # type: ignore[arg-type]
    async with gf.open_device_group() as group:
        with pytest.raises(gf.UsageError, match="device 99 is not in this group"):
            group.start_run(gf.zeros(4, F32), device=99)


@pytest.mark.faults_device
async def test_a_cancel_scope_outside_takes_its_cancellation_and_the_failure_goes_on() -> None:
    try:
        with pytest.raises(BaseExceptionGroup) as info:
            with anyio.move_on_after(0.1):
                async with gf.open_stream_lease() as lease:
                    lease.start_run(fault_op())
                    await anyio.sleep(5)  # cancelled by the scope outside
        assert info.value.subgroup(gf.DeviceFaultError) is not None
        assert info.value.subgroup(anyio.get_cancelled_exc_class()) is None
    finally:
        reset_after_fault()


async def test_a_run_started_from_a_task_outside_the_scope_is_still_the_scopes() -> None:
    x = await gf.zeros(N, F32)
    leases: list[gf.StreamLease] = []
    have_lease, started_one = anyio.Event(), anyio.Event()

    async def starter() -> None:  # a task started before the lease: not inside its scope
        await have_lease.wait()
        leases[0].start_run(K.slow_fill(x, 5.0, 0.2))
        started_one.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(starter)
        t0 = time.perf_counter()
        async with gf.open_stream_lease() as lease:
            leases.append(lease)
            have_lease.set()
            await started_one.wait()
        took = time.perf_counter() - t0
    assert took >= 0.2 - EARLY, f"the lease was left {took:.3f} s after its 0.2 s run started"
    assert (await gf.to_host(x) == 5.0).all()


@pytest.mark.faults_device
async def test_a_failure_after_a_cancelled_await_is_raised_at_the_scope_exit() -> None:
    x = await gf.zeros(N, F32)
    fault = fault_op()
    try:
        with pytest.raises(gf.DeviceFaultError, match="ILLEGAL_ADDRESS"):
            async with gf.open_stream_lease() as lease:
                started = lease.start_run(K.slow_fill(x, 1.0, 0.2).then(lambda _: fault))
                with anyio.move_on_after(0.05):
                    await started  # cancelled: this task was given no outcome
                assert not started.done()
    finally:
        reset_after_fault()
