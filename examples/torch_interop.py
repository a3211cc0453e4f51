"""Mix gpuflow kernels with PyTorch, zero-copy both ways, and await a PyTorch
forward pass from asyncio without blocking the event loop.

Shows: ``torch.from_dlpack(arr)`` and ``gf.from_dlpack(tensor)`` sharing one
device pointer; ``gf.foreign(fn, arr)`` running PyTorch code as a step of a
gpuflow pipeline, on gpuflow's stream; ``await gf.wait_stream(stream)``
waiting for PyTorch work while a ticker task on the same loop keeps ticking.

Needs PyTorch with a CUDA device; without them it says so and skips.
Run it:  python examples/torch_interop.py [--backend auto|cuda]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import anyio
import numpy as np

import gpuflow as gf

SOURCE = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


async def main() -> None:
    import torch
    from torch.utils.dlpack import from_dlpack  # torch.from_dlpack, which its stubs hide

    mod = gf.compile(SOURCE)
    n = 1 << 20
    cfg = gf.LaunchConfig.for_num_elems(n)
    x = await gf.arange(n, dtype=np.float32)
    y = await gf.ones(n, dtype=np.float32)

    # zero-copy both ways: the same device memory, seen by both libraries
    t = from_dlpack(x)  # torch's stream waits for x's writes; no copy
    assert t.data_ptr() == x.ptr
    back = gf.from_dlpack(t)
    assert back.ptr == x.ptr
    print(f"one buffer, two views: 0x{x.ptr:x}")

    # gpuflow -> PyTorch -> gpuflow, one pipeline on gpuflow's stream, awaited
    op = (
        mod.saxpy(cfg, 2.0, x, y, n)  # y = 2x + 1
        .then(lambda y: gf.foreign(lambda v: torch.relu(from_dlpack(v) - 1000.0), y))
        .then(lambda r: mod.saxpy(cfg, 1.0, x, r, n))  # r + x
    )
    got = await gf.to_host(op)
    xs = np.arange(n, dtype=np.float32)
    want = np.maximum(2 * xs + 1 - 1000, 0) + xs
    assert np.allclose(got, want), got[:4]
    print("gpuflow -> PyTorch -> gpuflow pipeline: correct")

    # await a "forward pass": a few large matrix products on PyTorch's stream
    # (few launches, so that enqueueing them is quick; the GPU takes long)
    a = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    ticks: list[float] = []
    stop = anyio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            await anyio.sleep(0.002)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.01)
        for _ in range(30):
            a = torch.tanh(a @ a.T * 1e-4)  # enqueued on PyTorch's stream
        t0 = time.perf_counter()
        await gf.wait_stream(torch.cuda.current_stream())  # the loop keeps running
        waited = time.perf_counter() - t0
        stop.set()
    gaps = np.diff([tk for tk in ticks if tk >= t0])
    print(f"awaited the forward pass for {waited * 1e3:.0f} ms; "
          f"{len(gaps)} ticks while the forward pass ran, largest gap {gaps.max() * 1e3:.1f} ms")
    assert torch.cuda.current_stream().query(), "wait_stream returned before the work was done"
    assert gaps.max() < 0.05, "the event loop was blocked"
    print("ok")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    backend = gf.init_device_contexts(backend=p.parse_args().backend)
    print(f"backend: {backend}")
    if importlib.util.find_spec("torch") is None:
        print("skipped: PyTorch is not installed")
        sys.exit(0)
    import torch

    if backend != "cuda" or not torch.cuda.is_available():
        print("skipped: needs PyTorch and gpuflow on a CUDA device")
        sys.exit(0)
    anyio.run(main)
