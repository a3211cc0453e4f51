"""Features used together: behaviours each feature's own tests leave
unpinned, where two meet (a latency class and a pool, a prune and a failure,
a lease and the policy, a runtime replaced and what it made).

Each asserts what a user sees: data, errors, which stream a run took (its
public ``priority`` and ``sms``), what stays alive; each has a planted bug
in ``tests/mutations`` that it catches.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import interop
from helpers import kernels as K

import gpuflow as gf
from gpuflow import testing

pytestmark = pytest.mark.anyio

F32 = np.float32


def probe(seen: list[gf.Stream], then: gf.DeviceOperation[Any] | None = None) -> Any:
    """An operation that records the stream it runs on (then runs ``then``)."""

    def fn(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        seen.append(ctx.stream)
        return gf.value(None) if then is None else then

    return gf.with_context(fn)


def fault_op() -> gf.DeviceOperation[Any]:
    return K.fault_module().null_write(gf.LaunchConfig(1, 32), 32)


# -- 1. a class of reserved SMs at the default priority: a pool of its own ----------------------


@pytest.mark.sim_only  # (reserves SMs of a simulated device)
async def test_a_class_of_reserved_sms_keeps_a_pool_of_its_own_however_it_grows() -> None:
    gf.init_device_contexts(backend="sim", num_devices=1, reserve_sms={"x": 8})
    xs = [await gf.zeros(64, F32) for _ in range(16)]
    in_class: list[gf.Stream] = []
    default: list[gf.Stream] = []

    async def reserved(i: int) -> None:
        with gf.latency_class(sms="x"):  # (priority 0: the default's)
            await probe(in_class, K.slow_fill(xs[i], 1.0, 0.05))

    async def plain(i: int) -> None:
        await probe(default, K.slow_fill(xs[8 + i], 1.0, 0.05))

    async with anyio.create_task_group() as tg:  # the class's pool grows past its four
        for i in range(8):
            tg.start_soon(reserved, i)
    async with anyio.create_task_group() as tg:  # then the default class, grown too
        for i in range(8):
            tg.start_soon(plain, i)
    assert len(set(in_class)) > 4  # it grew
    assert {s.sms for s in in_class} == {"x"}
    assert {s.sms for s in default} == {None}, "a default run landed on the reserved SMs"


# -- 2. a runtime replaced destroys every level's and partition's streams ------------------------


@pytest.mark.sim_only  # (one simulated backend, kept by the runtime that replaces)
async def test_a_runtime_replaced_on_its_backend_leaves_no_stream_of_any_level() -> None:
    be = gf.lowlevel.new_sim_backend(1)
    gf.init_device_contexts(backend=be, reserve_sms={"x": 8})
    x = await gf.zeros(64, F32)
    for cls in (dict(priority=3), dict(sms="x"), dict(priority=2, sms="x")):
        with gf.latency_class(**cls):
            await K.slow_fill(x, 1.0, 0.0)
    del x
    gf.init_device_contexts(backend=be)  # the same backend goes on: what the first made goes
    await testing.assert_quiescent_async()  # (which counts every stream gpuflow made)
    assert len(be._streams) == len(gf.lowlevel.pool_streams())  # type: ignore[attr-defined]


# -- 3. a reservation rounded as the driver rounds it, never overlapping the rest ----------------


@pytest.mark.alone  # (compares times taken on the simulated SMs)
@pytest.mark.sim_only  # (a small simulated device)
async def test_a_reservation_rounded_up_leaves_the_rest_its_own_sms() -> None:
    block_s = 0.05
    gf.init_device_contexts(backend=gf.lowlevel.new_sim_backend(1, sms=32),
                            reserve_sms={"x": 12})  # rounded up to 16
    info = gf.device_info()
    assert info.reserved_sms == {"x": 16} and info.other_sms == 16
    await K.spin(1, 0.0)  # (compiled and loaded before anything is timed)
    took: dict[str, float] = {}

    async def reserved() -> None:
        with gf.latency_class(sms="x"):
            await K.spin(16, block_s)  # every reserved SM busy

    async def rest() -> None:
        t0 = time.monotonic()
        await K.spin(info.other_sms or 0, block_s)  # as many blocks as SMs are left
        took["rest"] = time.monotonic() - t0

    async with anyio.create_task_group() as tg:
        tg.start_soon(reserved)
        await anyio.sleep(0.005)
        tg.start_soon(rest)
    assert took["rest"] < 1.5 * block_s, took  # one wave: no SM of it was a reserved one


# -- 5. a scope past its prune still raises a failure nobody awaited -----------------------------


async def _failed_on_device_1(group: gf.DeviceGroup) -> gf.StartedRun[Any]:
    """A run of the group on device 1 that fails (its device is reset under
    it: not a sticky fault), nobody awaiting it."""
    x = await gf.copy(await gf.zeros(64, F32), device=1)
    started = group.start_run(K.slow_fill(x, 1.0, 0.2), device=1)
    gf.reset_device(1)  # "reset with work pending": the run fails
    assert isinstance(started.failed(), gf.DeviceFaultError)
    return started


@pytest.mark.sim_only  # (two simulated devices)
async def test_a_group_that_started_many_runs_still_raises_the_failure_nobody_awaited() -> None:
    ok = gf.value(1)
    with pytest.raises(gf.DeviceFaultError, match="was reset with work pending"):
        async with gf.open_device_group([0, 1]) as group:
            await _failed_on_device_1(group)
            for _ in range(200):  # past any pruning of the group's records
                await group.start_run(ok, device=0)


# -- 6. a group left by a child's error, and a failure nobody awaited: both ----------------------


@pytest.mark.sim_only  # (two simulated devices)
async def test_a_group_left_by_a_childs_error_also_raises_the_failure_nobody_awaited() -> None:
    async def child() -> None:
        raise ValueError("the child's own error")

    with pytest.raises(BaseExceptionGroup) as raised:
        async with gf.open_device_group([0, 1]) as group:
            await _failed_on_device_1(group)
            group.start_soon(child, device=0)
    errors = _leaves(raised.value)
    assert {type(e) for e in errors} == {ValueError, gf.DeviceFaultError}, errors


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for e in group.exceptions for leaf in _leaves(e)]
    return [group]


# -- 7. a run that cannot wait: a stream no lease holds, before a leased one ---------------------


async def test_a_run_that_cannot_wait_takes_an_unleased_stream_even_when_all_are_stalled() -> None:
    policy = gf.StreamPoolLeastLoaded(max_streams=4, stall_s=0.02)  # (the pool's four: no growth)
    xs = [await gf.zeros(64, F32) for _ in range(3)]
    async with gf.open_stream_lease() as lease:  # one of the four, idle
        busy = [s for s in gf.lowlevel.pool_streams()[:4] if s is not lease.stream]
        for x, stream in zip(xs, busy, strict=True):  # the other three: long work, stalled
            K.slow_fill(x, 1.0, 0.5).enqueue_on(stream)
        await anyio.sleep(0.05)  # (stalled: nothing finished for stall_s)
        seen: list[gf.Stream] = []
        await anyio.to_thread.run_sync(lambda: probe(seen).sync(policy))
        assert seen[0] in busy and not seen[0].leased, "the run took the lease's stream"
        for s in busy:
            await gf.wait_stream(s)


# -- 8. at the pool's bound, awaits are served in the order they came ----------------------------


def _block_until(cond: Any, timeout: float = 10.0) -> None:
    """Hold the event loop (as a task that computes would) until ``cond()``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


async def test_awaits_at_the_bound_keep_their_order_past_a_blocking_run_and_a_newcomer() -> None:
    """Two awaits ``a`` and ``b`` wait for a stream; the stream ``a`` is woken
    for is taken by a blocking ``sync`` of another thread before ``a`` looks,
    and a new await ``c`` comes the moment another stream goes idle, before
    ``a`` has looked again: ``a`` keeps its place at the head, and ``c``
    queues behind ``b``.  (The loop is held, as by a task that computes,
    where a wake-up must wait: a test of the order, not of timing.)"""
    policy = gf.StreamPoolLeastLoaded(max_streams=4)  # (the pool's four: no growth)
    pool = gf.lowlevel.pool_streams()[:4]
    xs = [await gf.zeros(64, F32) for _ in range(5)]
    for x, stream, seconds in zip(xs[:4], pool, [0.15, 0.3, 0.8, 0.8], strict=True):
        K.slow_fill(x, 1.0, seconds).enqueue_on(stream)
    order: list[str] = []
    took: dict[str, gf.Stream] = {}

    def request(name: str, then: gf.DeviceOperation[Any] | None = None) -> Any:
        def fn(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
            order.append(name)
            took[name] = ctx.stream
            return gf.value(None) if then is None else then

        return gf.with_context(fn)

    async def waiter(name: str) -> None:
        await request(name).run(policy)

    failed: list[BaseException] = []

    def blocking() -> None:
        try:
            request("sync", K.slow_fill(xs[4], 1.0, 0.2)).sync(policy)
        except BaseException as exc:  # (said by the test, not lost with the thread)
            failed.append(exc)
            order.append("sync")

    sync = threading.Thread(target=blocking)
    async with anyio.create_task_group() as tg:
        for name in ("a", "b"):
            tg.start_soon(waiter, name)
            await anyio.sleep(0.01)  # (each waits before the next comes)
        assert order == []
        _block_until(pool[0].idle)  # the loop busy: ``a`` is woken, but has not looked
        sync.start()  # another thread's blocking run takes that stream first
        _block_until(lambda: "sync" in order)
        await anyio.sleep(0.05)  # ``a`` looks, finds every stream busy, and waits again
        assert order == ["sync"]
        _block_until(pool[1].idle)  # another goes idle, and ``c`` comes before ``a`` looks
        await waiter("c")
    sync.join()
    assert failed == []
    assert took["sync"] is pool[0]
    assert order == ["sync", "a", "b", "c"], "an await was served out of turn"
    for s in pool:
        await gf.wait_stream(s)


async def test_awaits_woken_together_take_their_streams_in_the_order_they_came() -> None:
    """Every stream goes idle at once: the awaits waiting are all woken, and
    take their streams in the order they came, whatever order their loop
    resumes them in (Trio's varies)."""
    policy = gf.StreamPoolLeastLoaded(max_streams=4)
    pool = gf.lowlevel.pool_streams()[:4]
    order: list[int] = []

    def note(i: int) -> Any:
        def fn(ctx: gf.ExecutionContext) -> Any:
            order.append(i)
            return gf.value(None)

        return gf.with_context(fn)

    async def waiter(i: int) -> None:
        await note(i).run(policy)

    for _ in range(4):
        order.clear()
        for stream in pool:
            K.spin(1, 0.05).enqueue_on(stream)
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(waiter, i)
                await anyio.sleep(0.005)
        assert order == [0, 1, 2], "awaits woken together took their streams out of turn"


async def test_a_new_await_waits_behind_the_one_woken_for_an_idle_stream() -> None:
    policy = gf.StreamPoolLeastLoaded(max_streams=4)
    pool = gf.lowlevel.pool_streams()[:4]
    for stream, seconds in zip(pool, [0.1, 0.8, 0.8, 0.8], strict=True):
        K.spin(1, seconds).enqueue_on(stream)
    order: list[str] = []

    def note(name: str) -> Any:
        def fn(ctx: gf.ExecutionContext) -> Any:
            order.append(name)
            return gf.value(None)

        return gf.with_context(fn)

    async def first() -> None:
        await note("a").run(policy)

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await anyio.sleep(0.02)  # (``a`` waits)
        _block_until(pool[0].idle)  # ``a`` is woken (by the completer's thread)...
        time.sleep(0.05)  # (however slowly that thread is scheduled)
        await note("b").run(policy)  # ...and has not looked yet when ``b`` comes
    assert order == ["a", "b"], "a new await took the stream the first was woken for"
    for s in pool:
        await gf.wait_stream(s)


# -- 10. cancel_at_every_point inside a caller's own lease ----------------------------------------


async def test_cancel_at_every_point_inside_a_callers_own_lease_passes_a_correct_pipeline() -> None:
    x = await gf.zeros(64, F32)

    async def pipeline() -> None:
        await K.slow_fill(x, 2.0, 0.001)
        np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 2.0, F32))

    async with gf.open_stream_lease():  # held throughout: not the pipeline's to give back
        report = await testing.cancel_at_every_point(pipeline)
    assert report.points == 4 and report.runs == 5


# -- 11. a write on the last writer's stream waits for another library's use since -------------


async def test_a_write_on_the_last_writers_stream_waits_for_another_librarys_use_since() -> None:
    fake = interop.FakeLib()  # another library, on a stream of its own
    x = await gf.zeros(interop.N, F32)
    async with gf.open_stream_lease():  # every gpuflow write of x on one stream
        await interop.late_fill(x, 1.0, seconds=0.0)
        fake.late_scale(x, 2.0)  # reads x, and 0.3 s later writes it doubled
        await interop.add(x, 10.0)  # on the stream that wrote x last: after the other's write
    np.testing.assert_array_equal(await gf.to_host(x), np.full(interop.N, 12.0, F32))


# -- 12. an export to one of gpuflow's streams hands the array over ------------------------------


async def test_an_export_to_a_gpuflow_stream_orders_later_uses_after_the_consumers_writes() -> None:
    fake = interop.FakeLib()
    x = await gf.full(interop.N, 1.0, F32)
    consumer = gf.new_stream()  # a stream of gpuflow's, no pool stream: the read goes elsewhere
    with fake.on(consumer):  # the other library works on gpuflow's stream
        fake.late_scale(x, 3.0)  # exported to it, then written there 0.3 s later
    np.testing.assert_array_equal(await gf.to_host(x), np.full(interop.N, 3.0, F32))
    await gf.wait_stream(consumer)


# -- 13. a refused graph launch keeps the pending updates --------------------------------------


@pytest.mark.sim_only  # (two simulated devices)
async def test_a_refused_graph_launch_keeps_the_updates_for_the_next_launch() -> None:
    gf.init_device_contexts(backend="sim", num_devices=2)
    x, y = await gf.zeros(64, F32), await gf.zeros(64, F32)
    graph = gf.copy(x, out=y).capture()
    graph.update(gf.copy(await gf.full(64, 5.0, F32), out=x))
    with pytest.raises(gf.UsageError, match="launched on device 1"):
        await graph.launch().run(gf.SingleStream(device=1))
    with pytest.raises(gf.UsageError, match="cannot itself be captured"):
        graph.launch().capture()
    np.testing.assert_array_equal(await gf.to_host(x), np.zeros(64, F32))  # not yet run
    np.testing.assert_array_equal(await gf.to_host(graph.launch()), np.full(64, 5.0, F32))


# -- 14. a stream retired with nothing pending releases its lane and stream at once --------------


async def test_a_stream_dropped_with_nothing_pending_goes_with_its_lane_at_once() -> None:
    s = gf.new_stream(priority=1)  # (made now: a stream of its own)
    await gf.wait_stream(s)
    del s
    import gc

    gc.collect()
    gf.memory_stats()  # (a safe point: a dropped stream's finalizer's work is done here)
    from gpuflow._core import resource_leaks

    assert resource_leaks() == []  # its backend stream and its completion lane went


# -- what the stateful test (test_stateful.py) found where features meet -------------------------


async def test_a_reset_retires_the_stream_other_libraries_arrays_arrive_on() -> None:
    x = await gf.full(interop.N, 2.0, F32)
    y = await gf.copy(gf.from_dlpack(interop.DlpackOnly(x)))  # (arrives on the interop stream)
    del x, y
    gf.reset_device(0)
    x = await gf.full(interop.N, 3.0, F32)
    y = await gf.copy(gf.from_dlpack(interop.DlpackOnly(x)))  # a new one, after the reset
    np.testing.assert_array_equal(await gf.to_host(y), np.full(interop.N, 3.0, F32))
    del x, y
    await testing.assert_quiescent_async()  # (the old one's backend stream and lane went)


async def test_a_reset_under_an_abandoned_run_on_a_stream_of_its_own_leaves_nothing() -> None:
    x = await gf.zeros(64, F32)
    policy = gf.SingleStream(device=0)  # (a stream of its own)
    with anyio.move_on_after(0.05):  # the await abandoned: its kernel goes on
        await K.slow_fill(x, 1.0, 0.5).run(policy)
    del policy  # its stream, retired: its lane waits for that run...
    gc.collect()
    gf.memory_stats()  # (a safe point: the stream's finalizer's work is done)
    gf.reset_device(0)  # ...which the reset fails
    del x
    await testing.assert_quiescent_async()
