"""Awaited tiny kernels per second, 64 tasks x 100, under several stream choices.

The default policy grows the pool as soon as every stream is busy (up to 32
streams); this compares it with the pool held at its four streams and with
round robin, on the backend in use, asyncio.

usage: python benchmarks/probe_throughput.py [cuda|sim|auto]
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import anyio

import gpuflow as gf


async def tasks(op: gf.DeviceOperation[Any], policy: gf.SchedulingPolicy | None) -> float:
    async def worker() -> None:
        for _ in range(100):
            await op.run(policy)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(64):
            tg.start_soon(worker)
    return 6400 / (time.perf_counter() - t0)


def main() -> None:
    backend = gf.init_device_contexts(backend=sys.argv[1] if len(sys.argv) > 1 else "auto")
    mod = gf.compile('extern "C" __global__ void empty() {}', references={"empty": lambda: None})
    op = mod.empty(gf.LaunchConfig(1, 1))
    policies: dict[str, gf.SchedulingPolicy | None] = {
        "default (grows to 32)": None,
        "least loaded, 4 streams": gf.StreamPoolLeastLoaded(max_streams=4),
        "round robin, 4 streams": gf.StreamPoolRoundRobin(),
    }
    for name, policy in policies.items():
        anyio.run(tasks, op, policy)
        rates = [anyio.run(tasks, op, policy) for _ in range(3)]
        print(f"{backend} 64x100 awaits, {name}: {statistics.median(rates):,.0f} op/s", flush=True)


if __name__ == "__main__":
    main()
