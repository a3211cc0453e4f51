"""The yardstick of gpuflow's run path: a plain loop with no gpuflow.

Each await launches an empty kernel on one of four streams through
cuda-bindings, enqueues a 64-bit write of the stream's next sequence number
into a pinned, device-mapped word of its own, and parks on an asyncio
future; one callback a loop turn reads the four words and resolves the
futures they cover.  It is pure Python too, and does what gpuflow's common
await must do (launch, mark, park, see the mark reached, resume) with
nothing else: the rate a loop that launches, marks and polls reaches on a
CPU, beside which gpuflow's rate on the same CPU is gpuflow's own share.

Used by ``probe_placement.py`` (on a GPU) and ``profile_frontend.py``
(also against the stand-in libcuda, ``tests/stand_in/libcuda.c``).
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from typing import Any

#: How many streams the plain loop launches on (the pool's default).
STREAMS = 4


class PlainLoop:
    """Launch, mark and poll on ``raws`` (the bench's ``Raw`` launchers,
    one a stream), asyncio's futures for the parking."""

    def __init__(self, raws: list[Any]) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.raws = raws
        err, host = cu.cuMemHostAlloc(4096, cu.CU_MEMHOSTALLOC_DEVICEMAP)
        assert not err, err
        err, dev_ptr = cu.cuMemHostGetDevicePointer(host, 0)
        assert not err, err
        self.dev_ptr = int(dev_ptr)
        self.words = [ctypes.c_uint64.from_address(int(host) + 64 * i) for i in range(len(raws))]
        for w in self.words:
            w.value = 0
        self.seqs = [0] * len(raws)

    async def row(self, tasks: int, per: int) -> float:
        """``tasks`` tasks each awaiting ``per`` launches: awaits a second."""
        cu, raws, words, seqs, dev_ptr = self.cu, self.raws, self.words, self.seqs, self.dev_ptr
        loop = asyncio.get_running_loop()
        pending: list[list[tuple[int, asyncio.Future[None]]]] = [[] for _ in raws]
        armed = [False]

        def poll() -> None:
            left = 0
            for i, queue in enumerate(pending):
                reached, k = words[i].value, 0
                while k < len(queue) and queue[k][0] <= reached:
                    if not queue[k][1].done():  # (its task may have failed)
                        queue[k][1].set_result(None)
                    k += 1
                del queue[:k]
                left += len(queue)
            if left:
                loop.call_soon(poll)
            else:
                armed[0] = False

        async def one(i: int) -> None:
            raws[i].launch()
            seqs[i] += 1
            (rc,) = cu.cuStreamWriteValue64(raws[i].stream, dev_ptr + 64 * i, seqs[i], 0)
            assert not rc, rc
            fut = loop.create_future()
            pending[i].append((seqs[i], fut))
            if not armed[0]:
                armed[0] = True
                loop.call_soon(poll)
            await fut

        async def worker(j: int) -> None:
            for _ in range(per):
                await one(j % len(raws))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(j) for j in range(tasks)))
        return tasks * per / (time.perf_counter() - t0)
