"""Communicators: collectives as operations, and no hang whatever a peer does.

Single-process communicators run over every device the backend has (two
simulated devices on ``sim``; on a machine with one GPU, a communicator of
one rank, which is still NCCL's).  Ranks of several processes run on
``sim`` here (spawned, and under ``mpiexec`` from the ``mpich`` wheel); two
ranks that meet by a unique id inside one process need two devices (NCCL
refuses two ranks on one GPU).  A hang is made on purpose with a recv whose
send never comes (a communicator of one rank receiving from itself, on
both backends) or a peer that never calls.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K
from helpers import ranks

import gpuflow as gf
from gpuflow import testing

F32 = np.float32
HERE = Path(__file__).resolve().parents[1]  # tests/
DEADLINE = 0.5

pytestmark = pytest.mark.anyio


def devices() -> list[int]:
    return list(range(min(gf.device_count(), 2)))


def two_devices() -> None:
    if gf.device_count() < 2:
        pytest.skip("needs two devices (NCCL takes one rank a GPU)")


async def put(host: np.ndarray[Any, Any], device: int) -> gf.DeviceArray:
    with gf.use_device(device):
        return await gf.from_host(host)


async def get(a: gf.DeviceArray) -> np.ndarray[Any, Any]:
    with gf.use_device(a.device):
        return await gf.to_host(a)


def shards(n: int, dtype: Any = F32) -> list[np.ndarray[Any, Any]]:
    return [(np.arange(6) % 5 + 1 + 3 * d).astype(dtype) for d in range(n)]


REFERENCE = {
    "sum": lambda s: np.sum(s, axis=0),
    "prod": lambda s: np.prod(s, axis=0),
    "max": lambda s: np.max(s, axis=0),
    "min": lambda s: np.min(s, axis=0),
    "avg": lambda s: np.sum(s, axis=0) / len(s),
}


# -- collectives of one process's devices ---------------------------------------------------
@pytest.mark.parametrize("op", sorted(REFERENCE))
@pytest.mark.parametrize("dtype", [F32, np.int32, np.float64])
async def test_all_reduce_over_the_devices_of_a_process(op: str, dtype: Any) -> None:
    devs = devices()
    host = shards(len(devs), dtype)
    async with gf.open_communicator(devs) as comm:
        assert comm.devices == tuple(devs) and comm.nranks == len(devs)
        xs = [await put(h, d) for h, d in zip(host, devs, strict=True)]
        outs = await comm.all_reduce(xs, op)
        want = REFERENCE[op](np.stack(host)).astype(dtype)
        for d, out in zip(devs, outs, strict=True):
            assert out.device == d
            np.testing.assert_allclose(await get(out), want, rtol=1e-6)
        for h, x in zip(host, xs, strict=True):  # out of place: inputs untouched
            np.testing.assert_array_equal(await get(x), h)


async def test_another_devices_part_does_not_queue_behind_unrelated_work() -> None:
    """The part of a collective on another device than the run's waits for its
    array's own last write, not for whatever that write's stream ran after."""
    two_devices()
    import time

    host = shards(2)
    async with gf.open_communicator([0, 1]) as comm:
        xs = [await put(h, d) for h, d in zip(host, [0, 1], strict=True)]
        writer = gf.new_stream(1)  # x1's last writer
        gf.copy(await put(host[1], 1), out=xs[1]).enqueue_on(writer)
        with gf.use_device(1):
            junk = await gf.zeros(64, F32)
        K.slow_fill(junk, 1.0, 1.0, 64).enqueue_on(writer)  # unrelated long work there
        t0 = time.perf_counter()
        outs = await comm.all_reduce(xs, "sum")
        took = time.perf_counter() - t0
        assert took < 0.5, f"the all-reduce waited {took:.2f} s for unrelated work"
        np.testing.assert_array_equal(await get(outs[1]), host[0] + host[1])
        with gf.use_device(1):
            await gf.wait_stream(writer)


async def test_in_place_all_reduce_writes_its_input() -> None:
    devs = devices()
    host = shards(len(devs))
    async with gf.open_communicator(devs) as comm:
        xs = [await put(h, d) for h, d in zip(host, devs, strict=True)]
        outs = await comm.all_reduce(xs, "max", out=xs)
        assert all(o is x for o, x in zip(outs, xs, strict=True))
        for x in xs:
            np.testing.assert_array_equal(await get(x), np.max(np.stack(host), axis=0))


async def test_a_collective_run_again_takes_its_arrays_as_they_are_then() -> None:
    """A collective of given arrays is checked once and run again from what
    was found; each run still reads the arrays as they are at that run, the
    lists it was given as they are then."""
    devs = devices()
    host = shards(len(devs))
    async with gf.open_communicator(devs) as comm:
        xs = [await put(h, d) for h, d in zip(host, devs, strict=True)]
        outs = [await put(np.zeros(6, F32), d) for d in devs]
        op = comm.all_reduce(xs, "sum", out=outs)
        for k in range(3):  # the inputs change between runs: each run reads them anew
            for x, h in zip(xs, host, strict=True):
                await gf.copy(await put(h + k, x.device), out=x)
            got = await op
            assert all(g is o for g, o in zip(got, outs, strict=True))
            want = np.sum(np.stack(host), axis=0) + k * len(devs)
            for o in outs:
                np.testing.assert_array_equal(await get(o), want)
        # the list given as out now holds another array: the next run writes that one
        first = outs[0]
        outs[0] = await put(np.zeros(6, F32), devs[0])
        for _ in range(2):  # (checked anew, then run again from what was found)
            got = await op
            assert got[0] is outs[0] and got[0] is not first
            np.testing.assert_array_equal(await get(outs[0]), want)
        # a list given as input, changed the same way
        xs[0] = await put(np.full(6, 100, F32), devs[0])
        await op
        rest = sum((h + 2 for h in host[1:]), np.zeros(6, F32))  # (the last k)
        np.testing.assert_array_equal(await get(outs[-1]), np.full(6, 100, F32) + rest)


async def test_a_collective_run_again_enqueues_on_that_runs_stream() -> None:
    """A collective run again from what its earlier runs found enqueues on
    the stream of the run, not on theirs, where unrelated work may queue;
    and, on that stream too, on the arrays its lists hold then."""
    import time

    async with gf.open_communicator([0]) as comm:
        x = await put(np.ones(6, F32), 0)
        y = await put(np.zeros(6, F32), 0)
        z = await put(np.zeros(6, F32), 0)
        outs = [y]
        op = comm.all_reduce([x], out=outs)
        first, second = gf.new_stream(0), gf.new_stream(0)
        for _ in range(2):  # checked, then run from what was found, on ``first``
            assert op.enqueue_on(first)[0] is y
            await gf.wait_stream(first)
        for out in (z, y):
            outs[0] = out
            for _ in range(2):  # checked anew, then run from what was found then
                assert op.enqueue_on(first)[0] is out
                await gf.wait_stream(first)
        with gf.use_device(0):
            junk = await gf.zeros(64, F32)
        K.slow_fill(junk, 1.0, 1.0, 64).enqueue_on(first)  # unrelated long work there
        t0 = time.perf_counter()
        op.enqueue_on(second)
        await gf.wait_stream(second)
        took = time.perf_counter() - t0
        assert took < 0.5, f"the all-reduce waited {took:.2f} s for another stream's work"
        np.testing.assert_array_equal(await get(y), np.ones(6, F32))
        await gf.wait_stream(first)


async def test_a_collective_awaited_over_a_pools_streams_is_checked_once_a_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Awaits of one collective, which a round-robin policy spreads over the
    device's streams, each run from what the first run on that stream
    found: its arrays are checked once a stream, not at every run, and
    every run has the right result (that each enqueues on its own stream:
    the test above)."""
    async with gf.open_communicator([0]) as comm:
        x = await put(np.arange(6, dtype=F32), 0)
        y = await put(np.zeros(6, F32), 0)
        blank = await put(np.full(6, -1, F32), 0)
        op = comm.all_reduce([x], "max", out=[y])
        checked: list[gf.Stream] = []
        real = gf.DeviceArray._check_usable

        def counted(self: gf.DeviceArray, ctx: Any, what: str) -> None:
            if what == "all_reduce":  # (not the copy's)
                checked.append(ctx.stream)
            real(self, ctx, what)

        monkeypatch.setattr(gf.DeviceArray, "_check_usable", counted)
        runs = 24
        spread = gf.StreamPoolRoundRobin()
        for k in range(runs):
            await gf.copy(blank, out=y)
            got = await op.run(spread)
            assert got[0] is y
            np.testing.assert_array_equal(await get(y), np.arange(6, dtype=F32), f"run {k}")
        streams = set(checked)
        assert len(streams) > 1, "the policy put every run on one stream"
        # (input and out checked once on each stream the runs went to)
        assert len(checked) <= 2 * len(streams) < 2 * (runs - 1), checked


async def test_the_default_policy_puts_a_collective_after_the_previous_one_when_idle() -> None:
    """Under the default policy a collective goes to the stream of its
    communicator's previous collective while that stream has nothing
    pending (no wait on another stream), and to another stream where it has
    (nothing queues behind unrelated work), or where a stream lease holds
    it; an explicit policy is followed."""
    import time

    async with gf.open_communicator([0]) as comm:
        x = await put(np.ones(6, F32), 0)
        y = await put(np.zeros(6, F32), 0)
        op = comm.all_reduce([x], out=[y])
        streams: list[gf.Stream] = []
        for _ in range(6):
            await op
            streams.append(comm._tails[0][0])  # (where the rank's latest went)
        assert len(set(streams)) == 1, streams
        home = streams[-1]
        # that stream busy with unrelated work: the next goes elsewhere, at once
        with gf.use_device(0):
            junk = await gf.zeros(64, F32)
        K.slow_fill(junk, 1.0, 1.0, 64).enqueue_on(home)
        t0 = time.perf_counter()
        await op
        took = time.perf_counter() - t0
        assert took < 0.5, f"the all-reduce queued {took:.2f} s behind unrelated work"
        assert comm._tails[0][0] is not home
        await gf.wait_stream(home)
        # held by a stream lease: taken by the runs inside it, by no other
        where: list[gf.Stream] = []
        ready, done = anyio.Event(), anyio.Event()

        async def outside() -> None:  # (started before the lease: not in it)
            await ready.wait()
            await op
            where.append(comm._tails[0][0])
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(outside)
            async with gf.open_stream_lease() as lease:
                await op
                assert comm._tails[0][0] is lease.stream
                ready.set()
                await done.wait()
                assert where[0] is not lease.stream
        # an explicit policy is followed
        single = gf.SingleStream(0)
        await op.run(single)
        assert comm._tails[0][0] is single.stream


@pytest.mark.sim_only  # (on CUDA a reset under a live NCCL communicator is undefined)
async def test_a_collective_run_again_refuses_arrays_of_a_reset_device() -> None:
    """The checks a collective's later runs keep: an array of a device reset
    since is refused by a run from what an earlier run checked as by a first run, before
    anything is enqueued."""
    async with gf.open_communicator([0]) as comm:
        x = await put(np.ones(6, F32), 0)
        y = await put(np.zeros(6, F32), 0)
        op = comm.all_reduce([x], out=[y])
        await op
        await op  # (from what the first run checked)
        await anyio.to_thread.run_sync(gf.reset_device, 0)
        for run in (op, comm.all_reduce([x], out=[y])):  # checked before, then first
            with pytest.raises(gf.UsageError, match="reset or replaced"):
                await run
        z = await put(np.ones(6, F32), 0)  # arrays made since are taken
        np.testing.assert_array_equal(await get((await comm.all_reduce([z]))[0]), np.ones(6, F32))


async def test_a_collective_of_a_replaced_runtime_names_its_array() -> None:
    """Once gpuflow is initialised again, a collective run again refuses the
    array of the replaced runtime it was given, naming it, as a first run
    does, before anything is enqueued: the default policy, which looks first
    at the stream of the rank's previous collective, never takes a stream
    of the replaced runtime (the run would fail there, naming a stream the
    caller never gave)."""
    async with gf.open_communicator([0]) as comm:
        x = await put(np.ones(6, F32), 0)
        op = comm.all_reduce([x])
        await op
        await op  # (from what the first run checked)
        gf.init_device_contexts(backend=gf.current_backend())
        for run in (op, comm.all_reduce([x])):  # checked before, then first
            with pytest.raises(gf.UsageError, match=r"all_reduce\(\) input: .*DeviceArray"):
                await run


async def test_broadcast_all_gather_and_reduce_scatter() -> None:
    devs = devices()
    n = len(devs)
    host = shards(n)
    async with gf.open_communicator(devs) as comm:
        xs = [await put(h, d) for h, d in zip(host, devs, strict=True)]
        for b in await comm.broadcast(xs, root=n - 1):
            np.testing.assert_array_equal(await get(b), host[n - 1])
        for g in await comm.all_gather(xs):
            assert g.shape == (n, 6)
            np.testing.assert_array_equal(await get(g), np.stack(host))
        rows = [await put(np.arange(n * 3, dtype=F32).reshape(n, 3) * (d + 1), d) for d in devs]
        total = np.sum([np.arange(n * 3, dtype=F32).reshape(n, 3) * (d + 1) for d in devs], 0)
        for r, part in enumerate(await comm.reduce_scatter(rows)):
            assert part.shape == (3,)
            np.testing.assert_array_equal(await get(part), total[r])
        # into arrays of the caller's
        outs = [await put(np.zeros((n, 6), F32), d) for d in devs]
        got = await comm.all_gather(xs, out=outs)
        assert all(g is o for g, o in zip(got, outs, strict=True))
        np.testing.assert_array_equal(await get(outs[0]), np.stack(host))


async def test_send_and_recv_between_devices_in_one_group() -> None:
    two_devices()
    async with gf.open_communicator([0, 1]) as comm:
        a = await put(np.arange(5, dtype=F32), 0)
        b = await put(np.full(5, 7, F32), 1)
        into = await put(np.zeros(5, F32), 0)
        sent, got, _, back = await comm.group(
            comm.send(a, 1),
            comm.recv(0, shape=(5,), dtype=F32, device=1),
            comm.send(b, 0),
            comm.recv(1, out=into),
        )
        assert sent is None and got.device == 1 and back is into
        np.testing.assert_array_equal(await get(got), np.arange(5, dtype=F32))
        np.testing.assert_array_equal(await get(into), np.full(5, 7, F32))


async def test_a_transfer_to_itself_needs_its_match_in_the_same_group() -> None:
    d = devices()[0]
    with gf.use_device(d):
        x = await gf.from_host(np.arange(4, dtype=F32))
        y = await gf.zeros(4, F32)
        async with gf.open_communicator([d]) as comm:
            _, got = await comm.group(comm.send(x, 0), comm.recv(0, out=y))
            assert got is y
            np.testing.assert_array_equal(await gf.to_host(y), np.arange(4, dtype=F32))
        async with gf.open_communicator([d]) as comm:
            with pytest.raises(gf.CommunicatorError) as refused:
                await comm.recv(0, out=y)  # its send is in no group: NCCL refuses it
            assert refused.value.name == "ncclInvalidUsage"


async def test_an_aborted_communicator_refuses_collectives_and_its_scope_raises() -> None:
    devs = devices()
    with pytest.raises(gf.CommunicatorError, match="the program gives up") as left:
        async with gf.open_communicator(devs) as comm:
            xs = [await put(np.ones(4, F32), d) for d in devs]
            await comm.all_reduce(xs)
            comm.abort("the program gives up")
            comm.abort("twice")  # idempotent: the first reason stays
            with pytest.raises(gf.CommunicatorError) as refused:
                await comm.all_reduce(xs)
            assert refused.value is comm.error
            for x in xs:  # the arrays are the program's still
                np.testing.assert_array_equal(await get(x), np.ones(4, F32))
    assert left.value is comm.error and "twice" not in str(comm.error)


async def test_collectives_compose_with_then_map_and_zip() -> None:
    devs = devices()
    host = shards(len(devs))
    async with gf.open_communicator(devs) as comm:
        xs = [await put(h, d) for h, d in zip(host, devs, strict=True)]
        # a kernel writes rank 0's input, the all-reduce reads it after that
        # write, and a copy of the result follows on the same run
        op = (
            K.module()
            .scale(K.cfg(6), xs[0], 2.0, 6)
            .then(lambda _: comm.all_reduce(xs))
            .map(lambda outs: outs[0])
            .then(lambda y: gf.copy(y))
        )
        with gf.use_device(devs[0]):
            out = await gf.to_host(op)
        want = np.sum(np.stack([host[0] * 2, *host[1:]]), axis=0)
        np.testing.assert_array_equal(out, want)
        # two collectives as the arms of a zip (the pool may give them two
        # streams: each rank still runs them in the order they were issued)
        with gf.use_device(devs[0]):
            sums, gathered = await gf.zip(comm.all_reduce(xs), comm.all_gather(xs))
        for s_, g in zip(sums, gathered, strict=True):
            np.testing.assert_array_equal(await get(s_), want)
            np.testing.assert_array_equal(await get(g), np.stack([host[0] * 2, *host[1:]]))


async def test_a_collective_reads_after_a_write_on_another_stream_and_before_a_later_one() -> (
    None
):
    devs = devices()
    d0 = devs[0]
    async with gf.open_communicator(devs) as comm:
        xs = [await put(np.zeros(4, F32), d) for d in devs]
        # three streams: a slow write, the collective reading it, a later
        # write of the same array; only hazard tracking orders them
        K.slow_fill(xs[0], 3.0, 0.2).enqueue_on(gf.new_stream(d0))
        outs = comm.all_reduce(xs).enqueue_on(gf.new_stream(d0))
        K.slow_fill(xs[0], 5.0, 0.0).enqueue_on(gf.new_stream(d0))
        np.testing.assert_array_equal(await get(outs[0]), np.full(4, 3.0, F32))
        np.testing.assert_array_equal(await get(xs[0]), np.full(4, 5.0, F32))


async def test_a_collective_run_again_orders_its_uses_as_a_first_run() -> None:
    """A collective run again from what its first run checked (one rank: the backend's issuer
    of its call) reads after a write on another stream, writes after one,
    and a later write on a third stream waits for its read."""
    async with gf.open_communicator([0]) as comm:
        x = await put(np.ones(4, F32), 0)
        y = await put(np.zeros(4, F32), 0)
        op = comm.all_reduce([x], out=[y])
        s1, s2, s3 = gf.new_stream(0), gf.new_stream(0), gf.new_stream(0)
        for _ in range(3):  # the first run, then two from what it checked, on s2
            op.enqueue_on(s2)
            await gf.wait_stream(s2)
        K.slow_fill(x, 3.0, 0.2).enqueue_on(s1)
        assert op.enqueue_on(s2)[0] is y
        K.slow_fill(x, 5.0, 0.0).enqueue_on(s3)
        await gf.wait_stream(s3)
        np.testing.assert_array_equal(await get(y), np.full(4, 3.0, F32))
        np.testing.assert_array_equal(await get(x), np.full(4, 5.0, F32))
        K.slow_fill(y, 7.0, 0.2).enqueue_on(s3)
        op.enqueue_on(s2)
        np.testing.assert_array_equal(await get(y), np.full(4, 5.0, F32))


@pytest.mark.sim_only  # the record of what the streams ran is the simulator's
async def test_a_collective_run_again_runs_after_the_ranks_previous_one() -> None:
    async with gf.open_communicator([0]) as comm:
        x = await put(np.ones(64, F32), 0)
        op = comm.all_reduce([x], out=[await put(np.zeros(64, F32), 0)])
        s1, s2 = gf.new_stream(0), gf.new_stream(0)
        for _ in range(3):  # (checked on s2)
            op.enqueue_on(s2)
            await gf.wait_stream(s2)
        with testing.record_activity() as activity:
            K.slow_fill(await put(np.zeros(4, F32), 0), 1.0, 0.2).enqueue_on(s1)
            comm.all_gather([x]).enqueue_on(s1)
            op.enqueue_on(s2)
            await gf.wait_stream(s1)
            await gf.wait_stream(s2)
    ran = {a.what: a for a in activity if a.what.startswith("nccl")}
    first, second = ran["nccl all_gather"], ran["nccl all_reduce"]
    assert second.start >= first.end, (first, second)


@pytest.mark.sim_only  # the record of what the streams ran is the simulator's
async def test_a_rank_runs_its_collectives_in_the_order_they_were_issued() -> None:
    devs = devices()
    async with gf.open_communicator(devs) as comm:
        xs = [await put(np.ones(64, F32), d) for d in devs]
        with testing.record_activity() as activity:
            with gf.use_device(devs[0]):
                await gf.zip(comm.all_reduce(xs), comm.all_gather(xs))
    for d in devs:
        ran = {a.what: a for a in activity if a.device == d and a.what.startswith("nccl")}
        first, second = ran["nccl all_reduce"], ran["nccl all_gather"]
        if d == devs[0]:  # the zip's arms ran on two streams (else this proves nothing)
            assert first.stream != second.stream
        assert second.start >= first.end, (first, second)


# -- never hang ------------------------------------------------------------------------------
# Rank 0 and rank 1 meet by a unique id in this process (two tasks, two
# devices); rank 1 joins and never calls, so a collective of rank 0 waits
# for ever, as NCCL's does.  (A rank of one cannot hang: NCCL refuses a
# transfer to itself whose match is not in the same group.)
@contextlib.asynccontextmanager
async def lonely_rank0(hold: float = 3.0) -> Any:
    """Rank 0's communicator (device 0), with rank 1 joined and idle for ``hold`` s."""
    two_devices()
    uid = gf.new_unique_id()

    async def idle() -> None:
        with gf.use_device(1):
            async with gf.open_communicator(gf.RankInfo(1, 2, uid)) as peer:
                assert peer.rank == 1
                await anyio.sleep(hold)

    async with anyio.create_task_group() as tg:
        tg.start_soon(idle)
        with gf.use_device(0):
            yield gf.open_communicator(gf.RankInfo(0, 2, uid))
        tg.cancel_scope.cancel()


async def test_joining_waits_for_every_rank_and_a_deadline_ends_that_wait() -> None:
    two_devices()
    uid = gf.new_unique_id()
    with gf.use_device(0):
        with pytest.raises(TimeoutError):
            with anyio.fail_after(DEADLINE):
                async with gf.open_communicator(gf.RankInfo(0, 2, uid)):
                    raise AssertionError("joined without rank 1")
    # rank 1 joins late: rank 0's abandoned join ends in its own thread, which
    # releases what it made (rank 0 leaves), so a collective of rank 1 finds
    # rank 0 gone: NCCL's remote error, not a hang
    with gf.use_device(1):
        with pytest.raises(gf.CommunicatorError):
            async with gf.open_communicator(gf.RankInfo(1, 2, uid)) as late:
                x = await gf.from_host(np.ones(2, F32))
                with pytest.raises(gf.CommunicatorError, match="rank 0 left"):
                    with anyio.fail_after(10):
                        await late.all_reduce(x)


async def test_a_peer_that_never_calls_is_a_hang_that_the_deadline_ends() -> None:
    async with lonely_rank0() as opened:
        with pytest.raises(gf.CommunicatorError) as left:
            async with opened as comm:
                x = await gf.from_host(np.ones(3, F32))
                with pytest.raises(TimeoutError):
                    with anyio.fail_after(DEADLINE):
                        await comm.all_reduce(x)
                assert comm.error is not None and "was cancelled" in str(comm.error)
                # an aborted communicator refuses what comes next, with its error
                with pytest.raises(gf.CommunicatorError) as refused:
                    await comm.all_reduce(x)
                assert refused.value is comm.error
        assert left.value is comm.error  # leaving the scope reports the abort
    await testing.assert_quiescent_async()  # the aborted collective returned: nothing in flight


async def test_in_flight_says_a_collective_waits_for_its_peers() -> None:
    seen: list[gf.RunInFlight] = []
    async with lonely_rank0() as opened:
        with pytest.raises(gf.CommunicatorError):
            async with opened as comm:
                x = await gf.from_host(np.ones(3, F32))

                async def waits() -> None:
                    await comm.all_reduce(x)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(waits, name="all-reduce")
                    deadline = time.monotonic() + 5
                    while not (seen := [r for r in gf.in_flight() if r.task == "all-reduce"]):
                        assert time.monotonic() < deadline, "the collective's run"
                        await anyio.sleep(0.01)
                    tg.cancel_scope.cancel()
    (run,) = seen
    assert "all_reduce" in run.operation
    assert run.waits_for == "its collective's peers (<gpuflow.Communicator ranks [0] of 2 (open)>)"


async def test_leaving_the_scope_with_an_error_aborts_collectives_left_pending() -> None:
    failed: list[BaseException] = []

    async def outside(comm: gf.Communicator, x: gf.DeviceArray) -> None:
        # a task outside the scope, awaiting a collective of its communicator
        with gf.use_device(0):
            try:
                await comm.all_reduce(x)
            except gf.CommunicatorError as exc:
                failed.append(exc)

    async with lonely_rank0() as opened:
        stream = gf.new_stream(0)
        async with anyio.create_task_group() as tg:
            with pytest.raises(ZeroDivisionError):
                async with opened as comm:
                    x = await gf.from_host(np.ones(3, F32))
                    comm.all_reduce(x).enqueue_on(stream)  # never completes by itself
                    tg.start_soon(outside, comm, x)
                    await anyio.sleep(0.05)
                    1 / 0  # noqa: B018
        assert comm.error is not None and "ZeroDivisionError" in str(comm.error)
        assert failed == [comm.error]  # the other task's await failed with the abort
    await testing.assert_quiescent_async()


async def test_a_cancelled_task_group_aborts_the_collective_its_task_awaited() -> None:
    errors: list[BaseException] = []
    async with lonely_rank0() as opened:
        with pytest.raises(gf.CommunicatorError):
            async with opened as comm:
                x = await gf.from_host(np.ones(3, F32))

                async def waits() -> None:
                    try:
                        await comm.all_reduce(x)
                    except BaseException as exc:
                        errors.append(exc)
                        raise

                async with anyio.create_task_group() as tg:
                    tg.start_soon(waits)
                    await anyio.sleep(0.05)
                    tg.cancel_scope.cancel()
    assert len(errors) == 1 and isinstance(errors[0], anyio.get_cancelled_exc_class())
    assert comm.error is not None and "was cancelled" in str(comm.error)


async def test_a_peer_that_leaves_fails_every_pending_await_with_its_error() -> None:
    two_devices()
    uid = gf.new_unique_id()
    errors: list[gf.CommunicatorError] = []

    async def waiter(x: gf.DeviceArray, comm: gf.Communicator) -> None:
        with gf.use_device(0):
            try:
                await comm.all_reduce(x)  # no deadline: the peer's leaving ends it
            except gf.CommunicatorError as exc:
                errors.append(exc)

    async def rank0() -> None:
        with gf.use_device(0):
            with pytest.raises(gf.CommunicatorError):
                async with gf.open_communicator(gf.RankInfo(0, 2, uid)) as comm:
                    x = await gf.from_host(np.ones(3, F32))
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(waiter, x, comm)
                        tg.start_soon(waiter, x, comm)

    async def rank1() -> None:
        with gf.use_device(1):
            with pytest.raises(gf.CommunicatorError, match="this rank gives up"):
                async with gf.open_communicator(gf.RankInfo(1, 2, uid)) as comm:
                    await anyio.sleep(0.1)
                    comm.abort("this rank gives up")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rank0)
            tg.start_soon(rank1)
    assert len(errors) == 2, errors
    for e in errors:
        assert (e.name, e.rank) == ("ncclRemoteError", 0), e
        assert "rank 1 left the communicator" in str(e)


# -- bad input ---------------------------------------------------------------------------
async def test_bad_input_is_a_usage_error_before_anything_is_enqueued() -> None:
    devs = devices()
    n = len(devs)
    with pytest.raises(gf.UsageError, match="not open"):
        await gf.open_communicator(devs).all_reduce([None] * n)
    with pytest.raises(gf.UsageError, match="reduction 'mean'"):
        gf.open_communicator(devs).all_reduce([], "mean")
    with pytest.raises(gf.UsageError, match="root 5"):
        gf.open_communicator(devs).broadcast([], root=5)
    with pytest.raises(gf.UsageError, match="rank 3 is not one of 2"):
        gf.open_communicator(gf.RankInfo(3, 2, b"x"))
    with pytest.raises(gf.UsageError, match="twice"):
        gf.open_communicator([devs[0], devs[0]])
    async with gf.open_communicator(devs) as comm:
        xs = [await put(np.ones(4, F32), d) for d in devs]
        flags = [await put(np.ones(4, np.bool_), d) for d in devs]
        sim = gf.current_backend() == "sim"
        with testing.record_activity() if sim else contextlib.nullcontext() as activity:
            with pytest.raises(gf.UsageTypeError, match="sequence of"):
                await comm.all_reduce(xs[0])
            with pytest.raises(gf.UsageError, match=f"has {n + 1} arrays for {n} ranks"):
                await comm.all_reduce([*xs, xs[0]])
            with pytest.raises(gf.UsageError, match="cannot be communicated"):
                await comm.all_reduce(flags)
            with pytest.raises(gf.UsageError, match="out is"):
                await comm.all_reduce(xs, out=[await put(np.ones(5, F32), d) for d in devs])
            with pytest.raises(gf.UsageError, match="first dimension"):
                await comm.reduce_scatter(xs)
            if n == 2:
                with pytest.raises(gf.UsageError, match=r"one comm\.group"):
                    await comm.send(xs[0], 0)
                with pytest.raises(gf.UsageError, match="differs across ranks"):
                    await comm.all_reduce([xs[0], await put(np.ones(3, F32), 1)])
                with pytest.raises(gf.UsageError, match="rank 0's device is 0"):
                    await comm.all_reduce([xs[1], xs[0]])
            with pytest.raises(gf.UsageError, match="captured"):
                comm.all_reduce(xs).capture()
            if n == 2:
                async with gf.open_communicator([0]) as one:
                    with pytest.raises(gf.UsageError, match="has no rank in this communicator"):
                        await one.all_reduce([xs[1]])
        if activity is not None:
            assert not [a for a in activity if a.what.startswith("nccl")], activity
    assert comm.error is None


async def test_a_communicator_is_entered_once() -> None:
    comm = gf.open_communicator(devices())
    async with comm:
        pass
    with pytest.raises(gf.UsageError, match="entered once"):
        async with comm:
            pass


# -- ranks in several processes (sim: processes of one host) -----------------------------
def _expected(n: int) -> dict[str, Any]:
    xs = [np.array([r + 1, 2 * r + 1, 3], F32) for r in range(n)]
    st = np.stack(xs)
    rows = [np.arange(n * 2, dtype=np.int32).reshape(n, 2) * (r + 1) for r in range(n)]
    return {
        "sum": st.sum(0).tolist(),
        "prod": st.prod(0).tolist(),
        "max": st.max(0).tolist(),
        "min": st.min(0).tolist(),
        "avg": (st.sum(0) / n).tolist(),
        "in_place": [sum(range(n)), sum(10 + r for r in range(n))],
        "broadcast": xs[-1].tolist(),
        "all_gather": st.tolist(),
        "reduce_scatter": [np.sum(rows, axis=0)[r].tolist() for r in range(n)],
        "ring": [xs[(r - 1) % n].tolist() for r in range(n)],
    }


def _check_every_collective(results: list[dict[str, Any]], n: int) -> None:
    want = _expected(n)
    for r, got in enumerate(results):
        for key, value in want.items():
            expect = value[r] if key in ("reduce_scatter", "ring") else value
            np.testing.assert_allclose(got[key], expect, rtol=1e-6, err_msg=f"rank {r} {key}")


@pytest.mark.sim_only
@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_two_processes_started_by_spawn_ranks(loop: str) -> None:
    results = gf.spawn_ranks(ranks.every_collective, 2, loop, timeout=60)
    _check_every_collective(results, 2)


def _mpiexec() -> str:
    found = shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                          os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail("mpiexec is not installed (the test extra installs the mpich wheel)")
    return found


@pytest.mark.sim_only
@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_two_processes_started_by_mpiexec(loop: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), str(HERE)]))
    proc = subprocess.run(
        [_mpiexec(), "-n", "2", sys.executable, str(HERE / "helpers" / "ranks.py"),
         "every_collective", loop],
        capture_output=True, text=True, timeout=90, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [d["result"] for d in sorted(_json_objects(proc.stdout), key=lambda d: d["rank"])]
    assert len(results) == 2
    _check_every_collective(results, 2)


def _json_objects(text: str) -> list[dict[str, Any]]:
    """The ranks' JSON reports in ``text``: mpiexec forwards two processes'
    output through one pipe, where one rank's line can run into the other's."""
    decoder = json.JSONDecoder()
    found: list[dict[str, Any]] = []
    at = text.find('{"rank"')
    while at >= 0:
        obj, end = decoder.raw_decode(text, at)
        found.append(obj)
        at = text.find('{"rank"', end)
    return found


@pytest.mark.sim_only
@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_a_rank_killed_mid_collective_fails_the_survivors_await(loop: str) -> None:
    with pytest.raises(ChildProcessError) as failed:
        gf.spawn_ranks(ranks.killed, 2, loop, timeout=60)
    msg = str(failed.value)
    assert "rank 1 died" in msg and "rank 0" not in msg, msg
    survivor = failed.value.results[0]  # type: ignore[attr-defined]
    # its await failed with the peer's error (no deadline needed), and its
    # scope reported the abort that followed
    assert survivor["error"] == "ncclRemoteError", survivor
    assert "rank 1 left the communicator" in survivor["message"], survivor
    assert survivor["scope"] == "ncclRemoteError", survivor


@pytest.mark.sim_only
def test_spawn_ranks_reports_a_rank_that_raised_with_the_others_results() -> None:
    with pytest.raises(ChildProcessError) as failed:
        gf.spawn_ranks(ranks.fails_on_the_last, 2, "asyncio", timeout=60)
    assert "rank 1 raised" in str(failed.value)
    assert "ValueError: rank 1 was told to fail" in str(failed.value)  # its traceback
    assert failed.value.results == ["rank 0 ok on asyncio", None]  # type: ignore[attr-defined]


@pytest.mark.sim_only
def test_spawn_ranks_kills_ranks_still_running_at_its_timeout() -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] were still running"):
        gf.spawn_ranks(ranks.sleeps, 2, 60.0, timeout=3)


@pytest.mark.sim_only
def test_what_ranks_print_arrives_in_whole_lines_prefixed_by_the_rank(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert gf.spawn_ranks(ranks.prints_in_pieces, 2, 20, timeout=60) == ["printed"] * 2
    out, err = capfd.readouterr()
    lines = out.splitlines()
    for r in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {r}] ")]
        assert mine == [f"[rank {r}] line {i} of rank {r}" for i in range(20)] + [
            f"[rank {r}] unfinished"]
    assert len(lines) == 42  # nothing cut by another rank's pieces
    assert sorted(err.splitlines()) == [f"[rank {r}] warning from rank {r}" for r in (0, 1)]


def test_spawn_ranks_is_refused_inside_an_event_loop() -> None:
    async def inside() -> None:
        gf.spawn_ranks(ranks.every_collective, 1, "asyncio")

    with pytest.raises(gf.UsageError, match="block the running"):
        anyio.run(inside)


@pytest.mark.sim_only
def test_a_rank_joins_while_another_rank_asks_whether_it_left() -> None:
    """A rank asking whether another left takes that rank's lock for an
    instant; a rank joining just then still joins (it failed as "already
    joined" about one run in five of the late-join test), and a lock held
    for good is still another holder."""
    import fcntl
    import threading
    import time

    from gpuflow._backends._sim import _comm as _simcomm  # the simulated rendezvous itself
    from gpuflow._core._runtime import ensure_runtime

    uid = gf.new_unique_id()
    root = uid[len(_simcomm._ID_PREFIX) :].decode()
    lock_file = os.path.join(root, "rank-1")

    def probe_held(seconds: float) -> threading.Thread:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as _gone does, held longer

        def release() -> None:
            time.sleep(seconds)
            os.close(fd)

        t = threading.Thread(target=release)
        t.start()
        return t

    def join_rank_1() -> Any:
        backend: Any = ensure_runtime().backend
        return _simcomm.SimComm(backend, root, 1, 2, backend._dev(0))

    releaser = probe_held(0.01)
    comm = join_rank_1()
    comm.join()  # retried past the probe
    releaser.join()
    comm.leave()
    releaser = probe_held(4 * _simcomm._JOIN_PROBE_S)
    try:
        with pytest.raises(gf.UsageError, match="already joined"):
            join_rank_1().join()
    finally:
        releaser.join()


@pytest.mark.sim_only
def test_a_rank_is_never_seen_gone_while_it_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's lock file appears already locked: a rank asking whether it
    left, while it joins slowly, never takes it for gone (the last rank
    "out" then removed the directory, and the joining rank waited for the
    others for ever: the late-join test hung once in CI)."""
    import fcntl
    import threading
    import time

    from gpuflow._backends._sim import _comm as _simcomm  # the simulated rendezvous itself
    from gpuflow._core._runtime import ensure_runtime

    uid = gf.new_unique_id()
    root = uid[len(_simcomm._ID_PREFIX) :].decode()
    lock_file = os.path.join(root, "rank-1")
    real_flock = fcntl.flock
    joining: list[threading.Thread] = []

    def slow_to_lock(fd: int, operation: int) -> None:
        if threading.current_thread() in joining:
            time.sleep(0.05)  # the joining rank is slow to take its lock
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", slow_to_lock)
    backend: Any = ensure_runtime().backend
    comm = _simcomm.SimComm(backend, root, 1, 2, backend._dev(0))
    joiner = threading.Thread(target=comm.join)
    joining.append(joiner)
    joiner.start()
    seen_gone = False
    while joiner.is_alive():
        seen_gone = _simcomm._gone(lock_file) or seen_gone
    joiner.join()
    assert not seen_gone
    assert os.path.exists(lock_file) and not _simcomm._gone(lock_file)  # joined, held
    comm.leave()
