"""Stream priorities, read the right way round: 0 is the default, higher is more urgent.

The device's range comes from the driver (CUDA's 0 to -5 on current GPUs
is gpuflow's 0 to 5; ``sim`` takes the same levels) and a level out of it
is refused, never clamped.  On cuda the driver is asked what it made.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import cuda_native, simulated
from helpers import kernels as K

import gpuflow as gf


def driver_priority(stream: gf.Stream) -> int:
    """What CUDA says the stream's priority is (its own numbers: lower is more urgent)."""
    from cuda.bindings import driver

    err, value = driver.cuStreamGetPriority(driver.CUstream(stream.__cuda_stream__()[1]))
    assert int(err) == 0
    return int(value)


def driver_range() -> tuple[int, int]:
    from cuda.bindings import driver

    err, least, greatest = driver.cuCtxGetStreamPriorityRange()
    assert int(err) == 0
    return int(least), int(greatest)


def test_a_new_stream_takes_a_priority_level_higher_more_urgent(device_backend: str) -> None:
    assert gf.new_stream().priority == 0  # the default
    levels = gf.lowlevel.current_backend_object().stream_priorities(0)
    assert levels == 5  # as current GPUs: CUDA's 0 to -5
    streams = {p: gf.new_stream(priority=p) for p in range(levels + 1)}
    assert {p: s.priority for p, s in streams.items()} == {p: p for p in streams}
    if cuda_native():  # the driver made what was asked, the other way round
        least, greatest = driver_range()
        assert least - greatest == levels
        assert {p: driver_priority(s) for p, s in streams.items()} == {
            p: least - p for p in streams
        }
    # work runs on them as on any stream
    x = gf.arange(8, dtype=np.float32).sync_on(streams[levels])
    np.testing.assert_array_equal(gf.to_host(x).sync_on(streams[levels]), np.arange(8))


@pytest.mark.parametrize(
    ("priority", "error", "match"),
    [
        (6, gf.UsageError, r"priority 6 is out of device 0's range: 0 \(the default\) to 5"),
        (-1, gf.UsageError, r"priority -1 is out of device 0's range: 0 \(the default\) to 5"),
        (1.5, gf.UsageTypeError, "priority must be an int, got float"),
        (True, gf.UsageTypeError, "priority must be an int, got bool"),
    ],
)
def test_a_priority_out_of_range_is_refused_naming_the_range(
    priority: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        gf.new_stream(0, priority=priority)


@pytest.mark.anyio
async def test_the_trace_shows_each_runs_priority(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    urgent, plain = gf.new_stream(priority=4), gf.new_stream()
    with gf.trace(path):
        for s in (urgent, plain):
            gf.value(1).enqueue_on(s)
            await gf.wait_stream(s)
        while gf.testing.pending_runs():
            await anyio.sleep(0.005)
    events = json.loads(path.read_text())["traceEvents"]
    runs = [e for e in events if e.get("cat") == "gpuflow.run" and e["args"]["how"] != "await"]
    assert [(e["args"]["stream"], e["args"]["priority"]) for e in runs] == [
        (repr(urgent), 4), (repr(plain), 0)
    ]


def probe(seen: list[gf.Stream], then: gf.DeviceOperation[Any] | None = None) -> Any:
    """An operation that records the stream it runs on (then runs ``then``)."""

    def fn(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        seen.append(ctx.stream)
        return gf.value(None) if then is None else then

    return gf.with_context(fn)


@pytest.mark.anyio
async def test_runs_started_in_a_class_block_take_streams_of_that_level() -> None:
    seen: list[gf.Stream] = []
    assert gf.current_latency_class().priority == 0
    with gf.latency_class(priority=3) as cls:
        assert cls == gf.LatencyClass(3, None, None) == gf.current_latency_class()
        await probe(seen)  # awaited
        await gf.zip(probe(seen), probe(seen))  # a zip's arms too

        async def child() -> None:  # a task started in the block
            await probe(seen)

        async with anyio.create_task_group() as tg:
            tg.start_soon(child)
        with gf.latency_class(priority=1):  # the innermost applies
            await probe(seen)
        await probe(seen)
    await probe(seen)  # and after the block, the default again
    levels = [s.priority for s in seen]
    assert levels == [3, 3, 3, 3, 1, 3, 0], levels
    # each level has a pool of its own: a level-3 stream is never a default one
    assert not {s for s in seen if s.priority == 3} & set(gf.lowlevel.pool_streams())


@pytest.mark.alone  # (bounds the time it takes)
@pytest.mark.anyio
async def test_a_busy_level_grows_its_own_pool_and_never_waits_for_another_level() -> None:
    x = [await gf.zeros(64, np.float32) for _ in range(8)]
    seen: list[gf.Stream] = []

    async def one(i: int) -> None:
        await probe(seen, K.slow_fill(x[i], 1.0, 0.1))

    t0 = anyio.current_time()
    with gf.latency_class(priority=2):
        async with anyio.create_task_group() as tg:
            for i in range(8):  # more at once than the level's four first streams
                tg.start_soon(one, i)
    took = anyio.current_time() - t0
    assert len(set(seen)) == 8 and {s.priority for s in seen} == {2}  # it grew to 8
    assert took < 0.1 + 0.15, f"eight 0.1 s runs at one level took {took:.3f} s"


@pytest.mark.anyio
async def test_a_lease_of_a_priority_level_holds_a_stream_of_that_level() -> None:
    seen: list[gf.Stream] = []
    async with gf.open_stream_lease(priority=4) as a, gf.open_stream_lease(priority=4) as b:
        assert a.priority == 4 and a.stream.priority == 4 and b.stream.priority == 4
        assert a.stream is not b.stream
        with gf.latency_class(priority=1):  # a lease's runs stay on its stream (the innermost: b's)
            await probe(seen)
        assert seen == [b.stream]
    async with gf.open_stream_lease() as plain:
        assert plain.stream.priority == 0
    with pytest.raises(gf.UsageError, match=r"priority 9 is out of device 0's range"):
        async with gf.open_stream_lease(priority=9):
            pass


def test_a_class_block_checks_its_level_before_anything_runs() -> None:
    with pytest.raises(gf.UsageError, match=r"priority 6 is out of device \d's range: 0 \(the"):
        with gf.latency_class(priority=6):
            raise AssertionError("entered")
    with pytest.raises(gf.UsageTypeError, match="priority must be an int, got str"):
        with gf.latency_class(priority="high"):  # type: ignore[arg-type]
            raise AssertionError("entered")
    assert gf.current_latency_class().priority == 0


def test_a_reset_device_makes_a_levels_pool_anew(device_backend: str) -> None:
    if not simulated():
        pytest.skip("sim: the CUDA driver keeps a reset for a process's end")
    seen: list[gf.Stream] = []
    with gf.latency_class(priority=2):
        probe(seen).sync()  # a blocking run too
        gf.reset_device(0)
        probe(seen).sync()
    probe(seen).sync()
    assert [s.priority for s in seen] == [2, 2, 0] and seen[0] is not seen[1]
    assert not seen[0].current() and seen[1].current()


@pytest.mark.sim_only  # (a sim told that making a stream waits, as CUDA's does)
def test_where_making_a_stream_waits_every_level_is_made_ahead_and_again_after_a_reset() -> None:
    from gpuflow._backends._sim._backend import SimBackend

    class Waiting(SimBackend):
        setup_waits_for_idle = True  # (as cuda: the pools' streams are made when it starts)

    gf.init_device_contexts(backend=Waiting(1), reserve_sms={"interactive": 8})
    be = gf.lowlevel.current_backend_object()
    top = be.stream_priorities(0)

    def made() -> int:  # (the backend streams sim holds)
        return len(be._streams)  # type: ignore[attr-defined]

    before = made()
    with gf.latency_class(priority=top, sms="interactive"):
        gf.zeros(4, np.float32).sync()  # a class's first run makes no stream
    with gf.latency_class(priority=1):
        gf.zeros(4, np.float32).sync()
    assert made() == before
    gf.reset_device(0)  # the pools again, every level's too (and no deadlock)
    after = made()
    with gf.latency_class(priority=top, sms="interactive"):
        gf.zeros(4, np.float32).sync()
    assert made() == after
