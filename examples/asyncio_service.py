"""A TCP service that runs a short GPU pipeline per request, under a deadline.

Shows: awaiting GPU work from asyncio (through AnyIO) without blocking the
loop, a per-request deadline with ``anyio.fail_after``, and what happens when
it hits: the client gets "timeout" at once, while the kernel already running
finishes on the GPU with every buffer it uses kept alive (nothing is freed
under a running kernel; ``gf.testing.assert_quiescent()`` checks that at the
end, and the simulator would catch a use after free).

The script starts the service on a free port of 127.0.0.1, sends it a few
requests itself (fast ones, and slow ones that miss the deadline), prints
the answers and stops.

Run it:  python examples/asyncio_service.py [--backend auto|cuda|sim]
"""

from __future__ import annotations

import argparse

import anyio
import anyio.abc
import numpy as np

import gpuflow as gf

SOURCE = r"""
// every thread waits ns nanoseconds of GPU time, then writes x[i] = v * i
extern "C" __global__ void work(float* x, float v, int n, long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); }
    while (now - start < (unsigned long long)ns);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v * i;
}
"""


def work_ref(x: np.ndarray, v: float, n: int, ns: int) -> None:
    import time

    time.sleep(ns / 1e9)
    x[:n] = np.float32(v) * np.arange(n, dtype=np.float32)


DEADLINE = 0.2  # seconds a request may take
N = 4096
MOD = gf.compile(SOURCE, references={"work": work_ref})


async def handle(value: float, gpu_ms: int) -> str:
    """One request: GPU work of ``gpu_ms``, then the sum of the result."""
    op = gf.to_host(
        gf.zeros(N, np.float32).then(
            lambda x: MOD.work(gf.LaunchConfig.for_num_elems(N), x, value, N, gpu_ms * 1_000_000)
        )
    )
    try:
        with anyio.fail_after(DEADLINE):
            host = await op  # the GPU wakes this task; the loop serves others meanwhile
    except TimeoutError:
        return "timeout"
    return f"ok {float(host.sum()):.0f}"


async def serve(listener: anyio.abc.Listener[anyio.abc.SocketStream]) -> None:
    async def on_connection(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            value, gpu_ms = (await stream.receive()).decode().split()
            answer = await handle(float(value), int(gpu_ms))
            await stream.send(answer.encode())

    await listener.serve(on_connection)


async def request(port: int, value: float, gpu_ms: int) -> str:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(f"{value} {gpu_ms}".encode())
        return (await stream.receive()).decode()


async def main(backend: str) -> None:
    print(f"backend: {gf.init_device_contexts(backend=backend)}")
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    # a few fast requests (10 ms of GPU work) and two slow ones (500 ms) at once
    jobs = [(float(i), 10) for i in range(1, 7)] + [(100.0, 500), (200.0, 500)]
    answers: dict[tuple[float, int], str] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, listener)

        async def client(value: float, gpu_ms: int) -> None:
            answers[value, gpu_ms] = await request(port, value, gpu_ms)

        async with anyio.create_task_group() as clients:
            for job in jobs:
                clients.start_soon(client, *job)
        tg.cancel_scope.cancel()  # stop serving
    for (value, gpu_ms), answer in sorted(answers.items()):
        print(f"request value={value:g} gpu={gpu_ms} ms -> {answer}")
    expected = float(np.arange(N, dtype=np.float32).sum())
    for (value, gpu_ms), answer in answers.items():
        want = "timeout" if gpu_ms * 1e-3 > DEADLINE else f"ok {value * expected:.0f}"
        assert answer == want, (value, gpu_ms, answer)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    anyio.run(main, p.parse_args().backend, backend="asyncio")
    # the slow kernels outlived their requests: wait for them (a blocking wait,
    # so outside the event loop), then check that nothing is pending and that
    # nothing was used after it was freed
    gf.testing.assert_quiescent(timeout=5)
    print("ok")
