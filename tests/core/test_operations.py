"""DeviceOperation semantics: laziness, reuse, and every combinator.

Results are observed through what the device computed (counters and arrays
written by kernels), never through a reference's side effects, so every test
here means the same on ``sim`` and on a real GPU.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K

import gpuflow as gf
from gpuflow import testing

pytestmark = pytest.mark.anyio

F32 = np.float32


def stream_probe(tag: object = None) -> gf.DeviceOperation[tuple[object, gf.Stream, int]]:
    """An operation producing ``(tag, stream it ran on, device it ran on)``."""
    return gf.with_context(lambda ctx: gf.value((tag, ctx.stream, ctx.device)))


# -- laziness and reuse ---------------------------------------------------------------------------


async def test_building_does_no_work() -> None:
    m = K.module()
    calls: list[str] = []
    c = await gf.zeros(1, np.int32)
    x = await gf.ones(8, F32)

    def ctx_fn(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        calls.append("with_context")
        return K.bump(c)

    def then_fn(out: Any) -> gf.DeviceOperation[Any]:
        calls.append("then")
        return m.scale(K.cfg(8), x, 3.0, 8)

    def map_fn(out: Any) -> Any:
        calls.append("map")
        return out

    op = gf.zip(gf.with_context(ctx_fn).then(then_fn).map(map_fn), K.bump(c)).shared()
    parts = op.unzip(2)
    _ = (parts[0].first(), op.last(), gf.to_host(x).map(map_fn), gf.copy(x))
    await anyio.sleep(0.05)
    assert calls == []
    assert (await gf.to_host(c))[0] == 0
    np.testing.assert_array_equal(await gf.to_host(x), np.ones(8, F32))

    await parts[1]
    assert calls == ["with_context", "then", "map"]
    assert (await gf.to_host(c))[0] == 2
    np.testing.assert_array_equal(await gf.to_host(x), np.full(8, 3, F32))


async def test_from_host_reads_the_host_data_when_it_runs() -> None:
    data = np.arange(6, dtype=np.int64)
    op = gf.to_host(gf.from_host(data))
    data[:] = 7
    np.testing.assert_array_equal(await op, np.full(6, 7))


async def test_a_recipe_runs_its_work_each_time() -> None:
    c = await gf.zeros(1, np.int32)
    op = K.bump(c).then(lambda _: K.bump(c))
    await op
    assert (await gf.to_host(c))[0] == 2
    await op
    assert (await gf.to_host(c))[0] == 4


def test_a_recipe_runs_its_work_each_time_sync() -> None:
    c = K.counter()
    op = K.bump(c)
    for _ in range(3):
        op.sync()
    assert K.read_count(c) == 3
    make = gf.zeros(4, F32)
    a, b = make.sync(), make.sync()
    assert a is not b and a.ptr != b.ptr


@pytest.mark.sim_only  # the documentation, the same on every backend
def test_the_docs_say_a_recipe_runs_each_time_and_shared_runs_once() -> None:
    doc = " ".join((gf.DeviceOperation.__doc__ or "").split())
    assert "awaiting the same operation twice launches its kernels twice" in doc
    assert "op.shared()" in doc
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    first = " ".join(readme.split("\n* ", 1)[1].split("\n* ", 1)[0].split())
    assert first.startswith("A `DeviceOperation` is a recipe")
    assert "awaiting `op` twice runs its kernels twice" in first and "op.shared()" in first


# -- value, with_context, then, map ---------------------------------------------------------------


async def test_value_produces_its_argument() -> None:
    obj = object()
    assert await gf.value(obj) is obj
    assert await gf.value((1, "a")) == (1, "a")
    assert await gf.value(None) is None


async def test_with_context_gets_the_run_context() -> None:
    seen: list[gf.ExecutionContext] = []

    def fn(ctx: gf.ExecutionContext) -> gf.DeviceOperation[int]:
        seen.append(ctx)
        return gf.value(41).map(lambda v: v + 1)

    stream = gf.new_stream(0)
    assert await gf.with_context(fn).run(_Fixed(stream)) == 42
    (ctx,) = seen
    assert isinstance(ctx, gf.ExecutionContext)
    assert ctx.stream == stream and ctx.device == 0


class _Fixed:
    """A user policy: always the one stream."""

    def __init__(self, stream: gf.Stream) -> None:
        self.stream = stream
        self.calls = 0

    def next_stream(self, device: int) -> gf.Stream:
        self.calls += 1
        return self.stream


async def test_then_gets_the_output_and_runs_on_the_same_stream_strictly_after() -> None:
    m = K.module()
    n = 256
    x = await gf.zeros(n, F32)
    y = await gf.zeros(n, F32)
    streams: list[gf.Stream] = []

    def second(out: gf.DeviceArray) -> gf.DeviceOperation[Any]:
        assert out is x  # the launch produces the array it writes
        return gf.with_context(
            lambda ctx: streams.append(ctx.stream) or m.copy_f32(K.cfg(n), out, y, n)
        )

    op = gf.with_context(lambda ctx: streams.append(ctx.stream) or K.slow_fill(x, 5.0, 0.1))
    out = await op.then(second)
    assert out is y
    assert len(streams) == 2 and streams[0] == streams[1]
    # the copy read x only after the slow write finished
    np.testing.assert_array_equal(await gf.to_host(y), np.full(n, 5, F32))


async def test_then_chains_device_outputs() -> None:
    m = K.module()
    n = 100
    op = (
        gf.from_host(np.arange(n, dtype=F32))
        .then(lambda x: m.scale(K.cfg(n), x, 2.0, n))
        .then(lambda x: gf.zeros(n, F32).then(lambda y: m.saxpy(K.cfg(n), 3.0, x, y, n)))
    )
    np.testing.assert_array_equal(await gf.to_host(op), 6 * np.arange(n, dtype=F32))


async def test_map_transforms_the_output_on_the_host() -> None:
    x = await gf.full(5, 2.0, dtype=F32)
    out = await gf.value(x).map(lambda a: (a.shape, a.dtype))
    assert out == ((5,), np.dtype(F32))
    assert await gf.value(3).map(lambda v: v * 2).map(str) == "6"


async def test_map_over_to_host_output_runs_after_completion() -> None:
    n = 512
    x = await gf.zeros(n, F32)
    seen: list[float] = []

    def total(a: np.ndarray) -> float:
        seen.append(float(a.sum()))  # what the host sees when map runs
        return float(a.sum())

    op = gf.to_host(K.slow_fill(x, 2.0, 0.1)).map(total).map(lambda s: s + 1)
    assert await op == 2.0 * n + 1
    assert seen == [2.0 * n]
    # a tuple holding host data defers too
    pair = await gf.zip(gf.to_host(x), gf.value(1)).map(lambda t: float(t[0][0]) + t[1])
    assert pair == 3.0


async def test_a_then_chain_longer_than_the_recursion_limit_runs_in_order() -> None:
    import sys

    steps = sys.getrecursionlimit() + 500
    c = await gf.zeros(1, np.int32)
    bump = K.module().count(gf.LaunchConfig(1, 1), c)
    op: gf.DeviceOperation[Any] = bump
    for _ in range(steps - 1):
        op = op.then(lambda _out: bump)
    await op
    assert int((await gf.to_host(c))[0]) == steps


async def test_then_over_to_host_output_is_refused() -> None:
    x = await gf.ones(4, F32)
    called: list[object] = []
    op = gf.to_host(x).then(lambda a: called.append(a) or gf.value(a))
    with pytest.raises(gf.UsageError, match=r"(?i)await") as info:
        await op
    assert "map" in str(info.value)
    assert called == []


# -- zip ------------------------------------------------------------------------------------------


async def test_zip_produces_the_tuple_of_outputs() -> None:
    x = await gf.full(3, 4, dtype=np.int32)
    out = await gf.zip(gf.value(1), gf.to_host(x), gf.value("s"))
    assert isinstance(out, tuple) and len(out) == 3
    assert out[0] == 1 and out[2] == "s"
    np.testing.assert_array_equal(out[1], [4, 4, 4])
    (single,) = await gf.zip(gf.value(9))
    assert single == 9


async def test_zip_arms_run_on_different_pool_streams() -> None:
    tags = await gf.zip(stream_probe("a"), stream_probe("b"), stream_probe("c"))
    streams = {s for _tag, s, _dev in tags}
    assert [t for t, _s, _d in tags] == ["a", "b", "c"]
    assert len(streams) == 3
    assert all(dev == 0 for _t, _s, dev in tags)


async def test_zip_arms_overlap_and_the_join_waits_for_all() -> None:
    m = K.module()
    n = 256
    a, b = await gf.zip(gf.zeros(n, F32), gf.zeros(n, F32))
    out = await gf.zeros(n, F32)
    op = gf.zip(K.slow_fill(a, 1.0, 0.2), K.slow_fill(b, 2.0, 0.2)).then(
        lambda ab: m.vadd(K.cfg(n), ab[0], ab[1], out, n)
    )
    t0 = time.perf_counter()
    await op
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.33, f"zipped 0.2 s kernels took {elapsed:.3f} s: the arms did not overlap"
    assert elapsed >= 0.19
    np.testing.assert_array_equal(await gf.to_host(out), np.full(n, 3, F32))


@pytest.mark.sim_only
async def test_sim_record_shows_zip_arms_running_at_once_on_two_streams() -> None:
    # the arms wait behind a gate kernel, so both are enqueued before either
    # may start, and the check does not depend on how fast the host enqueues
    m = K.module()
    n = 256
    gate, a, b, out = await gf.zip(*(gf.zeros(n, F32) for _ in range(4)))
    op = K.slow_fill(gate, 0.0, 0.1).then(
        lambda _: gf.zip(K.slow_fill(a, 1.0, 0.1), K.slow_fill(b, 2.0, 0.1))
    ).then(lambda ab: m.vadd(K.cfg(n), ab[0], ab[1], out, n))
    with testing.record_activity() as record:
        await op
    slow = sorted((r for r in record if r.what == "kernel 'slow_fill'"), key=lambda r: r.start)
    (vadd,) = (r for r in record if r.what == "kernel 'vadd'")
    assert len(slow) == 3, record
    first, arms = slow[0], slow[1:]
    assert first.stream == vadd.stream  # the gate and the join are on the run's stream
    assert arms[0].stream != arms[1].stream, f"the zip arms ran on one stream: {arms}"
    assert testing.overlapped(*arms), f"the zip arms ran one after the other: {arms}"
    # the fork waited for the gate, and the join for both arms
    assert all(first.end <= arm.start for arm in arms)
    assert all(arm.end <= vadd.start for arm in arms)
    np.testing.assert_array_equal(await gf.to_host(out), np.full(n, 3, F32))


async def test_zip_arms_overlap_on_the_device_clock() -> None:
    # each arm's kernel stamps its start and end on the device's own clock
    wait = 0.1
    t0, t1 = await gf.zip(gf.zeros(2, np.int64), gf.zeros(2, np.int64))
    gate = await gf.zeros(256, F32)
    await K.slow_fill(gate, 0.0, wait).then(
        lambda _: gf.zip(K.stamped_wait(t0, wait), K.stamped_wait(t1, wait))
    )
    a, b = await gf.zip(gf.to_host(t0), gf.to_host(t1))
    for t in (a, b):
        assert t[1] - t[0] >= int(wait * 1e9), t
    assert a[0] < b[1] and b[0] < a[1], (
        f"the zip arms ran one after the other on the device: {a.tolist()} then {b.tolist()}"
    )


def test_zip_arms_overlap_sync() -> None:
    n = 64
    a, b = gf.zip(gf.zeros(n, F32), gf.zeros(n, F32)).sync()
    t0 = time.perf_counter()
    ha, hb = gf.zip(
        gf.to_host(K.slow_fill(a, 1.0, 0.2)), gf.to_host(K.slow_fill(b, 2.0, 0.2))
    ).sync()
    assert time.perf_counter() - t0 < 0.33
    np.testing.assert_array_equal(ha, np.ones(n, F32))
    np.testing.assert_array_equal(hb, np.full(n, 2, F32))


async def test_zip_completes_when_its_slowest_arm_does() -> None:
    # host data copied by the slow arm is only complete if the run's completion
    # (signalled on the first arm's stream) waits for the join
    n = 256
    a, b, c = await gf.zip(gf.zeros(n, F32), gf.zeros(n, F32), gf.zeros(n, F32))
    ha, hb, hc = await gf.zip(
        gf.to_host(K.slow_fill(a, 1.0, 0.01)),
        gf.to_host(K.slow_fill(b, 2.0, 0.15)),
        gf.to_host(K.slow_fill(c, 3.0, 0.05)),
    )
    for h, v in ((ha, 1), (hb, 2), (hc, 3)):
        np.testing.assert_array_equal(h, np.full(n, v, F32))


def test_zip_completes_when_its_slowest_arm_does_sync() -> None:
    n = 64
    a, b = gf.zip(gf.zeros(n, F32), gf.zeros(n, F32)).sync()
    s = gf.new_stream()
    ha, hb = gf.zip(
        gf.to_host(K.slow_fill(a, 1.0, 0.01)), gf.to_host(K.slow_fill(b, 2.0, 0.15))
    ).sync()
    np.testing.assert_array_equal(ha, np.ones(n, F32))
    np.testing.assert_array_equal(hb, np.full(n, 2, F32))
    # enqueue_on: synchronizing the run's stream covers every arm
    a2, b2 = gf.zip(gf.zeros(n, F32), gf.zeros(n, F32)).sync_on(s)
    gf.zip(K.slow_fill(a2, 4.0, 0.01), K.slow_fill(b2, 5.0, 0.15)).enqueue_on(s)
    s.synchronize()
    hb2 = gf.to_host(gf.copy(b2)).sync()
    np.testing.assert_array_equal(hb2, np.full(n, 5, F32))


# -- shared ---------------------------------------------------------------------------------------


async def test_shared_runs_once_across_concurrent_tasks() -> None:
    n = 128
    c = await gf.zeros(1, np.int32)
    starts: list[int] = []

    def source(ctx: gf.ExecutionContext) -> gf.DeviceOperation[gf.DeviceArray]:
        starts.append(1)
        return K.bump(c).then(lambda _: gf.zeros(n, F32).then(lambda x: K.slow_fill(x, 7.0, 0.05)))

    shared = gf.with_context(source).shared()
    results: list[Any] = []

    async def clone_user() -> None:
        results.append(await shared.clone())

    async def reader() -> None:
        results.append(await gf.to_host(shared.clone()))

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(clone_user)
        for _ in range(4):
            tg.start_soon(reader)
    arrays = [r for r in results if isinstance(r, gf.DeviceArray)]
    hosts = [r for r in results if isinstance(r, np.ndarray)]
    assert len(arrays) == 8 and len(hosts) == 4
    assert all(a is arrays[0] for a in arrays)
    for h in hosts:  # every reader, on whatever stream, saw the finished write
        np.testing.assert_array_equal(h, np.full(n, 7, F32))
    assert starts == [1]
    assert (await gf.to_host(c))[0] == 1
    # later runs reuse the one result too
    assert await shared is arrays[0]
    assert (await gf.to_host(c))[0] == 1


def test_shared_runs_once_across_threads() -> None:
    n = 64
    c = K.counter()
    starts: list[int] = []
    lock = threading.Lock()

    def source(ctx: gf.ExecutionContext) -> gf.DeviceOperation[gf.DeviceArray]:
        with lock:
            starts.append(1)
        time.sleep(0.02)  # widen the window in which the other threads arrive
        return K.bump(c).then(lambda _: gf.zeros(n, F32).then(lambda x: K.slow_fill(x, 3.0, 0.05)))

    shared = gf.with_context(source).shared()
    barrier = threading.Barrier(8)
    results: list[Any] = [None] * 8
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            op = shared.clone()
            results[i] = op.sync() if i % 2 else gf.to_host(op).sync()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert starts == [1]
    assert K.read_count(c) == 1
    arrays = results[1::2]
    assert all(a is arrays[0] for a in arrays)
    for h in results[0::2]:
        np.testing.assert_array_equal(h, np.full(n, 3, F32))


async def test_shared_failure_reaches_every_clone() -> None:
    calls: list[int] = []

    class Boom(Exception):
        pass

    def source(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        calls.append(1)
        raise Boom("source failed")

    shared = gf.with_context(source).shared()
    errors: list[BaseException] = []

    async def user(op: gf.DeviceOperation[Any]) -> None:
        try:
            await op
        except Boom as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(user, shared.clone())
    await user(shared)
    assert calls == [1]
    assert len(errors) == 7
    assert all(e is errors[0] for e in errors)
    assert str(errors[0]) == "source failed"


def test_shared_failure_reaches_every_clone_in_threads() -> None:
    calls: list[int] = []

    def source(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        calls.append(1)
        time.sleep(0.02)
        return gf.value(1).then(lambda _: 5)  # type: ignore[arg-type, return-value]

    shared = gf.with_context(source).shared()
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker() -> None:
        barrier.wait()
        try:
            shared.clone().sync()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == [1]
    assert len(errors) == 4 and all(isinstance(e, gf.UsageError) for e in errors)
    assert all(e is errors[0] for e in errors)


# -- unzip, first, last ---------------------------------------------------------------------------


async def test_unzip_runs_the_source_once() -> None:
    c = await gf.zeros(1, np.int32)
    starts: list[int] = []

    def source(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        starts.append(1)
        return K.bump(c).then(lambda _: gf.zip(gf.full(2, 1, np.int32), gf.full(3, 2, np.int32)))

    a, b = gf.with_context(source).unzip(2)
    ha = await gf.to_host(a)
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(gf.to_host(b).run)
    hb = await gf.to_host(b)
    both = await gf.zip(a, b)
    np.testing.assert_array_equal(ha, [1, 1])
    np.testing.assert_array_equal(hb, [2, 2, 2])
    assert both[0].shape == (2,) and both[1].shape == (3,)
    assert starts == [1]
    assert (await gf.to_host(c))[0] == 1


async def test_unzip_of_host_data() -> None:
    x = await gf.arange(4, dtype=np.int32)
    first, second = gf.zip(gf.to_host(x), gf.value("tag")).unzip(2)
    np.testing.assert_array_equal(await first, [0, 1, 2, 3])
    assert await second == "tag"


async def test_unzip_checks_its_arity() -> None:
    with pytest.raises(gf.UsageError, match="positive int"):
        gf.value((1, 2)).unzip(0)
    a, _b, _c = gf.value((1, 2)).unzip(3)
    with pytest.raises(gf.UsageError, match=r"unzip\(3\).*2 values"):
        await a


async def test_first_and_last() -> None:
    z = gf.zip(gf.value(1), gf.value(2), gf.value(3))
    assert await z.first() == 1
    assert await z.last() == 3
    assert await gf.value(("only",)).first() == "only"
    x = await gf.arange(3, dtype=np.int64)
    np.testing.assert_array_equal(await gf.zip(gf.value(0), gf.to_host(x)).last(), [0, 1, 2])
    with pytest.raises(gf.UsageError, match=r"first\(\) needs .*non-empty tuple, got int"):
        await gf.value(5).first()


# -- what combinators refuse ----------------------------------------------------------------------


async def test_combinators_refuse_non_operations() -> None:
    with pytest.raises(TypeError, match=r"DeviceOperation.*int.*gf\.value"):
        gf.zip(gf.value(1), 2)  # type: ignore[call-overload]
    with pytest.raises(gf.UsageError, match="at least one"):
        gf.zip()
    with pytest.raises(TypeError, match=r"then\(\) expected a callable, got int"):
        gf.value(1).then(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"map\(\) expected a callable, got str"):
        gf.value(1).map("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"with_context\(\) expected a callable, got NoneType"):
        gf.with_context(None)  # type: ignore[arg-type]
    # host data is not wrapped in gf.value (to_host could not copy that): it is on the host
    with pytest.raises(TypeError, match=r"to_host\(\) takes a DeviceArray.*got ndarray: "
                       r"that is host data already \(gf\.from_host\(x\)") as info:
        gf.to_host(np.ones(3))  # type: ignore[arg-type]
    assert "gf.value" not in str(info.value)
    with pytest.raises(TypeError, match=r"copy\(\) source takes a DeviceArray.*list.*from_host"):
        gf.copy([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"copy\(\) out .*got int"):
        gf.copy(gf.zeros(1), out=3)  # type: ignore[arg-type]

    class Foreign:  # another library's array
        def __dlpack__(self) -> None: ...

    with pytest.raises(TypeError, match=r"got Foreign: another library's array: gf\.from_dlpack"):
        gf.to_host(Foreign())  # type: ignore[arg-type]


async def test_then_function_must_return_an_operation() -> None:
    def not_an_op(v: int) -> int:
        return v + 1

    op = gf.value(1).then(not_an_op)  # type: ignore[arg-type]
    with pytest.raises(gf.UsageError, match=r"not_an_op must return a DeviceOperation") as info:
        await op
    msg = str(info.value)
    assert "not_an_op" in msg and "must return a DeviceOperation" in msg and "int" in msg
    assert ".map()" in msg


async def test_with_context_function_must_return_an_operation() -> None:
    op = gf.with_context(lambda ctx: 3)  # type: ignore[arg-type, return-value]
    with pytest.raises(gf.UsageError, match="must return a DeviceOperation, returned int"):
        await op
