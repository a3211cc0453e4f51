"""The timeline: ``gf.trace(path)`` and ``GPUFLOW_TRACE`` write Chrome trace-event JSON.

The file is read back and checked against the trace-event format (what
Perfetto and ``chrome://tracing`` load) and against what the runs did: one
``gpuflow.run`` complete event per run, on the track of the stream it ran on,
with its outcome and times in order.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K
from helpers import simulated

import gpuflow as gf
from gpuflow import testing
from gpuflow._core import _trace

F32 = np.float32
N = 64
PHASES = {"X", "B", "E", "b", "e", "n", "i", "I", "M", "s", "t", "f", "C"}


def probe(seen: list[gf.Stream], then: gf.DeviceOperation[Any] | None = None) -> Any:
    """An operation that records the stream it runs on (then runs ``then``)."""

    def fn(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        seen.append(ctx.stream)
        return gf.value(None) if then is None else then

    return gf.with_context(fn)


def load(path: Path) -> list[dict[str, Any]]:
    """The events of a trace file, checked against the trace-event format."""
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    events: list[dict[str, Any]] = doc["traceEvents"]
    for e in events:
        assert e["ph"] in PHASES, e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int), e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
        if e["ph"] in ("b", "e"):
            assert "id" in e and "cat" in e, e
    # on every stream track, the runs' slices (and their work on other
    # streams) follow one another
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") in ("gpuflow.run", "gpuflow.arm"):
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for slices in tracks.values():
        # a track is one stream
        assert len({e["args"]["stream"] for e in slices if "stream" in e["args"]}) <= 1
        slices.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(slices):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)
    # each item the device ran lies inside a slice of its run, on its own track
    for item in (e for e in events if e.get("cat") == "gpuflow.item"):
        assert any(
            inside(item, parent) and parent["args"]["run"] == item["args"]["run"]
            for parent in tracks.get((item["pid"], item["tid"]), [])
        ), item
    return events


def inside(child: dict[str, Any], parent: dict[str, Any]) -> bool:
    """Whether the slice ``child`` lies within the slice ``parent`` (on any track)."""
    return bool(
        parent["ts"] - 1e-3 <= child["ts"]
        and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + 1e-3
    )


def items(events: list[dict[str, Any]], run: dict[str, Any]) -> list[dict[str, Any]]:
    """The device's items of ``run`` (a run's event), in the order they started."""
    found = [e for e in events
             if e.get("cat") == "gpuflow.item" and e["args"]["run"] == run["args"]["run"]]
    return sorted(found, key=lambda e: e["ts"])


def runs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs' events, in the order the runs started."""
    found = [e for e in events if e.get("cat") == "gpuflow.run"]
    return sorted(found, key=lambda e: e["args"]["enqueued_us"])


def broken(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
    raise ValueError("not today")


async def quiet() -> None:
    """Until every run handed to the completer has finished."""
    with anyio.fail_after(5):
        while testing.pending_runs():
            await anyio.sleep(0.005)


@pytest.mark.anyio
async def test_a_trace_holds_one_event_per_run_with_its_fields(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    m = K.module()
    x = await gf.zeros(N, F32)
    seen: list[gf.Stream] = []
    own = gf.new_stream()
    ops = [probe(seen, m.scale(K.cfg(N), x, 2.0, N)) for _ in range(4)]
    with gf.trace(path):
        for op in ops[:3]:
            await op
        await anyio.to_thread.run_sync(ops[3].sync)  # a blocking run, from another thread
        gf.value(7).enqueue_on(own)
        await quiet()
    events = load(path)
    got = runs(events)
    assert len(got) == 5
    assert [e["args"]["how"] for e in got] == ["await"] * 3 + ["sync", "enqueue_on"]
    # the device's times, mapped onto the host's clock: within some microseconds on cuda
    slack = 50 if gf.current_backend() == "cuda" else 1e-3
    for e, stream in zip(got[:4], seen, strict=True):
        a = e["args"]
        assert e["ph"] == "X" and f"<gpuflow.DeviceOperation {e['name']}>" == repr(ops[0])
        assert a["op"] == repr(ops[0]) and a["device"] == 0 and a["stream"] == repr(stream)
        assert a["outcome"] == "ok" and a["gpu"] == "ok"
        assert a["enqueued_us"] <= a["enqueue_end_us"] <= a["gpu_done_us"]
        assert a["enqueued_us"] - slack <= e["ts"] <= e["ts"] + e["dur"]
        assert e["ts"] + e["dur"] <= a["gpu_done_us"] + slack
        # its kernel, inside it, whichever thread ran it
        assert a["device_timed"] and [i["name"] for i in items(events, e)] == ["kernel scale"]
    for e in got[:3]:  # awaited: the task resumed after the GPU was done
        assert e["args"]["gpu_done_us"] <= e["args"]["resumed_us"]
    assert got[4]["args"]["stream"] == repr(own) and got[4]["name"] == "value int"
    # tracks: one per stream a run used, named; and each awaited run's wake-up
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
    assert {(e["pid"], e["tid"]) for e in got} <= set(names)
    assert len({names[e["pid"], e["tid"]] for e in got}) == len(set(seen) | {own})
    wakes = [e for e in events if e.get("cat") == "gpuflow.wake"]
    assert sorted(e["ph"] for e in wakes) == ["b"] * 3 + ["e"] * 3
    enqueues = [e for e in events if e.get("cat") == "gpuflow.enqueue"]
    assert len(enqueues) == 5
    assert len({e["tid"] for e in enqueues}) == 2  # the loop's thread and the worker's


@pytest.mark.anyio
async def test_cancelled_and_failed_runs_are_marked(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    x = await gf.zeros(N, F32)
    with gf.trace(path):
        with anyio.move_on_after(0.02):
            await K.slow_fill(x, 1.0, 0.2)
        with pytest.raises(ValueError, match="not today"):
            await gf.with_context(broken)
        await quiet()
        with anyio.move_on_after(0.02):  # still on the device when the trace ends
            await K.slow_fill(x, 2.0, 0.2)
    got = runs(load(path))
    names = ["kernel slow_fill", "with_context broken", "kernel slow_fill"]
    assert [e["name"] for e in got] == names
    cancelled, failed, unfinished = (e["args"] for e in got)
    assert (cancelled["outcome"], cancelled["gpu"]) == ("cancelled", "ok")
    # the task stopped waiting long before the GPU was done
    assert cancelled["resumed_us"] + 0.1e6 < cancelled["gpu_done_us"]
    assert failed["outcome"] == "error"
    assert (unfinished["outcome"], unfinished["gpu"]) == ("cancelled", "unfinished")
    assert "gpu_done_us" not in unfinished
    await quiet()


@pytest.mark.anyio
@pytest.mark.faults_device
async def test_a_faulted_run_is_marked(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    fault = K.fault_module().null_write(gf.LaunchConfig(1, 32), 32)
    try:
        with gf.trace(path):
            with pytest.raises(gf.DeviceFaultError, match=r"ILLEGAL_ADDRESS|faulted"), \
                    anyio.fail_after(5):
                await fault
    finally:
        if simulated():  # cuda keeps the fault for the process (a child)
            gf.reset_device(0)
    (e,) = runs(load(path))
    assert e["name"] == "kernel null_write"
    assert (e["args"]["outcome"], e["args"]["gpu"]) == ("fault", "fault")


@pytest.mark.anyio
async def test_no_trace_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _trace.active == ()
    begun: list[object] = []
    monkeypatch.setattr(_trace, "begin", lambda *a: begun.append(a))
    await gf.value(1)
    await anyio.to_thread.run_sync(gf.value(2).sync)
    gf.value(3).enqueue_on(gf.new_stream())
    assert begun == []
    monkeypatch.undo()
    # a trace records only what runs while it is open
    path = tmp_path / "run.json"
    with gf.trace(path):
        await gf.value("inside")
    assert _trace.active == ()
    await gf.value("after")
    assert [e["name"] for e in runs(load(path))] == ["value str"]


@pytest.mark.anyio
async def test_nested_traces_each_get_the_runs_of_their_time(tmp_path: Path) -> None:
    outer, inner = tmp_path / "outer.json", tmp_path / "inner.json"
    with gf.trace(outer):
        await gf.value(1)
        with gf.trace(inner):
            await gf.value(2.0)
        await gf.value("3")
    assert [e["name"] for e in runs(load(outer))] == ["value int", "value float", "value str"]
    assert [e["name"] for e in runs(load(inner))] == ["value float"]


@pytest.mark.anyio
async def test_nvtx_ranges_while_tracing_when_nvtx_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str | None, str, int]] = []
    fake = types.ModuleType("nvtx")

    def push_range(message: str | None = None, domain: str | None = None, **_: Any) -> None:
        calls.append(("push", message, str(domain), threading.get_ident()))

    def pop_range(domain: str | None = None) -> None:
        calls.append(("pop", None, str(domain), threading.get_ident()))

    fake.push_range = push_range  # type: ignore[attr-defined]
    fake.pop_range = pop_range  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvtx", fake)
    monkeypatch.setattr(_trace, "_nvtx", None)  # as in a process that never traced
    await gf.value(0)
    assert calls == []  # not tracing: nvtx is not even imported
    path = tmp_path / "run.json"
    with gf.trace(path):
        await gf.value(1)
        await anyio.to_thread.run_sync(gf.value(2).sync)
        with pytest.raises(ValueError):
            await gf.with_context(broken)
    # a range per run, named as the run, pushed and popped by the thread
    # that enqueued it, even when enqueueing failed
    names = [e["name"] for e in runs(load(path))]
    assert names == ["value int", "value int", "with_context broken"]
    assert [c[:3] for c in calls] == [
        step for name in names for step in (("push", name, "gpuflow"), ("pop", None, "gpuflow"))
    ]
    assert all(calls[i][3] == calls[i + 1][3] for i in range(0, len(calls), 2))
    assert calls[0][3] != calls[2][3]  # the second run was enqueued by a worker thread


def test_the_environment_variable_traces_a_whole_program(
    device_backend: str, tmp_path: Path
) -> None:
    path = tmp_path / "program.json"
    program = textwrap.dedent(f"""
        import anyio, numpy as np, gpuflow as gf
        gf.init_device_contexts(backend={device_backend!r})

        async def main():
            x = await gf.zeros(8, np.float32)
            await gf.to_host(x)

        anyio.run(main)
        gf.value(1).sync()
    """)
    # the gpuflow under test first, whatever the working directory
    where = str(Path(gf.__file__).parent.parent)
    pythonpath = os.pathsep.join(p for p in (where, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, GPUFLOW_TRACE=str(path), PYTHONPATH=pythonpath)
    proc = subprocess.run(
        [sys.executable, "-c", program], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = runs(load(path))
    assert [e["args"]["how"] for e in got] == ["await", "await", "sync"]
    assert got[0]["name"].startswith("full (8,) float32")  # gf.zeros
    assert [e["name"] for e in got[1:]] == ["to_host", "value int"]
    assert all(e["args"]["outcome"] == "ok" for e in got)


# -- what the device ran, inside each run --------------------------------------------------------


README = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}"""


@pytest.mark.anyio
async def test_the_readme_program_shows_its_kernel_and_copy_inside_its_run(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    mod = gf.compile(
        README, references={"saxpy": lambda a, x, y, n: y.__setitem__(slice(None), a * x + y)}
    )
    with gf.trace(path):  # the README's first program
        n = 1 << 20
        x = gf.arange(n, dtype=np.float32)
        y = gf.ones(n, dtype=np.float32)
        op = mod.saxpy(gf.LaunchConfig.for_num_elems(n), 2.0, x, y, n)
        out = await gf.to_host(op)
    np.testing.assert_array_equal(out[:3], [1, 3, 5])
    events = load(path)
    (run,) = runs(events)
    assert run["name"] == "to_host" and run["args"]["device_timed"]
    # one slice per item the run enqueued, inside the run's slice, in the order
    # the stream ran them; nothing of gpuflow's own (marks, waits, signals)
    shown = items(events, run)
    assert [e["name"] for e in shown] == ["arange", "fill", "kernel saxpy", "copy to host"]
    assert all(inside(e, run) and (e["pid"], e["tid"]) == (run["pid"], run["tid"])
               for e in shown)
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in itertools.pairwise(shown))
    assert shown[2]["args"]["what"] == "kernel 'saxpy'"
    assert shown[3]["args"]["what"].startswith("copy from ")
    if simulated():  # its slice is the device's: the first item to the end
        assert run["ts"] == pytest.approx(shown[0]["ts"], abs=1e-3)


@pytest.mark.anyio
async def test_zip_arms_graphs_and_blocking_runs_show_their_items(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    m = K.module()
    a, b = await gf.zip(gf.zeros(N, F32), gf.zeros(N, F32))
    graph = m.scale(K.cfg(N), a, 2.0, N).capture()
    own = gf.new_stream()
    with gf.trace(path):
        await gf.zip(m.scale(K.cfg(N), a, 2.0, N), m.scale(K.cfg(N), b, 3.0, N))
        await graph.launch()
        await anyio.to_thread.run_sync(m.scale(K.cfg(N), b, 2.0, N).sync)
        m.scale(K.cfg(N), a, 0.5, N).enqueue_on(own)
        await quiet()
    events = load(path)
    zipped, replay, blocking, unawaited = runs(events)
    assert [e["args"]["how"] for e in runs(events)] == ["await", "await", "sync", "enqueue_on"]
    # the zip: one kernel on the run's stream, the other arm's on another
    # stream, inside a slice of the run there
    kernels = items(events, zipped)
    assert [e["name"] for e in kernels] == ["kernel scale"] * 2
    assert len({e["tid"] for e in kernels}) == 2
    (arm,) = (e for e in events if e.get("cat") == "gpuflow.arm")
    assert arm["name"] == zipped["name"] and arm["args"]["run"] == zipped["args"]["run"]
    assert arm["tid"] != zipped["tid"]
    assert [e for e in kernels if inside(e, arm) and e["tid"] == arm["tid"]]
    assert [e["name"] for e in items(events, replay)] == ["graph of 1 nodes"]
    for run in (blocking, unawaited):
        assert [e["name"] for e in items(events, run)] == ["kernel scale"]
    np.testing.assert_array_equal(await gf.to_host(a), np.zeros(N, F32))


@pytest.mark.anyio
@pytest.mark.sim_only  # the simulated communicators record their collectives
async def test_a_collective_shows_on_each_device_inside_its_run(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    xs = [await gf.full(N, 1.0, dtype=F32)]
    with gf.use_device(1):
        xs.append(await gf.full(N, 2.0, dtype=F32))
    async with gf.open_communicator([0, 1]) as comm:
        with gf.trace(path):
            outs = await comm.all_reduce(xs, "sum")
    np.testing.assert_array_equal(await gf.to_host(outs[0]), np.full(N, 3.0, F32))
    events = load(path)
    (run,) = runs(events)
    collective = items(events, run)
    assert [e["name"] for e in collective] == ["nccl all_reduce"] * 2
    assert sorted(e["pid"] for e in collective) == [100, 101]  # one on each device


@pytest.mark.sim_only  # the writer alone
def test_a_slice_that_would_overlap_the_next_is_cut_where_the_next_starts(tmp_path: Path) -> None:
    rec = _trace.Recorder(tmp_path / "run.json")
    inner = _trace._INNER

    def run(name: str, ts: float, dur: float, inner_end: float) -> dict[str, Any]:
        return {"name": name, "cat": "gpuflow.run", "ph": "X", "ts": ts, "dur": dur,
                "pid": 100, "tid": 1, "args": {"run": name}, inner: inner_end}

    # seen done (by the host) after the device had started the next run's work;
    # the last one's own item ends after the next's start: it is not cut there
    rec._events = [run("a", 0.0, 10.0, 0.0), run("b", 6.0, 10.0, 12.0),
                   run("c", 8.0, 10.0, 8.0), run("d", 30.0, 5.0, 30.0)]
    rec._no_overlaps()
    assert [(e["name"], e["ts"], e["dur"]) for e in rec._events] == [
        ("a", 0.0, 6.0), ("b", 6.0, 6.0), ("c", 8.0, 10.0), ("d", 30.0, 5.0)]
    assert all(inner not in e for e in rec._events)
