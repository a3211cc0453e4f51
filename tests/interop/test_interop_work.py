"""Other libraries' streams and code: foreign streams awaited
(``gf.wait_stream``), foreign code on gpuflow's stream (``gf.foreign``),
``python -m gpuflow info``, and PyTorch and CuPy on a CUDA device (skipped
otherwise).  The other library is gpuflow itself seen only through the
protocols, or :class:`helpers.interop.FakeLib`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import os
import re
import subprocess
import sys
import time
import weakref
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from helpers.interop import (
    F32,
    CaiOnly,
    DlpackOnly,
    FakeLib,
    N,
    add,
    backend,
    handle,
    late_copy,
    late_fill,
    wait_until,
)

import gpuflow as gf

# -- foreign streams -----------------------------------------------------------------------


class StreamProtocol:
    """cuda.core's way: ``__cuda_stream__() -> (version, handle)``."""

    def __init__(self, h: int) -> None:
        self._h = h

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._h)


class TorchLikeDevice:
    """torch.device's way: ``index``."""

    def __init__(self, index: int) -> None:
        self.index = index


class TorchLikeStream:
    """torch.cuda.Stream's way: ``cuda_stream``, ``device_index`` and ``device``
    (a torch.device)."""

    def __init__(self, h: int, device: int) -> None:
        self.cuda_stream = h
        self.device_index = device
        self.device = TorchLikeDevice(device)


class CupyLikeStream:
    """cupy.cuda.Stream's way: ``ptr`` and ``device_id``."""

    def __init__(self, h: int, device: int) -> None:
        self.ptr = h
        self.device_id = device


class CoreLikeStream(StreamProtocol):
    """cuda.core's way: ``__cuda_stream__`` and ``device``, a Device with ``device_id``."""

    def __init__(self, h: int, device: int) -> None:
        super().__init__(h)
        self.device = CupyLikeStream(0, device)  # (what counts: its device_id)


class OldTorchLikeStream:
    """A stream object with ``cuda_stream`` and a ``device`` with ``index`` only."""

    def __init__(self, h: int, device: int) -> None:
        self.cuda_stream = h
        self.device = TorchLikeDevice(device)


def test_a_stream_object_says_its_handle_and_device_each_way() -> None:
    from gpuflow._core import _stream_protocols  # the reading of other libraries' stream objects

    for obj in (
        TorchLikeStream(0x1234, 1),
        OldTorchLikeStream(0x1234, 1),
        CupyLikeStream(0x1234, 1),
        CoreLikeStream(0x1234, 1),
    ):
        handle = _stream_protocols.stream_handle(obj, "wait_stream")
        assert handle == (0x1234, 1), type(obj).__name__
    assert _stream_protocols.stream_handle(StreamProtocol(0x1234), "wait_stream") == (0x1234, None)
    assert _stream_protocols.stream_handle(2, "wait_stream") == (2, None)


@pytest.mark.anyio
@pytest.mark.parametrize("form", ["gpuflow", "int", "protocol", "torch", "cupy"])
async def test_wait_stream_orders_after_the_foreign_work(form: str) -> None:
    fake = FakeLib()
    gpuflow_stream = gf.new_stream()
    if form == "gpuflow":
        fake.current = handle(gpuflow_stream)
    x = await gf.zeros(N, F32)
    fake.late_fill_untracked(x.ptr, 5.0)  # a write gpuflow knows nothing of
    h = fake.stream()
    stream = {
        "gpuflow": gpuflow_stream,
        "int": h,
        "protocol": StreamProtocol(h),
        "torch": TorchLikeStream(h, 0),
        "cupy": CupyLikeStream(h, 0),
    }[form]
    out = await gf.to_host(gf.wait_stream(stream).map(lambda _: x))
    assert np.array_equal(out, np.full(N, 5, F32))


@pytest.mark.anyio
async def test_awaiting_wait_stream_lets_the_event_loop_run() -> None:
    fake = FakeLib()
    x = await gf.zeros(N, F32)
    fake.late_fill_untracked(x.ptr, 5.0, seconds=0.5)
    running: list[bool] = []
    done = False

    async def ticker() -> None:
        while not done:
            running.append(not fake.idle())
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await gf.wait_stream(fake.own)
        finished = fake.idle()
        done = True
    assert finished  # the wait really waited for the foreign work
    assert any(running)  # and other tasks ran while that work was still running


@pytest.mark.anyio
async def test_wait_stream_composes_with_zip_and_then() -> None:
    fake = FakeLib()
    x = await gf.zeros(N, F32)
    fake.late_fill_untracked(x.ptr, 5.0)
    both = gf.zip(gf.wait_stream(fake.own), gf.full(N, 1.0, F32))
    out = await gf.to_host(both.then(lambda _: add(x, 1.0)))  # 5 + 1 only after the write
    assert np.array_equal(out, np.full(N, 6, F32))


@pytest.mark.anyio
async def test_a_cancelled_wait_stream_is_cancelled_at_once() -> None:
    fake = FakeLib()
    x = await gf.zeros(N, F32)
    fake.late_fill_untracked(x.ptr, 5.0, seconds=0.5)
    with anyio.move_on_after(0.05) as scope:
        await gf.wait_stream(fake.own)
    assert scope.cancelled_caught
    assert not fake.idle()  # the await ended before the foreign work did
    await gf.wait_stream(fake.own)  # (x must outlive the write gpuflow knows nothing of)


@pytest.mark.anyio
@pytest.mark.parametrize("traced", [False, True])
async def test_a_cancelled_lone_wait_keeps_the_stream_object_until_the_work_is_done(
    traced: bool, tmp_path: Path
) -> None:
    """The run of a lone ``await gf.wait_stream(obj)`` keeps the library's
    stream object (whose handle names the stream its completion is marked
    on, and a wake-up may be enqueued on later) until that work is done,
    whatever happens to the await; also while a trace records, where the
    await is unusual."""
    fake = FakeLib()
    x = await gf.zeros(N, F32)
    fake.late_fill_untracked(x.ptr, 5.0, seconds=0.3)
    refs: list[weakref.ref[TorchLikeStream]] = []

    async def wait_for_the_library() -> None:  # (the object lives in its frame only)
        obj = TorchLikeStream(fake.own, 0)
        refs.append(weakref.ref(obj))
        await gf.wait_stream(obj)

    with gf.trace(tmp_path / "run.json") if traced else contextlib.nullcontext():
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_the_library)
            await anyio.sleep(0.05)
            tg.cancel_scope.cancel()  # (the task and its frames are gone after this block)
    gc.collect()
    alive = refs[0]
    assert not fake.idle()
    assert alive() is not None  # kept by the run in flight
    await gf.wait_stream(fake.own)
    wait_until(lambda: gc.collect() >= 0 and alive() is None, "the stream object is let go")


@pytest.mark.anyio
async def test_a_lone_wait_stream_holds_up_no_stream_of_gpuflow() -> None:
    """``await gf.wait_stream(s)`` alone completes on ``s`` itself: no stream
    of gpuflow's waits for the foreign work, so a run the same policy puts on
    the same stream meanwhile does not wait for work it does not use."""
    fake = FakeLib()
    x = await gf.zeros(N, F32)
    fake.late_fill_untracked(x.ptr, 5.0, seconds=0.5)
    policy = gf.SingleStream(0)  # every run of it on one stream
    waited: list[bool] = []

    async def wait_for_the_library() -> None:
        await gf.wait_stream(fake.own).run(policy)
        waited.append(fake.idle())

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_the_library)
        await anyio.sleep(0.02)  # (its run is in flight)
        assert not waited
        ours = await gf.to_host(gf.full(N, 1.0, F32)).run(policy)
        ours_before_theirs = not fake.idle()
    assert np.array_equal(ours, np.full(N, 1, F32))
    assert ours_before_theirs  # ours did not wait for the foreign work
    assert waited == [True]  # and the wait did


@pytest.mark.anyio
async def test_wait_stream_of_a_stream_being_captured_is_refused() -> None:
    """The foreign work of a stream being captured runs when its graph is
    launched: waiting for it now is refused, before anything is enqueued,
    whether the wait is awaited alone or composed, and leaves nothing in
    flight (the lease's exit would wait for it)."""
    fake = FakeLib()
    be = backend()
    be.begin_capture(fake._own_raw)
    try:
        async with gf.open_stream_lease():
            with pytest.raises(gf.UsageError, match="captured into a graph"):
                await gf.wait_stream(fake.own)
            with pytest.raises(gf.UsageError, match="being captured into a graph"):
                await gf.wait_stream(fake.own).then(lambda _: gf.full(N, 1.0, F32))
    finally:
        be.end_capture(fake._own_raw)
    await gf.wait_stream(fake.own)  # (waits again once the capture ended)


class _Tracker:
    """A structured scope that only records the runs started inside it."""

    _pinned = None

    def __init__(self) -> None:
        self.runs: list[gf.lowlevel.Run] = []

    def _track(self, sub: gf.lowlevel.Run) -> None:
        self.runs.append(sub)


@pytest.mark.anyio
async def test_a_refused_wait_stream_leaves_no_run_in_flight() -> None:
    """A wait refused before anything was enqueued (its stream is being
    captured) is a run that ended: a scope that tracked it would otherwise
    wait for it for ever (a stream lease's exit, which is shielded)."""
    from gpuflow._core._scoped import enter_scope, leave_scope

    fake = FakeLib()
    be = backend()
    tracker = _Tracker()
    token = enter_scope(tracker)
    be.begin_capture(fake._own_raw)
    try:
        with pytest.raises(gf.UsageError, match="captured into a graph"):
            await gf.wait_stream(fake.own)
    finally:
        be.end_capture(fake._own_raw)
        leave_scope(token)
    assert len(tracker.runs) == 1
    assert tracker.runs[0].done, "the refused run is still in flight"
    assert isinstance(tracker.runs[0].error, gf.UsageError)


@pytest.mark.parametrize("default", [0, 1, 2])
def test_wait_stream_on_a_default_stream(default: int) -> None:
    fake = FakeLib()
    fake.current = default  # its work goes to the default stream of device 0
    x = gf.zeros(N, F32).sync()
    fake.late_fill_untracked(x.ptr, 5.0)
    out = gf.to_host(gf.wait_stream(default).map(lambda _: x)).sync()
    assert np.array_equal(out, np.full(N, 5, F32))


@pytest.mark.anyio
@pytest.mark.parametrize("default", [0, 1, 2])
async def test_a_lone_wait_stream_on_a_default_stream(default: int) -> None:
    # awaited alone, it completes on the default stream itself, of the run's device
    fake = FakeLib()
    fake.current = default
    x = await gf.zeros(N, F32)
    fake.late_fill_untracked(x.ptr, 5.0)
    await gf.wait_stream(default)
    assert np.array_equal(await gf.to_host(x), np.full(N, 5, F32))


def test_one_foreign_stream_is_one_stream_until_its_device_is_reset() -> None:
    """Another library's stream, named again, is the same gpuflow stream (its
    hazards are one stream's), and a new one once its device was reset."""
    from gpuflow._core import _stream_protocols  # the resolution itself
    from gpuflow._core._runtime import ensure_runtime

    fake = FakeLib()
    rt = ensure_runtime()
    handle = fake.own  # (a handle of the backend's, no gpuflow stream)
    first, own = _stream_protocols.stream_for(rt, handle, 0)
    assert not own
    assert _stream_protocols.stream_for(rt, handle, 0)[0] is first
    default = _stream_protocols.stream_for(rt, 0, 0)[0]
    assert default is _stream_protocols.stream_for(rt, 0, 0)[0] and default is not first
    gf.reset_device(0)
    after = _stream_protocols.stream_for(rt, 0, 0)[0]
    assert after is not default
    gf.wait_stream(0).sync()  # (the new one is usable)


class _CountingDriver:
    """The driver bindings, counting the calls that resolve a stream's context."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver
        self.asked = 0

    def cuStreamGetCtx(self, handle: Any) -> Any:
        self.asked += 1
        return self._driver.cuStreamGetCtx(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)


@pytest.mark.cuda_only
@pytest.mark.anyio
async def test_a_stream_object_that_names_its_device_is_resolved_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream object that says its device (torch's, CuPy's; a new object
    each time, as ``torch.cuda.current_stream()`` gives) is resolved by the
    driver once for its device's context: an await of it alone then makes
    no call to ask.  A bare handle is asked about each time, and after a
    reset of the device the stream is resolved again."""
    be: Any = backend()
    driver = _CountingDriver(be._cu)
    monkeypatch.setattr(be, "_cu", driver)
    fake = FakeLib()
    x = await gf.zeros(N, F32)
    await gf.wait_stream(TorchLikeStream(fake.own, 0))
    for value in (5.0, 6.0, 7.0):
        fake.late_fill_untracked(x.ptr, value)  # (the library's launch asks, itself)
        asked = driver.asked
        await gf.wait_stream(TorchLikeStream(fake.own, 0))
        await gf.wait_stream(CupyLikeStream(fake.own, 0))
        assert driver.asked == asked
        assert np.array_equal(await gf.to_host(x), np.full(N, value, F32))  # (it waited)
    await gf.wait_stream(fake.own)  # (no device said)
    assert driver.asked == asked + 1
    gf.reset_device(0)
    again = FakeLib()  # (its handle may be the old one's)
    await gf.wait_stream(TorchLikeStream(again.own, 0))
    assert driver.asked == asked + 2


@pytest.mark.sim_only
@pytest.mark.anyio
async def test_a_destroyed_stream_named_with_its_device_is_refused() -> None:
    # sim: a destroyed stream's handle is refused, also from an object that
    # names its device and was awaited before (on CUDA using one is undefined)
    be = backend()
    theirs = be.create_stream(0)
    named = TorchLikeStream(be.stream_handle(theirs), 0)
    await gf.wait_stream(named)
    be.destroy_stream(theirs)
    with pytest.raises(gf.UsageError, match="not a live stream"):
        await gf.wait_stream(named)


def test_a_dropped_stream_of_gpuflow_is_no_longer_known_by_its_handle() -> None:
    """gpuflow's own streams are known by their handles while they live (a
    wait_stream of one joins hazard tracking); a dropped one is forgotten,
    and what is kept of streams made and dropped stays bounded."""
    from gpuflow._core import _stream_protocols
    from gpuflow._core._runtime import ensure_runtime

    rt = ensure_runtime()
    s = gf.new_stream()
    h = handle(s)
    assert _stream_protocols.own_stream(rt, h) is s
    del s
    gc.collect()
    assert _stream_protocols.own_stream(rt, h) is None
    for _ in range(600):
        gf.new_stream()  # (dropped at once)
    gc.collect()
    assert len(rt._by_handle) <= 2 * 256


@pytest.mark.anyio
async def test_gpuflow_keeps_no_weak_reference_to_a_stream_object() -> None:
    """PyTorch up to 2.11 leaves the weak references to a freed
    ``torch.cuda.Stream`` dangling (its dealloc does not clear them), and the
    garbage collector crashes on them later: gpuflow never makes one to
    another library's stream object, awaited alone or composed."""
    fake = FakeLib()
    obj = TorchLikeStream(fake.own, 0)
    await gf.wait_stream(obj)
    await gf.wait_stream(obj).then(lambda _: gf.full(N, 1.0, F32))
    assert weakref.getweakrefcount(obj) == 0


def test_wait_stream_refuses_what_is_not_a_stream() -> None:
    class BadProtocol:
        def __cuda_stream__(self) -> str:
            return "stream"

    with pytest.raises(gf.UsageTypeError, match="needs a stream"):
        gf.wait_stream("stream")
    with pytest.raises(gf.UsageTypeError, match="needs a stream"):
        gf.wait_stream(True)
    with pytest.raises(gf.UsageError, match="not -5"):
        gf.wait_stream(-5)
    with pytest.raises(gf.UsageTypeError, match="__cuda_stream__"):
        gf.wait_stream(BadProtocol())
    with pytest.raises(gf.UsageError, match="graph capture"):
        gf.wait_stream(gf.new_stream()).capture()


@pytest.mark.sim_only
def test_wait_stream_refuses_a_handle_that_is_no_stream() -> None:
    # sim: an unknown handle is refused (on CUDA using one is undefined)
    with pytest.raises(gf.UsageError, match="not a live stream"):
        gf.wait_stream(0x1234).sync()


# -- foreign code on gpuflow's stream -------------------------------------------------------


@pytest.mark.anyio
async def test_foreign_code_runs_on_gpuflows_stream_in_a_pipeline(lib: FakeLib) -> None:
    runs_on: list[int] = []
    seen: list[int] = []

    def step(x: gf.DeviceArray) -> gf.DeviceArray:
        seen.append(lib.stream())
        lib.late_scale(x, 2.0)  # slow read-modify-write on its current stream
        return x

    def on_stream(ctx: gf.ExecutionContext, x: gf.DeviceArray) -> gf.DeviceOperation[Any]:
        runs_on.append(handle(ctx.stream))
        return gf.foreign(step, x)

    op = (
        gf.full(N, 3.0, F32)
        .then(lambda x: gf.with_context(lambda ctx: on_stream(ctx, x)))
        .then(lambda x: add(x, 10.0))  # gpuflow again, after the foreign step
    )
    assert np.array_equal(await gf.to_host(op), np.full(N, 16, F32))
    assert seen == runs_on  # the foreign code's current stream was the run's


@pytest.mark.anyio
async def test_foreign_code_is_ordered_after_gpuflows_uses_of_its_arguments(
    lib: FakeLib,
) -> None:
    x = await gf.zeros(N, F32)
    late_fill(x, 7.0).enqueue_on(gf.new_stream())  # pending, slow, on another stream

    def overwrite(x: gf.DeviceArray) -> None:
        # a write gpuflow learns of only because x is an argument of foreign():
        # through a raw pointer, fast, after the slow write
        lib.late_fill_untracked(x.ptr, 1.0, seconds=0)

    await gf.foreign(overwrite, x)
    assert np.array_equal(await gf.to_host(x), np.ones(N, F32))


@pytest.mark.anyio
async def test_foreign_results_come_back_as_device_arrays(lib: FakeLib) -> None:
    src = await gf.full(N, 2.0, F32)

    def step() -> tuple[Any, Any, str, np.ndarray]:
        return DlpackOnly(src), CaiOnly(src), "meta", np.ones(3)

    a, b, meta, host = await gf.foreign(step)
    assert isinstance(a, gf.DeviceArray) and isinstance(b, gf.DeviceArray)
    assert a.ptr == b.ptr == src.ptr
    assert meta == "meta" and isinstance(host, np.ndarray)  # the rest is passed through
    assert np.array_equal(await gf.to_host(a), np.full(N, 2, F32))


def test_foreign_refuses_what_it_cannot_run() -> None:
    with pytest.raises(gf.UsageTypeError, match="callable"):
        gf.foreign(3)  # type: ignore[arg-type]
    with pytest.raises(gf.UsageError, match="graph capture"):
        gf.foreign(lambda: None).capture()
    with pytest.raises(gf.UsageTypeError, match="callable"):
        gf.lowlevel.register_stream_adapter(3)  # type: ignore[arg-type]


# -- python -m gpuflow info ------------------------------------------------------------------


def test_info_lists_the_sms_each_device_would_reserve(tmp_path: Path) -> None:
    package_root = Path(gf.__file__).parent.parent
    path = os.pathsep.join(p for p in (str(package_root), os.environ.get("PYTHONPATH")) if p)

    def info(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpuflow", "info", *args], cwd=tmp_path, capture_output=True,
            text=True, timeout=120, env=dict(os.environ, PYTHONPATH=path),
        )  # fmt: skip

    proc = info()
    assert proc.returncode == 0, proc.stderr[-2000:]
    sms = int(re.search(r"  0: .*, (\d+) SMs\n", proc.stdout).group(1))  # type: ignore[union-attr]
    assert "reserved SMs: none asked (--reserve-sms NAME=COUNT" in proc.stdout
    proc = info("--reserve-sms", "interactive=12", "--reserve-sms", "bulk=8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # rounded up to the device's granule (8 SMs on sim and on compute capability 9.0)
    assert "     reserved SMs 'interactive': 16 (12 asked)\n" in proc.stdout, proc.stdout
    assert "     reserved SMs 'bulk': 8 (8 asked)\n" in proc.stdout
    assert f"     the other streams' SMs: {sms - 24}\n" in proc.stdout
    proc = info("--reserve-sms", f"interactive={sms}")
    assert proc.returncode == 0 and "reserved SMs: none: cannot reserve SMs on " in proc.stdout
    assert f"do not fit in the device's {sms}" in proc.stdout
    proc = info("--reserve-sms", "interactive")
    assert proc.returncode == 2 and "'interactive' is not NAME=COUNT" in proc.stderr


def test_info_reports_backend_devices_and_libraries(tmp_path: Path) -> None:
    package_root = Path(gf.__file__).parent.parent
    path = os.pathsep.join(p for p in (str(package_root), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "gpuflow", "info"], cwd=tmp_path, capture_output=True,
        text=True, timeout=120, env=dict(os.environ, PYTHONPATH=path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert f"gpuflow {gf.__version__}" in out
    cuda_devices = gf._backends.cuda_probe()[0]
    if cuda_devices:
        assert "backend: cuda" in out
        assert f"CUDA devices: {cuda_devices}" in out
        assert "compute capability" in out
    else:
        assert "backend: sim" in out and "no CUDA device" in out
        assert "gpuflow sim device 0" in out
        # how many it simulates, and how to choose (the demo simulates two)
        assert "devices: 1 (the simulation makes as many as asked for: " in out
        assert "gf.init_device_contexts(num_devices=N)" in out and "--devices N" in out
    for name, module in (("PyTorch", "torch"), ("CuPy", "cupy")):
        installed = find_spec(module) is not None
        assert (f"{name}: not installed" in out) != installed
    # the optional packages: event loops, the MPI bootstrap, NCCL
    for dist in ("trio", "uvloop", "mpi4py", "nccl4py", "nvidia-nccl-cu13"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        assert f"{dist} {version}" in out, dist


# -- PyTorch and CuPy (on a CUDA device) ------------------------------------------------------


@pytest.mark.cuda_only
def test_torch_sees_the_same_pointer_both_ways() -> None:
    torch = pytest.importorskip("torch")
    a = gf.arange(N, dtype=F32).sync()
    t = torch.from_dlpack(a)
    assert t.data_ptr() == a.ptr and t.device == torch.device("cuda", a.device)
    assert np.array_equal(t.cpu().numpy(), np.arange(N, dtype=F32))
    assert torch.as_tensor(a, device="cuda").data_ptr() == a.ptr  # __cuda_array_interface__
    x = torch.arange(N, dtype=torch.float32, device="cuda") * 2
    b = gf.from_dlpack(x)
    assert b.ptr == x.data_ptr()
    assert np.array_equal(gf.to_host(b).sync(), np.arange(N, dtype=F32) * 2)


@pytest.mark.cuda_only
def test_torch_memory_lives_while_gpuflow_reads_it() -> None:
    torch = pytest.importorskip("torch")
    x = torch.full((N,), 3.0, device="cuda")
    torch.cuda.synchronize()
    b = gf.from_dlpack(x)
    out, reader = gf.zeros(N, F32).sync(), gf.new_stream()
    late_copy(b, out).enqueue_on(reader)
    del x, b
    gc.collect()
    # PyTorch's allocator hands a freed block out again at once: released early,
    # x's memory would hold -1 before the slow read reads it
    y = torch.full((N,), -1.0, device="cuda")
    assert np.array_equal(gf.to_host(out).sync_on(reader), np.full(N, 3, F32))
    del y


@pytest.mark.cuda_only
def test_an_export_to_torch_lives_until_torch_is_done() -> None:
    torch = pytest.importorskip("torch")
    a = gf.full(N, 4.0, F32).sync()
    t = torch.from_dlpack(a)
    del a
    gc.collect()
    assert float(t.sum()) == 4.0 * N  # the memory outlived the gpuflow array


@pytest.mark.cuda_only
def test_cupy_sees_the_same_pointer_both_ways() -> None:
    cupy = pytest.importorskip("cupy")
    a = gf.arange(N, dtype=F32).sync()
    c = cupy.from_dlpack(a)
    assert c.data.ptr == a.ptr
    assert np.array_equal(cupy.asnumpy(c), np.arange(N, dtype=F32))
    assert cupy.asarray(a).data.ptr == a.ptr  # __cuda_array_interface__
    x = cupy.arange(N, dtype=cupy.float32) * 2
    b = gf.from_dlpack(x)
    assert b.ptr == x.data.ptr
    assert np.array_equal(gf.to_host(b).sync(), np.arange(N, dtype=F32) * 2)


@pytest.mark.cuda_only
@pytest.mark.anyio
async def test_a_gpuflow_torch_gpuflow_pipeline() -> None:
    torch = pytest.importorskip("torch")
    w = torch.full((N,), 2.0, device="cuda")
    torch.cuda.synchronize()  # (w is made on PyTorch's own stream)
    seen: list[int] = []
    runs_on: list[int] = []

    def torch_step(x: gf.DeviceArray) -> Any:
        seen.append(torch.cuda.current_stream().cuda_stream)
        t = torch.from_dlpack(x)  # after the slow gpuflow write: the same stream
        return torch.relu(t - 3.0) + t * w

    def on_stream(ctx: gf.ExecutionContext, x: gf.DeviceArray) -> gf.DeviceOperation[Any]:
        runs_on.append(handle(ctx.stream))
        return gf.foreign(torch_step, x)

    op = (
        gf.zeros(N, F32)
        .then(lambda x: late_fill(x, 5.0, seconds=0.2))
        .then(lambda x: gf.with_context(lambda ctx: on_stream(ctx, x)))
        .then(lambda y: add(y, 1.0))
    )
    out = await gf.to_host(op)
    assert np.array_equal(out, np.full(N, (5 - 3) + 5 * 2 + 1, F32))
    assert seen == runs_on


@pytest.mark.cuda_only
@pytest.mark.anyio
async def test_awaiting_a_busy_torch_stream_keeps_the_loop_ticking() -> None:
    torch = pytest.importorskip("torch")
    stream = torch.cuda.Stream()
    # how many cycles of torch.cuda._sleep make 400 ms on this GPU (measured
    # after a first call: the first ran at other clocks on the H200)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        with torch.cuda.stream(stream):
            begin.record()
            torch.cuda._sleep(50_000_000)
            end.record()
        end.synchronize()
    cycles = int(50_000_000 * 400 / begin.elapsed_time(end))
    with torch.cuda.stream(stream):
        begin.record()
        torch.cuda._sleep(cycles)  # the "forward pass": 400 ms of GPU work
        end.record()
    ticks: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            ticks.append(time.perf_counter())
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0)
        await gf.wait_stream(stream)
        finished = end.query()
        done = True
    assert finished  # the wait waited for the busy work ...
    assert begin.elapsed_time(end) >= 200  # ... which was busy for at least 200 ms
    gaps = np.diff(ticks)
    assert len(ticks) >= 10 and gaps.max() < 0.05  # and the loop kept ticking meanwhile
