"""Mix gpuflow kernels with CuPy, zero-copy both ways, awaited under Trio.

Shows: ``cupy.asarray(arr)`` (``__cuda_array_interface__``) and
``gf.from_dlpack(cupy_array)`` sharing one device pointer; ``gf.foreign``
running CuPy code as a step of a gpuflow pipeline, on gpuflow's stream;
``await gf.wait_stream(cupy_stream)`` waiting for CuPy work on a stream of
its own.

Needs CuPy with a CUDA device; without them it says so and skips.  Needs
Trio too: python3 -m pip install 'gpuflow[trio]'.
Run it:  python examples/cupy_interop.py [--backend auto|cuda]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import numpy as np

import gpuflow as gf

try:
    import trio
except ModuleNotFoundError:
    sys.exit("this example runs under Trio, which gpuflow's trio extra installs: "
             "python3 -m pip install 'gpuflow[trio]' (from a checkout: -e '.[trio]')")

SOURCE = r"""
extern "C" __global__ void scale(float* x, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * s;
}
"""


async def main() -> None:
    import cupy

    mod = gf.compile(SOURCE)
    n = 1 << 16
    cfg = gf.LaunchConfig.for_num_elems(n)
    x = await gf.arange(n, dtype=np.float32)

    c = cupy.asarray(x)  # CuPy's current stream waits for x's writes; no copy
    assert c.data.ptr == x.ptr
    back = gf.from_dlpack(c)
    assert back.ptr == x.ptr
    print(f"cupy sees the same memory: 0x{x.ptr:x}")

    # gpuflow -> CuPy -> gpuflow on gpuflow's stream
    op = (
        mod.scale(cfg, x, 2.0, n)  # x = 2i
        .then(lambda x: gf.foreign(lambda v: cupy.sqrt(cupy.asarray(v)), x))
        .then(lambda r: mod.scale(cfg, r, 0.5, n))  # sqrt(2i) / 2
    )
    got = await gf.to_host(op)
    want = np.sqrt(2 * np.arange(n, dtype=np.float32)) / 2
    assert np.allclose(got, want), got[:4]
    print("gpuflow -> CuPy -> gpuflow pipeline: correct")

    # CuPy work on a stream of its own, awaited without blocking Trio
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        m = cupy.random.random((4096, 4096), dtype=cupy.float32)
        for _ in range(20):
            m = m @ m.T / 4096
    await gf.wait_stream(s)
    assert s.done, "wait_stream returned before CuPy's work was done"
    print("awaited CuPy's stream")
    print("ok")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    backend = gf.init_device_contexts(backend=p.parse_args().backend)
    print(f"backend: {backend}")
    if importlib.util.find_spec("cupy") is None:
        print("skipped: CuPy is not installed")
        sys.exit(0)
    if backend != "cuda":
        print("skipped: needs CuPy and gpuflow on a CUDA device")
        sys.exit(0)
    trio.run(main)
