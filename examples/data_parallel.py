"""Data-parallel steps over ranks: kernels on each rank's shard, then an all-reduce.

Shows: ``gf.open_communicator`` as a scope (one rank per process), a
collective awaited like any operation and ordered after the kernel that
wrote its input, and the two ways ranks meet: ``mpiexec`` (the id broadcast
with mpi4py, ``gf.bootstrap_mpi()``) or ``gf.spawn_ranks`` (processes started
here, the id handed to them).  Each step every rank scales its shard by the
step's factor (a kernel), all-reduces it (sum), and checks the result
against what every rank's shard gives.

Run it:  mpiexec -n 2 python examples/data_parallel.py [--backend auto|cuda|sim]
    or:  python examples/data_parallel.py [--backend ...] [--ranks N]
(on a machine without a GPU the ranks are simulated devices, one a process;
on CUDA, one GPU a rank: with one GPU, one rank.)
"""

from __future__ import annotations

import argparse
import os

import anyio
import numpy as np

import gpuflow as gf

SOURCE = r"""
extern "C" __global__ void scale(float* x, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * s;
}
"""


def scale_ref(x: np.ndarray, s: float, n: int) -> None:
    x[:n] *= np.float32(s)


N = 1 << 14
STEPS = 3


def shard(rank: int) -> np.ndarray:
    return (np.arange(N, dtype=np.float32) % 97 + rank) / 8


async def train(info: gf.RankInfo) -> None:
    mod = gf.compile(SOURCE, references={"scale": scale_ref})
    cfg = gf.LaunchConfig.for_num_elems(N)
    async with gf.open_communicator(info) as comm:
        x = await gf.from_host(shard(info.rank))
        for step in range(1, STEPS + 1):
            # the kernel writes x; the all-reduce reads it after that write,
            # on the run's stream, and makes a new array with every rank's sum
            op = mod.scale(cfg, x, float(step), N).then(lambda _: comm.all_reduce(x, "sum"))
            total = await gf.to_host(op)
            factor = np.float32(np.prod(np.arange(1, step + 1)))  # every step so far
            want = np.sum([shard(r) for r in range(info.nranks)], axis=0) * factor
            assert np.allclose(total, want, rtol=1e-5), (total[:4], want[:4])
            print(f"rank {info.rank}: step {step} all-reduced {N} floats over "
                  f"{info.nranks} ranks, checked", flush=True)


def rank_main(info: gf.RankInfo) -> str:
    """One rank (a process): its own event loop, its own device."""
    anyio.run(train, info)
    return f"rank {info.rank} done"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    p.add_argument("--ranks", type=int, default=2, help="ranks to spawn (without mpiexec)")
    args = p.parse_args()
    under_mpi = any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"))
    if under_mpi:
        chosen = gf.init_device_contexts(backend=args.backend)
        info = gf.bootstrap_mpi()
        gf.init_device_contexts(backend=chosen, default_device=info.rank % gf.device_count())
        if info.rank == 0:
            print(f"backend: {chosen}, ranks: {info.nranks} (mpiexec)", flush=True)
        rank_main(info)
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()  # every rank has checked its steps
        if info.rank == 0:
            print("ok", flush=True)
        return
    chosen = gf.init_device_contexts(backend=args.backend)
    if chosen == "sim":
        gf.init_device_contexts(backend="sim", num_devices=args.ranks)
    ranks = min(args.ranks, gf.device_count())  # NCCL: one rank a GPU
    print(f"backend: {chosen}, ranks: {ranks} (spawned)", flush=True)
    for line in gf.spawn_ranks(rank_main, ranks, timeout=120):
        print(line)
    print("ok")


if __name__ == "__main__":
    main()
