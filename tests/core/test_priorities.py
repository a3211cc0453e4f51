"""Stream priorities, read the right way round: 0 is the default, higher is more urgent.

The device's range comes from the driver (CUDA's 0 to -5 on current GPUs
is gpuflow's 0 to 5; ``sim`` takes the same levels) and a level out of it
is refused, never clamped.  On cuda the driver is asked what it made.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import gpuflow as gf


def driver_priority(stream: gf.Stream) -> int:
    """What CUDA says the stream's priority is (its own numbers: lower is more urgent)."""
    from cuda.bindings import driver

    err, value = driver.cuStreamGetPriority(driver.CUstream(stream.__cuda_stream__()[1]))
    assert int(err) == 0
    return int(value)


def driver_range() -> tuple[int, int]:
    from cuda.bindings import driver

    err, least, greatest = driver.cuCtxGetStreamPriorityRange()
    assert int(err) == 0
    return int(least), int(greatest)


def test_a_new_stream_takes_a_priority_level_higher_more_urgent(device_backend: str) -> None:
    assert gf.new_stream().priority == 0  # the default
    levels = gf.lowlevel.current_backend_object().stream_priorities(0)
    assert levels == 5  # as current GPUs: CUDA's 0 to -5
    streams = {p: gf.new_stream(priority=p) for p in range(levels + 1)}
    assert {p: s.priority for p, s in streams.items()} == {p: p for p in streams}
    if device_backend == "cuda":  # the driver made what was asked, the other way round
        least, greatest = driver_range()
        assert least - greatest == levels
        assert {p: driver_priority(s) for p, s in streams.items()} == {
            p: least - p for p in streams
        }
    # work runs on them as on any stream
    x = gf.arange(8, dtype=np.float32).sync_on(streams[levels])
    np.testing.assert_array_equal(gf.to_host(x).sync_on(streams[levels]), np.arange(8))


@pytest.mark.parametrize(
    ("priority", "error", "match"),
    [
        (6, gf.UsageError, r"priority 6 is out of device 0's range: 0 \(the default\) to 5"),
        (-1, gf.UsageError, r"priority -1 is out of device 0's range: 0 \(the default\) to 5"),
        (1.5, gf.UsageTypeError, "priority must be an int, got float"),
        (True, gf.UsageTypeError, "priority must be an int, got bool"),
    ],
)
def test_a_priority_out_of_range_is_refused_naming_the_range(
    priority: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        gf.new_stream(0, priority=priority)


@pytest.mark.anyio
async def test_the_trace_shows_each_runs_priority(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    urgent, plain = gf.new_stream(priority=4), gf.new_stream()
    with gf.trace(path):
        for s in (urgent, plain):
            gf.value(1).enqueue_on(s)
            await gf.wait_stream(s)
        while gf.testing.pending_runs():
            await anyio.sleep(0.005)
    events = json.loads(path.read_text())["traceEvents"]
    runs = [e for e in events if e.get("cat") == "gpuflow.run" and e["args"]["how"] != "await"]
    assert [(e["args"]["stream"], e["args"]["priority"]) for e in runs] == [
        (repr(urgent), 4), (repr(plain), 0)
    ]
