"""``gf.testing.assert_quiescent`` and its awaitable form.

Both wait for every run to finish and then say what is not at rest; the
blocking one is refused in an event loop's thread (it would stop the
loop), the awaitable one lets the loop run.
"""

from __future__ import annotations

import inspect
import re
import threading
import time
from collections.abc import Awaitable, Callable

import anyio
import numpy as np
import pytest
from helpers import kernels as K

import gpuflow as gf
from gpuflow import testing
from gpuflow._core import _finalizers

pytestmark = pytest.mark.anyio

F32 = np.float32
LONG = 0.3


async def _ticks_while(wait: Callable[[], Awaitable[None] | None]) -> tuple[int, float]:
    """How often another task of the loop ran while ``wait`` waited for a
    long kernel, and how long the wait took."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    x = await gf.zeros(256, F32)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.02)  # the ticker runs
        before = ticks
        K.slow_fill(x, 1.0, LONG).enqueue_on(gf.new_stream())
        t0 = time.monotonic()
        result = wait()
        if inspect.isawaitable(result):
            await result
        took = time.monotonic() - t0
        tg.cancel_scope.cancel()
    return ticks - before, took


async def test_the_awaitable_form_waits_for_the_gpu_and_lets_the_loop_run() -> None:
    ticks, took = await _ticks_while(testing.assert_quiescent_async)
    assert took > LONG * 0.8, "it did not wait for the kernel"
    assert ticks >= 5, f"the loop ran {ticks} times in {took:.2f} s"


async def test_the_blocking_form_is_refused_in_the_loop_and_names_the_awaitable_one() -> None:
    x = await gf.zeros(256, F32)
    K.slow_fill(x, 1.0, LONG).enqueue_on(gf.new_stream())
    t0 = time.monotonic()
    with pytest.raises(gf.UsageError, match=re.escape(
        "gf.testing.assert_quiescent() would block the running "
    )) as refused:  # fmt: skip
        testing.assert_quiescent()
    assert time.monotonic() - t0 < LONG / 2  # refused at once, not after the wait
    assert str(refused.value).endswith("`await gf.testing.assert_quiescent_async()`")
    # in a worker thread it blocks that thread only, and waits for the GPU
    await anyio.to_thread.run_sync(testing.assert_quiescent)
    assert testing.pending_runs() == 0


async def test_the_awaitable_form_says_what_is_not_at_rest() -> None:
    lease = gf.open_stream_lease()
    await lease.__aenter__()
    x = await gf.zeros(256, F32)
    K.slow_fill(x, 1.0, LONG).enqueue_on(gf.new_stream())
    with pytest.raises(AssertionError, match=r"^gpuflow is not quiescent: 1 run\(s\) still pending "
                       r"after 0.05 s; 1 stream lease\(s\) still held: <gpuflow.StreamLease of "
                       r"device 0, held by task .* at .*test_quiescence.py:\d+>$"):  # fmt: skip
        await testing.assert_quiescent_async(timeout=0.05)
    await lease.__aexit__(None, None, None)
    await testing.assert_quiescent_async()
    assert testing.pending_runs() == 0


def test_the_check_waits_for_a_finalizers_work_another_thread_is_doing() -> None:
    # What a finalizer left (an import's release, which submits a run) may be
    # under way in another thread, the reaper's drain, when the check starts:
    # the queue is empty by then, and no run is pending yet.  The check waits
    # for that drain, then for the run it submitted.
    x = gf.zeros(256, F32).sync()
    s = gf.new_stream()
    taken, go = threading.Event(), threading.Event()

    def release() -> None:
        taken.set()
        go.wait(5.0)
        K.slow_fill(x, 1.0, 0.1).enqueue_on(s)

    _finalizers.finalize_later(release)
    drainer = threading.Thread(target=_finalizers.run_finalized)
    drainer.start()
    assert taken.wait(5.0)
    threading.Timer(0.05, go.set).start()
    testing.assert_quiescent(timeout=5.0)
    assert go.is_set(), "the check passed while another thread did a finalizer's work"
    assert testing.pending_runs() == 0
    drainer.join(5.0)
    assert np.all(gf.to_host(x).sync() == 1.0)


def test_the_check_reports_the_runs_its_last_look_saw(monkeypatch: pytest.MonkeyPatch) -> None:
    # A run handed over after the wait's last look (a release a finishing
    # run dropped, say) came after the wait: the report must not call it
    # "still pending after" a wait that never waited for it.
    from gpuflow._testing import _quiescence

    x = gf.zeros(256, F32).sync()
    s = gf.new_stream()
    real = _quiescence.look
    late: list[bool] = []

    def look() -> int | None:
        seen = real()
        if seen == 0 and not late:
            late.append(True)
            _finalizers.finalize_later(lambda: K.slow_fill(x, 1.0, 0.2).enqueue_on(s))
        return seen

    monkeypatch.setattr(_quiescence, "look", look)
    testing.assert_quiescent(timeout=5.0)
    assert late and testing.pending_runs() == 1  # (the late run, handed over since)
    testing.assert_quiescent(timeout=5.0)  # (waited for, this time)
    assert testing.pending_runs() == 0
    assert np.all(gf.to_host(x).sync() == 1.0)


def test_the_blocking_check_waits_for_work_on_gpuflows_streams_outside_any_run() -> None:
    """Work enqueued on one of gpuflow's streams outside any run (through
    the backend, as :mod:`gpuflow.lowlevel` allows) has no run pending to
    count: "cannot tell yet" is not at rest, and the blocking check waits
    for that work too (the fixture at every test's end is this check)."""
    from gpuflow._backends._records import KernelArg
    from gpuflow.lowlevel import PointerArg

    be = gf.lowlevel.current_backend_object()
    s = gf.new_stream()
    kernel = be.load_kernel(0, K.module(), "slow_fill")
    buf = be.alloc(0, 4 * 256, s.raw)
    ns = np.int64(LONG * 1e9)
    args: list[KernelArg] = [PointerArg(buf, np.dtype(F32), 256, True), F32(1.0), np.int32(256), ns]
    be.launch(kernel, (1, 1, 1), (256, 1, 1), 0, args, s.raw)
    t0 = time.monotonic()
    assert testing.pending_runs() == 0 and not be.query(s.raw)
    testing.assert_quiescent(timeout=5.0)
    assert time.monotonic() - t0 >= LONG * 0.8, "the check passed while the stream was busy"
    assert be.query(s.raw)
    be.free(buf, s.raw)
    be.synchronize(s.raw)
