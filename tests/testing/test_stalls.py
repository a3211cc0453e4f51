"""No call of a serving path waits for GPU work it does not depend on.

Long kernels run on streams whose arrays and streams the test then drops;
meanwhile every call of a user's path (making streams and arrays, kernels,
copies, transfers, the array protocols, leases, graphs, collections that
run gpuflow's finalizers) is timed by ``gf.testing.assert_no_stall``: one
that waited for the long kernels fails the test, naming the call.  Seen on
the H200 before: making a stream (when the driver grows its own pool of
them) and loading a module (at a kernel's first launch) each waited for
every kernel in flight.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K

import gpuflow as gf
from gpuflow import testing

F32 = np.float32
N = 256
LONG = 1.5  # seconds of unrelated GPU work in flight throughout
LIMIT = 0.25  # far below LONG, far above any call's own time on a loaded machine
M = K.module()
# compiled before the runtime is made, and launched for the first time inside the check
FRESH = gf.compile(
    'extern "C" __global__ void twice(const float* x, float* y, int n) {'
    " int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = 2.0f * x[i]; }",
    references={"twice": lambda x, y, n: y.__setitem__(slice(0, n), 2 * x[:n])},
)


def _still_running(raws: list[Any]) -> bool:
    be = gf.lowlevel.current_backend_object()
    return not any(be.query(raw) for raw in raws)


@pytest.mark.anyio
async def test_a_serving_path_never_waits_for_unrelated_long_work() -> None:
    # long work on streams of their own, whose arrays and streams are dropped
    busy = [gf.new_stream() for _ in range(2)]
    for s in busy:
        K.slow_fill(await gf.zeros(N, F32), 1.0, LONG).enqueue_on(s)
    pool_long = await gf.zeros(N, F32)
    witness = gf.lowlevel.pool_streams()[0]  # (a pool stream is never destroyed)
    K.slow_fill(pool_long, 2.0, LONG).enqueue_on(witness)
    del busy, s, pool_long
    t0 = time.monotonic()
    with testing.assert_no_stall(LIMIT):
        gc.collect()  # the dropped arrays' and streams' finalizers run here
        streams = [gf.new_stream() for _ in range(24)]
        x = await gf.from_host(np.arange(N, dtype=F32))
        y = await gf.zeros(N, F32)
        await FRESH.twice(K.cfg(N), x, y, N)  # the module's first launch
        np.testing.assert_array_equal(await gf.to_host(y), 2 * np.arange(N, dtype=F32))
        z = await gf.copy(y)
        await gf.copy(x, out=z).run(gf.SingleStream())
        K.slow_fill(z, 3.0, 0.001).enqueue_on(streams[0])
        w = gf.from_dlpack(z)  # (through the protocol: gpuflow is the consumer)
        torch_like = gf.from_dlpack(x.__dlpack__(stream=streams[1].__cuda_stream__()[1]))
        async with gf.open_stream_lease():
            np.testing.assert_array_equal(await gf.to_host(w), np.full(N, 3, F32))
        graph = FRESH.twice(K.cfg(N), x, y, N).capture()
        await graph.launch()
        await gf.wait_stream(streams[2])
        np.testing.assert_array_equal(await gf.to_host(torch_like), np.arange(N, dtype=F32))
        del graph, w, z, streams, torch_like
        gc.collect()
    took = time.monotonic() - t0
    # the check meant something: the long work was in flight all along
    assert took < LONG / 2 and _still_running([witness.raw]), took
    await testing.assert_quiescent_async(timeout=LONG * 4)


def test_assert_no_stall_names_a_call_that_blocks() -> None:
    x = gf.zeros(N, F32).sync()
    with pytest.raises(AssertionError, match=r"DeviceOperation\.sync blocked .*called from"):
        with testing.assert_no_stall(0.05) as stalls:
            K.slow_fill(x, 1.0, 0.2).sync()  # blocks by design: a stall all the same
            assert len(stalls) == 1
    with testing.assert_no_stall(0.05) as stalls:
        K.slow_fill(x, 1.0, 0.2).enqueue_on(gf.new_stream())  # returns at once
    assert stalls == []
    with pytest.raises(ValueError, match="limit"):
        with testing.assert_no_stall(0):
            pass


@pytest.mark.anyio
async def test_a_long_await_is_no_stall() -> None:
    # the time a task spends suspended in an await does not block its thread
    x = await gf.zeros(N, F32)
    with testing.assert_no_stall(0.05):
        with anyio.fail_after(5):
            await K.slow_fill(x, 1.0, 0.3)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(N, 1, F32))


def test_the_profile_hook_installed_before_is_restored_after() -> None:
    """A profiler's or a coverage tool's hook, installed before the block,
    is the thread's hook again after it, also when the block fails."""
    calls: list[str] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        calls.append(event)

    previous = sys.getprofile()
    sys.setprofile(profiler)
    try:
        with testing.assert_no_stall(1.0):
            gf.zeros(8, F32).sync()
        assert sys.getprofile() is profiler
        with pytest.raises(RuntimeError), testing.assert_no_stall(1.0):
            raise RuntimeError("the block failed")
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(previous)
    assert calls  # (it was the thread's hook outside the blocks)
