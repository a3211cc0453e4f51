"""CUDA graphs: capture, launch, update, what cannot be captured, lifetimes, DOT.

Graph code is tested on ``sim`` too (it records the captured work and
replays it), with the same contract as a CUDA graph: capturing runs nothing,
each launch replays the captured work on the arrays captured, ordered after
(and before) other work on them like any operation.
"""

from __future__ import annotations

import gc
import re
import weakref
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import cuda_native
from helpers import kernels as K

import gpuflow as gf
from gpuflow import testing

F32 = np.float32
I32 = np.int32
N = 256
M = K.module()
CFG = K.cfg(N)


def host(x: Any) -> np.ndarray:
    return gf.to_host(x).sync()


def chain(x: gf.DeviceArray, y: gf.DeviceArray, z: gf.DeviceArray) -> gf.DeviceOperation[Any]:
    """``y = 3x``, ``z = x + y`` (``4x``): three kernels writing preallocated arrays."""
    return (
        M.copy_f32(CFG, x, y, N)
        .then(lambda y: M.scale(CFG, y, 3.0, N))
        .then(lambda y: M.vadd(CFG, x, y, z, N))
    )


def arrays(*values: float) -> list[gf.DeviceArray]:
    return [gf.full(N, v, dtype=F32).sync() for v in values]


async def aarrays(*values: float) -> list[gf.DeviceArray]:
    return [await gf.full(N, v, dtype=F32) for v in values]


# -- capture and launch ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_captured_chain_replays_its_kernels() -> None:
    h = np.arange(N, dtype=F32)
    x = await gf.from_host(h)
    y, z = await gf.zeros(N, F32), await gf.zeros(N, F32)
    graph = chain(x, y, z).capture()
    assert isinstance(graph, gf.Graph)
    # capturing recorded the work, it did not run it
    np.testing.assert_array_equal(await gf.to_host(z), np.zeros(N, F32))
    out = await graph.launch()
    assert out is z  # the captured output handles, holding the new results
    np.testing.assert_array_equal(await gf.to_host(z), 4 * h)
    np.testing.assert_array_equal(await gf.to_host(y), 3 * h)


def test_a_graph_launch_can_be_synced_and_chained() -> None:
    x, y, z = arrays(2.0, 0.0, 0.0)
    graph = chain(x, y, z).capture()
    assert graph.launch().sync() is z
    np.testing.assert_array_equal(host(z), np.full(N, 8, F32))
    # a launch is an operation like any other: chain it, read it back
    halved = graph.launch().then(lambda z: M.scale(CFG, z, 0.5, N))
    np.testing.assert_array_equal(host(halved), np.full(N, 4, F32))
    s = gf.new_stream()
    graph.launch().enqueue_on(s)
    s.synchronize()
    np.testing.assert_array_equal(host(z), np.full(N, 8, F32))


@pytest.mark.anyio
async def test_update_refreshes_the_input_before_the_next_launch() -> None:
    x, y, z = await aarrays(0.0, 0.0, 0.0)
    graph = chain(x, y, z).capture()
    for i in range(20):
        h = np.full(N, i, F32) + np.arange(N, dtype=F32)
        graph.update(gf.copy(gf.from_host(h), out=x))
        if i == 0:  # an update runs with the next launch, not before
            np.testing.assert_array_equal(await gf.to_host(x), np.zeros(N, F32))
        np.testing.assert_array_equal(await gf.to_host(graph.launch()), 4 * h)


@pytest.mark.anyio
async def test_an_update_is_applied_once_not_again_at_later_launches() -> None:
    x, y, z = await aarrays(0.0, 0.0, 0.0)
    src = await gf.full(N, 2.0, dtype=F32)
    graph = chain(x, y, z).capture()
    graph.update(gf.copy(src, out=x))
    np.testing.assert_array_equal(await gf.to_host(graph.launch()), np.full(N, 8, F32))
    # the input changed since: a later launch replays on x as it is now,
    # and does not copy src into it again
    await gf.copy(await gf.full(N, 5.0, dtype=F32), out=x)
    await gf.copy(await gf.full(N, 3.0, dtype=F32), out=src)
    np.testing.assert_array_equal(await gf.to_host(graph.launch()), np.full(N, 20, F32))
    np.testing.assert_array_equal(await gf.to_host(graph.launch()), np.full(N, 20, F32))


@pytest.mark.anyio
async def test_update_waits_for_a_replay_still_reading_the_input_on_another_stream() -> None:
    # one replay waits, then reads x into acc (acc += x); the update that
    # refreshes x for the next launch must wait for that read, wherever it runs
    x, acc, pause = await aarrays(1.0, 0.0, 0.0)
    slow = 0.3
    graph = K.slow_fill(pause, 0.0, slow).then(lambda _: M.saxpy(CFG, 1.0, x, acc, N)).capture()
    streams: list[gf.Stream] = []
    enqueued = anyio.Event()

    def launch_on(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        streams.append(ctx.stream)
        if len(streams) == 1:
            enqueued.set()  # the first replay is enqueued once this returns
        return graph.launch()

    async def first() -> None:
        await gf.with_context(launch_on)

    async with anyio.create_task_group() as tg:
        tg.start_soon(first)
        await enqueued.wait()
        graph.update(gf.copy(gf.from_host(np.full(N, 10, F32)), out=x))
        await gf.with_context(launch_on)
    assert streams[0] != streams[1]  # the second launch did not queue behind the first
    # the first replay read the old input, the second the new one
    np.testing.assert_array_equal(await gf.to_host(acc), np.full(N, 1 + 10, F32))


@pytest.mark.anyio
async def test_replays_are_ordered_like_any_writes_to_the_same_arrays() -> None:
    # one replay is a slow read-modify-write of acc: read it, wait, write acc + 1;
    # replays awaited from many tasks (on different pool streams) must not overlap
    acc, tmp, pause, one = await aarrays(0.0, 0.0, 0.0, 1.0)
    rmw = (
        M.copy_f32(CFG, acc, tmp, N)
        .then(lambda _: K.slow_fill(pause, 0.0, 0.005))
        .then(lambda _: M.vadd(CFG, tmp, one, acc, N))
    )
    graph = rmw.capture()

    async def replay() -> None:
        await graph.launch()

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(replay)
    np.testing.assert_array_equal(await gf.to_host(acc), np.full(N, 10, F32))
    s = gf.new_stream()
    for _ in range(40):
        graph.launch().enqueue_on(s)
    np.testing.assert_array_equal(await gf.to_host(acc), np.full(N, 50, F32))


def test_a_launch_waits_for_work_still_writing_its_inputs() -> None:
    x, y, z = arrays(0.0, 0.0, 0.0)
    graph = chain(x, y, z).capture()
    K.slow_fill(x, 5.0, 0.1).enqueue_on(gf.new_stream())
    graph.launch().sync_on(gf.new_stream())
    np.testing.assert_array_equal(host(z), np.full(N, 20, F32))


@pytest.mark.anyio
async def test_zip_arms_inside_a_capture() -> None:
    h = np.arange(N, dtype=F32)
    x = await gf.from_host(h)
    a, b, z = await aarrays(0.0, 0.0, 0.0)
    op = gf.zip(
        M.copy_f32(CFG, x, a, N).then(lambda a: M.scale(CFG, a, 2.0, N)),
        M.copy_f32(CFG, x, b, N).then(lambda b: M.scale(CFG, b, 3.0, N)),
    ).then(lambda ab: M.vadd(CFG, ab[0], ab[1], z, N))
    graph = op.capture()
    np.testing.assert_array_equal(await gf.to_host(z), np.zeros(N, F32))
    for k in range(1, 4):
        graph.update(gf.copy(gf.from_host(h * k), out=x))
        assert await graph.launch() is z
        np.testing.assert_array_equal(await gf.to_host(z), 5 * k * h)


@pytest.mark.anyio
async def test_a_capture_of_a_zip_output_produces_the_tuple() -> None:
    x, a, b = await aarrays(2.0, 2.0, 2.0)
    graph = gf.zip(M.copy_f32(CFG, x, a, N), M.copy_f32(CFG, x, b, N)).capture()
    await gf.copy(gf.full(N, 7.0, dtype=F32), out=x)
    out = await graph.launch()
    assert out == (a, b)
    np.testing.assert_array_equal(await gf.to_host(a), np.full(N, 7, F32))
    np.testing.assert_array_equal(await gf.to_host(b), np.full(N, 7, F32))


# -- what cannot be captured -----------------------------------------------------------------------


def test_what_cannot_be_captured_is_refused_by_name() -> None:
    c = K.counter()
    x, y = arrays(1.0, 0.0)
    refused = {
        "allocation": M.scale(CFG, gf.zeros(N, F32), 2.0, N),
        "from_host": gf.from_host(np.ones(N, F32)),
        "to_host": gf.to_host(K.bump(c)),
    }
    for name, op in refused.items():
        with pytest.raises(gf.UsageError, match=name):
            op.capture()
    with pytest.raises(gf.UsageError, match="allocation"):
        K.bump(c).then(lambda _: gf.copy(x)).capture()  # a copy into a new array allocates
    # a nested run inside the captured operation names what it tried to run
    nested = K.bump(c).then(lambda _: gf.with_context(lambda ctx: gf.value(K.bump(c).sync())))
    with pytest.raises(gf.UsageError, match=r"(?s)kernel count.*inside a graph capture"):
        nested.capture()
    inner = M.copy_f32(CFG, x, y, N)
    with pytest.raises(gf.UsageError, match=r"capture\(\) inside a capture"):
        gf.with_context(lambda ctx: gf.value(inner.capture())).capture()
    # nothing ran, and nothing is left half-captured: capture and run as usual
    assert K.read_count(c) == 0
    graph = K.bump(c).then(lambda _: M.copy_f32(CFG, x, y, N)).capture()
    graph.launch().sync()
    graph.launch().sync()
    assert K.read_count(c) == 2
    np.testing.assert_array_equal(host(y), np.ones(N, F32))
    K.bump(c).sync()
    assert K.read_count(c) == 3


# -- a graph keeps what it uses alive --------------------------------------------------------------


async def _captured_chain(h: np.ndarray) -> gf.Graph[Any]:
    """A graph over arrays that nothing but the graph refers to."""
    x = await gf.from_host(h)
    y, z = await aarrays(0.0, 0.0)
    return chain(x, y, z).capture()


@pytest.mark.anyio
async def test_a_graph_keeps_its_arrays_alive() -> None:
    h = np.arange(N, dtype=F32)
    graph = await _captured_chain(h)
    gc.collect()  # the user's references are gone
    for _ in range(3):
        np.testing.assert_array_equal(await gf.to_host(graph.launch()), 4 * h)
    assert testing.use_after_free_count() == 0


async def _slow_copy_graph(
    value: float, out: gf.DeviceArray, seconds: float = 0.1
) -> gf.Graph[Any]:
    """A slow graph copying an input only the graph refers to into ``out``."""
    pause, x = await aarrays(0.0, value)
    return K.slow_fill(pause, 1.0, seconds).then(lambda _: M.copy_f32(CFG, x, out, N)).capture()


@pytest.mark.anyio
async def test_dropping_a_graph_while_a_launch_is_in_flight() -> None:
    out = await gf.zeros(N, F32)
    graph = await _slow_copy_graph(3.0, out)
    with anyio.move_on_after(0.02) as scope:
        await graph.launch()
    assert scope.cancelled_caught
    del graph
    gc.collect()
    np.testing.assert_array_equal(await gf.to_host(out), np.full(N, 3, F32))
    # and an enqueued launch whose graph is dropped at once
    graph = await _captured_chain(np.full(N, 2, F32))
    s = gf.new_stream()
    z = graph.launch().enqueue_on(s)
    del graph
    gc.collect()
    np.testing.assert_array_equal(await gf.to_host(z), np.full(N, 8, F32))
    await testing.assert_quiescent_async()


@pytest.mark.anyio
async def test_a_launch_in_flight_keeps_its_graph_until_the_gpu_is_done() -> None:
    out = await gf.zeros(N, F32)
    # long enough that the GPU is surely still at it after a full collection
    graph = await _slow_copy_graph(3.0, out, seconds=1.0)
    # Collect what earlier work left first.  Seen on the H200: a collection
    # that finalizes such garbage (an earlier runtime's, a finished capture's)
    # can wait for the GPU, so the collection below would outlast the replay,
    # and the graph would rightly be gone by the time we look.
    gc.collect()
    alive = weakref.ref(graph)
    graph.launch().enqueue_on(gf.new_stream())
    del graph
    gc.collect()
    assert alive() is not None, "the graph was released while a launch of it was running"
    np.testing.assert_array_equal(await gf.to_host(out), np.full(N, 3, F32))  # waits for it
    await testing.assert_quiescent_async()
    gc.collect()
    assert alive() is None, "the graph outlived its last launch"


def zipped(x: gf.DeviceArray, a: gf.DeviceArray, b: gf.DeviceArray, z: gf.DeviceArray) -> Any:
    """``a = x``, ``b = x`` on two zip arms, joined by ``z = a + b``: three kernels."""
    return gf.zip(M.copy_f32(CFG, x, a, N), M.copy_f32(CFG, x, b, N)).then(
        lambda ab: M.vadd(CFG, ab[0], ab[1], z, N)
    )


@pytest.mark.anyio
async def test_a_graph_has_one_node_per_captured_kernel() -> None:
    # the events that fork and join the zip arms are edges of the graph, not nodes
    x, y, z = await aarrays(1.0, 0.0, 0.0)
    assert chain(x, y, z).capture().nodes == 3
    a, b = await aarrays(0.0, 0.0)
    graph = zipped(x, a, b, z).capture()
    assert graph.nodes == 3
    await graph.launch()
    np.testing.assert_array_equal(await gf.to_host(z), np.full(N, 2, F32))


def test_a_free_during_a_capture_is_no_part_of_the_graph() -> None:
    # an array last written on the capturing stream is dropped mid-capture:
    # its stream-ordered free waits for the capture's end, as on CUDA
    s = gf.new_stream()
    x, y, z = (gf.full(N, v, dtype=F32).sync_on(s) for v in (1.0, 0.0, 0.0))
    doomed = [gf.full(N, 9.0, dtype=F32).sync_on(s)]

    def drop(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        doomed.clear()
        gc.collect()  # the allocation's finalizer frees it on the captured stream
        return chain(x, y, z)

    graph = gf.with_context(drop).capture(stream=s)
    assert graph.nodes == 3
    graph.launch().sync_on(s)
    np.testing.assert_array_equal(host(z), np.full(N, 4, F32))


# what a stream runs besides work: the edges between work, and the completion signal
_NOT_WORK = ("event record", "event wait", "mark wait", "host signal", "completion mark")


@pytest.mark.sim_only
@pytest.mark.anyio
async def test_sim_a_launch_replays_the_whole_graph_as_one_item() -> None:
    x, y, z, a, b = await aarrays(1.0, 0.0, 0.0, 0.0, 0.0)
    for graph, want in ((chain(x, y, z).capture(), 4), (zipped(x, a, b, z).capture(), 2)):
        with testing.record_activity() as record:
            await graph.launch()
        work = [r for r in record if r.what not in _NOT_WORK]
        # one replay of all three nodes, and not one kernel run on its own
        assert [r.what for r in work] == ["graph of 3 nodes"], record
        np.testing.assert_array_equal(await gf.to_host(z), np.full(N, want, F32))


def test_a_graph_launches_on_its_own_device_only() -> None:
    devices = gf.open_device_group().devices
    if len(devices) < 2:
        pytest.skip("needs two devices")
    x, y, z = arrays(1.0, 0.0, 0.0)
    graph = chain(x, y, z).capture()
    with pytest.raises(gf.UsageError, match="captured on device 0 launched on device 1"):
        graph.launch().sync(gf.SingleStream(device=1))


# -- to_dot ----------------------------------------------------------------------------------------

_NODE = re.compile(r'^\s*(n\d+) \[label="((?:[^"\\]|\\.)*)"(.*)\];$')
_EDGE = re.compile(r"^\s*(n\d+) -> (n\d+);$")


def parse_dot(text: str) -> tuple[dict[str, tuple[str, str]], set[tuple[str, str]]]:
    """``{id: (label, attributes)}`` and the set of ``(from, to)`` edges."""
    lines = text.strip().splitlines()
    assert lines[0].startswith("digraph") and lines[-1] == "}"
    nodes: dict[str, tuple[str, str]] = {}
    edges: set[tuple[str, str]] = set()
    for line in lines[1:-1]:
        if m := _NODE.match(line):
            assert m.group(1) not in nodes
            nodes[m.group(1)] = (m.group(2), m.group(3))
        elif m := _EDGE.match(line):
            edges.add((m.group(1), m.group(2)))
    for a, b in edges:
        assert a in nodes and b in nodes
    return nodes, edges


def _one(nodes: dict[str, tuple[str, str]], label: str) -> str:
    found = [n for n, (lab, _) in nodes.items() if lab.startswith(label)]
    assert len(found) == 1, f"{label!r}: {found} in {nodes}"
    return found[0]


def _all(nodes: dict[str, tuple[str, str]], label: str) -> set[str]:
    return {n for n, (lab, _) in nodes.items() if lab.startswith(label)}


def test_to_dot_shows_kernels_copies_joins_and_shared_points() -> None:
    h = np.ones(N, F32)
    total = M.vadd(CFG, gf.from_host(h), gf.from_host(h), gf.zeros(N, F32), N).shared()
    op = gf.zip(M.scale(CFG, total, 2.0, N), gf.copy(total.clone())).then(
        lambda t: M.vadd(CFG, t[0], t[1], gf.zeros(N, F32), N)
    )
    nodes, edges = parse_dot(op.to_dot())
    vadd = _one(nodes, "kernel vadd")  # the one inside `then` is opaque until run
    scale = _one(nodes, "kernel scale")
    shared = _one(nodes, "shared")  # once, however many clones use it
    copy = _one(nodes, "copy")
    join = _one(nodes, "zip (2)")
    then = _one(nodes, "then")
    uploads = _all(nodes, "from_host")
    allocs = _all(nodes, "full")
    assert len(uploads) == 2 and len(allocs) == 1
    assert {(u, vadd) for u in uploads} | {(a, vadd) for a in allocs} <= edges
    assert {(vadd, shared), (shared, scale), (shared, copy)} <= edges
    assert {(scale, join), (copy, join), (join, then)} <= edges
    assert len(edges) == 9
    # each kind is drawn differently
    assert nodes[vadd][1] != nodes[copy][1] != nodes[join][1] != nodes[shared][1]
    # an edge leads from every node but the result to what consumes it
    assert {a for a, _ in edges} == set(nodes) - {then}


def test_to_dot_shows_unzip_points_and_their_single_source() -> None:
    x, y = arrays(1.0, 0.0)
    first, second = gf.zip(M.copy_f32(CFG, x, y, N), gf.copy(x)).unzip(2)
    op = gf.zip(first, second)
    nodes, edges = parse_dot(op.to_dot())
    picks = _all(nodes, "unzip")
    assert len(picks) == 2
    shared = _one(nodes, "shared")
    joins = _all(nodes, "zip (2)")
    assert len(joins) == 2  # the source's zip and the outer one
    outer = [j for j in joins if all((p, j) in edges for p in picks)]
    inner = [j for j in joins if (j, shared) in edges]
    assert len(outer) == 1 and len(inner) == 1
    assert {(shared, p) for p in picks} <= edges
    assert (_one(nodes, "kernel copy_f32"), inner[0]) in edges
    assert (_one(nodes, "copy"), inner[0]) in edges


def test_to_dot_quotes_labels() -> None:
    def odd_name(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
        return gf.value(None)

    odd_name.__qualname__ = 'say "hi" \\ bye'
    nodes, _ = parse_dot(gf.with_context(odd_name).to_dot())
    (label,) = (lab for lab, _ in nodes.values())
    assert label == r"with_context say \"hi\" \\ bye"


def test_a_graph_exposes_its_executable_handle_on_cuda_only(device_backend: str) -> None:
    x, y, z = arrays(1.0, 0.0, 0.0)
    graph = chain(x, y, z).capture()
    if cuda_native():
        assert gf.lowlevel.graph_exec_handle(graph) > 0
    else:
        with pytest.raises(gf.UsageError, match="sim backend have no CUDA handle"):
            gf.lowlevel.graph_exec_handle(graph)
