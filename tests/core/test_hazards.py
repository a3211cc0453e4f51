"""Automatic cross-stream dependencies, and shared()/unzip() under concurrency.

A ``DeviceArray`` remembers its last write and the reads since; work on
another stream orders itself after them (read-after-write, write-after-read,
write-after-write).  Every test puts the two sides of a hazard on different
streams and makes the side that must come first *slow*, so a missing
dependency shows up as wrong data: the slow kernels spin before they touch
memory (or between reading and writing it), on the GPU as on ``sim``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest
from helpers import kernels as K

import gpuflow as gf

pytestmark = pytest.mark.anyio

F32 = np.float32
I32 = np.int32
N = 256
SLOW = 0.15

# The memory clobber keeps the compiler from moving loads and stores across
# the wait, so "read, wait, write" and "wait, read" happen in that order.
SOURCE = K.WAIT_NS + r"""

// a slow reader: waits ns nanoseconds, then copies src into dst
extern "C" __global__ void late_copy(const float* src, float* dst, int n, long long ns) {
    gf_wait_ns(ns);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

// a slow read-modify-write: reads x, waits ns nanoseconds, writes x + c
extern "C" __global__ void slow_add_i32(int* x, int c, int n, long long ns) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int v = i < n ? x[i] : 0;
    gf_wait_ns(ns);
    if (i < n) x[i] = v + c;
}
"""


def late_copy_ref(src: np.ndarray, dst: np.ndarray, n: int, ns: int) -> None:
    time.sleep(ns / 1e9)
    dst[:n] = src[:n]


def slow_add_i32_ref(x: np.ndarray, c: int, n: int, ns: int) -> None:
    v = x[:n].copy()
    time.sleep(ns / 1e9)
    x[:n] = v + np.int32(c)


MOD = gf.compile(SOURCE, references={"late_copy": late_copy_ref, "slow_add_i32": slow_add_i32_ref})


def late_copy(src: Any, dst: Any, seconds: float, n: int = N) -> gf.DeviceOperation[Any]:
    return MOD.late_copy(K.cfg(n), src, dst, n, int(seconds * 1e9))


def slow_add(x: Any, c: int, seconds: float, n: int = N) -> gf.DeviceOperation[Any]:
    return MOD.slow_add_i32(K.cfg(n), x, c, n, int(seconds * 1e9))


def fill(x: gf.DeviceArray, v: float) -> gf.DeviceOperation[Any]:
    """A fast write of ``v`` into all of ``x`` (a device copy from a fresh array)."""
    return gf.copy(gf.full(x.shape, v, dtype=x.dtype), out=x)


def full_f32(v: float) -> np.ndarray:
    return np.full(N, v, F32)


def on_enqueue(event: anyio.Event, op: gf.DeviceOperation[Any]) -> gf.DeviceOperation[Any]:
    def fn(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        event.set()
        return op

    return gf.with_context(fn)


def two_streams() -> tuple[gf.Stream, gf.Stream]:
    a, b = gf.new_stream(), gf.new_stream()
    assert a != b
    return a, b


# -- read after write, write after read, write after write ----------------------------------------


def test_read_after_write_across_streams() -> None:
    a, b = two_streams()
    x = gf.zeros(N, F32).sync()
    K.slow_fill(x, 5.0, SLOW).enqueue_on(a)
    t0 = time.perf_counter()
    # b's reader waits for a's writer (and only b is synchronized here)
    np.testing.assert_array_equal(gf.to_host(x).sync_on(b), full_f32(5))
    assert time.perf_counter() - t0 >= SLOW - 0.05
    # a kernel reading x on another stream sees the write too
    y = gf.zeros(N, F32).sync()
    K.slow_fill(x, 6.0, SLOW).enqueue_on(a)
    late_copy(x, y, 0.0).enqueue_on(b)
    np.testing.assert_array_equal(gf.to_host(y).sync_on(b), full_f32(6))


def test_a_write_waits_for_a_read_on_the_arrays_own_last_writer_stream() -> None:
    """The read that a write on another stream must wait for may be on the
    stream that last wrote the array (read there after its write), not only
    on a third stream: the write waits for it, and the read sees the value
    from before the write."""
    a, b = two_streams()
    x = gf.full(N, 1.0, dtype=F32).sync_on(a)  # last written on a
    y = gf.zeros(N, F32).sync()
    late_copy(x, y, SLOW).enqueue_on(a)  # a slow read of x, on its writer's stream
    fill(x, 7.0).enqueue_on(b)  # a write from another stream
    np.testing.assert_array_equal(gf.to_host(y).sync_on(a), full_f32(1))
    np.testing.assert_array_equal(gf.to_host(x).sync_on(b), full_f32(7))


def test_write_after_read_across_streams() -> None:
    a, b = two_streams()
    x = gf.full(N, 1.0, dtype=F32).sync()
    y = gf.zeros(N, F32).sync()
    late_copy(x, y, SLOW).enqueue_on(a)  # reads x after SLOW
    fill(x, 9.0).enqueue_on(b)  # must wait for that read
    a.synchronize()
    b.synchronize()
    np.testing.assert_array_equal(gf.to_host(y).sync(), full_f32(1))
    np.testing.assert_array_equal(gf.to_host(x).sync(), full_f32(9))


def test_write_after_write_across_streams() -> None:
    a, b = two_streams()
    c = gf.new_stream()
    x = gf.zeros(N, F32).sync()
    K.slow_fill(x, 1.0, SLOW).enqueue_on(a)
    fill(x, 2.0).enqueue_on(b)  # the later write wins, whatever the speeds
    np.testing.assert_array_equal(gf.to_host(x).sync_on(c), full_f32(2))
    b.synchronize()
    a.synchronize()
    np.testing.assert_array_equal(gf.to_host(x).sync(), full_f32(2))


def test_a_writer_waits_for_every_reader_on_every_stream() -> None:
    a, b = two_streams()
    c = gf.new_stream()
    x = gf.full(N, 3.0, dtype=F32).sync()
    y1, y2 = gf.zeros(N, F32).sync(), gf.zeros(N, F32).sync()
    late_copy(x, y1, SLOW).enqueue_on(a)
    late_copy(x, y2, SLOW / 2).enqueue_on(c)
    fill(x, 4.0).enqueue_on(b)
    for s in (a, b, c):
        s.synchronize()
    np.testing.assert_array_equal(gf.to_host(y1).sync(), full_f32(3))
    np.testing.assert_array_equal(gf.to_host(y2).sync(), full_f32(3))
    np.testing.assert_array_equal(gf.to_host(x).sync(), full_f32(4))


# -- a use waits for the array's own uses, never for whatever their stream ran later ------------

LONG = 1.0  # unrelated work in flight: a wait for it is unmistakable


def test_a_use_on_another_stream_does_not_wait_for_unrelated_later_work() -> None:
    a, b = two_streams()
    y = gf.zeros(16, F32).sync_on(a)  # done, a idle
    z = gf.zeros(16, F32).sync_on(a)
    K.slow_fill(z, 1.0, LONG, 16).enqueue_on(a)  # unrelated long work on a, touching z only
    t0 = time.perf_counter()
    K.slow_fill(y, 2.0, 0.001, 16).sync_on(b)  # writes y on b
    took = time.perf_counter() - t0
    assert took < LONG / 2, f"the write on b waited {took:.2f} s for a's unrelated kernel"
    np.testing.assert_array_equal(gf.to_host(y).sync_on(b), np.full(16, 2, F32))
    a.synchronize()


def test_a_use_waits_for_a_pending_write_but_not_for_what_its_stream_ran_after() -> None:
    a, b = two_streams()
    y = gf.zeros(N, F32).sync()
    z = gf.zeros(N, F32).sync()
    K.slow_fill(y, 5.0, SLOW).enqueue_on(a)  # y's write, pending
    K.slow_fill(z, 1.0, LONG).enqueue_on(a)  # then unrelated long work on a
    t0 = time.perf_counter()
    got = gf.to_host(y).sync_on(b)  # waits for y's write (the mark of its run) only
    took = time.perf_counter() - t0
    np.testing.assert_array_equal(got, full_f32(5))
    assert SLOW - 0.05 <= took < LONG / 2, took
    # and a write on b after the pending reads of a run on a
    x = gf.full(N, 1.0, dtype=F32).sync()
    out = gf.zeros(N, F32).sync()
    late_copy(x, out, SLOW).enqueue_on(a)  # reads x after SLOW (behind the long work!)
    a.synchronize()
    late_copy(x, out, SLOW).enqueue_on(a)
    K.slow_fill(z, 2.0, LONG).enqueue_on(a)
    fill(x, 9.0).sync_on(b)  # waits for the read, not for the long fill after it
    np.testing.assert_array_equal(gf.to_host(out).sync_on(b), full_f32(1))
    a.synchronize()


def test_a_zip_arms_write_is_waited_for_up_to_its_join_only() -> None:
    a, b = two_streams()
    y, z = gf.zeros(N, F32).sync(), gf.zeros(N, F32).sync()
    arm: list[gf.Stream] = []

    def on_arm(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        arm.append(ctx.stream)
        return K.slow_fill(y, 4.0, SLOW)

    # the second arm forks onto another stream, which the run joins back
    gf.zip(gf.value(None), gf.with_context(on_arm)).enqueue_on(a)
    assert arm[0] != a
    K.slow_fill(z, 1.0, LONG).enqueue_on(arm[0])  # unrelated, after the arm on its stream
    t0 = time.perf_counter()
    np.testing.assert_array_equal(gf.to_host(y).sync_on(b), full_f32(4))
    assert time.perf_counter() - t0 < LONG / 2
    arm[0].synchronize()
    a.synchronize()


def test_a_shared_clone_waits_for_the_source_not_its_streams_later_work() -> None:
    a, b = two_streams()
    z = gf.zeros(N, F32).sync()
    shared = gf.full(N, 6.0, dtype=F32).shared()
    shared.sync_on(a)  # the source runs on a
    K.slow_fill(z, 1.0, LONG).enqueue_on(a)  # then unrelated long work there
    t0 = time.perf_counter()
    np.testing.assert_array_equal(gf.to_host(shared.clone()).sync_on(b), full_f32(6))
    assert time.perf_counter() - t0 < LONG / 2
    a.synchronize()


def test_views_of_one_allocation_share_its_hazards() -> None:
    a, b = two_streams()
    x = gf.zeros(N, F32).sync()
    view = x.reshape(16, N // 16)
    K.slow_fill(x, 7.0, SLOW).enqueue_on(a)
    np.testing.assert_array_equal(gf.to_host(view).sync_on(b), np.full((16, N // 16), 7, F32))


# -- dependent operations awaited from different tasks ---------------------------------------------


async def test_dependent_operations_awaited_from_different_tasks() -> None:
    x = await gf.zeros(N, F32)
    y = await gf.zeros(N, F32)
    written = anyio.Event()
    read: list[np.ndarray] = []

    async def producer() -> None:
        await on_enqueue(written, K.slow_fill(x, 8.0, SLOW)).run(gf.SingleStream())

    async def consumer() -> None:
        await written.wait()
        # another stream, another task: ordered after the producer all the same
        read.append(await gf.to_host(late_copy(x, y, 0.0)).run(gf.SingleStream()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        tg.start_soon(producer)
    np.testing.assert_array_equal(read[0], full_f32(8))


async def test_a_pipeline_of_tasks_each_reading_the_previous_stage() -> None:
    m = K.module()
    stages = 6
    arrays = [await gf.zeros(N, F32) for _ in range(stages + 1)]
    ones = await gf.full(N, 1.0, dtype=F32)
    enqueued = [anyio.Event() for _ in range(stages + 1)]

    async def head() -> None:
        await on_enqueue(enqueued[0], K.slow_fill(arrays[0], 10.0, SLOW))

    async def stage(k: int) -> None:
        await enqueued[k - 1].wait()
        # the default policy puts each stage on the next pool stream
        op = m.vadd(K.cfg(N), arrays[k - 1], ones, arrays[k], N)
        await on_enqueue(enqueued[k], op)

    async with anyio.create_task_group() as tg:
        for k in range(stages, 0, -1):
            tg.start_soon(stage, k)
        tg.start_soon(head)
    for k, arr in enumerate(arrays):
        np.testing.assert_array_equal(await gf.to_host(arr), full_f32(10 + k))


async def test_concurrent_read_modify_writes_from_many_tasks_do_not_race() -> None:
    x = await gf.zeros(N, I32)
    tasks = 12

    async def bump() -> None:
        await slow_add(x, 1, 0.005)  # round robin: consecutive tasks, different streams

    async with anyio.create_task_group() as tg:
        for _ in range(tasks):
            tg.start_soon(bump)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(N, tasks, I32))


async def test_concurrent_read_modify_writes_from_tasks_and_threads() -> None:
    x = await gf.zeros(N, I32)

    def in_thread() -> None:
        for _ in range(3):
            slow_add(x, 1, 0.003).sync()

    async def in_task() -> None:
        for _ in range(3):
            await slow_add(x, 1, 0.003)

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(anyio.to_thread.run_sync, in_thread)
            tg.start_soon(in_task)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(N, 24, I32))


def test_read_modify_writes_from_many_threads_do_not_race() -> None:
    # a thread switch between ordering a launch after x's last write and
    # enqueueing it would let another thread's launch miss it: switch threads
    # as often as the interpreter can, to make that window show
    x = gf.zeros(64, I32).sync()
    threads, rounds = 8, 20

    def worker() -> None:
        for _ in range(rounds):
            slow_add(x, 1, 0.0005, 64).sync()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(30)
    finally:
        sys.setswitchinterval(interval)
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(64, threads * rounds, I32))


# -- shared() and unzip() from many tasks and threads at once --------------------------------------


async def test_shared_clones_from_many_tasks_and_threads_run_the_source_once() -> None:
    c = await gf.zeros(1, I32)
    y = await gf.zeros(N, F32)
    starts: list[int] = []
    lock = threading.Lock()

    def source(ctx: gf.ExecutionContext) -> gf.DeviceOperation[gf.DeviceArray]:
        with lock:
            starts.append(1)
        return K.bump(c).then(lambda _: K.slow_fill(y, 7.0, 0.05))

    shared = gf.with_context(source).shared()
    gate = threading.Event()
    results: list[Any] = []

    def in_thread() -> None:
        gate.wait(5)
        results.append(gf.to_host(shared.clone()).sync())

    async def in_task() -> None:
        await anyio.to_thread.run_sync(gate.wait, 5)
        results.append(await gf.to_host(shared.clone()))

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(anyio.to_thread.run_sync, in_thread)
            tg.start_soon(in_task)
        await anyio.sleep(0.02)
        gate.set()  # everyone at once
    assert len(results) == 12
    for r in results:  # each reader, on whatever stream, waited for the producer
        np.testing.assert_array_equal(r, full_f32(7))
    assert starts == [1]
    assert (await gf.to_host(c))[0] == 1


async def test_unzip_parts_from_many_tasks_and_threads_run_the_source_once() -> None:
    c = await gf.zeros(1, I32)
    a, b = await gf.zeros(N, F32), await gf.zeros(N, F32)
    source = K.bump(c).then(lambda _: gf.zip(K.slow_fill(a, 1.0, 0.05), K.slow_fill(b, 2.0, 0.05)))
    first, second = source.unzip(2)
    results: list[tuple[int, np.ndarray]] = []
    gate = threading.Event()

    def in_thread(i: int, part: gf.DeviceOperation[Any]) -> None:
        gate.wait(5)
        results.append((i, gf.to_host(part).sync()))

    async def in_task(i: int, part: gf.DeviceOperation[Any]) -> None:
        await anyio.to_thread.run_sync(gate.wait, 5)
        results.append((i, await gf.to_host(part)))

    async with anyio.create_task_group() as tg:
        for k in range(4):
            i, part = k % 2, (first, second)[k % 2]
            tg.start_soon(anyio.to_thread.run_sync, in_thread, i, part)
            tg.start_soon(in_task, i, part)
        await anyio.sleep(0.02)
        gate.set()
    assert len(results) == 8
    for i, r in results:
        np.testing.assert_array_equal(r, full_f32(i + 1))
    assert (await gf.to_host(c))[0] == 1


def test_a_clone_on_another_stream_waits_for_the_producer() -> None:
    a, b = two_streams()
    y = gf.zeros(N, F32).sync()
    shared = K.slow_fill(y, 3.0, SLOW).shared()
    assert shared.enqueue_on(a) is y  # the producer, still running on a
    t0 = time.perf_counter()
    np.testing.assert_array_equal(gf.to_host(shared.clone()).sync_on(b), full_f32(3))
    assert time.perf_counter() - t0 >= SLOW - 0.05
    # a kernel consuming the clone on a third stream sees it too
    z = gf.zeros(N, F32).sync()
    c = gf.new_stream()
    late_copy(shared.clone(), z, 0.0).enqueue_on(c)
    np.testing.assert_array_equal(gf.to_host(z).sync_on(c), full_f32(3))


async def test_cancelling_one_clone_does_not_disturb_the_others() -> None:
    y = await gf.zeros(N, F32)
    shared = K.slow_fill(y, 4.0, SLOW).shared()
    got: list[np.ndarray] = []
    cancelled: list[bool] = []

    async def impatient() -> None:
        with anyio.move_on_after(0.02) as scope:
            await gf.to_host(shared.clone())  # the producer
        cancelled.append(scope.cancelled_caught)

    async def patient() -> None:
        await anyio.sleep(0.005)
        got.append(await gf.to_host(shared.clone()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(impatient)
        tg.start_soon(patient)
    assert cancelled == [True]
    np.testing.assert_array_equal(got[0], full_f32(4))


async def test_a_shared_failure_reaches_clones_in_tasks_and_threads() -> None:
    calls: list[int] = []

    def boom(_: Any) -> gf.DeviceOperation[Any]:
        calls.append(1)
        raise ValueError("source failed")

    shared = gf.zeros(4, F32).then(boom).shared()
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            shared.clone().sync()
        except ValueError as exc:
            errors.append(exc)

    async def in_task() -> None:
        try:
            await shared.clone()
        except ValueError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(in_task)
            tg.start_soon(anyio.to_thread.run_sync, in_thread)
    assert calls == [1]
    assert len(errors) == 6
    assert all(e is errors[0] for e in errors)
