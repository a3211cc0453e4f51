"""Latency classes: urgent work gets SMs first, or SMs of its own, and its own busy poll.

The effects are shown on ``sim``'s model of a device's SMs (each block of a
kernel holds an SM for its time; free SMs go to the most urgent stream's
blocks first, then in launch order; reserved SMs serve their own streams
alone), with a small device so that a grid of a few blocks fills it.  The
checks of bad input and the busy poll run on every backend.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K
from helpers import simulated
from helpers.completion import reinit

import gpuflow as gf
from gpuflow._backends import Backend
from gpuflow._core._runtime import CURRENT  # (to see that a refused set-up replaced nothing)

#: one block's time on the small simulated device: long against a thread's
#: wake-up, short enough that a test of four waves takes a fraction of a second
BLOCK_S = 0.05
#: the short request's kernel: one block
SHORT_S = 0.005


def small_device(sms: int = 8, **kwargs: Any) -> None:
    gf.init_device_contexts(backend=gf.lowlevel.new_sim_backend(1, sms=sms), **kwargs)


async def short_behind_long(long_blocks: int, **short_class: Any) -> tuple[float, float]:
    """Start ``long_blocks`` blocks of :data:`BLOCK_S` in the default class,
    then, 10 ms later, one short block in ``short_class``: how long the short
    one took, and the long one."""
    took: dict[str, float] = {}

    async def long() -> None:
        t0 = time.monotonic()
        await K.spin(long_blocks, BLOCK_S)
        took["long"] = time.monotonic() - t0

    async with anyio.create_task_group() as tg:
        tg.start_soon(long)
        await anyio.sleep(0.01)
        t0 = time.monotonic()
        with gf.latency_class(**short_class):
            await K.spin(1, SHORT_S)
        took["short"] = time.monotonic() - t0
    return took["short"], took["long"]


@pytest.mark.alone  # (compares times taken on the simulated SMs)
@pytest.mark.sim_only
def test_the_sim_runs_a_grid_in_waves_of_its_sms() -> None:
    small_device(8)
    device: Any = gf.lowlevel.current_backend_object().device_state(0)
    sms = device.sms  # (the simulated device's SMs)
    K.spin(1, 0.0).sync()  # (compiled and loaded before anything is timed)
    for blocks, waves in [(8, 1), (16, 2), (17, 3)]:
        t0 = time.monotonic()
        K.spin(blocks, BLOCK_S).sync()
        took = time.monotonic() - t0
        assert waves * BLOCK_S <= took < waves * BLOCK_S + 0.04, (blocks, took)
    before = sms.blocks_run
    t0 = time.monotonic()
    x = gf.zeros(1 << 16, np.float32).sync()
    K.module().scale(K.cfg(x.size), x, 2.0, x.size).sync()  # no block time: none taken
    assert time.monotonic() - t0 < 0.04
    assert sms.blocks_run - before == K.cfg(x.size).grid[0]


@pytest.mark.alone  # (compares times taken on the simulated SMs)
@pytest.mark.sim_only
@pytest.mark.anyio
async def test_an_urgent_kernel_behind_a_saturating_one_starts_within_one_block() -> None:
    small_device(8)
    short, long = await short_behind_long(8 * 4, priority=1)
    # the first SM to free up (within one block) goes to the urgent block
    assert short < BLOCK_S + SHORT_S + 0.03, short
    assert long >= 4 * BLOCK_S and short < long - 2 * BLOCK_S, (short, long)
    # of the same priority, it starts only once every block launched before it has
    short, long = await short_behind_long(8 * 4)
    assert short >= 4 * BLOCK_S - 0.01 - 0.005, (short, long)


@pytest.mark.alone  # (compares times taken on the simulated SMs)
@pytest.mark.sim_only
@pytest.mark.anyio
async def test_reserved_sms_serve_their_class_alone() -> None:
    small_device(16, reserve_sms={"interactive": 8})
    # the other work runs on the 8 SMs left: three waves of 8, not 1.5 of 16
    short, long = await short_behind_long(8 * 3, sms="interactive")
    assert short < SHORT_S + 0.03, short  # its own SMs were free
    assert long >= 3 * BLOCK_S, long
    short, long = await short_behind_long(8 * 3)  # in the default class: behind the batch
    assert short >= 3 * BLOCK_S - 0.015, (short, long)
    # the other ways in: a lease, a stream of its own
    async with gf.open_stream_lease(sms="interactive", priority=2) as lease:
        stream = lease.stream
        assert (lease.sms, stream.sms, stream.priority) == ("interactive", "interactive", 2)
    assert gf.new_stream(sms="interactive").sms == "interactive"
    assert gf.new_stream().sms is None


@pytest.mark.anyio
async def test_a_class_takes_its_own_level_and_nests() -> None:
    reserve = simulated()
    if reserve:  # (on cuda, the fixture's runtime reserves nothing)
        gf.init_device_contexts(
            backend=gf.current_backend(), num_devices=2, reserve_sms={"interactive": 8}
        )
    seen: list[gf.Stream] = []

    def see(ctx: gf.ExecutionContext) -> gf.DeviceOperation[None]:
        seen.append(ctx.stream)
        return gf.value(None)

    def probe() -> gf.DeviceOperation[None]:
        return gf.with_context(see)

    assert gf.current_latency_class() == gf.LatencyClass(0, None, None)
    sms = "interactive" if reserve else None
    with gf.latency_class(priority=2, sms=sms, busy_poll_us=50) as outer:
        assert outer == gf.LatencyClass(2, sms, 50) == gf.current_latency_class()
        await probe()
        with gf.latency_class(priority=1) as inner:  # what it leaves out is the outer's
            assert inner == gf.LatencyClass(1, sms, 50)
            await probe()
        await gf.zip(probe(), probe())
    await probe()
    want = [(2, sms), (1, sms), (2, sms), (2, sms), (0, None)]
    assert [(s.priority, s.sms) for s in seen] == want
    assert gf.current_latency_class() == gf.LatencyClass()


@pytest.mark.anyio
async def test_a_class_sets_its_own_busy_poll() -> None:
    reinit(busy_poll_us=200)  # the runtime's: shorter than the kernel
    x = await gf.zeros(64, np.float32)
    stats = gf.lowlevel.current_completion_statistics
    before = stats()
    with gf.latency_class(busy_poll_us=2_000_000):  # interactive: polls until it is done
        await K.slow_fill(x, 1.0, 0.03)
    after = stats()
    assert after.spun + after.polled - before.spun - before.polled == 1, (before, after)
    assert after.pipes_armed == before.pipes_armed  # it never slept
    reinit(busy_poll_us=2_000_000)  # the runtime's: longer than the kernel
    x = await gf.zeros(64, np.float32)
    before = stats()
    with gf.latency_class(busy_poll_us=0):  # batch: sleeps at once, the GPU wakes it
        await K.slow_fill(x, 2.0, 0.03)
        async with gf.open_stream_lease() as lease:  # (and a run started now, awaited later)
            run = lease.start_run(K.slow_fill(x, 3.0, 0.03))
            await run
    after = stats()
    # each of the two slept at once, where the runtime's budget would have polled
    assert after.pipes_armed - before.pipes_armed == 2, (before, after)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 3.0, np.float32))


@pytest.mark.parametrize(
    ("reserve", "error", "match"),
    [
        ({"a": 0}, gf.UsageError, r"reserve_sms\['a'\] must be a number of SMs \(an int of 1"),
        ({"a": "8"}, gf.UsageError, r"reserve_sms\['a'\] must be a number of SMs"),
        ({"": 8}, gf.UsageError, r"a name of reserved SMs must be a str, got ''"),
        ([("a", 8)], gf.UsageTypeError, r"reserve_sms must map names to numbers of SMs"),
    ],
)
def test_reserve_sms_checks_its_argument_before_any_backend_starts(
    reserve: Any, error: type[Exception], match: str
) -> None:
    old = CURRENT.runtime
    with pytest.raises(error, match=match):
        gf.init_device_contexts(backend=gf.current_backend(), reserve_sms=reserve)
    assert CURRENT.runtime is old  # nothing replaced


@pytest.mark.sim_only
def test_more_sms_than_the_device_has_is_refused_at_set_up() -> None:
    old = CURRENT.runtime
    with pytest.raises(
        gf.UsageError,
        match=r"cannot reserve SMs on sim device 0: 16 SMs \(rounded up to multiples of 8\) "
        r"and at least 8 left for the rest do not fit in the device's 16",
    ):
        small_device(16, reserve_sms={"interactive": 12})
    assert CURRENT.runtime is old


@pytest.mark.sim_only
def test_a_backend_without_partitions_refuses_to_reserve_sms() -> None:
    from gpuflow._backends._sim._backend import SimBackend  # (a variant of it)

    class NoPartitions(SimBackend):
        partition_sms = Backend.partition_sms  # (the interface's default)

    with pytest.raises(gf.UsageError, match=r"the sim backend cannot reserve SMs \(reserve_sms\)"):
        gf.init_device_contexts(backend=NoPartitions(1), reserve_sms={"interactive": 8})


@pytest.mark.anyio
async def test_a_class_names_only_reserved_sms_and_checks_before_anything_runs() -> None:
    with pytest.raises(gf.UsageError, match=r"no SMs named 'fast' are reserved on device 0 \(none"):
        with gf.latency_class(sms="fast"):
            raise AssertionError("entered")
    with pytest.raises(gf.UsageTypeError, match="sms must be the name of reserved SMs"):
        with gf.latency_class(sms=8):  # type: ignore[arg-type]
            raise AssertionError("entered")
    with pytest.raises(gf.UsageError, match=r"busy_poll_us must be 0 \(no polling\) or more"):
        with gf.latency_class(busy_poll_us=-1):
            raise AssertionError("entered")
    with pytest.raises(gf.UsageError, match="no SMs named 'fast'"):
        gf.new_stream(sms="fast")
    with pytest.raises(gf.UsageError, match="no SMs named 'fast'"):
        async with gf.open_stream_lease(sms="fast"):
            raise AssertionError("entered")
    if simulated():
        gf.init_device_contexts(
            backend=gf.current_backend(), reserve_sms={"interactive": 8, "bulk": 8}
        )
        with pytest.raises(gf.UsageError, match=r"\(reserved: 'interactive', 'bulk'\)"):
            gf.new_stream(sms="fast")


@pytest.mark.sim_only
def test_the_trace_says_each_runs_class(tmp_path: Path) -> None:
    small_device(16, reserve_sms={"interactive": 8})
    path = tmp_path / "trace.json"
    with gf.trace(path):
        with gf.latency_class(priority=3, sms="interactive"):
            K.spin(1, 0.0).sync()
        K.spin(1, 0.0).sync()
    events = json.loads(path.read_text())["traceEvents"]
    runs = [e["args"] for e in events if e.get("cat") == "gpuflow.run"]
    assert [(a["priority"], a.get("sms")) for a in runs] == [(3, "interactive"), (0, None)]


@pytest.mark.sim_only
def test_a_kernel_waiting_for_sms_ends_with_its_devices_context() -> None:
    small_device(8)
    ran: list[int] = []

    @gf.testing.block_time(BLOCK_S)
    def record(ns: int) -> None:
        ran.append(ns)

    mod = gf.compile(K.SOURCE, references={**K.REFERENCES, "spin": record})
    stream = gf.new_stream()
    mod.spin(gf.LaunchConfig(8 * 20, 32), 1).enqueue_on(stream)  # twenty waves: a second
    time.sleep(BLOCK_S * 1.5)
    t0 = time.monotonic()
    gf.reset_device(0)  # what was queued is gone with the context, as on CUDA
    be = gf.lowlevel.current_backend_object()
    while not be.query(stream.raw):
        assert time.monotonic() - t0 < 0.5, "the kernel went on waiting for SMs"
        time.sleep(0.005)
    assert time.monotonic() - t0 < 0.03  # at once (woken), not at its next wave
    assert ran == []  # and it computed nothing on the new context


@pytest.mark.sim_only
@pytest.mark.anyio
async def test_a_runs_part_on_another_device_keeps_its_class() -> None:
    gf.init_device_contexts(backend=gf.current_backend(), num_devices=2)
    x = await gf.full(4, 1.0, np.float32).run(gf.SingleStream(device=1))
    be = gf.lowlevel.current_backend_object()
    with gf.testing.record_activity() as record:
        with gf.latency_class(priority=3):
            out = await gf.to_host(x)  # a run of device 0, its copy on device 1
    np.testing.assert_array_equal(out, np.ones(4, np.float32))
    (copy,) = [a for a in record if a.what.startswith("copy from")]
    assert copy.device == 1
    level = {be.activity_stream_id(s.raw) for s in CURRENT.runtime.streams(1, 3)}  # type: ignore[union-attr]
    assert copy.stream in level, "the copy on device 1 left its class"


@pytest.mark.anyio
async def test_a_pipeline_runs_whole_on_reserved_sms_and_on_the_sms_left() -> None:
    be = gf.lowlevel.current_backend_object()
    gf.init_device_contexts(
        backend=be, num_devices=gf.device_count(), reserve_sms={"interactive": 8}
    )
    n = 1000
    host = np.arange(n, dtype=np.float32)

    async def pipeline() -> np.ndarray:
        x = await gf.from_host(host)  # a copy in
        y = await gf.full(n, 2.0, np.float32)  # a fill
        z = await gf.arange(n, dtype=np.float32)  # a built-in kernel
        await K.module().saxpy(K.cfg(n), 3.0, x, y, n)  # a kernel: y = 3x + 2
        await K.module().vadd(K.cfg(n), y, z, y, n)  # y = 4x + 2, read and written
        return await gf.to_host(gf.copy(y))  # a copy on the device, a copy out

    want = 4 * host + 2
    with gf.latency_class(priority=1, sms="interactive"):
        np.testing.assert_array_equal(await pipeline(), want)
    np.testing.assert_array_equal(await pipeline(), want)  # on the SMs left
    async with gf.open_stream_lease(sms="interactive") as lease:
        assert lease.stream.sms == "interactive"
        lease.start_run(K.spin(4, 0.001))  # (waited for at the exit)


# -- what a class makes: leases, device groups, streams take it ---------------------------------


def _probe(seen: list[gf.Stream]) -> gf.DeviceOperation[None]:
    def see(ctx: gf.ExecutionContext) -> gf.DeviceOperation[None]:
        seen.append(ctx.stream)
        return gf.value(None)

    return gf.with_context(see)


@pytest.mark.alone  # (compares times taken on the simulated SMs)
@pytest.mark.sim_only
@pytest.mark.anyio
async def test_a_request_in_a_lease_inside_its_class_is_served_as_its_class() -> None:
    """The newcomer's service: interactive requests in a stream lease inside
    their class, beside batch work that keeps the other SMs busy.  The lease
    takes the class's reserved SMs, so the short request is not queued
    behind the batch."""
    small_device(16, reserve_sms={"interactive": 8})
    took: dict[str, float] = {}

    async def long() -> None:
        t0 = time.monotonic()
        await K.spin(8 * 3, BLOCK_S)
        took["long"] = time.monotonic() - t0

    async with anyio.create_task_group() as tg:
        tg.start_soon(long)
        await anyio.sleep(0.01)
        t0 = time.monotonic()
        with gf.latency_class(priority=1, sms="interactive"):
            async with gf.open_stream_lease() as lease:
                await K.spin(1, SHORT_S)
        took["short"] = time.monotonic() - t0
    assert (lease.priority, lease.sms) == (1, "interactive")
    assert took["short"] < SHORT_S + 0.03, took  # its own SMs were free
    assert took["long"] >= 3 * BLOCK_S, took


@pytest.mark.anyio
async def test_leases_groups_and_streams_made_in_a_class_take_it_unless_given_their_own() -> None:
    reserve = simulated()
    if reserve:  # (on cuda, the fixture's runtime reserves nothing)
        gf.init_device_contexts(
            backend=gf.current_backend(), num_devices=2, reserve_sms={"interactive": 8}
        )
    sms = "interactive" if reserve else None
    seen: list[gf.Stream] = []
    with gf.latency_class(priority=2, sms=sms):
        stream = gf.new_stream()
        own_stream = gf.new_stream(priority=0, sms=None)
        lease = gf.open_stream_lease()  # (entered outside the block: it took the class)
        own_lease = gf.open_stream_lease(priority=1)
        group = gf.open_device_group()
    assert (stream.priority, stream.sms) == (2, sms)
    assert (own_stream.priority, own_stream.sms) == (0, None)
    async with lease:
        assert (lease.stream.priority, lease.stream.sms) == (2, sms)
        assert gf.current_latency_class().priority == 2  # (the work inside is the class)
        await _probe(seen)
    async with own_lease:
        assert (own_lease.stream.priority, own_lease.stream.sms) == (1, sms)
    assert gf.current_latency_class() == gf.LatencyClass()  # (left with the lease)

    async def child() -> None:
        await _probe(seen)

    async with group as g:
        g.start_soon(child)
        await g.start_run(_probe(seen))
    assert gf.current_latency_class() == gf.LatencyClass()
    assert [(s.priority, s.sms) for s in seen] == [(2, sms)] * 3
    # (a group given its own class)
    seen.clear()
    with gf.latency_class(priority=2):
        async with gf.open_device_group(priority=1) as g:
            g.start_soon(child)
    assert [s.priority for s in seen] == [1]


@pytest.mark.anyio
async def test_a_lease_and_a_group_made_in_a_class_take_its_busy_poll() -> None:
    reinit(busy_poll_us=2_000_000)  # the runtime's: longer than the kernel
    x = await gf.zeros(64, np.float32)
    with gf.latency_class(busy_poll_us=0):  # batch: sleeps at once
        lease = gf.open_stream_lease()
        group = gf.open_device_group()
    stats = gf.lowlevel.current_completion_statistics
    before = stats()
    async with lease:
        await K.slow_fill(x, 1.0, 0.03)
    async with group:
        await K.slow_fill(x, 2.0, 0.03)
    after = stats()
    assert after.pipes_armed - before.pipes_armed == 2, (before, after)
    # given their own: polls until done
    before = stats()
    async with gf.open_stream_lease(busy_poll_us=2_000_000):
        await K.slow_fill(x, 3.0, 0.03)
    assert stats().pipes_armed == before.pipes_armed
    np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 3.0, np.float32))


@pytest.mark.alone  # (compares times taken on the simulated SMs)
@pytest.mark.sim_only  # (a small simulated device; on a GPU, the bench's classes row)
@pytest.mark.anyio
async def test_a_classs_first_request_under_load_is_served_as_its_second() -> None:
    """A module's load waits for the device's running kernels, as the
    driver's does: every module compiled before the runtime started, and
    every one compiled since, is loaded into the reserved SMs' context
    ahead, so the class's first request does not load it behind the batch."""
    before = gf.compile(K.SOURCE + "\n// compiled before the runtime\n", references=K.REFERENCES)
    small_device(16, reserve_sms={"interactive": 8})
    after = gf.compile(K.SOURCE + "\n// compiled after\n", references=K.REFERENCES)
    loads = gf.lowlevel.current_backend_object().loads  # type: ignore[attr-defined]
    waited = loads.waited
    for module in (before, after):
        took = []

        async def batch(module: gf.Module = module) -> None:
            await module.spin(gf.LaunchConfig(8 * 4, 32), int(BLOCK_S * 1e9))  # the other SMs

        async with anyio.create_task_group() as tg:
            tg.start_soon(batch)
            await anyio.sleep(0.02)
            for _ in range(2):
                t0 = time.monotonic()
                with gf.latency_class(sms="interactive", priority=1):
                    await module.spin(gf.LaunchConfig(1, 32), int(SHORT_S * 1e9))
                took.append(time.monotonic() - t0)
        first, second = took
        assert first < SHORT_S + 0.03 and second < SHORT_S + 0.03, took
    assert loads.waited == waited  # no load waited behind the batch
