"""A service with an interactive and a batch endpoint, under load, with and
without latency classes.

Shows: ``gf.latency_class`` around each endpoint's GPU work (the
interactive one at the device's highest stream priority, on SMs reserved
for it at set-up, polling for its completion; the batch one sleeping until
the GPU wakes it), and what it changes.  Two batch clients keep every SM of
the device busy with long kernels; an interactive client sends short
requests meanwhile.  Without classes a short kernel waits for every block
of the batch work launched before it; with them it runs on its own SMs (and
would take the first free SM of the others before any batch block).

The script runs the same load twice, without and with the classes, and
prints each endpoint's latencies (median and 99th percentile).

Run it:  python examples/latency_classes.py [--backend auto|cuda|sim]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import anyio
import numpy as np

import gpuflow as gf

SOURCE = r"""
// each block waits ns nanoseconds of GPU time (holding its SM), then writes
extern "C" __global__ void work(float* out, int n, long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); }
    while (now - start < (unsigned long long)ns);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 1.0f;
}
"""


# on sim, each block of the kernel holds one of the device's simulated SMs for ns
@gf.testing.block_time(lambda out, n, ns: ns / 1e9)
def work_ref(out: np.ndarray, n: int, ns: int) -> None:
    out[:n] = 1.0


INTERACTIVE_S = 200e-6  # one block
BATCH_BLOCK_S = 2e-3  # a batch kernel: four waves of these over every SM
REQUESTS = 100


class Service:
    """Two endpoints; with ``classes``, each runs its GPU work in its class."""

    def __init__(self, classes: bool) -> None:
        self.module = gf.compile(SOURCE, references={"work": work_ref})
        info = gf.device_info(0)
        sms = info.sms or 132
        # a GPU's SM holds many blocks of 32 threads at once; sim runs one an SM
        self.batch_blocks = sms * (1 if info.backend == "sim" else 32) * 4
        top = info.max_priority
        self.interactive_class: dict[str, Any] = {}
        self.batch_class: dict[str, Any] = {}
        if classes:
            self.interactive_class = dict(priority=top, sms="interactive", busy_poll_us=1000)
            self.batch_class = dict(busy_poll_us=0)

    async def interactive(self) -> None:
        out = gf.zeros(32, np.float32)
        with gf.latency_class(**self.interactive_class):
            done = await out.then(
                lambda x: self.module.work(gf.LaunchConfig(1, 32), x, 32, int(INTERACTIVE_S * 1e9))
            ).then(gf.to_host)
        assert done[0] == 1.0

    async def batch(self) -> None:
        n = self.batch_blocks * 32
        with gf.latency_class(**self.batch_class):
            out = await gf.zeros(n, np.float32)
            cfg = gf.LaunchConfig(self.batch_blocks, 32)
            await self.module.work(cfg, out, n, int(BATCH_BLOCK_S * 1e9))


async def load(service: Service) -> dict[str, list[float]]:
    """Two batch clients back to back, and ``REQUESTS`` interactive requests
    5 ms apart meanwhile: each request's seconds, by endpoint."""
    took: dict[str, list[float]] = {"interactive": [], "batch": []}
    finished = anyio.Event()

    async def timed(endpoint: str) -> None:
        t0 = anyio.current_time()
        await getattr(service, endpoint)()
        took[endpoint].append(anyio.current_time() - t0)

    async def batch_client() -> None:
        while not finished.is_set():
            await timed("batch")

    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(batch_client)
        await anyio.sleep(0.02)  # (the batch work is running)
        for _ in range(REQUESTS):
            await timed("interactive")
            await anyio.sleep(0.005)
        finished.set()
    return took


def report(label: str, took: dict[str, list[float]]) -> float:
    parts = []
    for endpoint, times in took.items():
        p50 = statistics.median(times) * 1e3
        p99 = sorted(times)[int(0.99 * (len(times) - 1))] * 1e3
        parts.append(f"{endpoint} p50 {p50:.2f} ms, p99 {p99:.2f} ms ({len(times)} requests)")
    print(f"{label}: " + "; ".join(parts))
    return sorted(took["interactive"])[int(0.99 * (len(took["interactive"]) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    args = p.parse_args()
    backend = gf.init_device_contexts(backend=args.backend, num_devices=1)
    print(f"backend: {backend}, {gf.device_info(0).sms} SMs")
    without = report("without classes", anyio.run(load, Service(classes=False)))
    # 8 SMs of each device for the interactive class; gpuflow's other streams
    # are made in the SMs left
    gf.init_device_contexts(backend=args.backend, num_devices=1, reserve_sms={"interactive": 8})
    with_classes = report("with classes", anyio.run(load, Service(classes=True)))
    print(f"interactive p99: {without / with_classes:.1f}x shorter with the classes")
    if with_classes >= without:
        raise SystemExit("the classes did not shorten the interactive requests")
    gf.testing.assert_quiescent()
    print("ok")


if __name__ == "__main__":
    main()
