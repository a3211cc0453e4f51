"""Properties of the simulator itself that keep it truthful under load.

A stream's worker sleeps until an item arrives on *its* stream: with many
streams, as under a burst of concurrent requests, an item wakes one worker,
not every one (a wake-up of every worker for every item made 32 streams
three times slower than 8).  The completion words are written by the
streams themselves, in order.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
from helpers import kernels as K

import gpuflow as gf

pytestmark = pytest.mark.sim_only

F32 = np.float32


def test_an_item_wakes_its_own_stream_only() -> None:
    be: Any = gf.lowlevel.current_backend_object()
    idle = [gf.new_stream() for _ in range(31)]
    busy = gf.new_stream()
    x = gf.zeros(64, F32).sync()
    busy.synchronize()
    raw = {id(s.raw): cast(Any, s.raw) for s in (*idle, busy)}  # (sim's own streams)
    before = {k: r.wakeups for k, r in raw.items()}
    for i in range(200):
        K.slow_fill(x, float(i), 0.0).enqueue_on(busy)
    busy.synchronize()
    woken = sum(raw[id(s.raw)].wakeups - before[id(s.raw)] for s in idle)
    assert woken == 0, f"idle streams' workers woke {woken} times for another stream's items"
    assert raw[id(busy.raw)].wakeups <= 2 * 200 + 2  # (and its own, at most once an item or two)
    np.testing.assert_array_equal(gf.to_host(x).sync(), np.full(64, 199, F32))
    assert be.use_after_free_count() == 0


def test_marks_set_the_word_in_stream_order() -> None:
    be: Any = gf.lowlevel.current_backend_object()
    s = gf.new_stream()
    read = be.completion_reader(s.raw)
    x = gf.zeros(64, F32).sync()
    K.slow_fill(x, 1.0, 0.05).enqueue_on(s)
    first = be.mark(s.raw)
    K.slow_fill(x, 2.0, 0.0).enqueue_on(s)
    second = be.mark(s.raw)
    assert second > first > 0 and read() < first  # not before the slow item is done
    s.synchronize()
    assert read() == be.mark(s.raw) - 1 >= second  # (the enqueue_on runs are marked too)
    s.synchronize()


@pytest.mark.faults_device
def test_a_reference_slicing_past_its_array_is_an_out_of_bounds_fault() -> None:
    """``y[:n] = ...`` with ``n`` past the end of ``y``: NumPy would clip the
    slice and hide the bad launch; the simulator reports it as the device
    does an illegal address, a sticky fault that names the access."""
    m = K.module()
    x = gf.full(4, 1.0, dtype=F32).sync()
    y = gf.full(4, 1.0, dtype=F32).sync()
    m.saxpy(K.cfg(4), 2.0, x, y, 4).sync()  # within bounds: as before
    np.testing.assert_array_equal(gf.to_host(y).sync(), np.full(4, 3, F32))
    try:
        with pytest.raises(gf.DeviceFaultError) as fault:
            m.saxpy(K.cfg(8), 2.0, x, y, 8).sync()  # 8 elements of arrays of 4
        assert fault.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert "out of bounds: [:8] of an array of 4 elements" in str(fault.value)
    finally:
        gf.reset_device(0)
        gf.reset_device(1)
    # arrays computed from a kernel's arrays check their own bounds too
    from gpuflow._backends._sim._bounded import Bounded

    a = np.arange(6, dtype=F32).view(Bounded)
    assert list((a[:3] * 2)[:-1]) == [0.0, 2.0]
    with pytest.raises(IndexError, match="out of bounds"):
        (a * 2)[2:7]
