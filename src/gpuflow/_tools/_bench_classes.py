"""``python -m gpuflow bench --only classes``: short requests while long
kernels keep every SM busy, with no class, with a higher priority and with
reserved SMs (:func:`gpuflow.latency_class`).

Two batch tasks await a long kernel back to back (one always queued behind
the other), each a grid of several waves of blocks that hold every SM of
the device; meanwhile a task starts short requests (one block) one at a
time, a few milliseconds apart, and measures each from its start to the
end of its await.  Without a class a short kernel's block waits for every
block launched before it to start; at a higher priority it takes the first
SM that frees up; on reserved SMs it finds its own free.  Each is printed
against the same requests on an idle device, and the classes against no
class, all measured in the same run.  On ``sim`` the device is its model
of SMs (132, one block each at a time); on a GPU an SM holds many blocks at
once, and the grid is made large enough to fill them all.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio

import gpuflow as gf

from ._bench_rows import row

#: one block of the batch work (the time a short request can wait for an SM
#: at a higher priority), waves of blocks per batch kernel, a short
#: request's block, and the gap between two requests
LONG_BLOCK_S = 0.002
WAVES = 4
SHORT_S = 50e-6
GAP_S = 0.003
#: blocks of 32 threads an SM holds at once on a GPU (compute capability
#: 9.0's bound): what fills a device; ``sim`` runs one an SM
RESIDENT_ON_GPU = 32
RESERVED = "interactive"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _requests(mod: gf.Module, n: int, busy: bool, cls: dict[str, Any]) -> list[float]:
    """``n`` short requests in ``cls``, with the batch work running when
    ``busy``: each one's seconds from start to the end of its await."""
    sms = gf.lowlevel.current_backend_object().sm_count(0) or 132
    resident = 1 if gf.current_backend() == "sim" else RESIDENT_ON_GPU
    long = mod.spin(gf.LaunchConfig(sms * resident * WAVES, 32), int(LONG_BLOCK_S * 1e9))
    short = mod.spin(gf.LaunchConfig(1, 32), int(SHORT_S * 1e9))
    took: list[float] = []
    done = anyio.Event()

    async def batch() -> None:
        while not done.is_set():
            await long

    with gf.latency_class(**cls):
        # untimed: the class's first request makes its streams and, on
        # reserved SMs, loads the kernel into their green context (a
        # service pays that once, at its start)
        await short
    async with anyio.create_task_group() as tg:
        if busy:
            for _ in range(2):
                tg.start_soon(batch)
            await anyio.sleep(LONG_BLOCK_S * WAVES)  # (every SM busy, one kernel queued)
        with gf.latency_class(**cls):
            for _ in range(n):
                t0 = anyio.current_time()
                await short
                took.append(anyio.current_time() - t0)
                await anyio.sleep(GAP_S)
        done.set()
    return took


@contextmanager
def _reserving(count: int) -> Iterator[None]:
    """The runtime again with ``count`` SMs reserved on each device, then as it was."""
    be = gf.lowlevel.current_backend_object()
    devices = gf.device_count()
    gf.init_device_contexts(backend=be, num_devices=devices, reserve_sms={RESERVED: count})
    try:
        yield
    finally:
        gf.init_device_contexts(backend=be, num_devices=devices)


def bench_classes(mod: gf.Module, quick: bool) -> None:
    n = 40 if quick else 200
    top = gf.lowlevel.current_backend_object().stream_priorities(0)
    print(f"short requests ({SHORT_S * 1e6:.0f} us, one block) while two batch tasks keep every "
          f"SM busy ({WAVES} waves of {LONG_BLOCK_S * 1e3:.0f} ms blocks a kernel; asyncio)")

    def measure(busy: bool, **cls: object) -> list[float]:
        return anyio.run(_requests, mod, n, busy, cls, backend="asyncio")

    idle = measure(False)
    plain = measure(True)
    urgent = measure(True, priority=top) if top else None
    try:
        with _reserving(8):
            reserved: list[float] | None = measure(True, sms=RESERVED)
    except gf.UsageError as exc:  # (a driver without green contexts: said, not faked)
        print(f"  (reserved SMs not measured: {exc})")
        reserved = None
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        base = _percentile(idle, q) * 1e3
        none = _percentile(plain, q) * 1e3
        row(f"short {name}, no class, every SM busy", none, "ms", f"short {name}, idle device",
            base)
        if urgent is not None:
            row(f"short {name}, priority {top}", _percentile(urgent, q) * 1e3, "ms",
                f"short {name}, no class", none, "<= 0.5x")
        if reserved is not None:
            row(f"short {name}, 8 reserved SMs", _percentile(reserved, q) * 1e3, "ms",
                f"short {name}, no class", none, "<= 0.5x")
    print(f"  (medians of {n}: idle {statistics.median(idle) * 1e3:.3f} ms)")
