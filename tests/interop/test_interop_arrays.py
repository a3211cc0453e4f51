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
``DeviceArray._allocation`` shows the hazard state and the backend's buffer, to see
when it is freed.
"""

from __future__ import annotations

import ctypes
import gc
import time
import weakref
from typing import Any

import numpy as np
import pytest
from helpers.interop import (
    EARLY,
    F32,
    SLOW,
    CaiOnly,
    DlpackOnly,
    FakeLib,
    N,
    _new_capsule,
    add,
    backend,
    capsule_name,
    handle,
    idle,
    late_copy,
    late_fill,
    wait_until,
)

import gpuflow as gf
from gpuflow import testing
from gpuflow._memory import _dlpack

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
    late_fill(gf.zeros(N, F32).sync(), 0.0).enqueue_on(a._allocation.writer)  # (the stream is busy)
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
    late_fill(a, 5.0).enqueue_on(a._allocation.writer)  # (a write gpuflow knows of)
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
    assert len(a._allocation.foreign) == 1
    assert np.array_equal(gf.to_host(out).sync(), np.full(N, 4, F32))


def test_a_capsule_dropped_unconsumed_releases_the_memory() -> None:
    a = gf.full(N, 1.0, F32).sync()
    buffer: Any = a._allocation.buffer  # the backend's buffer, to see when it is freed
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
    buffer: Any = a._allocation.buffer
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
    buffer: Any = src._allocation.buffer
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
    buffer: Any = a._allocation.buffer
    ptr = a.ptr
    del a
    gc.collect()
    wait_until(lambda: buffer.freed, "the buffer is freed")
    with pytest.raises(gf.UsageError, match="not in a live buffer"):
        be.foreign_buffer(ptr, 16, 0)


