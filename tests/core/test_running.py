"""The four ways to run an operation, scheduling policies, streams and the runtime."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import CUDA_DEVICES
from helpers import kernels as K

import gpuflow as gf
from gpuflow import testing

F32 = np.float32


def probe() -> gf.DeviceOperation[tuple[gf.Stream, int]]:
    """An operation producing the stream and device it ran on."""
    return gf.with_context(lambda ctx: gf.value((ctx.stream, ctx.device)))


# -- sync, sync_on, enqueue_on, await -------------------------------------------------------------


def test_sync_blocks_until_done_and_returns_the_output() -> None:
    n = 128
    x = gf.zeros(n, F32).sync()
    t0 = time.perf_counter()
    out = K.slow_fill(x, 4.0, 0.1).sync()
    assert time.perf_counter() - t0 >= 0.09
    assert out is x
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(n, 4, F32))


def test_sync_on_runs_on_that_stream() -> None:
    s = gf.new_stream()
    stream, device = probe().sync_on(s)
    assert stream == s and device == s.device == 0
    x = gf.zeros(16, F32).sync_on(s)
    K.slow_fill(x, 2.0, 0.05).sync_on(s)
    np.testing.assert_array_equal(gf.to_host(x).sync_on(s), np.full(16, 2, F32))


def test_enqueue_on_returns_without_waiting() -> None:
    n = 64
    s = gf.new_stream()
    x = gf.zeros(n, F32).sync_on(s)
    t0 = time.perf_counter()
    out = K.slow_fill(x, 9.0, 0.3).enqueue_on(s)
    enqueued = time.perf_counter() - t0
    assert out is x
    assert enqueued < 0.1, f"enqueue_on took {enqueued:.3f} s: it waited for the kernel"
    s.synchronize()
    assert time.perf_counter() - t0 >= 0.28
    host = np.empty(n, F32)
    h = gf.to_host(x).enqueue_on(s)  # host data: valid once the stream is synchronized
    s.synchronize()
    host[:] = h
    np.testing.assert_array_equal(host, np.full(n, 9, F32))


def test_enqueue_on_refuses_map_over_pending_host_data() -> None:
    s = gf.new_stream()
    x = gf.ones(4, F32).sync_on(s)
    with pytest.raises(gf.UsageError, match="sync_on"):
        gf.to_host(x).map(np.sum).enqueue_on(s)
    s.synchronize()


@pytest.mark.anyio
async def test_enqueue_on_from_async_code_does_not_block() -> None:
    s = gf.new_stream()
    x = await gf.zeros(8, F32)
    t0 = time.perf_counter()
    K.slow_fill(x, 1.0, 0.2).enqueue_on(s)
    assert time.perf_counter() - t0 < 0.1
    await anyio.to_thread.run_sync(s.synchronize)
    np.testing.assert_array_equal(await gf.to_host(x), np.ones(8, F32))


@pytest.mark.anyio
async def test_await_and_run_with_a_policy() -> None:
    x = await gf.arange(10, dtype=np.int32)
    np.testing.assert_array_equal(await gf.to_host(x), np.arange(10, dtype=np.int32))
    s = gf.new_stream()
    stream, _dev = await probe().run(_Fixed(s))
    assert stream == s


@pytest.mark.anyio
async def test_sync_inside_an_event_loop_raises_usage_error(anyio_backend_name: str) -> None:
    op = gf.value(1)
    with pytest.raises(gf.UsageError, match="await") as info:
        op.sync()
    assert anyio_backend_name in str(info.value)
    with pytest.raises(gf.UsageError, match="await"):
        op.sync(gf.SingleStream(0))
    with pytest.raises(gf.UsageError, match="await"):
        op.sync_on(gf.new_stream())
    # the loop's own thread is refused, not a worker thread of the program
    assert await anyio.to_thread.run_sync(op.sync) == 1
    assert await op == 1


def _rank_noop(info: gf.RankInfo) -> int:
    return info.rank


@pytest.mark.anyio
async def test_every_blocking_call_is_refused_in_the_loop_naming_its_own_alternative(
    anyio_backend_name: str,
) -> None:
    """Each blocking public call raises at once in a thread that runs an
    event loop, says which loop, and names what does the same without
    blocking; from a worker thread each still works."""

    x = await gf.zeros(16, np.float32)
    s = gf.new_stream()
    K.slow_fill(x, 1.0, 0.5).enqueue_on(s)  # (a blocking call would wait for it)
    op = gf.value(1)
    refusals: list[tuple[Callable[[], object], str, str]] = [
        (op.sync, "op.sync()", "`await op` (or `await op.run(policy)`)"),
        (lambda: op.sync_on(s), "op.sync_on(stream)",
         "`op.enqueue_on(stream)` and then `await gf.wait_stream(stream)`"),
        (s.synchronize, "stream.synchronize()", "`await gf.wait_stream(stream)`"),
        (lambda: gf.spawn_ranks(_rank_noop, 1), "spawn_ranks()",
         "`await anyio.to_thread.run_sync(gf.spawn_ranks, fn, nranks)`"),
        (lambda: x.__dlpack__(dl_device=(1, 0)), "exporting a device array to host memory",
         "`await gf.to_host(array)`"),
        (gf.testing.assert_quiescent, "gf.testing.assert_quiescent()",
         "`await gf.testing.assert_quiescent_async()`"),
    ]  # fmt: skip
    t0 = time.monotonic()
    for call, what, instead in refusals:
        with pytest.raises(gf.UsageError) as info:
            call()
        message = str(info.value)
        assert message.startswith(what) and f"running {anyio_backend_name} event loop" in message
        assert message.endswith(instead), message
    assert time.monotonic() - t0 < 0.25  # none of them waited for the kernel
    await anyio.to_thread.run_sync(s.synchronize)  # a worker thread may block
    assert s.idle()


def test_sync_refuses_a_bad_policy() -> None:
    with pytest.raises(TypeError, match="SchedulingPolicy"):
        gf.value(1).sync(policy="round robin")  # type: ignore[arg-type]

    class Broken:
        def next_stream(self, device: int) -> Any:
            return "stream 0"

    with pytest.raises(gf.UsageError, match="not a Stream"):
        gf.value(1).sync(Broken())


def test_runs_are_thread_safe() -> None:
    c = K.counter()
    op = K.bump(c)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(5):
                op.sync(gf.SingleStream(0))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    # each thread used a stream of its own; the counter's writes were ordered anyway
    assert K.read_count(c) == 20


# -- scheduling policies --------------------------------------------------------------------------


class _Fixed:
    """A user-defined policy: always one stream, counting its calls."""

    def __init__(self, stream: gf.Stream) -> None:
        self.stream = stream
        self.devices: list[int] = []

    def next_stream(self, device: int) -> gf.Stream:
        self.devices.append(device)
        return self.stream


def test_round_robin_gives_consecutive_runs_different_streams() -> None:
    streams = [probe().sync()[0] for _ in range(4)]
    assert len(set(streams)) == 4
    assert probe().sync()[0] == streams[0]  # the pool has streams_per_device=4 streams
    policy = gf.StreamPoolRoundRobin()
    assert isinstance(policy, gf.SchedulingPolicy)
    mine = [probe().sync(policy)[0] for _ in range(4)]
    assert set(mine) == set(streams)


@pytest.mark.anyio
async def test_round_robin_under_await() -> None:
    streams = [(await probe())[0] for _ in range(4)]
    assert len(set(streams)) == 4


def test_streams_per_device_sizes_the_pool() -> None:
    gf.init_device_contexts(backend=gf.current_backend(), streams_per_device=2)
    streams = {probe().sync()[0] for _ in range(6)}
    assert len(streams) == 2


def test_single_stream_always_uses_one_stream() -> None:
    policy = gf.SingleStream(device=0)
    assert isinstance(policy, gf.SchedulingPolicy)
    streams = {probe().sync(policy)[0] for _ in range(5)}
    assert streams == {policy.stream}
    pool = {probe().sync()[0] for _ in range(4)}
    assert policy.stream not in pool  # a stream of its own
    # a zip under it cannot fork: every arm on the one stream
    arms = gf.zip(probe(), probe()).sync(policy)
    assert arms[0][0] == arms[1][0] == policy.stream


def test_single_stream_on_another_device() -> None:
    if K.num_devices() < 2:
        pytest.skip("needs two devices")
    policy = gf.SingleStream(device=1)
    stream, device = probe().sync(policy)
    assert device == 1 and stream.device == 1 and stream == policy.stream
    x = gf.full(3, 5, dtype=np.int32).sync(policy)
    assert x.device == 1
    np.testing.assert_array_equal(gf.to_host(x).sync(policy), [5, 5, 5])


@pytest.mark.anyio
async def test_a_user_defined_policy_is_used() -> None:
    s = gf.new_stream()
    policy = _Fixed(s)
    assert isinstance(policy, gf.SchedulingPolicy)
    stream, _ = await probe().run(policy)
    assert stream == s and policy.devices == [0]
    # zip arms ask the run's policy for their streams too
    arms = await gf.zip(probe(), probe(), probe()).run(policy)
    assert {a[0] for a in arms} == {s}
    assert policy.devices == [0, 0, 0, 0]
    out = await gf.full(2, 1.5, dtype=F32).run(policy)
    np.testing.assert_array_equal(await gf.to_host(out).run(policy), [1.5, 1.5])


def test_a_user_defined_policy_is_used_by_sync() -> None:
    streams = [gf.new_stream(), gf.new_stream()]

    class Alternate:
        def __init__(self) -> None:
            self.i = 0

        def next_stream(self, device: int) -> gf.Stream:
            self.i += 1
            return streams[self.i % 2]

    policy = Alternate()
    got = [probe().sync(policy)[0] for _ in range(4)]
    assert got == [streams[1], streams[0], streams[1], streams[0]]


# -- streams and contexts -------------------------------------------------------------------------


def test_new_stream() -> None:
    a, b = gf.new_stream(), gf.new_stream(0)
    assert isinstance(a, gf.Stream) and a.device == 0 and b.device == 0
    assert a != b and hash(a) != hash(b)
    a.synchronize()  # idle: returns at once
    with pytest.raises(gf.UsageError, match="device 99"):
        gf.new_stream(99)


def test_stream_is_hashable_and_equal_for_the_same_underlying_stream() -> None:
    s = gf.new_stream()
    for twin in (copy.copy(s), copy.deepcopy(s)):  # (the stream itself: one per stream)
        assert twin == s and hash(twin) == hash(s)
        assert len({s, twin}) == 1
        assert {s: 1}[twin] == 1
    assert s != gf.new_stream() and s != "stream"  # type: ignore[comparison-overlap]
    # the same pool stream reached twice compares equal
    policy = gf.SingleStream(0)
    assert probe().sync(policy)[0] == probe().sync(policy)[0]


def test_execution_context_exposes_device_and_stream() -> None:
    seen: list[gf.ExecutionContext] = []

    def fn(ctx: gf.ExecutionContext) -> gf.DeviceOperation[None]:
        seen.append(ctx)
        return gf.value(None)

    s = gf.new_stream()
    gf.with_context(fn).sync_on(s)
    (ctx,) = seen
    assert ctx.device == 0
    assert isinstance(ctx.stream, gf.Stream) and ctx.stream == s


# -- the runtime ----------------------------------------------------------------------------------


def test_init_device_contexts_refuses_bad_arguments() -> None:
    backend = gf.current_backend()
    x = gf.ones(3, F32).sync()
    with pytest.raises(gf.UsageError, match="backend"):
        gf.init_device_contexts(backend="opencl")
    with pytest.raises(gf.UsageError, match="streams_per_device"):
        gf.init_device_contexts(streams_per_device=0, backend=backend)
    with pytest.raises(gf.UsageError, match="num_devices"):
        gf.init_device_contexts(num_devices=0, backend=backend)
    with pytest.raises(gf.UsageError, match="num_devices"):
        gf.init_device_contexts(num_devices=-1, backend=backend)
    with pytest.raises(gf.UsageError, match="default_device"):
        gf.init_device_contexts(default_device=64, backend=backend)
    with pytest.raises(gf.UsageError, match="default_device"):
        gf.init_device_contexts(default_device=-1, backend=backend)
    # a refused call leaves the runtime as it was
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.ones(3, F32))


def test_init_device_contexts_returns_the_backend(device_backend: str) -> None:
    assert gf.current_backend() == device_backend
    assert gf.init_device_contexts(backend=device_backend) == device_backend
    assert gf.current_backend() == device_backend
    # auto takes cuda wherever a CUDA device is present
    assert gf.init_device_contexts(backend="auto") == ("cuda" if CUDA_DEVICES else "sim")
    gf.init_device_contexts(backend=device_backend)
    np.testing.assert_array_equal(gf.to_host(gf.arange(3, dtype=np.int32)).sync(), [0, 1, 2])


@pytest.mark.sim_only
def test_current_backend_is_sim_here() -> None:
    assert gf.current_backend() == "sim"
    assert gf.init_device_contexts(backend="sim", num_devices=3) == "sim"
    assert K.num_devices() == 3


def test_current_device_is_the_default_device() -> None:
    assert gf.current_device() == 0
    assert probe().sync()[1] == 0


@pytest.mark.sim_only
def test_default_device_chooses_where_runs_go() -> None:
    gf.init_device_contexts(default_device=1, num_devices=2, backend="sim")
    assert gf.current_device() == 1
    stream, device = probe().sync()
    assert device == 1 and stream.device == 1
    assert gf.zeros(2, F32).sync().device == 1
    assert gf.new_stream().device == 1


def test_streams_of_a_replaced_runtime_are_refused() -> None:
    s = gf.new_stream()
    gf.init_device_contexts(backend=gf.current_backend(), num_devices=1)
    with pytest.raises(gf.UsageError, match="replaced or reset"):
        gf.value(1).sync_on(s)


# -- the device's activity record (gpuflow.testing) -----------------------------------------------


@pytest.mark.sim_only
def test_sim_activity_record_holds_what_each_stream_ran_in_order() -> None:
    s0, s1 = gf.new_stream(0), gf.new_stream(1)
    c0 = gf.zeros(1, np.int32).sync_on(s0)
    c1 = gf.zeros(1, np.int32).sync_on(s1)
    with testing.record_activity() as record:
        K.bump(c0).then(lambda _: K.bump(c0)).sync_on(s0)
        K.bump(c1).sync_on(s1)
    kernels = [r for r in record if r.what == "kernel 'count'"]
    assert [r.device for r in kernels] == [0, 0, 1]
    first, second, other = kernels
    assert first.stream == second.stream != other.stream
    assert first.start <= first.end <= second.start <= second.end
    assert not testing.overlapped(first, second)
    assert all(r.start <= r.end for r in record)
    closed = list(record)
    K.bump(c0).sync_on(s0)
    assert record == closed  # nothing is recorded once the block has exited
    assert K.read_count(c0) == 3


@pytest.mark.cuda_only
def test_cuda_activity_record_times_what_each_stream_ran_with_events() -> None:
    s0, s1 = gf.new_stream(0), gf.new_stream(0)
    c0 = gf.zeros(1, np.int32).sync_on(s0)
    c1 = gf.zeros(1, np.int32).sync_on(s1)
    with testing.record_activity() as record:
        K.bump(c0).then(lambda _: K.bump(c0)).sync_on(s0)
        K.bump(c1).sync_on(s1)
    kernels = [r for r in record if r.what == "kernel 'count'"]
    assert len(kernels) == 3, record
    first, second, other = kernels
    assert first.stream == second.stream != other.stream
    assert first.start <= first.end <= second.start <= second.end
    assert not [r for r in record if r.what in ("completion mark", "event record")]
    closed = list(record)
    K.bump(c0).sync_on(s0)
    assert record == closed  # nothing is recorded once the block has exited
    assert K.read_count(c0) == 3


def test_a_backend_without_an_activity_record_refuses_one() -> None:
    be = gf.lowlevel.current_backend_object()
    with pytest.raises(gf.UsageError, match="keeps no record of device activity"):
        gf.lowlevel.Backend.start_activity_record(be)  # the interface's own answer
