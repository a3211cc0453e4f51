"""The communicator rows of ``python -m gpuflow bench`` (``--only nccl``).

Both measured against NCCL's own call through nccl4py's bindings, in the
same run, on the same communicator, buffers and streams:

* all-reduce bandwidth (float32 sum, out of place, 1 MiB to 1 GiB: with
  one rank NCCL's all-reduce is then a device copy, in place nothing at
  all): gpuflow's
  collective enqueued back to back against NCCL's call back to back, each
  ended by one synchronize; algorithm bandwidth (bytes / time) and, with
  more than one rank, bus bandwidth (times ``2 (n - 1) / n``, nccl-tests'
  convention);
* for the sizes below 64 MiB, where a call's host time bounds both sides,
  the same all-reduce eight times into eight outputs as one run
  (``comm.group``) against NCCL's eight calls in one group: what a step
  with several collectives pays, as the performance guide advises;
* a 4-byte all-reduce awaited, under every loop, against NCCL's call
  followed by a blocking ``cuStreamSynchronize``: in turns of 100, as
  every latency row of the bench, and (a reference) one by one, each just
  after the other.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

import anyio
import numpy as np

import gpuflow as gf

from ._bench_rows import event_loops, median_us, row

_MiB = 1 << 20


def _label(nbytes: int) -> str:
    return f"{nbytes // _MiB} MiB" if nbytes < 1024 * _MiB else f"{nbytes // (1024 * _MiB)} GiB"


def _raw_all_reduce(
    nb: ModuleType, comms: list[Any], xs: list[gf.DeviceArray], ys: list[gf.DeviceArray],
    handles: list[int], count: int, dtype: int, op: int, reps: int = 1,
) -> None:
    """NCCL's own all-reduce of ``xs`` into ``ys``, one group over the devices,
    ``reps`` times."""
    _raw_grouped(nb, comms, xs, [ys], handles, count, dtype, op, reps)


def _raw_grouped(
    nb: ModuleType, comms: list[Any], xs: list[gf.DeviceArray], outs: list[list[gf.DeviceArray]],
    handles: list[int], count: int, dtype: int, op: int, reps: int = 1,
) -> None:
    """NCCL's own all-reduces of ``xs`` into each of ``outs`` (a list over
    the devices each), all in one group over the devices, ``reps`` times."""
    for _ in range(reps):
        nb.group_start()
        for ys in outs:
            for c, x, y, h in zip(comms, xs, ys, handles, strict=True):
                nb.all_reduce(x.ptr, y.ptr, count, dtype, op, c, h)
        nb.group_end()


def _interleaved(
    reps: int, ours: Callable[[], object], raw: Callable[[], object], finish: Callable[[], object]
) -> dict[str, float]:
    """Seconds per op of ``reps`` ops enqueued back to back and then finished,
    the median of 5 blocks, the two sides taking turns (both see the same
    machine)."""
    times: dict[str, list[float]] = {"ours": [], "raw": []}
    for _ in range(5):
        for name, fn in (("raw", raw), ("ours", ours)):
            t0 = time.perf_counter()
            fn()
            finish()
            times[name].append((time.perf_counter() - t0) / reps)
    return {name: statistics.median(t) for name, t in times.items()}


async def _bandwidth_rows(
    comm: gf.Communicator, nbytes: int, nb: ModuleType, cu: ModuleType, f32: int, total: int
) -> None:
    devs = comm.devices
    raw_comms = [c.comm._comm for c in comm.raw]
    count = nbytes // 4
    xs, ys = [], []
    for d in devs:
        with gf.use_device(d):
            xs.append(await gf.ones(count, np.float32))
            ys.append(await gf.zeros(count, np.float32))
    s0 = gf.new_stream(devs[0])
    op = comm.all_reduce(xs, out=ys)
    op.enqueue_on(s0)  # the first: every part finds its stream, kept after
    handles = [s.__cuda_stream__()[1] for s in (s0, *(y._allocation.writer for y in ys[1:]))]
    for h in handles:
        cu.cuStreamSynchronize(h)
    reps = 5 if nbytes >= 256 * _MiB else 20
    per_op = _interleaved(
        reps,
        ours=lambda: [op.enqueue_on(s0) for _ in range(reps)],
        raw=lambda: _raw_all_reduce(nb, raw_comms, xs, ys, handles, count, f32, total, reps),
        finish=lambda: [cu.cuStreamSynchronize(h) for h in handles],
    )
    mine = nbytes / per_op["ours"] / 1e9
    base = nbytes / per_op["raw"] / 1e9
    target = ">= 0.95x" if nbytes >= 64 * _MiB else ">= 0.8x"
    row(f"all-reduce {_label(nbytes)} algbw", mine, "GB/s", "nccl4py call", base, target,
        lower_is_better=False)
    n = comm.nranks
    if n > 1:
        bus = 2 * (n - 1) / n
        row(f"all-reduce {_label(nbytes)} busbw", mine * bus, "GB/s", "nccl4py call",
            base * bus, target, lower_is_better=False)
    if nbytes < 64 * _MiB:
        await _grouped_row(comm, nbytes, xs, s0, handles, nb, cu, f32, total)


async def _grouped_row(
    comm: gf.Communicator, nbytes: int, xs: list[gf.DeviceArray], s0: gf.Stream,
    handles: list[int], nb: ModuleType, cu: ModuleType, f32: int, total: int, k: int = 8,
) -> None:
    """``k`` all-reduces of ``xs`` as one run (``comm.group``) against NCCL's
    ``k`` calls in one group: algorithm bandwidth of the ``k`` together."""
    raw_comms = [c.comm._comm for c in comm.raw]
    count = nbytes // 4
    outs = []
    for _ in range(k):
        ys = []
        for d in comm.devices:
            with gf.use_device(d):
                ys.append(await gf.zeros(count, np.float32))
        outs.append(ys)
    op = comm.group(*(comm.all_reduce(xs, out=ys) for ys in outs))
    op.enqueue_on(s0)
    for h in handles:
        cu.cuStreamSynchronize(h)
    reps = 5
    per_group = _interleaved(
        reps,
        ours=lambda: [op.enqueue_on(s0) for _ in range(reps)],
        raw=lambda: _raw_grouped(nb, raw_comms, xs, outs, handles, count, f32, total, reps),
        finish=lambda: [cu.cuStreamSynchronize(h) for h in handles],
    )
    row(f"all-reduce {_label(nbytes)}, {k} in one group", k * nbytes / per_group["ours"] / 1e9,
        "GB/s", f"nccl4py, {k} calls in a group", k * nbytes / per_group["raw"] / 1e9,
        "(reference)", lower_is_better=False)


async def _latencies(
    ours: Callable[[], Awaitable[None]], raw: Callable[[], None], reps: int, block: int = 100
) -> tuple[tuple[list[float], list[float]], tuple[list[float], list[float]]]:
    """Seconds of each of ``reps`` awaits of ``ours`` and calls of ``raw``
    (after a tenth as many untimed): taken in turns of ``block``, as every
    latency row of the bench; then taken one by one, each just after the
    other, which leaves the caches to the other path (a reference)."""
    clock = time.perf_counter
    turns: tuple[list[float], list[float]] = ([], [])
    for turn in range(-1, max(1, reps // block)):
        for _ in range(max(1, reps // 10) if turn < 0 else block):
            t0 = clock()
            await ours()
            if turn >= 0:
                turns[0].append(clock() - t0)
        for _ in range(max(1, reps // 10) if turn < 0 else block):
            t0 = clock()
            raw()
            if turn >= 0:
                turns[1].append(clock() - t0)
    alternate: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        t0 = clock()
        await ours()
        t1 = clock()
        raw()
        alternate[0].append(t1 - t0)
        alternate[1].append(clock() - t1)
    return turns, alternate


def bench_collectives(quick: bool, cuda: bool) -> None:
    if not cuda or importlib.util.find_spec("nccl") is None:
        print("all-reduce: needs a CUDA device and NCCL (pip install 'gpuflow[nccl]')")
        return
    import nccl.core as core
    from cuda.bindings import driver as cu
    from nccl.bindings import nccl as nb

    devs = list(range(gf.device_count()))
    n = len(devs)
    f32, total = int(core.FLOAT32), int(core.SUM)
    sizes = [_MiB, 4 * _MiB, 16 * _MiB, 64 * _MiB, 256 * _MiB, 1024 * _MiB]
    if quick:
        sizes = sizes[:4]
    print(f"all-reduce, float32 sum out of place, {n} rank(s) on this process's devices "
          "(median of 5 blocks)")

    async def bandwidth() -> None:
        async with gf.open_communicator(devs) as comm:
            for nbytes in sizes:
                await _bandwidth_rows(comm, nbytes, nb, cu, f32, total)

    anyio.run(bandwidth)

    reps = 200 if quick else 1000
    for lib, backend, options in event_loops():

        async def latency() -> tuple[tuple[list[float], list[float]], ...]:
            async with gf.open_communicator(devs) as comm:
                raw_comms = [c.comm._comm for c in comm.raw]
                xs, ys = [], []
                for d in devs:
                    with gf.use_device(d):
                        xs.append(await gf.ones(1, np.float32))
                        ys.append(await gf.zeros(1, np.float32))
                s0 = gf.new_stream(devs[0])
                streams = [s0, *(gf.new_stream(d) for d in devs[1:])]
                handles = [s.__cuda_stream__()[1] for s in streams]
                op = comm.all_reduce(xs, "max", out=ys)

                async def ours() -> None:
                    await op

                def raw() -> None:
                    _raw_all_reduce(nb, raw_comms, xs, ys, handles, 1, f32, int(core.MAX))
                    for h in handles:
                        cu.cuStreamSynchronize(h)

                return await _latencies(ours, raw, reps)

        turns, alternate = anyio.run(latency, backend=backend, backend_options=options)
        row(f"await 4-byte all-reduce ({lib})", median_us(turns[0]), "us",
            "nccl4py call + cuStreamSynchronize", median_us(turns[1]), "<= 2x")
        row(f"  the same, one by one ({lib})", median_us(alternate[0]), "us",
            "nccl4py call + cuStreamSynchronize", median_us(alternate[1]), "(reference)")
