"""Structured lifetimes: stream leases and device groups.

A scope's guarantees are observed through what the device did (arrays the
kernels wrote, counters), through the public ``gpuflow.testing`` helpers and
through semantic time bounds ("the exit waited for the kernel": at least the
kernel's duration), never through the simulator's internals, so every test
here means the same on ``sim`` and on a real GPU.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K
from helpers import simulated
from helpers.child import run_child

import gpuflow as gf
from gpuflow import testing

pytestmark = pytest.mark.anyio

F32 = np.float32
N = 256
#: conftest initialises the default pool: four streams a device
POOL = 4
#: slack on "the scope waited for the kernel" (clock and scheduling jitter)
EARLY = 0.01
#: generous bound on "and no longer than that": the completion path's latency
LATE = 0.15


def stream_probe(seen: list[gf.Stream], then: gf.DeviceOperation[Any] | None = None) -> Any:
    """An operation that records the stream it runs on (then runs ``then``)."""

    def fn(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        seen.append(ctx.stream)
        return gf.value(None) if then is None else then

    return gf.with_context(fn)


def on_enqueue(event: anyio.Event, op: gf.DeviceOperation[Any]) -> gf.DeviceOperation[Any]:
    """``op``, setting ``event`` once it is being enqueued (before the task suspends)."""

    def fn(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        event.set()
        return op

    return gf.with_context(fn)


_ON: dict[int, gf.SingleStream] = {}


def on(device: int) -> gf.SingleStream:
    """A policy running on one stream of ``device``, the same all session long.

    The stream outlives every array it touches: a private stream collected in
    the same garbage cycle as an array it used (a traceback kept by
    ``pytest.raises``) is destroyed before the array's free can be ordered
    after it, and gpuflow then leaks the array with a warning.
    """
    return _ON.setdefault(device, gf.SingleStream(device))


async def read(x: gf.DeviceArray) -> np.ndarray:
    """The contents of ``x``, read on a stream of its own device."""
    return await gf.to_host(x).run(on(x.device))


def all_devices() -> list[int]:
    return gf.open_device_group().devices


# -- stream leases: where the work runs -----------------------------------------------------------


async def test_lease_runs_every_op_of_its_scope_on_its_stream() -> None:
    seen: list[gf.Stream] = []
    async with gf.open_stream_lease() as lease:
        assert isinstance(lease.stream, gf.Stream)
        assert lease.stream.device == gf.current_device()
        for _ in range(3):
            await stream_probe(seen)
        # a zip inside the lease stays on the lease's stream (every other pool
        # stream may be someone else's lease)
        await gf.zip(stream_probe(seen), stream_probe(seen), stream_probe(seen))

        async def child() -> None:
            await stream_probe(seen)
            await gf.zip(stream_probe(seen), stream_probe(seen))

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(child)
        assert len(seen) == 3 + 3 + 3 * 3
        assert all(s == lease.stream for s in seen)
        held = lease.stream
    with pytest.raises(gf.UsageError, match="not held"):
        _ = lease.stream
    # after the scope, runs go back to the pool's round robin
    seen.clear()
    for _ in range(POOL):
        await stream_probe(seen)
    assert len(set(seen)) == POOL and held in seen


async def test_lease_orders_the_work_of_all_its_tasks_on_one_stream() -> None:
    x = await gf.zeros(N, F32)
    c = await gf.zeros(1, np.int32)
    slow = 0.2
    enqueued = anyio.Event()
    t_first: list[float] = []
    t_second: list[float] = []
    async with gf.open_stream_lease():

        async def first() -> None:
            await on_enqueue(enqueued, K.slow_fill(x, 1.0, slow))
            t_first.append(time.perf_counter())

        async def second() -> None:
            await enqueued.wait()
            t0 = time.perf_counter()
            await K.bump(c)  # independent of x: only the stream orders it
            t_second.append(time.perf_counter() - t0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            tg.start_soon(first)
    # the bump was enqueued behind the slow kernel on the same stream
    assert t_second[0] >= slow - EARLY - 0.05, f"bump took {t_second[0]:.3f} s"
    np.testing.assert_array_equal(await gf.to_host(x), np.ones(N, F32))
    assert (await gf.to_host(c))[0] == 1


async def test_explicit_policy_inside_a_lease_is_respected() -> None:
    seen: list[gf.Stream] = []
    policy = gf.SingleStream()
    async with gf.open_stream_lease() as lease:
        await stream_probe(seen).run(policy)
        assert seen == [policy.stream] and seen[0] != lease.stream


# -- stream leases: the exit waits for the GPU -----------------------------------------------------


async def test_lease_exit_waits_for_enqueued_work() -> None:
    x = await gf.zeros(N, F32)
    slow = 0.2
    t0 = time.perf_counter()
    async with gf.open_stream_lease() as lease:
        K.slow_fill(x, 2.0, slow).enqueue_on(lease.stream)
    elapsed = time.perf_counter() - t0
    assert elapsed >= slow - EARLY, f"the lease exit returned after {elapsed:.3f} s"
    assert testing.pending_runs() == 0
    assert testing.leases_held() == 0
    np.testing.assert_array_equal(await gf.to_host(x), np.full(N, 2, F32))


async def test_lease_exit_waits_when_the_scope_raises() -> None:
    x = await gf.zeros(N, F32)
    slow = 0.2
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="boom"):
        async with gf.open_stream_lease() as lease:
            K.slow_fill(x, 3.0, slow).enqueue_on(lease.stream)
            raise ValueError("boom")
    elapsed = time.perf_counter() - t0
    assert elapsed >= slow - EARLY
    assert testing.pending_runs() == 0 and testing.leases_held() == 0
    np.testing.assert_array_equal(await gf.to_host(x), np.full(N, 3, F32))


async def test_lease_exit_after_cancellation_waits_for_the_kernel_and_no_longer() -> None:
    x = await gf.zeros(N, F32)
    slow = 0.3
    cancelled_at: list[float] = []
    op = K.slow_fill(x, 4.0, slow)
    t0 = time.perf_counter()
    with anyio.move_on_after(0.05) as scope:
        async with gf.open_stream_lease():
            try:
                await op
            except anyio.get_cancelled_exc_class():
                cancelled_at.append(time.perf_counter() - t0)
                raise
    elapsed = time.perf_counter() - t0
    assert scope.cancelled_caught
    assert cancelled_at and cancelled_at[0] < slow / 2, "the await was not cancelled promptly"
    # shielded: the exit waited for the kernel, then returned right after it
    assert slow - EARLY <= elapsed < slow + LATE, f"lease exit after {elapsed:.3f} s"
    assert testing.pending_runs() == 0 and testing.leases_held() == 0
    np.testing.assert_array_equal(await gf.to_host(x), np.full(N, 4, F32))


@pytest.mark.parametrize("scope", ["lease", "group"])
async def test_a_scope_that_tracked_many_runs_still_waits_for_each_pending_one(
    scope: str,
) -> None:
    """A scope keeps a record of every run started in it, and prunes the
    finished ones once it holds many: a run still pending then (the first
    one, long) is kept, and the exit waits for it."""
    x = await gf.zeros(N, F32)
    c = await gf.zeros(N, np.int32)
    m = K.module()
    long_run = 0.3
    t0 = time.monotonic()
    async with gf.open_stream_lease() if scope == "lease" else gf.open_device_group():
        K.slow_fill(x, 4.0, long_run).enqueue_on(gf.new_stream())  # pending throughout
        for _ in range(150):  # (well past the records it keeps before pruning)
            await m.add_i32(K.cfg(N), c, 1, N)
    assert time.monotonic() - t0 >= long_run - EARLY, "the exit did not wait for the long run"
    assert testing.pending_runs() == 0
    np.testing.assert_array_equal(await read(x), np.full(N, 4, F32))


async def test_lease_exit_waits_for_work_of_its_child_tasks() -> None:
    xs = [await gf.zeros(N, F32) for _ in range(3)]
    slow = 0.15
    t0 = time.perf_counter()
    with anyio.move_on_after(0.03):
        async with gf.open_stream_lease():
            async with anyio.create_task_group() as tg:
                for i, x in enumerate(xs):
                    tg.start_soon(lambda x=x, i=i: K.slow_fill(x, float(i + 1), slow).run())
    # the three kernels ran one after another on the lease's stream
    elapsed = time.perf_counter() - t0
    assert elapsed >= 3 * slow - EARLY
    assert testing.pending_runs() == 0
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(await gf.to_host(x), np.full(N, i + 1, F32))


async def test_a_task_outliving_the_lease_is_not_stranded() -> None:
    # a task started from inside the lease's scope into an outer task group:
    # the lease's exit drains its run too, and the task still gets its result
    x = await gf.zeros(N, F32)
    done = anyio.Event()

    async def worker() -> None:
        await K.slow_fill(x, 5.0, 0.15)
        done.set()

    async with anyio.create_task_group() as tg:
        async with gf.open_stream_lease():
            tg.start_soon(worker)
            await anyio.sleep(0.02)
        with anyio.fail_after(2):
            await done.wait()
    np.testing.assert_array_equal(await gf.to_host(x), np.full(N, 5, F32))


# -- stream leases: exclusive, and waiting when none is free ---------------------------------------


async def test_two_leases_never_hold_the_same_stream() -> None:
    c = await gf.zeros(1, np.int32)
    holding: set[gf.Stream] = set()
    peak = [0]

    async def user(i: int) -> None:
        for r in range(3):
            async with gf.open_stream_lease() as lease:
                assert lease.stream not in holding, "two leases share a stream"
                holding.add(lease.stream)
                peak[0] = max(peak[0], len(holding))
                await K.bump(c)
                await anyio.sleep(0.002 * ((i + r) % 3))
                holding.remove(lease.stream)

    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(user, i)
    assert peak[0] == POOL
    assert testing.leases_held() == 0
    assert (await gf.to_host(c))[0] == 30


async def _hold(
    held: dict[int, gf.Stream],
    release: anyio.Event,
    i: int,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    async with gf.open_stream_lease() as lease:
        held[i] = lease.stream
        task_status.started()
        await release.wait()
        del held[i]


async def test_a_lease_waits_when_every_stream_is_leased() -> None:
    held: dict[int, gf.Stream] = {}
    release = [anyio.Event() for _ in range(POOL)]
    got: list[gf.Stream] = []
    acquired = anyio.Event()

    async def fifth() -> None:
        async with gf.open_stream_lease() as lease:
            got.append(lease.stream)
            acquired.set()
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        for i in range(POOL):
            await tg.start(_hold, held, release[i], i)
        assert len(set(held.values())) == POOL
        taken = dict(held)
        tg.start_soon(fifth)
        await anyio.sleep(0.1)
        # waiting: not failed (the task group would have raised), not sharing
        assert got == [] and testing.leases_held() == POOL
        release[2].set()
        with anyio.fail_after(2):
            await acquired.wait()
        assert got == [taken[2]]
        assert got[0] not in held.values()
        for ev in release:
            ev.set()
    assert testing.leases_held() == 0


async def test_lease_waiters_are_served_in_order() -> None:
    held: dict[int, gf.Stream] = {}
    release = [anyio.Event() for _ in range(POOL)]
    order: list[int] = []

    async def waiter(i: int, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        async with gf.open_stream_lease():
            order.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(POOL):
            await tg.start(_hold, held, release[i], i)
        async with anyio.create_task_group() as waiters:
            for i in range(6):
                await waiters.start(waiter, i)
                await anyio.sleep(0.005)  # each one is queued before the next
            # one stream comes free; each waiter passes it on as it leaves
            release[0].set()
        for ev in release:
            ev.set()
    assert order == list(range(6))
    assert testing.leases_held() == 0


async def test_cancelled_lease_waiters_do_not_leak() -> None:
    held: dict[int, gf.Stream] = {}
    release = anyio.Event()
    entered: list[int] = []
    async with anyio.create_task_group() as tg:
        for i in range(POOL):
            await tg.start(_hold, held, release, i)
        streams = set(held.values())
        with anyio.move_on_after(0.05) as scope:
            async with anyio.create_task_group() as waiters:
                for i in range(3):

                    async def want(i: int = i) -> None:
                        async with gf.open_stream_lease():
                            entered.append(i)

                    waiters.start_soon(want)
        assert scope.cancelled_caught and entered == []
        assert testing.leases_held() == POOL
        release.set()
    assert testing.leases_held() == 0
    # every stream came back: POOL leases at once get POOL distinct streams, no waiting
    got: list[gf.Stream] = []
    all_in = anyio.Event()

    async def take() -> None:
        async with gf.open_stream_lease() as lease:
            got.append(lease.stream)
            if len(got) == POOL:
                all_in.set()
            await all_in.wait()

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            for _ in range(POOL):
                tg.start_soon(take)
    assert set(got) == streams


async def test_a_stream_handed_to_a_waiter_being_cancelled_is_passed_on() -> None:
    held: dict[int, gf.Stream] = {}
    release = anyio.Event()
    async with anyio.create_task_group() as tg:
        for i in range(1, POOL):
            await tg.start(_hold, held, release, i)
        scope = anyio.CancelScope()
        entered: list[gf.Stream] = []

        async def want(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            with scope:
                task_status.started()
                async with gf.open_stream_lease() as lease:
                    entered.append(lease.stream)

        async with gf.open_stream_lease() as mine:
            mine_stream = mine.stream
            await tg.start(want)
            await anyio.sleep(0.02)  # the waiter is queued
        # the exit just handed the stream to the waiter; cancel it before it runs
        scope.cancel()
        await anyio.sleep(0.05)
        assert entered == []
        assert testing.leases_held() == POOL - 1
        # the stream was passed back: the next lease gets it without waiting
        with anyio.fail_after(1):
            async with gf.open_stream_lease() as again:
                assert again.stream == mine_stream
        release.set()
    assert testing.leases_held() == 0


async def test_lease_waiter_in_another_event_loop_is_woken(
    anyio_backend_name: str, anyio_backend_options: dict[str, Any]
) -> None:
    held: dict[int, gf.Stream] = {}
    release = [anyio.Event() for _ in range(POOL)]
    result: list[gf.Stream] = []

    def other_loop() -> None:
        async def want() -> None:
            async with gf.open_stream_lease() as lease:
                result.append(lease.stream)

        anyio.run(want, backend=anyio_backend_name, backend_options=anyio_backend_options)

    async with anyio.create_task_group() as tg:
        for i in range(POOL):
            await tg.start(_hold, held, release[i], i)
        taken = dict(held)
        thread = threading.Thread(target=other_loop, daemon=True)
        thread.start()
        await anyio.sleep(0.1)
        assert result == [] and thread.is_alive()
        release[1].set()
        deadline = time.monotonic() + 2
        while thread.is_alive() and time.monotonic() < deadline:
            await anyio.sleep(0.005)
        assert not thread.is_alive(), "the waiter in the other loop was never woken"
        assert result == [taken[1]]
        for ev in release:
            ev.set()
    assert testing.leases_held() == 0


async def test_a_lease_in_an_async_generator_closed_by_another_task_is_released() -> None:
    x = await gf.zeros(N, F32)
    slow = 0.1

    async def leased_stream() -> Any:
        async with gf.open_stream_lease() as lease:
            K.slow_fill(x, 8.0, slow).enqueue_on(lease.stream)
            yield lease.stream

    agen = leased_stream()
    got: list[gf.Stream] = []

    async def first() -> None:
        got.append(await agen.__anext__())

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)  # entered in that task's context...
    assert testing.leases_held() == 1
    t0 = time.perf_counter()
    await agen.aclose()  # ...left from this one
    assert time.perf_counter() - t0 >= slow - EARLY - 0.05
    assert testing.leases_held() == 0 and testing.pending_runs() == 0
    np.testing.assert_array_equal(await gf.to_host(x), np.full(N, 8, F32))


async def test_lease_of_a_bad_device_is_refused() -> None:
    bad = max(all_devices()) + 1
    with pytest.raises(gf.UsageError, match=rf"device {bad} is not initialised"):
        async with gf.open_stream_lease(device=bad):
            pass
    assert testing.leases_held() == 0


# -- device groups ---------------------------------------------------------------------------------


async def test_device_group_children_run_on_their_device() -> None:
    devices = all_devices()
    seen: dict[int, tuple[int, int, gf.Stream, int]] = {}

    async def child(d: int) -> None:
        streams: list[gf.Stream] = []
        x = await stream_probe(streams, gf.full(8, d + 1, dtype=F32))
        seen[d] = (gf.current_device(), x.device, streams[0], int((await read(x))[0]))

    async with gf.open_device_group() as group:
        for d in devices:
            group.start_soon(child, d, device=d)
    assert gf.current_device() == 0
    assert sorted(seen) == devices
    for d, (current, array_device, stream, value) in seen.items():
        assert current == d and array_device == d and stream.device == d
        assert value == d + 1


async def test_device_group_without_devices_means_every_device() -> None:
    devices = all_devices()
    assert devices == sorted(set(devices)) and devices[0] == 0
    if simulated():
        assert devices == [0, 1]  # conftest initialises two sim devices
    with pytest.raises(gf.UsageError, match=rf"device {devices[-1] + 1} is not initialised"):
        gf.open_device_group([devices[-1] + 1])
    # start_soon without a device takes the group's devices in turn
    got: list[int] = []
    async with gf.open_device_group() as group:
        for _ in range(2 * len(devices)):
            group.start_soon(lambda: _append_current(got))
    assert sorted(got) == sorted(devices * 2)


async def _append_current(out: list[int]) -> None:
    out.append(gf.current_device())


async def test_device_group_refuses_bad_devices() -> None:
    devices = all_devices()
    cases: list[tuple[list[int], str]] = [
        ([devices[-1] + 1], rf"device {devices[-1] + 1} is not initialised"),
        ([-1], r"device -1 is not initialised"),
        ([], r"needs at least one device"),
    ]
    for bad, pattern in cases:
        with pytest.raises(gf.UsageError, match=pattern):
            gf.open_device_group(bad)
    async with gf.open_device_group([0]) as group:
        with pytest.raises(gf.UsageError, match=rf"device {devices[-1] + 1} is not in this group"):
            group.start_soon(_append_current, [], device=devices[-1] + 1)
        if len(devices) > 1:
            with pytest.raises(gf.UsageError, match="not in this group"):
                group.start_soon(_append_current, [], device=1)
    with pytest.raises(gf.UsageError, match="outside the device group"):
        group.start_soon(_append_current, [])


async def test_a_failing_child_cancels_the_others_and_the_group_still_waits() -> None:
    devices = all_devices()
    slow = 0.3
    cancelled: list[int] = []
    outs: dict[int, gf.DeviceArray] = {}
    built = anyio.Event()

    async def slow_child(d: int) -> None:
        x = outs[d] = await gf.zeros(N, F32)
        op = K.slow_fill(x, 6.0, slow)
        if len(outs) == len(devices):
            built.set()
        try:
            await op
        except anyio.get_cancelled_exc_class():
            cancelled.append(d)
            raise

    async def failing() -> None:
        # (once every child is about to await its kernel: a first compile
        # or a collection on the loop's thread may hold one back for 50 ms)
        await built.wait()
        await anyio.sleep(0.03)
        raise ValueError("child failed")

    t0 = time.perf_counter()
    with pytest.raises(ExceptionGroup) as info:
        async with gf.open_device_group() as group:
            for d in devices:
                group.start_soon(slow_child, d, device=d)
            group.start_soon(failing, device=devices[-1])
    elapsed = time.perf_counter() - t0
    assert info.group_contains(ValueError, match="child failed")
    assert sorted(cancelled) == devices
    # the kernels cannot be recalled: the group exit waited for them
    assert elapsed >= slow - EARLY
    assert testing.pending_runs() == 0
    for x in outs.values():
        np.testing.assert_array_equal(await read(x), np.full(N, 6, F32))


async def test_device_group_exit_waits_for_work_enqueued_on_every_device() -> None:
    devices = all_devices()
    slow = 0.25
    outs: dict[int, gf.DeviceArray] = {}

    async def child(d: int) -> None:
        x = outs[d] = await gf.zeros(N, F32)
        K.slow_fill(x, float(d + 1), slow).enqueue_on(gf.new_stream())  # not awaited

    t0 = time.perf_counter()
    async with gf.open_device_group() as group:
        for d in devices:
            group.start_soon(child, d, device=d)
    elapsed = time.perf_counter() - t0
    assert elapsed >= slow - EARLY
    assert testing.pending_runs() == 0
    for d, x in outs.items():
        assert x.device == d
        np.testing.assert_array_equal(await read(x), np.full(N, d + 1, F32))


async def test_device_group_exit_waits_for_the_longest_work_whatever_its_order() -> None:
    # a short kernel on device 0, a long one on device 1, neither awaited: the
    # exit waits for the long one, whether it was enqueued first or last
    devices = all_devices()
    if len(devices) < 2:
        pytest.skip("needs two devices")
    slow = 0.3
    seconds = {0: 0.0, 1: slow}

    async def child(x: gf.DeviceArray, turn: anyio.Event, next_turn: anyio.Event) -> None:
        await turn.wait()  # one child after the other, whatever the loop's scheduling
        K.slow_fill(x, float(x.device + 1), seconds[x.device]).enqueue_on(gf.new_stream())
        next_turn.set()

    for order in ([1, 0], [0, 1], [1, 0], [0, 1]):
        outs = {d: await gf.zeros(N, F32).run(on(d)) for d in order}
        turns = [anyio.Event() for _ in range(len(order) + 1)]
        turns[0].set()
        t0 = time.perf_counter()
        async with gf.open_device_group() as group:
            for i, d in enumerate(order):
                group.start_soon(child, outs[d], turns[i], turns[i + 1], device=d)
        elapsed = time.perf_counter() - t0
        assert testing.pending_runs() == 0, f"order {order}: the long kernel is still running"
        assert elapsed >= slow - EARLY, f"order {order}: the exit returned after {elapsed:.3f} s"
        for d, x in outs.items():
            np.testing.assert_array_equal(await read(x), np.full(N, d + 1, F32))


async def test_cancelled_device_group_waits_for_awaited_work_on_every_device() -> None:
    devices = all_devices()
    slow = 0.25
    outs: dict[int, gf.DeviceArray] = {}

    for d in devices:
        outs[d] = await gf.zeros(N, F32).run(on(d))
    ops = {d: K.slow_fill(x, float(d + 7), slow) for d, x in outs.items()}

    async def child(d: int) -> None:
        await ops[d]

    t0 = time.perf_counter()
    with anyio.move_on_after(0.05) as scope:
        async with gf.open_device_group() as group:
            for d in devices:
                group.start_soon(child, d, device=d)
    elapsed = time.perf_counter() - t0
    assert scope.cancelled_caught
    assert slow - EARLY <= elapsed < slow + LATE
    assert testing.pending_runs() == 0
    for d, x in outs.items():
        np.testing.assert_array_equal(await read(x), np.full(N, d + 7, F32))


async def test_device_group_inside_a_lease_runs_children_on_their_own_device() -> None:
    devices = all_devices()
    if len(devices) < 2:
        pytest.skip("needs two devices")
    seen: dict[int, gf.Stream] = {}

    async def child(d: int) -> None:
        streams: list[gf.Stream] = []
        await stream_probe(streams)
        seen[d] = streams[0]

    async with gf.open_stream_lease(device=0) as lease:
        async with gf.open_device_group() as group:
            for d in devices:
                group.start_soon(child, d, device=d)
        leased = lease.stream
    # device 0's child is inside the device-0 lease; the others are not
    assert seen[0] == leased
    for d in devices[1:]:
        assert seen[d].device == d


async def test_lease_inside_a_device_group_child_leases_that_device() -> None:
    devices = all_devices()
    seen: dict[int, tuple[int, list[gf.Stream]]] = {}

    async def child(d: int) -> None:
        async with gf.open_stream_lease() as lease:
            streams: list[gf.Stream] = []
            await stream_probe(streams)
            await gf.zip(stream_probe(streams), stream_probe(streams))
            seen[d] = (lease.stream.device, [s for s in streams if s != lease.stream])

    async with gf.open_device_group() as group:
        for d in devices:
            group.start_soon(child, d, device=d)
    assert {d: v[0] for d, v in seen.items()} == {d: d for d in devices}
    assert all(others == [] for _dev, others in seen.values())


# -- copies between devices and into existing arrays -----------------------------------------------


async def test_copy_to_another_device_waits_for_the_producer() -> None:
    devices = all_devices()
    if len(devices) < 2:
        pytest.skip("needs two devices")
    x = await gf.zeros(N, F32)
    K.slow_fill(x, 9.0, 0.1).enqueue_on(gf.new_stream(0))  # still writing x
    y = await gf.copy(x, device=1)
    assert isinstance(y, gf.DeviceArray)
    assert y.device == 1 and y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(await read(y), np.full(N, 9, F32))
    # and back again, through an operation source
    back = await gf.to_host(gf.copy(gf.copy(x, device=1), device=0))
    np.testing.assert_array_equal(back, np.full(N, 9, F32))


async def test_copy_into_an_existing_array() -> None:
    devices = all_devices()
    src = await gf.from_host(np.arange(N, dtype=F32))
    dst = await gf.zeros(N, F32)
    out = await gf.copy(src, out=dst)
    assert out is dst
    np.testing.assert_array_equal(await gf.to_host(dst), np.arange(N, dtype=F32))
    # across devices, into an array on the other device
    other = devices[-1]
    far = await gf.zeros(N, F32).run(on(other))
    assert far.device == other
    assert await gf.copy(src, out=far) is far
    np.testing.assert_array_equal(await read(far), np.arange(N, dtype=F32))
    with pytest.raises(gf.UsageError, match=rf"out is \({N + 1},\) float32, the source \({N},\)"):
        await gf.copy(src, out=await gf.zeros(N + 1, F32))
    with pytest.raises(gf.UsageError, match=rf"out is \({N},\) float64, the source \({N},\)"):
        await gf.copy(src, out=await gf.zeros(N, np.float64))


# -- a lease is entered once, and one never left is named ---------------------------------------


async def test_a_lease_is_entered_once() -> None:
    lease = gf.open_stream_lease()
    assert repr(lease).endswith(", not entered>")
    async with lease:
        with pytest.raises(gf.UsageError, match=r"was entered already: a stream lease is "
                           r"entered once \(gf.open_stream_lease\(\) makes another\)"):
            async with lease:
                pass
        assert lease.stream.leased  # (the refused entry changed nothing)
    assert repr(lease).endswith(", ended>")
    with pytest.raises(gf.UsageError, match="was entered already"):
        async with lease:
            pass
    assert testing.leases_held() == 0


async def test_a_lease_never_left_is_named_by_the_quiescence_check() -> None:
    lease = gf.open_stream_lease(priority=0)
    frame = inspect.currentframe()
    line = f"{__file__}:{frame.f_lineno + 1 if frame is not None else 0}"
    await lease.__aenter__()  # (entered by hand, not left)
    try:
        with pytest.raises(AssertionError) as failed:
            await testing.assert_quiescent_async(timeout=0.1)
        said = str(failed.value)
        held = "1 stream lease(s) still held: <gpuflow.StreamLease of device 0, held by task "
        assert held in said
        assert line in said, said
    finally:
        await lease.__aexit__(None, None, None)
    await testing.assert_quiescent_async()


@pytest.mark.sim_only  # (the same on every backend: it runs a child process)
def test_a_lease_never_left_is_named_at_the_exit() -> None:
    program = (
        "import anyio, gpuflow as gf\n"
        "async def main():\n"
        "    lease = gf.open_stream_lease()\n"
        "    await lease.__aenter__()\n"
        "anyio.run(main)\n"
    )
    proc = run_child([sys.executable, "-c", program], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "gpuflow: 1 stream lease(s) never left (entered, never exited): " in proc.stderr
    assert "<gpuflow.StreamLease of device 0, held by task " in proc.stderr
    assert "<string>:4>" in proc.stderr, proc.stderr
