"""Device arrays and the operations that make, fill and move them."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import kernels as K

import gpuflow as gf

pytestmark = pytest.mark.anyio

DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    np.int32,
    np.int64,
    np.uint8,
    np.int8,
    np.uint64,
    bool,
]


async def test_device_array_attributes() -> None:
    x = await gf.zeros((3, 4), np.float32)
    assert isinstance(x, gf.DeviceArray)
    assert x.shape == (3, 4) and x.dtype == np.dtype(np.float32)
    assert x.nbytes == 48 and x.size == 12 and x.ndim == 2 and len(x) == 3
    assert x.device == 0
    y = await gf.ones(7, np.int64)
    assert y.shape == (7,) and y.dtype == np.int64 and y.nbytes == 56
    assert (await gf.zeros((), np.int16)).shape == ()
    assert (await gf.zeros(0, np.float32)).nbytes == 0
    r = x.reshape(2, 6)
    assert r.shape == (2, 6) and r.dtype == x.dtype
    with pytest.raises(gf.UsageError, match="reshape"):
        x.reshape(5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
async def test_zeros_ones_full_match_numpy(dtype: type) -> None:
    dt = np.dtype(dtype)
    shape = (2, 3)
    fill = {"f": 2.5, "i": -7, "u": 200, "b": True}[dt.kind]
    z, o, f = await gf.zip(gf.zeros(shape, dt), gf.ones(shape, dt), gf.full(shape, fill, dt))
    for arr, want in [
        (z, np.zeros(shape, dt)),
        (o, np.ones(shape, dt)),
        (f, np.full(shape, fill, dt)),
    ]:
        assert arr.dtype == dt and arr.shape == shape
        got = await gf.to_host(arr)
        assert got.dtype == dt
        np.testing.assert_array_equal(got, want, strict=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
async def test_empty_and_the_like_functions_match_numpy(dtype: type) -> None:
    dt = np.dtype(dtype)
    host = np.arange(6).astype(dt).reshape(2, 3)
    x = await gf.from_host(host)
    fill = {"f": 2.5, "i": -7, "u": 200, "b": True}[dt.kind]
    e = await gf.empty((2, 3), dt)
    assert (e.shape, e.dtype) == ((2, 3), dt)
    for like in (x, host):  # a device array, or a NumPy one
        z, o, f, e = await gf.zip(gf.zeros_like(like), gf.ones_like(like),
                                  gf.full_like(like, fill), gf.empty_like(like))
        for arr, want in [(z, np.zeros_like(host)), (o, np.ones_like(host)),
                          (f, np.full_like(host, fill))]:
            np.testing.assert_array_equal(await gf.to_host(arr), want, strict=True)
        assert (e.shape, e.dtype) == (host.shape, dt)
    # dtype and shape given replace the array's, as NumPy's
    y = await gf.zeros_like(x, dtype=np.int16, shape=(3, 4))
    assert (y.shape, y.dtype) == ((3, 4), np.dtype(np.int16))
    # an empty array written whole reads back what was written
    w = await gf.copy(x, out=await gf.empty_like(x))
    np.testing.assert_array_equal(await gf.to_host(w), host, strict=True)


async def test_the_like_functions_refuse_what_has_no_shape_and_dtype() -> None:
    with pytest.raises(gf.UsageTypeError, match=r"zeros_like\(\) takes an array .* got list"):
        gf.zeros_like([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(gf.UsageError, match=r"fill value 300 does not fit dtype uint8"):
        gf.full_like(np.zeros(2, np.uint8), 300)
    with pytest.raises(gf.UsageError, match="has a negative dimension"):
        gf.empty(-1)


async def test_defaults_follow_numpy() -> None:
    assert (await gf.zeros(2)).dtype == np.zeros(2).dtype
    assert (await gf.ones(2)).dtype == np.ones(2).dtype
    for v in (3, 2.5, True):
        a = await gf.full(2, v)
        assert a.dtype == np.full(2, v).dtype
        np.testing.assert_array_equal(await gf.to_host(a), np.full(2, v), strict=True)
    assert (await gf.arange(5)).dtype == np.arange(5).dtype
    assert (await gf.arange(0.5, 3)).dtype == np.arange(0.5, 3).dtype


async def test_full_refuses_values_the_dtype_cannot_hold() -> None:
    for value, dtype in [
        (300, np.uint8),
        (-1, np.uint8),
        (1.5, np.int32),
        (2**40, np.int32),
        (1e300, np.float32),
        (float("nan"), np.int64),
        (2, bool),
        ("x", np.float32),
    ]:
        refused = rf"fill value {re.escape(repr(value))} does not fit dtype {np.dtype(dtype)}"
        with pytest.raises(gf.UsageError, match=refused):
            gf.full(3, value, dtype)
    with pytest.raises(gf.UsageError, match="dtype object cannot live on the device"):
        gf.zeros(3, object)
    with pytest.raises(gf.UsageError, match=r"shape \(-1,\) has a negative dimension"):
        gf.zeros(-1)
    with pytest.raises(gf.UsageError, match="shape must be an int or a sequence of ints"):
        gf.zeros("big")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "dtype"),
    [
        ((10,), np.int32),
        ((-5, 100, 7), np.int64),
        ((0, 200, 3), np.uint8),
        ((0, 1, 0.125), np.float32),
        ((1.5, 10, 0.5), np.float64),
        ((0, 64), np.float16),
        ((10, 0, -3), np.int32),
        ((5, 5), np.float64),
    ],
)
async def test_arange_matches_numpy(args: tuple[float, ...], dtype: type) -> None:
    a = await gf.arange(*args, dtype=dtype)
    want = np.arange(*args, dtype=dtype)
    assert a.shape == want.shape and a.dtype == want.dtype
    np.testing.assert_array_equal(await gf.to_host(a), want, strict=True)


async def test_arange_refuses_a_zero_step() -> None:
    with pytest.raises(gf.UsageError, match="step must not be zero"):
        gf.arange(0, 10, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
async def test_from_host_to_host_round_trip(dtype: type) -> None:
    rng = np.random.default_rng(7)
    host = (rng.integers(0, 100, size=(4, 5)) % (2 if dtype is bool else 100)).astype(dtype)
    back = await gf.to_host(gf.from_host(host))
    assert back is not host
    np.testing.assert_array_equal(back, host, strict=True)


async def test_round_trip_of_non_contiguous_and_odd_inputs() -> None:
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    for view in (base[::2, 1::3], base.T, base[:, 4], np.asfortranarray(base)):
        assert not view.flags.c_contiguous or view is base
        x = await gf.from_host(view)
        assert x.shape == view.shape
        np.testing.assert_array_equal(await gf.to_host(x), view, strict=True)
    np.testing.assert_array_equal(
        await gf.to_host(gf.from_host([[1, 2], [3, 4]])), [[1, 2], [3, 4]]
    )
    empty = await gf.to_host(gf.from_host(np.zeros((0, 3), np.int32)))
    assert empty.shape == (0, 3) and empty.dtype == np.int32
    scalar = await gf.to_host(gf.from_host(np.float32(2.5)))
    assert scalar.shape == () and scalar == np.float32(2.5)
    with pytest.raises(gf.UsageError, match="dtype <U1 cannot live on the device"):
        gf.from_host(np.array(["a", "b"]))


async def test_to_host_of_an_array_or_an_operation() -> None:
    x = await gf.arange(6, dtype=np.int32)
    np.testing.assert_array_equal(await gf.to_host(x), np.arange(6, dtype=np.int32))
    np.testing.assert_array_equal(
        await gf.to_host(gf.arange(6, dtype=np.int32)), np.arange(6, dtype=np.int32)
    )
    with pytest.raises(gf.UsageError, match=r"to_host needs a DeviceArray.*got int"):
        await gf.to_host(gf.value(3))  # type: ignore[arg-type]


async def test_copy_into_a_new_array_and_into_out() -> None:
    src = await gf.from_host(np.arange(12, dtype=np.int64).reshape(3, 4))
    dup = await gf.copy(src)
    assert dup is not src and dup.ptr != src.ptr
    assert dup.shape == (3, 4) and dup.dtype == np.int64 and dup.device == 0
    out = await gf.zeros((3, 4), np.int64)
    res = await gf.copy(src, out=out)
    assert res is out
    want = np.arange(12, dtype=np.int64).reshape(3, 4)
    np.testing.assert_array_equal(await gf.to_host(dup), want)
    np.testing.assert_array_equal(await gf.to_host(out), want)
    # the copy is independent of its source afterwards
    await gf.copy(gf.zeros((3, 4), np.int64), out=src)
    np.testing.assert_array_equal(await gf.to_host(dup), want)
    # sources and outs may be operations
    chained = await gf.to_host(gf.copy(gf.arange(4, dtype=np.int32), out=gf.zeros(4, np.int32)))
    np.testing.assert_array_equal(chained, [0, 1, 2, 3])


async def test_copy_waits_for_the_write_it_reads() -> None:
    # the write and the copy on different streams: queue order alone cannot
    # put the copy after the write, only the array's cross-stream wait does
    n = 256
    writer, reader = gf.SingleStream(), gf.SingleStream()
    assert writer.stream != reader.stream
    x = await gf.zeros(n, np.float32).run(writer)
    K.slow_fill(x, 6.0, 0.1).enqueue_on(writer.stream)  # still running when the copy is enqueued
    dup = await gf.copy(x).run(reader)
    np.testing.assert_array_equal(await gf.to_host(dup).run(reader), np.full(n, 6, np.float32))


async def test_copy_to_another_device() -> None:
    if K.num_devices() < 2:
        pytest.skip("needs two devices")
    src = await gf.from_host(np.arange(10, dtype=np.float32))
    on1 = await gf.copy(src, device=1)
    assert on1.device == 1 and on1.shape == (10,) and on1.dtype == np.float32
    policy = gf.SingleStream(device=1)
    np.testing.assert_array_equal(
        await gf.to_host(on1).run(policy), np.arange(10, dtype=np.float32)
    )
    # and back, into an existing array on device 0
    out = await gf.zeros(10, np.float32)
    await gf.copy(gf.copy(on1, device=0), out=out).run(policy)
    np.testing.assert_array_equal(await gf.to_host(out), np.arange(10, dtype=np.float32))
    # to_host copies from the array's device, whichever device the run is on
    assert gf.current_device() == 0
    np.testing.assert_array_equal(await gf.to_host(on1), np.arange(10, dtype=np.float32))
    np.testing.assert_array_equal(
        await gf.to_host(gf.copy(src, device=1)), np.arange(10, dtype=np.float32)
    )
    # a policy bound to device 0 (its stream cannot take the copy); an empty array
    np.testing.assert_array_equal(
        await gf.to_host(on1).run(gf.SingleStream(device=0)), np.arange(10, dtype=np.float32)
    )
    empty = await gf.zeros(0, np.float32).run(policy)
    assert (await gf.to_host(empty)).shape == (0,)
    # the copy waits for the array's last write, on its device
    with gf.use_device(1):
        K.slow_fill(on1, 6.0, 0.05).enqueue_on(gf.new_stream())  # still running
    np.testing.assert_array_equal(await gf.to_host(on1), np.full(10, 6, np.float32))


def test_to_host_of_another_devices_array_blocking() -> None:
    if K.num_devices() < 2:
        pytest.skip("needs two devices")
    on1 = gf.copy(gf.arange(4, dtype=np.float32), device=1).sync()
    want = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(gf.to_host(on1).sync(), want)
    np.testing.assert_array_equal(gf.to_host(on1).sync_on(gf.new_stream(0)), want)


async def test_copy_refuses_mismatched_out() -> None:
    src = await gf.zeros((2, 3), np.float32)
    with pytest.raises(gf.UsageError, match=r"out is \(3, 2\) float32, the source \(2, 3\)"):
        await gf.copy(src, out=gf.zeros((3, 2), np.float32))
    with pytest.raises(gf.UsageError, match=r"out is \(2, 3\) float64, the source \(2, 3\)"):
        await gf.copy(src, out=gf.zeros((2, 3), np.float64))
    with pytest.raises(gf.UsageError, match="device must be a device ordinal, not -1"):
        gf.copy(src, device=-1)


async def test_out_of_memory_is_reported_and_not_sticky() -> None:
    huge = 1 << 44  # 16 TiB: more than any device has (sim devices have 2 GiB)
    oom = rf"out of memory on \w+ device 0: {huge} bytes requested"
    with pytest.raises(gf.OutOfMemoryError, match=oom) as info:
        await gf.zeros(huge, np.uint8)
    err = info.value
    assert isinstance(err, gf.DeviceError)
    assert err.code == 2 and err.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(err)
    # not sticky: the device works on
    x = await gf.full(1000, 3, np.int32)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(1000, 3, np.int32))


@pytest.mark.sim_only
async def test_out_of_memory_just_above_the_sim_device_size() -> None:
    with pytest.raises(gf.OutOfMemoryError, match="out of memory"):
        await gf.zeros(3 << 30, np.uint8)
    await gf.zeros(1 << 20, np.uint8)
