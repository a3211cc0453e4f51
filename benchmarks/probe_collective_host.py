"""Whether the one-rank all-reduce rows are bound by the host or by the GPU.

The bench's bandwidth rows (``python -m gpuflow bench --only nccl``) enqueue
20 all-reduces back to back and then synchronize.  This times the same
blocks two ways: the host's loop alone (until the last call returns) and
the whole block (until the stream is synchronized), per call, for NCCL's
own call through nccl4py, ``op.enqueue_on(stream)`` of gpuflow's
all-reduce, and ``op.enqueue_on(stream)`` of a copy of the same size (a
run of gpuflow's with one driver call).  Where the host's loop takes about
the whole block, the GPU waits for the host and the row measures the
host's cost of a call.  Medians of 5 blocks, each path three times, in
turns; µs a call.

usage: python benchmarks/probe_collective_host.py   (a CUDA device and nccl4py)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import anyio
import numpy as np
from cuda.bindings import driver as cu

import gpuflow as gf


def _blocks(fn: Callable[[], object], handle: int, per: int = 20) -> tuple[float, float]:
    """Median µs a call of the host's loop and of the whole block."""
    host: list[float] = []
    whole: list[float] = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        t1 = time.perf_counter()
        cu.cuStreamSynchronize(handle)
        t2 = time.perf_counter()
        host.append((t1 - t0) / per * 1e6)
        whole.append((t2 - t0) / per * 1e6)
    return statistics.median(host), statistics.median(whole)


async def one_size(comm: gf.Communicator, count: int, nb: Any, f32: int, total: int) -> None:
    raw = cast(Any, comm._raw[0]).comm._comm if comm._raw else 0
    x = await gf.ones(count, np.float32)
    y = await gf.zeros(count, np.float32)
    op = comm.all_reduce([x], out=[y])
    copy = gf.copy(x, out=y)
    stream = gf.new_stream(0)
    handle = stream.__cuda_stream__()[1]
    for _ in range(2):  # (a first run, then one from its plan)
        op.enqueue_on(stream)
    cu.cuStreamSynchronize(handle)

    def nccl_call() -> None:
        nb.all_reduce(x.ptr, y.ptr, count, f32, total, raw, handle)

    paths: dict[str, Callable[[], object]] = {
        "NCCL's call": nccl_call,
        "gpuflow's all-reduce, enqueue_on": lambda: op.enqueue_on(stream),
        "gpuflow's copy, enqueue_on": lambda: copy.enqueue_on(stream),
    }
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for _ in range(3):
        for name, fn in paths.items():
            got[name].append(_blocks(fn, handle))
    print(f"{count * 4:,} bytes (host's loop / whole block, us a call):")
    for name, pairs in got.items():
        print(f"    {name:<34}" + ", ".join(f"{h:.1f} / {w:.1f}" for h, w in pairs))


async def main() -> None:
    import nccl.core as core
    from nccl.bindings import nccl as nb

    async with gf.open_communicator([0]) as comm:
        for count in (1, 1 << 18, 1 << 22):
            await one_size(comm, count, nb, int(core.FLOAT32), int(core.SUM))


if __name__ == "__main__":
    anyio.run(main)
