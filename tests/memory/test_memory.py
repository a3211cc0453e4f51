"""``gf.memory_stats()``: the memory gpuflow's arrays use, and what the backend holds.

In use is what live arrays occupy (it drops as soon as an array goes);
reserved is the backend's (on ``sim`` memory not yet freed in stream order,
on ``cuda`` the memory pool's reservation, which keeps freed memory).
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import numpy as np
import pytest
from helpers import kernels as K

import gpuflow as gf
from gpuflow import testing
from gpuflow._core._hazards import MemoryLedger

F32 = np.float32


def stats(device: int = 0) -> gf.MemoryStats:
    gc.collect()  # arrays dropped by the test are gone, not waiting for a cycle collection
    return gf.memory_stats(device)


def test_live_arrays_are_counted_exactly_and_uncounted_when_dropped() -> None:
    before = stats()
    assert before.device == 0
    x = gf.zeros(1000, F32).sync()
    y = gf.ones((3, 5), np.int64).sync()
    during = stats()
    assert during.in_use_bytes - before.in_use_bytes == 4000 + 120
    assert during.live_allocations - before.live_allocations == 2
    assert during.reserved_bytes is not None and during.reserved_bytes >= during.in_use_bytes
    del x
    after_x = stats()
    assert after_x.in_use_bytes - before.in_use_bytes == 120
    assert after_x.live_allocations - before.live_allocations == 1
    del y
    end = stats()
    assert (end.in_use_bytes, end.live_allocations) == (
        before.in_use_bytes, before.live_allocations,
    )  # fmt: skip


def test_the_default_device_is_the_current_one_and_each_device_counts_its_own() -> None:
    if gf.device_count() < 2:
        pytest.skip("needs two devices")
    zero, one = stats(0), stats(1)
    with gf.use_device(1):
        x = gf.zeros(256, F32).sync()
        assert gf.memory_stats() == stats(1)
        assert stats(1).in_use_bytes - one.in_use_bytes == 1024
    assert stats(0).in_use_bytes == zero.in_use_bytes
    assert gf.memory_stats().device == 0
    del x
    assert stats(1).in_use_bytes == one.in_use_bytes


def test_an_unknown_device_is_a_usage_error() -> None:
    with pytest.raises(gf.UsageError, match="device 7 is not initialised"):
        gf.memory_stats(7)


@pytest.mark.sim_only
def test_sim_reserves_until_the_free_is_done_in_stream_order() -> None:
    base = stats()
    assert base.reserved_bytes == 0 and base.in_use_bytes == 0
    stream = gf.new_stream()
    x = gf.zeros(1024, F32).sync_on(stream)
    assert stats().reserved_bytes == 4096
    # a long kernel still reads x when its last array goes: in use drops at
    # once, the memory is freed after the kernel, in stream order
    out = gf.zeros(1024, F32).sync_on(stream)
    K.slow_fill(out, 1.0, 0.3, n=1024).enqueue_on(stream)
    M = K.module()
    M.vadd(K.cfg(1024), x, out, out, 1024).enqueue_on(stream)
    del x
    now = stats()
    assert now.in_use_bytes == 4096 and now.live_allocations == 1
    assert now.reserved_bytes == 8192, "freed before the GPU was done with it"
    stream.synchronize()
    assert stats().reserved_bytes == 4096
    del out
    stream.synchronize()
    assert stats() == gf.MemoryStats(0, 0, 0, 0)


@pytest.mark.anyio
async def test_another_librarys_memory_is_not_counted() -> None:
    backing = await gf.zeros(512, F32)
    before = stats()

    class CaiOnly:  # a producer that speaks only __cuda_array_interface__, as Numba's arrays
        def __init__(self, a: gf.DeviceArray) -> None:
            self.a = a
            self.__cuda_array_interface__ = a.__cuda_array_interface__

    imported = gf.from_dlpack(CaiOnly(backing))
    assert imported.nbytes == 2048
    now = stats()
    assert (now.in_use_bytes, now.live_allocations) == (
        before.in_use_bytes, before.live_allocations,
    )  # fmt: skip
    del imported
    await testing.assert_quiescent_async()


def test_arrays_made_and_dropped_on_many_threads_are_counted_without_a_loss() -> None:
    before = stats()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            keep: list[Any] = []
            for i in range(150):
                keep.append(gf.zeros(16 + i % 7, F32).sync())
                if len(keep) > 5:
                    keep.pop(0)
                if i % 20 == 0:
                    gc.collect()  # finalizers run inside other threads' counting
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    after = stats()
    assert (after.in_use_bytes, after.live_allocations) == (
        before.in_use_bytes, before.live_allocations,
    )  # fmt: skip


def test_a_finalizer_that_runs_while_the_ledger_counts_neither_waits_nor_is_lost() -> None:
    # an array's finalizer may run in the middle of a count, on the same
    # thread (a garbage collection, a last reference dropped): it must not
    # wait for the lock the count holds, and its change must not be lost
    ledger = MemoryLedger()
    ran: list[bool] = []

    class Bytes(int):
        def __del__(self) -> None:
            ledger.freed(0, 10)  # as Allocation.__del__ does
            ran.append(True)

    ledger.allocated(0, Bytes(10))  # dropped inside the fold, with changes after it
    ledger.allocated(0, 10)
    ledger.allocated(0, 10)
    got: list[tuple[int, int]] = []
    counting = threading.Thread(target=lambda: got.append(ledger.totals(0)), daemon=True)
    counting.start()
    counting.join(5)
    assert not counting.is_alive(), "a finalizer waited for the ledger's own lock"
    assert ran == [True]
    assert got == [(30, 3)]
    assert ledger.totals(0) == (20, 2)  # the finalizer's change, counted next time
    assert ledger.totals(1) == (0, 0)
