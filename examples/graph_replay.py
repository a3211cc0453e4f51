"""Capture a pipeline into a CUDA graph once, then refresh its input and replay it.

Shows: ``op.capture()``, ``graph.update(gf.copy(new, out=input))``, awaiting
``graph.launch()``. A replay is one driver call however many kernels the
pipeline has, which is what makes hot loops fast.

Run it:  python examples/graph_replay.py [--backend auto|cuda|sim]
(no GPU needed: on a machine without one, gpuflow runs on its simulator).
"""

from __future__ import annotations

import argparse

import anyio
import numpy as np

import gpuflow as gf

# Every kernel comes with a NumPy reference: the simulator runs that, a GPU the CUDA code.
SOURCE = r"""
extern "C" __global__ void scale(float* x, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * s;
}
extern "C" __global__ void add(const float* a, const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
"""


def scale_ref(x: np.ndarray, s: float, n: int) -> None:
    x[:n] *= np.float32(s)


def add_ref(a: np.ndarray, b: np.ndarray, out: np.ndarray, n: int) -> None:
    out[:n] = a[:n] + b[:n]


async def main(backend: str) -> None:
    print(f"backend: {gf.init_device_contexts(backend=backend)}")
    mod = gf.compile(SOURCE, references={"scale": scale_ref, "add": add_ref})
    n = 1024
    cfg = gf.LaunchConfig.for_num_elems(n)

    # A capture records work into arrays that exist already: allocate first.
    inp = await gf.zeros(n, np.float32)
    tmp = await gf.zeros(n, np.float32)
    out = await gf.zeros(n, np.float32)
    pipeline = (
        gf.copy(inp, out=tmp)                              # tmp = inp
        .then(lambda t: mod.scale(cfg, t, 2.0, n))          # tmp *= 2
        .then(lambda t: mod.add(cfg, t, inp, out, n))       # out = tmp + inp  (= 3 * inp)
    )
    graph = pipeline.capture()  # nothing runs yet
    print(f"captured a graph of {graph.nodes} nodes")

    for step in range(3):
        new_input = np.full(n, step + 1, dtype=np.float32)
        # refresh the input in stream order, right before the next replay
        graph.update(gf.copy(gf.from_host(new_input), out=inp))
        await graph.launch()  # one driver call; the GPU wakes this task when done
        result = await gf.to_host(out)
        assert np.array_equal(result, 3 * new_input), result[:4]
        print(f"replay {step}: input {step + 1} -> output {result[0]:g}")
    print("ok")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    anyio.run(main, p.parse_args().backend)
