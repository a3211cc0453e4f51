"""The driver calls of a wait on a torch stream, right after a forward.

``gf.wait_stream(torch_stream)`` asks the driver whether another library
captures the stream (``cuStreamIsCapturing``), records an event on it
(``cuEventRecord``) and, until the work is done, asks about that event
(``cuEventQuery``).  This times each of those calls through ctypes, in
that order, as gpuflow makes them, and torch's ``Event.record`` and
``Event.query`` (the floor of the bench's PyTorch rows: an event asked once
per loop turn), the two paths taking turns, right after the bench's
PyTorch request (a 4-layer bf16 MLP forward, batch 32, width 1024, on one
of 8 torch streams) and on an idle stream; then the whole ``await
gf.wait_stream(s)`` the same two ways, under asyncio and Trio.  Medians,
µs.

usage: python benchmarks/probe_torch_wait.py   (a CUDA device and PyTorch)
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from ctypes import byref
from typing import Any

import anyio
import torch
from cuda.bindings import driver as cu

import gpuflow as gf
from gpuflow._tools._bench_poll import mlp_forward

REPS, WARM = 600, 100

lib = ctypes.CDLL("libcuda.so.1")
vp = ctypes.c_void_p
for name, args in (
    ("cuEventRecord", [vp, vp]),
    ("cuEventQuery", [vp]),
    ("cuStreamIsCapturing", [vp, vp]),
):
    getattr(lib, name).argtypes = args
    getattr(lib, name).restype = ctypes.c_int


def main() -> None:
    gf.init_device_contexts(backend="cuda")
    forward = mlp_forward()
    streams = [torch.cuda.Stream() for _ in range(8)]
    events = []
    for _ in range(16):
        err, ev = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        assert int(err) == 0
        events.append(int(ev))
    status = ctypes.c_int()
    clock = time.perf_counter_ns

    def gpuflows(i: int, s: Any) -> dict[str, Callable[[], object]]:
        # in the order a wait makes them
        h, ev = s.cuda_stream, events[i % len(events)]
        return {
            "gpuflow: cuStreamIsCapturing": lambda: lib.cuStreamIsCapturing(h, byref(status)),
            "gpuflow: cuEventRecord": lambda: lib.cuEventRecord(ev, h),
            "gpuflow: cuEventQuery": lambda: lib.cuEventQuery(ev),
        }

    def torchs(i: int, s: Any) -> dict[str, Callable[[], object]]:
        # the floor's: an event recorded, then asked once per loop turn
        ev = torch.cuda.Event()
        return {"torch: Event.record": lambda: ev.record(s), "torch: Event.query": ev.query}

    for after in (False, True):
        times: dict[str, list[float]] = {}
        for i in range(REPS):
            s = streams[i % len(streams)]
            if after:
                with torch.cuda.stream(s):
                    forward()
            # the two paths take turns, each making the first call after its forward
            for name, call in (gpuflows if i % 2 else torchs)(i, s).items():
                t0 = clock()
                call()
                t1 = clock()
                if i >= WARM:
                    times.setdefault(name, []).append((t1 - t0) / 1e3)
            torch.cuda.synchronize()
        where = "after the forward" if after else "idle stream"
        for name, ts in times.items():
            print(f"{where:18s} {name:34s} {statistics.median(ts):6.2f} us")

    async def waits(after: bool) -> float:
        out = []
        for i in range(REPS):
            s = streams[i % len(streams)]
            if after:
                with torch.cuda.stream(s):
                    forward()
            t0 = time.perf_counter()
            await gf.wait_stream(s)
            if i >= WARM:
                out.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(out)

    for backend in ("asyncio", "trio"):
        for after in (False, True):
            where = "after the forward" if after else "idle stream"
            us = anyio.run(waits, after, backend=backend)
            print(f"{where:18s} await gf.wait_stream(s) ({backend}){'':9s} {us:6.2f} us")


if __name__ == "__main__":
    main()
