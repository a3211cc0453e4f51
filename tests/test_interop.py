"""Other libraries' GPU work: arrays out and in (DLPack, ``__cuda_array_interface__``),
foreign streams awaited (``gf.wait_stream``), foreign code on gpuflow's stream
(``gf.foreign``), and ``python -m gpuflow info``.

On ``sim`` and ``cuda`` alike, the other library is gpuflow itself seen only
through the protocols, or :class:`FakeLib`: a CUDA library that knows gpuflow
arrays only through DLPack, streams only by their handles, and has a current
stream of its own; it enqueues real kernels through the backend interface, as
a CUDA library does through the driver.  A missing dependency shows up as
wrong data: the work that must come first is slow (it waits before it touches
memory), on the GPU as on ``sim``.  A use after free is a fault and a count on
``sim`` (checked after every test), and wrong data in the PyTorch tests, where
PyTorch's allocator hands freed memory out again at once.

The PyTorch and CuPy tests need a CUDA device and the library (skipped
otherwise); ``cuda.core`` (a test dependency) reads gpuflow's DLPack export
with its own parser, on both backends.

Private modules, where the machinery under test is theirs: ``_dlpack`` reads
and consumes capsules (FakeLib, the checks of versions, dtypes and flags);
``DeviceArray.allocation`` shows the hazard state and the backend's buffer, to see
when it is freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.metadata
import math
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import anyio
import kernels as K
import numpy as np
import pytest

import gpuflow as gf
from gpuflow import testing
from gpuflow._memory import _dlpack
from gpuflow.lowlevel import PointerArg

F32 = np.float32
N = 256
#: how long the work that must come first takes: surely still running when
#: the work that depends on it is enqueued, on a loaded machine
SLOW = 0.3
#: slack on "cannot have finished yet" (clock granularity)
EARLY = 0.01
DEADLINE = 20.0

# The memory clobber keeps the compiler from moving loads and stores across
# the wait, so "wait, write" and "read, wait, write" happen in that order.
SOURCE = K.WAIT_NS + r"""

// a slow write: waits ns nanoseconds, then writes v
extern "C" __global__ void late_fill(float* x, float v, int n, long long ns) {
    gf_wait_ns(ns);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}

// a slow read: waits ns nanoseconds, then copies src into dst
extern "C" __global__ void late_copy(const float* src, float* dst, int n, long long ns) {
    gf_wait_ns(ns);
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

// a slow read-modify-write: reads x, waits ns nanoseconds, writes x * s
extern "C" __global__ void late_scale(float* x, float s, int n, long long ns) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = i < n ? x[i] : 0.0f;
    gf_wait_ns(ns);
    if (i < n) x[i] = v * s;
}

extern "C" __global__ void add(float* x, float c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] + c;
}
"""


def late_fill_ref(x: np.ndarray, v: float, n: int, ns: int) -> None:
    time.sleep(ns / 1e9)
    x[:n] = np.float32(v)


def late_copy_ref(src: np.ndarray, dst: np.ndarray, n: int, ns: int) -> None:
    time.sleep(ns / 1e9)
    dst[:n] = src[:n]


def late_scale_ref(x: np.ndarray, s: float, n: int, ns: int) -> None:
    v = x[:n].copy()
    time.sleep(ns / 1e9)
    x[:n] = v * np.float32(s)


def add_ref(x: np.ndarray, c: float, n: int) -> None:
    x[:n] = x[:n] + np.float32(c)


MOD = gf.compile(
    SOURCE,
    references={
        "late_fill": late_fill_ref,
        "late_copy": late_copy_ref,
        "late_scale": late_scale_ref,
        "add": add_ref,
    },
)
CFG = gf.LaunchConfig.for_num_elems(N)


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


def late_fill(x: Any, v: float, seconds: float = SLOW) -> gf.DeviceOperation[Any]:
    return MOD.late_fill(CFG, x, v, N, ns(seconds))


def late_copy(src: Any, dst: Any, seconds: float = SLOW) -> gf.DeviceOperation[Any]:
    return MOD.late_copy(CFG, src, dst, N, ns(seconds))


def add(x: Any, c: float) -> gf.DeviceOperation[Any]:
    return MOD.add(CFG, x, c, N)


def handle(s: gf.Stream) -> int:
    return s.__cuda_stream__()[1]


def backend() -> gf.lowlevel.Backend:
    return gf.lowlevel.current_backend_object()


def idle(s: gf.Stream) -> bool:
    """The backend's own word on whether ``s`` has finished its work (not gpuflow's
    bookkeeping)."""
    return backend().query(s.raw)


# a consumer's view of capsules, through the C API (prototypes of our own)
_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi)
)
_new_capsule = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))


def capsule_name(capsule: Any) -> str:
    return str(_get_name(capsule).decode())


def wait_until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE} s"
        time.sleep(0.002)


class CaiOnly:
    """A producer that speaks only ``__cuda_array_interface__`` (as Numba's
    arrays do), and owns what backs its memory: a gpuflow array."""

    def __init__(self, backing: gf.DeviceArray, **changes: Any) -> None:
        self.backing = backing
        self.__cuda_array_interface__ = {**backing.__cuda_array_interface__, **changes}


class DlpackOnly:
    """A producer that speaks only DLPack (as JAX's arrays do)."""

    def __init__(self, backing: gf.DeviceArray) -> None:
        self.backing = backing

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.backing.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.backing.__dlpack_device__()


class FakeLib:
    """Another CUDA library, on any backend.

    It takes gpuflow arrays through DLPack only, on its *current stream* (its
    own stream, which is no gpuflow stream, or the one an adapter makes
    current, as ``torch.cuda.stream`` does), and lets go of them as soon as
    its work is enqueued, as a PyTorch temporary does.  It enqueues real
    kernels through the backend interface on that stream, knowing the stream
    only by its handle.  Its own stream lives as long as the backend.
    """

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self._own_raw = backend().create_stream(device)
        self.own = backend().stream_handle(self._own_raw)
        self.current: int | None = None

    def stream(self) -> int:
        return self.own if self.current is None else self.current

    def idle(self) -> bool:
        """The backend's word on whether its own stream has finished its work."""
        return backend().query(self._own_raw)

    @contextlib.contextmanager
    def on(self, stream: gf.Stream) -> Iterator[None]:
        previous, self.current = self.current, handle(stream)
        try:
            yield
        finally:
            self.current = previous

    def _take(self, array: Any) -> tuple[Any, _dlpack.ManagedTensor]:
        capsule = array.__dlpack__(stream=self.stream(), max_version=(1, 0))
        t = _dlpack.read_capsule(capsule)
        owner = _dlpack.take_capsule(capsule, t)
        nbytes = math.prod(t.shape) * 4
        return backend().foreign_buffer(t.ptr, nbytes, t.device_id), owner

    def _launch(self, name: str, *args: Any) -> None:
        be = backend()
        raw, _device = be.foreign_stream(self.stream(), self.device)
        kernel = be.load_kernel(self.device, MOD, name)
        be.launch(kernel, CFG.grid, CFG.block, 0, args, raw)

    def late_copy(self, src: Any, dst: Any, seconds: float = SLOW) -> None:
        s, s_owner = self._take(src)
        d, d_owner = self._take(dst)
        f32 = np.dtype(F32)
        self._launch(
            "late_copy", PointerArg(s, f32, N, False), PointerArg(d, f32, N, True),
            np.int32(N), np.int64(ns(seconds)),
        )  # fmt: skip
        del s_owner, d_owner  # let go at once: the work is still pending

    def late_scale(self, x: Any, factor: float, seconds: float = SLOW) -> None:
        buf, owner = self._take(x)
        self._launch(
            "late_scale", PointerArg(buf, np.dtype(F32), N, True), np.float32(factor),
            np.int32(N), np.int64(ns(seconds)),
        )  # fmt: skip
        del owner

    def late_fill_untracked(self, ptr: int, value: float, seconds: float = SLOW) -> None:
        """A write gpuflow knows nothing of: through a raw device pointer."""
        buf = backend().foreign_buffer(ptr, N * 4, self.device)
        self._launch(
            "late_fill", PointerArg(buf, np.dtype(F32), N, True), np.float32(value),
            np.int32(N), np.int64(ns(seconds)),
        )  # fmt: skip


@pytest.fixture
def lib() -> Iterator[FakeLib]:
    """A FakeLib that ``gf.foreign`` puts on gpuflow's stream."""
    fake = FakeLib()
    unregister = gf.lowlevel.register_stream_adapter(fake.on)
    yield fake
    unregister()


# -- arrays out ----------------------------------------------------------------------------


def test_an_array_is_cuda_memory_of_its_device_to_both_protocols() -> None:
    for device in range(min(gf.device_count(), 2)):
        with gf.use_device(device):
            a = gf.arange(12, dtype=F32).sync().reshape(3, 4)
        assert a.__dlpack_device__() == (2, device)  # kDLCUDA
        cai = a.__cuda_array_interface__
        assert cai["version"] == 3
        assert cai["shape"] == (3, 4) and cai["typestr"] == "<f4" and cai["strides"] is None
        assert cai["data"] == (a.ptr, False)
        assert isinstance(cai["stream"], int) and cai["stream"] > 2


def test_a_capsule_of_device_1_names_device_1_in_its_tensor() -> None:
    # a consumer reads the device from the DLTensor itself, not from
    # __dlpack_device__: both must name the array's device
    if gf.device_count() < 2:
        pytest.skip("needs two devices")
    with gf.use_device(1):
        a = gf.arange(N, dtype=F32).sync()
    assert a.device == 1 and a.__dlpack_device__() == (2, 1)
    for max_version in (None, (1, 0)):
        capsule = a.__dlpack__(max_version=max_version)
        t = _dlpack.read_capsule(capsule)
        assert (t.device_type, t.device_id, t.ptr) == (2, 1, a.ptr)
        b = gf.from_dlpack(capsule)  # the capsule alone says where the memory is
        assert (b.device, b.ptr) == (1, a.ptr)
    # through the protocol, where the producer names the device too: they agree
    c = gf.from_dlpack(DlpackOnly(a))
    assert (c.device, c.ptr) == (1, a.ptr)
    with gf.use_device(1):
        assert np.array_equal(gf.to_host(c).sync(), np.arange(N))
    utils = pytest.importorskip("cuda.core.utils")
    view_of = getattr(utils.StridedMemoryView, "from_dlpack", utils.StridedMemoryView)
    assert view_of(a, stream_ptr=-1).device_id == 1  # another library's parser


@pytest.mark.parametrize(
    ("max_version", "name", "version"),
    [
        (None, "dltensor", None),
        ((0, 8), "dltensor", None),
        ((1, 0), "dltensor_versioned", (1, 0)),
        ((1, 7), "dltensor_versioned", _dlpack.VERSION),
    ],
)
def test_capsules_are_versioned_when_the_consumer_asks(
    max_version: Any, name: str, version: Any
) -> None:
    a = gf.arange(N, dtype=F32).sync()
    capsule = a.__dlpack__(max_version=max_version)
    assert capsule_name(capsule) == name
    assert _dlpack.read_capsule(capsule).version == version
    b = gf.from_dlpack(capsule)
    assert capsule_name(capsule) == "used_" + name  # consumed: ownership moved
    assert b.ptr == a.ptr
    with pytest.raises(gf.UsageError, match="consumed once"):
        gf.from_dlpack(capsule)


@pytest.mark.parametrize(
    ("dtype", "code", "bits"),
    [
        (np.bool_, 6, 8), (np.int8, 0, 8), (np.int16, 0, 16), (np.int32, 0, 32),
        (np.int64, 0, 64), (np.uint8, 1, 8), (np.uint16, 1, 16), (np.uint32, 1, 32),
        (np.uint64, 1, 64), (np.float16, 2, 16), (np.float32, 2, 32), (np.float64, 2, 64),
        (np.complex64, 5, 64), (np.complex128, 5, 128),
    ],
)  # fmt: skip
def test_every_dtype_travels_with_its_dlpack_code(dtype: Any, code: int, bits: int) -> None:
    host = (np.arange(12) % 3).astype(dtype).reshape(3, 4)
    a = gf.from_host(host).sync()
    capsule = a.__dlpack__(max_version=(1, 0))
    t = _dlpack.read_capsule(capsule)
    assert (t.code, t.bits, t.lanes) == (code, bits, 1)  # dlpack.h's DLDataTypeCode
    assert (t.device_type, t.device_id, t.ptr) == (2, a.device, a.ptr)
    assert t.shape == (3, 4) and t.strides in (None, (4, 1))
    b = gf.from_dlpack(capsule)
    assert b.dtype == np.dtype(dtype) and b.shape == (3, 4)
    assert np.array_equal(gf.to_host(b).sync(), host)


@pytest.mark.anyio
@pytest.mark.parametrize("protocol", ["dlpack", "cai"])
async def test_an_import_of_a_gpuflow_array_is_the_same_memory(protocol: str) -> None:
    a = await gf.arange(N, dtype=F32)
    b = gf.from_dlpack(a if protocol == "dlpack" else CaiOnly(a))
    assert (b.ptr, b.shape, b.dtype, b.device) == (a.ptr, a.shape, a.dtype, a.device)
    await add(b, 1.0)  # a write through one view, awaited (ordered) ...
    assert np.array_equal(await gf.to_host(a), np.arange(N) + 1)  # ... is seen through the other
    await add(a, 1.0)
    assert np.array_equal(await gf.to_host(b), np.arange(N) + 2)


def test_cuda_core_reads_the_export_with_its_own_parser() -> None:
    utils = pytest.importorskip("cuda.core.utils")
    view_of = getattr(utils.StridedMemoryView, "from_dlpack", utils.StridedMemoryView)
    a = gf.arange(12, dtype=F32).sync().reshape(3, 4)
    consumer = gf.new_stream()
    for stream_ptr in (-1, handle(consumer)):
        view = view_of(a, stream_ptr=stream_ptr)
        assert view.ptr == a.ptr and view.device_id == a.device
        assert tuple(view.shape) == (3, 4) and view.dtype == np.dtype(F32)
        assert view.strides in (None, (4, 1)) and not view.readonly


def test_numpy_never_reads_device_memory_as_host_memory() -> None:
    a = gf.arange(N, dtype=F32).sync()
    with pytest.raises(Exception) as refused:
        np.from_dlpack(a)
    assert refused.type is not SystemError  # NumPy's own refusal, not a mangled one
    with pytest.raises(TypeError, match="device memory"):
        np.asarray(a)
    if np.lib.NumpyVersion(np.__version__) >= "2.1.0":
        # asking for the host explicitly copies there (and says it copied)
        assert np.array_equal(np.from_dlpack(a, device="cpu"), np.arange(N))
        capsule = a.__dlpack__(dl_device=(1, 0), max_version=(1, 0))
        assert _dlpack.read_capsule(capsule).copied
        with pytest.raises(BufferError):
            np.from_dlpack(a, device="cpu", copy=False)


@pytest.mark.anyio
async def test_a_host_copy_through_dlpack_is_refused_inside_an_event_loop() -> None:
    a = await gf.arange(N, dtype=F32)
    with pytest.raises(gf.UsageError, match="would block"):
        a.__dlpack__(dl_device=(1, 0))


def test_copy_true_exports_a_copy() -> None:
    a = gf.full(N, 1.0, F32).sync()
    capsule = a.__dlpack__(copy=True, max_version=(1, 0))
    assert _dlpack.read_capsule(capsule).copied
    b = gf.from_dlpack(capsule)
    assert b.ptr != a.ptr
    add(b, 1.0).sync()
    assert (gf.to_host(b).sync() == 2).all() and (gf.to_host(a).sync() == 1).all()


def test_an_export_that_copies_is_a_read_a_later_write_waits_for() -> None:
    """``__dlpack__(copy=True)`` copies on the stream of the array's last
    write, behind what that stream still runs: a write enqueued on another
    stream right after the export waits for the copy, which holds the value
    from before the write."""
    a = gf.full(N, 1.0, F32).sync()
    late_fill(gf.zeros(N, F32).sync(), 0.0).enqueue_on(a.allocation.writer)  # (the stream is busy)
    capsule = a.__dlpack__(copy=True, max_version=(1, 0))
    late_fill(a, 9.0, 0.0).enqueue_on(gf.new_stream())  # a write, right after the export
    b = gf.from_dlpack(capsule)
    assert (gf.to_host(b).sync() == 1).all()
    assert (gf.to_host(a).sync() == 9).all()


@pytest.mark.parametrize("copy", [False, True])
def test_a_capsule_handed_over_as_it_is_waits_for_its_producers_work(copy: bool) -> None:
    """A capsule asked for with no stream is ordered by its producer before
    the legacy default stream's later work (DLPack's meaning of no stream);
    gpuflow's streams do not wait for that stream by themselves, so the
    import's first use waits for it: here for a slow write still running,
    and for the copy behind it."""
    a = gf.zeros(N, F32).sync()
    late_fill(a, 5.0).enqueue_on(a.allocation.writer)  # (a write gpuflow knows of)
    b = gf.from_dlpack(a.__dlpack__(copy=copy, max_version=(1, 0)))
    assert (gf.to_host(b).sync() == 5).all()


def test_dlpack_refuses_what_it_cannot_do() -> None:
    a = gf.zeros(N, F32).sync()
    with pytest.raises(BufferError, match="device"):
        a.__dlpack__(dl_device=(2, 7))
    with pytest.raises(gf.UsageError, match="0 is ambiguous"):
        a.__dlpack__(stream=0)
    with pytest.raises(gf.UsageTypeError, match="stream must be an int"):
        a.__dlpack__(stream="default")  # type: ignore[arg-type]
    with pytest.raises(gf.UsageTypeError, match="max_version"):
        a.__dlpack__(max_version="1.0")  # type: ignore[arg-type]
    with pytest.raises(gf.UsageTypeError, match="copy"):
        a.__dlpack__(copy="yes")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_the_consumers_stream_waits_for_pending_writes_without_a_host_sync() -> None:
    fake = FakeLib()
    a = await gf.zeros(N, F32)
    writer = gf.new_stream()
    late_fill(a, 7.0).enqueue_on(writer)  # pending, slow, on another stream
    out = await gf.zeros(N, F32)
    fake.late_copy(a, out, seconds=0)  # takes a on its own stream, reads it at once
    assert not idle(writer)  # the export returned before the write finished: no host sync
    assert np.array_equal(await gf.to_host(out), np.full(N, 7, F32))


@pytest.mark.anyio
async def test_a_consumer_on_a_gpuflow_stream_waits_for_pending_writes() -> None:
    a = await gf.zeros(N, F32)
    writer = gf.new_stream()
    late_fill(a, 7.0).enqueue_on(writer)
    consumer = gf.new_stream()
    capsule = a.__dlpack__(stream=handle(consumer), max_version=(1, 0))
    assert not idle(writer)
    b = gf.from_dlpack(capsule)  # (a bare capsule brings no stream of its own)
    c = gf.copy(b).enqueue_on(consumer)  # the consumer reads on its stream
    assert np.array_equal(await gf.to_host(c), np.full(N, 7, F32))


@pytest.mark.anyio
async def test_an_export_to_one_of_gpuflows_streams_is_a_use_on_that_stream() -> None:
    a = await gf.zeros(N, F32)
    writer = gf.new_stream()
    late_fill(a, 7.0).enqueue_on(writer)

    def consume(ctx: gf.ExecutionContext) -> gf.DeviceOperation[gf.DeviceArray]:
        capsule = a.__dlpack__(stream=handle(ctx.stream), max_version=(1, 0))
        return gf.copy(gf.from_dlpack(capsule))  # read on ctx.stream, a pool stream

    assert np.array_equal(await gf.to_host(gf.with_context(consume)), np.full(N, 7, F32))


@pytest.mark.anyio
async def test_cai_names_a_stream_that_follows_every_use_so_far() -> None:
    a = await gf.full(N, 1.0, F32)
    reader, out = gf.new_stream(), await gf.zeros(N, F32)
    late_copy(a, out).enqueue_on(reader)  # a slow read of a, pending on another stream
    b = gf.from_dlpack(CaiOnly(a))  # the consumer waits on the stream the interface names...
    await add(b, 1.0)  # ...and writes: the slow read must still see 1
    assert np.array_equal(await gf.to_host(out), np.ones(N, F32))
    assert np.array_equal(await gf.to_host(a), np.full(N, 2, F32))


@pytest.mark.anyio
async def test_an_export_outlives_the_array_until_the_consumers_work_is_done() -> None:
    fake = FakeLib()
    a = await gf.full(N, 4.0, F32)
    out = await gf.zeros(N, F32)
    fake.late_copy(a, out)  # a slow read on its own stream; it lets go of both at once
    del a  # and gpuflow drops its array too: the memory must live until the read is done
    gc.collect()
    assert np.array_equal(await gf.to_host(out), np.full(N, 4, F32))
    assert testing.use_after_free_count() == 0


def test_an_array_exported_again_and_again_keeps_one_event_a_consumer_stream() -> None:
    fake = FakeLib()
    a, out = gf.full(N, 4.0, F32).sync(), gf.zeros(N, F32).sync()
    for _ in range(3):
        fake.late_copy(a, out, seconds=0)
    # the hazard state: the latest use of each stream covers the earlier ones
    assert len(a.allocation.foreign) == 1
    assert np.array_equal(gf.to_host(out).sync(), np.full(N, 4, F32))


def test_a_capsule_dropped_unconsumed_releases_the_memory() -> None:
    a = gf.full(N, 1.0, F32).sync()
    buffer: Any = a.allocation.buffer  # the backend's buffer, to see when it is freed
    capsule = a.__dlpack__()
    del a
    gc.collect()
    time.sleep(0.05)
    assert not buffer.freed  # the capsule keeps it
    del capsule
    gf.from_dlpack(gf.zeros(1, F32).sync())  # (dropped capsules are released at the next exchange)
    wait_until(lambda: buffer.freed, "the memory of a dropped capsule is freed")


@pytest.mark.sim_only
def test_a_consumer_whose_stream_is_gone_before_it_lets_go_leaks_rather_than_dangles() -> None:
    # sim: a destroyed stream's handle is refused (on CUDA using one is undefined)
    be = backend()
    a = gf.full(N, 1.0, F32).sync()
    buffer: Any = a.allocation.buffer
    consumer = be.create_stream(0)  # another library's stream
    capsule = a.__dlpack__(stream=be.stream_handle(consumer), max_version=(1, 0))
    owner = _dlpack.take_capsule(capsule, _dlpack.read_capsule(capsule))
    del a, capsule
    gc.collect()
    be.destroy_stream(consumer)  # the library destroys its stream while it holds the array
    with pytest.warns(UserWarning, match="leaked rather than freed"):
        del owner
    gc.collect()
    gf.zeros(1, F32).sync()
    assert not buffer.freed


# -- arrays in -----------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("protocol", ["dlpack", "cai"])
async def test_the_first_use_of_an_import_waits_for_the_producers_work(protocol: str) -> None:
    a = await gf.zeros(N, F32)
    writer = gf.new_stream()
    late_fill(a, 7.0).enqueue_on(writer)  # the producer's pending, slow write
    b = gf.from_dlpack(DlpackOnly(a) if protocol == "dlpack" else CaiOnly(a))
    assert np.array_equal(await gf.to_host(b), np.full(N, 7, F32))


@pytest.mark.anyio
async def test_a_first_use_waits_for_its_own_producer_not_for_later_imports() -> None:
    a, b = await gf.zeros(N, F32), await gf.zeros(N, F32)
    late_fill(a, 7.0).enqueue_on(gf.new_stream())  # the first producer: SLOW
    late_fill(b, 8.0, 3 * SLOW).enqueue_on(gf.new_stream())  # the second: far longer
    x = gf.from_dlpack(DlpackOnly(a))  # the interop stream waits for the first...
    y = gf.from_dlpack(DlpackOnly(b))  # ...then for the second
    t0 = time.perf_counter()
    assert np.array_equal(await gf.to_host(x), np.full(N, 7, F32))
    took = time.perf_counter() - t0
    assert took < 2 * SLOW, f"x's first use waited {took:.2f} s, for the later import's producer"
    assert np.array_equal(await gf.to_host(y), np.full(N, 8, F32))


@pytest.mark.anyio
async def test_an_import_does_not_wait_for_the_uses_of_another() -> None:
    first, second = await gf.full(N, 1.0, F32), await gf.full(N, 2.0, F32)
    a = gf.from_dlpack(CaiOnly(first))
    reader, out = gf.new_stream(), await gf.zeros(N, F32)
    late_copy(a, out).enqueue_on(reader)  # a long use of the first import ...
    del a  # ... whose producer is released after it
    gc.collect()
    gf.memory_stats()  # (runs the queued release now, before the second import)
    b = gf.from_dlpack(CaiOnly(second))
    assert np.array_equal(await gf.to_host(b), np.full(N, 2, F32))
    assert not idle(reader)  # the second import's use did not wait for the first's
    read = await gf.to_host(gf.wait_stream(reader).map(lambda _: out))
    assert np.array_equal(read, np.ones(N, F32))


@pytest.mark.anyio
async def test_the_producer_side_can_be_ordered_after_gpuflows_writes() -> None:
    fake = FakeLib()
    a = await gf.zeros(N, F32)
    b = gf.from_dlpack(a)
    late_fill(b, 7.0).enqueue_on(gf.new_stream())  # gpuflow writes the import, slowly
    out = await gf.zeros(N, F32)
    fake.late_copy(b, out, seconds=0)  # taken back through DLPack: after gpuflow's write
    assert np.array_equal(await gf.to_host(out), np.full(N, 7, F32))


def test_a_cai_producer_is_released_only_after_gpuflows_uses() -> None:
    backing = gf.full(N, 3.0, F32).sync()
    producer = CaiOnly(backing)
    released = weakref.ref(producer)
    b = gf.from_dlpack(producer)
    out, reader = gf.zeros(N, F32).sync(), gf.new_stream()
    start = time.monotonic()
    late_copy(b, out).enqueue_on(reader)  # gpuflow reads it, slowly
    del producer, backing, b  # the user drops everything but the read in flight
    gc.collect()
    assert released() is not None, "the producer was released while gpuflow reads its memory"
    assert not idle(reader)  # (the read is indeed still running)
    wait_until(lambda: released() is None, "the producer is released")
    assert time.monotonic() - start >= SLOW - EARLY
    assert np.array_equal(gf.to_host(out).sync_on(reader), np.full(N, 3, F32))


def test_a_dlpack_producers_memory_lives_until_gpuflows_uses_are_done() -> None:
    src = gf.full(N, 3.0, F32).sync()
    buffer: Any = src.allocation.buffer
    b = gf.from_dlpack(src)
    out, reader = gf.zeros(N, F32).sync(), gf.new_stream()
    start = time.monotonic()
    late_copy(b, out).enqueue_on(reader)
    del src, b
    gc.collect()
    assert not buffer.freed and not idle(reader)
    wait_until(lambda: buffer.freed, "the producer's memory is freed once gpuflow is done")
    assert time.monotonic() - start >= SLOW - EARLY
    assert np.array_equal(gf.to_host(out).sync_on(reader), np.full(N, 3, F32))


def test_read_only_memory_is_only_read() -> None:
    a = gf.full(N, 2.0, F32).sync()
    ro = gf.from_dlpack(CaiOnly(a, data=(a.ptr, True)))
    assert ro.readonly and not a.readonly
    with pytest.raises(gf.UsageError, match="read-only"):
        add(ro, 1.0).sync()
    with pytest.raises(gf.UsageError, match="read-only"):
        gf.copy(a, out=ro).sync()
    assert np.array_equal(gf.to_host(gf.copy(ro)).sync(), np.full(N, 2, F32))
    assert ro.__cuda_array_interface__["data"][1] is True
    assert _dlpack.read_capsule(ro.__dlpack__(max_version=(1, 0))).readonly


def versioned_capsule(a: gf.DeviceArray, flags: int) -> tuple[Any, Any]:
    """A DLPack 1.0 capsule of ``a``'s memory with ``flags``, as another producer
    makes it (no deleter: ``a`` owns the memory); and its struct, which must
    outlive the capsule's import."""
    shape = (ctypes.c_int64 * 1)(a.size)
    managed = _dlpack.DLManagedTensorVersioned()
    managed.version = _dlpack.DLPackVersion(1, 0)
    managed.flags = flags
    t = managed.dl_tensor
    t.data, t.device, t.ndim = a.ptr, _dlpack.DLDevice(2, a.device), 1
    t.dtype = _dlpack.DLDataType(2, 32, 1)  # float32
    t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    capsule = _new_capsule(ctypes.addressof(managed), b"dltensor_versioned", None)
    return capsule, (managed, shape)


def test_a_read_only_dlpack_import_is_only_read() -> None:
    a = gf.full(N, 2.0, F32).sync()
    capsule, _struct = versioned_capsule(a, _dlpack.FLAG_READ_ONLY)
    ro = gf.from_dlpack(capsule)
    ro_cai = gf.from_dlpack(CaiOnly(a, data=(a.ptr, True)))
    # a producer of read-only memory speaking DLPack (as JAX's arrays do)
    ro_producer = gf.from_dlpack(DlpackOnly(ro_cai))
    for b in (ro, ro_producer):
        assert b.ptr == a.ptr and b.readonly
        with pytest.raises(gf.UsageError, match="read-only"):
            add(b, 1.0).sync()
        with pytest.raises(gf.UsageError, match="read-only"):
            gf.copy(a, out=b).sync()
        assert np.array_equal(gf.to_host(gf.copy(b)).sync(), np.full(N, 2, F32))
    # the flag decides, not the memory: the same capsule without it is writable
    capsule, _struct = versioned_capsule(a, 0)
    rw = gf.from_dlpack(capsule)
    assert not rw.readonly
    add(rw, 1.0).sync()
    assert np.array_equal(gf.to_host(a).sync(), np.full(N, 3, F32))


def test_from_dlpack_refuses_host_memory() -> None:
    class HostArray:
        def __dlpack__(self, **kwargs: Any) -> Any:
            raise AssertionError("the device is checked first")

        def __dlpack_device__(self) -> tuple[int, int]:
            return (3, 0)  # kDLCUDAHost: pinned host memory

    with pytest.raises(gf.UsageError, match=r"host memory.*gf\.from_host"):
        gf.from_dlpack(np.arange(4.0))
    with pytest.raises(gf.UsageError, match="host memory"):
        gf.from_dlpack(HostArray())


def test_from_dlpack_refuses_memory_of_a_device_it_does_not_use() -> None:
    class Elsewhere:
        def __dlpack__(self, **kwargs: Any) -> Any:
            raise AssertionError("the device is checked first")

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 9)

    with pytest.raises(gf.UsageError, match="device 9, which gpuflow does not use"):
        gf.from_dlpack(Elsewhere())


def test_from_dlpack_refuses_a_dtype_it_cannot_pass_and_leaves_the_capsule() -> None:
    a = gf.zeros(N, np.uint16).sync()
    shape = (ctypes.c_int64 * 1)(N)
    managed = _dlpack.DLManagedTensor()  # what a producer of bfloat16 hands over
    t = managed.dl_tensor
    t.data, t.device, t.ndim = a.ptr, _dlpack.DLDevice(2, a.device), 1
    t.dtype = _dlpack.DLDataType(4, 16, 1)  # kDLBfloat
    t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    capsule = _new_capsule(ctypes.addressof(managed), b"dltensor", None)
    with pytest.raises(gf.UsageError, match="bfloat16 has no gpuflow dtype"):
        gf.from_dlpack(capsule)
    assert capsule_name(capsule) == "dltensor"  # still the producer's


def test_from_dlpack_refuses_what_it_cannot_wrap() -> None:
    a = gf.zeros((4, 4), F32).sync()
    with pytest.raises(gf.UsageError, match="not C-contiguous"):
        gf.from_dlpack(CaiOnly(a, strides=(4, 16)))  # Fortran order
    assert gf.from_dlpack(CaiOnly(a, strides=(16, 4))).ptr == a.ptr  # C order, spelt out
    with pytest.raises(gf.UsageError, match="masked"):
        gf.from_dlpack(CaiOnly(a, mask=a))
    with pytest.raises(gf.UsageError, match="not"):
        gf.from_dlpack(CaiOnly(a, data=(4096, False)))  # no device memory there
    with pytest.raises(gf.UsageTypeError, match="__dlpack__ or __cuda_array_interface__"):
        gf.from_dlpack(3)


@pytest.mark.sim_only
def test_sim_addresses_and_handles_map_back() -> None:
    # a property of the simulator: a foreign pointer is a view of a live
    # buffer, past its end or after its free it is refused; a stream handle is
    # its stream
    be = backend()
    a = gf.arange(N, dtype=F32).sync()
    view: Any = be.foreign_buffer(a.ptr + 16, 32, a.device)
    assert np.array_equal(view.data.view(F32), np.arange(4, 12, dtype=F32))
    with pytest.raises(gf.UsageError, match="past the end"):
        be.foreign_buffer(a.ptr + 16, a.nbytes, a.device)
    with pytest.raises(gf.UsageError, match="device 1"):
        be.foreign_buffer(a.ptr, 16, 1)
    s = gf.new_stream()
    assert be.foreign_stream(handle(s), 0) == (s.raw, 0)
    buffer: Any = a.allocation.buffer
    ptr = a.ptr
    del a
    gc.collect()
    wait_until(lambda: buffer.freed, "the buffer is freed")
    with pytest.raises(gf.UsageError, match="not in a live buffer"):
        be.foreign_buffer(ptr, 16, 0)


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
    await does not take the straight line."""
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

    stream = None

    def __init__(self) -> None:
        self.runs: list[gf.lowlevel.Run] = []

    def track(self, sub: gf.lowlevel.Run) -> None:
        self.runs.append(sub)


@pytest.mark.anyio
async def test_a_refused_wait_stream_leaves_no_run_in_flight() -> None:
    """A wait refused before anything was enqueued (its stream is being
    captured) is a run that ended: a scope that tracked it would otherwise
    wait for it for ever (a stream lease's exit, which is shielded)."""
    from gpuflow._core._run import enter_scope, leave_scope

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
    from gpuflow._core._runtime import get_runtime

    fake = FakeLib()
    rt = get_runtime()
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
    from gpuflow._core._runtime import get_runtime

    rt = get_runtime()
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
