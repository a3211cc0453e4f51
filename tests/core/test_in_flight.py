"""``gf.in_flight()``: the runs on the GPU now, and what each waits for.

What an await that seems stuck waits for is read off the runs themselves:
the task that awaits each (by name), how long it has been pending, its
stream and that stream's level, and the first thing its stream waits for
(the run ahead of it, another stream's work it was ordered after, a
collective's peers: that last one in ``tests/comm/test_comm.py``).
"""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest
from helpers import kernels as K

import gpuflow as gf

pytestmark = pytest.mark.anyio

F32 = np.float32


async def _wait_for(predicate: object, what: str) -> None:
    deadline = time.monotonic() + 5
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await anyio.sleep(0.005)


async def test_nothing_is_in_flight_at_rest() -> None:
    await gf.zeros(4)
    assert gf.in_flight() == []


async def test_a_stuck_await_is_found_behind_the_run_ahead_of_it() -> None:
    x = await gf.zeros(64, F32)
    y = await gf.zeros(64, F32)
    slow = K.slow_fill(x, 1.0, 0.4)
    quick = K.slow_fill(y, 2.0, 0.0)
    seen: list[list[gf.RunInFlight]] = []

    async def request(lease: gf.StreamLease) -> None:
        await quick  # (on the lease's stream, behind the slow run)

    async with gf.open_stream_lease() as lease:
        stream = lease.stream
        started = lease.start_run(slow)
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(request, lease, name="request 7")
            await _wait_for(lambda: len(gf.in_flight()) == 2, "two runs in flight")
            seen.append(gf.in_flight())
            assert "in flight on device 0" in repr(started)
        await started
    took = time.monotonic() - t0
    ahead, behind = seen[0]
    assert "slow_fill" in ahead.operation and "slow_fill" in behind.operation
    assert ahead.task is None  # started, awaited by nobody yet
    assert behind.task == "request 7"
    assert ahead.device == behind.device == 0
    assert ahead.stream == behind.stream == repr(stream)
    assert 0 <= behind.pending_s <= ahead.pending_s <= took
    assert behind.waits_for.startswith(
        f"the run ahead of it on its stream ({ahead.operation}, pending "
    )
    assert ahead.waits_for.startswith("its own work on the device")
    line = str(behind)
    assert line.startswith(f"{behind.operation} on device 0, {behind.stream}: awaited by task "
                           "'request 7', pending ")
    assert repr(started).endswith(", done>")
    assert gf.in_flight() == []


async def test_a_run_ordered_after_another_streams_work_says_so() -> None:
    x = await gf.zeros(64, F32)
    out: list[gf.RunInFlight] = []
    written = anyio.Event()

    async def reader() -> None:
        # (a task outside the lease) a read of x on another stream: ordered
        # after the slow write
        await written.wait()
        await gf.to_host(x)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader, name="reader")
        async with gf.open_stream_lease() as writer:
            stream = writer.stream
            writes = writer.start_run(K.slow_fill(x, 3.0, 0.4))
            written.set()
            await _wait_for(
                lambda: any(r.task == "reader" for r in gf.in_flight()), "the reader's run"
            )
            out = [r for r in gf.in_flight() if r.task == "reader"]
            await writes
    (read,) = out
    assert read.stream != repr(stream)
    assert f"on another stream ({stream!r})" in read.waits_for, read.waits_for
    assert "slow_fill" in read.waits_for


async def test_a_runs_level_is_its_streams() -> None:
    top = gf.lowlevel.current_backend_object().stream_priorities(0)
    if not top:
        pytest.skip("the device has no stream priorities")
    x = await gf.zeros(64, F32)
    with gf.latency_class(priority=top):
        async with gf.open_stream_lease() as lease:
            started = lease.start_run(K.slow_fill(x, 1.0, 0.2))
            (run,) = gf.in_flight()
            await started
    assert (run.priority, run.sms) == (top, None)
    assert f"priority {top}" in str(run)


@pytest.mark.sim_only  # (reads the failure a kernel's reference raises)
async def test_a_started_runs_repr_says_its_failure() -> None:
    m = K.fault_module()
    with pytest.raises(gf.DeviceFaultError):
        async with gf.open_stream_lease() as lease:
            started = lease.start_run(m.null_write(gf.LaunchConfig(1, 1), 1))
            with pytest.raises(gf.DeviceFaultError):
                await started
            assert ", failed: DeviceFaultError(" in repr(started)
            raise started.failed()  # type: ignore[misc]
    gf.reset_device(0)
