"""A Trio job fanned out over every device, scoped by a nursery-like device group.

Shows: ``gf.open_device_group()`` (an AnyIO task group whose children each
run with one device current), Trio as the event loop, and structured
failure: when one child fails, the others are cancelled, and the group
still waits until the GPU work every child enqueued is done before it
re-raises. Nothing outlives the ``async with``.

The job: each device squares a block of numbers and sums it; then the same
job again with one device failing half-way, to show the cancellation.

Run it:  python examples/trio_multi_gpu.py [--backend auto|cuda|sim]
(on a machine without a GPU it simulates two devices).  It needs Trio:
python3 -m pip install 'gpuflow[trio]'.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import gpuflow as gf

try:
    import trio
except ModuleNotFoundError:
    sys.exit("this example runs under Trio, which gpuflow's trio extra installs: "
             "python3 -m pip install 'gpuflow[trio]' (from a checkout: -e '.[trio]')")

SOURCE = r"""
extern "C" __global__ void square(float* x, int n, long long ns) {
    unsigned long long start, now;   // ns of GPU time first: a kernel worth cancelling
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); }
    while (now - start < (unsigned long long)ns);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * x[i];
}
"""


def square_ref(x: np.ndarray, n: int, ns: int) -> None:
    time.sleep(ns / 1e9)
    x[:n] = x[:n] * x[:n]


MOD = gf.compile(SOURCE, references={"square": square_ref})
N = 1 << 16


async def block(device: int, results: dict[int, float], fail: bool = False) -> None:
    """Square device ``device``'s block of the numbers and sum it."""
    start = device * N
    host = np.arange(start, start + N, dtype=np.float32) / N
    op = gf.from_host(host).then(
        lambda x: MOD.square(gf.LaunchConfig.for_num_elems(N), x, N, 100_000_000)  # 0.1 s
    )
    if fail:
        await trio.sleep(0.02)
        raise RuntimeError(f"device {device}: the input was bad")
    squared = await gf.to_host(op)  # runs on this child's device
    results[device] = float(squared.sum(dtype=np.float64))


async def main(backend: str) -> None:
    chosen = gf.init_device_contexts(backend=backend)
    if chosen == "sim" and gf.device_count() < 2:
        gf.init_device_contexts(backend="sim", num_devices=2)  # somewhere to fan out to
    devices = list(range(gf.device_count()))
    print(f"backend: {chosen}, devices: {devices}")

    results: dict[int, float] = {}
    async with gf.open_device_group() as group:
        for d in devices:
            group.start_soon(block, d, results, device=d)
    for d in devices:
        x = np.arange(d * N, (d + 1) * N, dtype=np.float64) / N
        assert abs(results[d] - float((x * x).sum())) < 1e-3 * results[d] + 1e-3
        print(f"device {d}: sum of squares {results[d]:.1f}")

    # one child fails: the others are cancelled at once, the group waits for
    # the GPU work already enqueued, then the failure comes out of the group
    results.clear()
    t0 = time.perf_counter()
    try:
        async with gf.open_device_group() as group:
            for d in devices:
                group.start_soon(block, d, results, d == devices[-1], device=d)
    except* RuntimeError as failed:
        print(f"the group failed after {time.perf_counter() - t0:.2f} s: "
              f"{failed.exceptions[0]}; finished before the cancel: {sorted(results)}")
    else:
        raise AssertionError("the failure did not come out of the group")
    assert gf.testing.pending_runs() == 0  # nothing the GPU still runs outlived the group
    print("ok")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    trio.run(main, p.parse_args().backend)
