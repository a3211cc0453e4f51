"""The ``cuda`` backend method by method, below the front end (a CUDA device only).

Each test drives a :class:`CudaBackend` of its own (not the runtime's) through
the backend interface: streams, copies (direct and through pinned staging),
fill and arange for every dtype, kernel arguments, events, the completion
marks (``marks="word"``, the GPU writing a word in host memory, and
``"event"``) and the pipe the GPU closes, out-of-memory and bad launches that
must not be sticky, graph capture, launch cost against the raw driver, how
long a mark or a host function holds its stream, and a sticky fault.

Raw-driver baselines load the same CUBIN through cuda.bindings themselves, in
the same primary context.  Measurements are printed (``pytest -rP`` shows them).
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import gpuflow as gf
from gpuflow import DeviceFaultError, LaunchError, OutOfMemoryError, UsageError
from gpuflow._backends._cuda import CudaBackend  # the backend itself is under test
from gpuflow.lowlevel import PointerArg

pytestmark = pytest.mark.cuda_only

SRC = r"""
extern "C" __global__ void empty() {}
extern "C" __global__ void spin(long long ns) {  // busy for ns of wall-clock time
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < (unsigned long long)ns);
}
extern "C" __global__ void saxpy(const float* x, float* y, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void add1(float* p, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] += 1.0f;
}
extern "C" __global__ void mix(double* out, long long a, double b, unsigned char c, short d,
                               unsigned long long e, float f, bool g, signed char h) {
  out[0] = (double)a; out[1] = b; out[2] = c; out[3] = d; out[4] = (double)e;
  out[5] = f; out[6] = g ? 1.0 : 0.0; out[7] = h;
}
extern "C" __global__ void four(const float* a, float* b, int n, float s) {
  if (threadIdx.x == 0 && blockIdx.x == 0) b[0] = s + (float)n;
}
extern "C" __global__ void bad(int* p) { p[threadIdx.x] = 1; }
"""
KERNELS = ("empty", "spin", "saxpy", "add1", "mix", "four", "bad")
MS = 1_000_000  # ns: the spin kernel's unit
MARKS = ("word", "event")
Arg = PointerArg | np.generic

#: a gpuflow module is what ``load_kernel`` needs (a ModuleSource): source and binary_for
MOD = gf.compile(SRC)


@dataclass
class Cuda:
    be: CudaBackend
    k: dict[str, Any]  # the kernels of SRC on device 0


def _open(marks: str) -> Cuda:
    be = CudaBackend(None, marks=marks)
    return Cuda(be, {name: be.load_kernel(0, MOD, name) for name in KERNELS})


@pytest.fixture(scope="module")
def _opened() -> Iterator[dict[str, Cuda]]:
    # filled on first use, inside a test: on a machine without a device the
    # tests are skipped before any backend is made
    opened: dict[str, Cuda] = {}
    yield opened
    for c in opened.values():
        c.be.close()


@pytest.fixture
def cuda_for(device_backend: str, _opened: dict[str, Cuda]) -> Callable[[str], Cuda]:
    """A backend of the given kind of marks, shared by this module's tests."""

    def get(marks: str) -> Cuda:
        if marks not in _opened:
            _opened[marks] = _open(marks)
        return _opened[marks]

    return get


@pytest.fixture
def cuda(cuda_for: Callable[[str], Cuda]) -> Cuda:
    return cuda_for("word")


def pipe_closed(r: int, timeout: float) -> bool:
    """Whether the write end of the pipe whose read end is ``r`` gets closed in time."""
    import select

    poller = select.poll()
    poller.register(r, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def measure(name: str, value: float, unit: str) -> None:
    print(f"  measured {name}: {value:.3f} {unit}", flush=True)


def ptr(buf: Any, dtype: Any, count: int, writes: bool = True) -> PointerArg:
    return PointerArg(buf, np.dtype(dtype), count, writes)


def blocks(n: int, t: int = 256) -> tuple[int, int, int]:
    return ((n + t - 1) // t, 1, 1)


def to_host(be: CudaBackend, buf: Any, dtype: Any, count: int, stream: Any) -> np.ndarray:
    out = np.empty(count, dtype=dtype)
    be.copy_to_host(out, buf, stream)
    be.synchronize(stream)
    return out


def from_host(be: CudaBackend, arr: np.ndarray, stream: Any) -> Any:
    buf = be.alloc(0, arr.nbytes, stream)
    be.copy_from_host(buf, np.ascontiguousarray(arr), stream)
    return buf


def _ok(res: tuple[Any, ...]) -> Any:
    assert int(res[0]) == 0, f"driver call failed: {res[0]}"
    return res[1] if len(res) == 2 else res[1:]


class RawDriver:
    """Device 0's primary context (the backend's own), current on this thread,
    with SRC's CUBIN loaded straight through cuda.bindings."""

    def __init__(self, be: CudaBackend) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.cudev = _ok(cu.cuDeviceGet(0))
        self.ctx = _ok(cu.cuDevicePrimaryCtxRetain(self.cudev))
        _ok(cu.cuCtxSetCurrent(self.ctx))
        self.module = _ok(cu.cuModuleLoadData(MOD.binary_for(be.device_arch(0))))

    def function(self, name: str) -> Any:
        return _ok(self.cu.cuModuleGetFunction(self.module, name.encode()))

    def close(self) -> None:
        self.cu.cuModuleUnload(self.module)
        self.cu.cuDevicePrimaryCtxRelease(self.cudev)


# -- checks -----------------------------------------------------------------------------
def test_devices_streams_and_kernel_loading(cuda: Cuda) -> None:
    be = cuda.be
    assert be.device_count >= 1
    name = be.device_name(0)
    assert isinstance(name, str) and name
    assert be.device_arch(0).startswith("sm_")
    s = be.create_stream(0)
    h = be.stream_handle(s)
    assert isinstance(h, int) and h != 0
    assert be.query(s) is True  # a fresh stream is idle
    for k in KERNELS:
        be.load_kernel(0, MOD, k)
    with pytest.raises(gf.DeviceError, match="'nope' not found in its module"):
        be.load_kernel(0, MOD, "nope")
    be.destroy_stream(s)
    be.destroy_stream(s)  # twice: no error


def test_copies_direct_and_staged(cuda: Cuda) -> None:
    be = cuda.be
    s = be.create_stream(0)
    for n in (1000, 4 << 20):  # direct (4 KB) and staged (16 MB) host-to-device paths
        a = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        buf = from_host(be, a, s)
        np.testing.assert_array_equal(to_host(be, buf, np.float32, n, s), a)
        buf2 = be.alloc(0, a.nbytes, s)
        be.copy_device(buf2, buf, a.nbytes, s)
        np.testing.assert_array_equal(to_host(be, buf2, np.float32, n, s), a)
        be.free(buf, s)
        be.free(buf2, s)
        be.free(buf2, s)  # twice: ignored
    # a staged device-to-host copy is delivered once its mark is seen reached
    # (complete_transfers: the bridge's path), not only by synchronize
    n = 1 << 20
    a = np.arange(n, dtype=np.int32)
    buf = from_host(be, a, s)
    be.synchronize(s)
    out = np.zeros(n, dtype=np.int32)
    be.launch(cuda.k["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(20 * MS)], s)
    be.copy_to_host(out, buf, s)
    number = be.mark(s)
    read = be.completion_reader(s)
    deadline = time.monotonic() + 5
    while read() < number and time.monotonic() < deadline:
        time.sleep(0.001)
    assert read() == number
    be.complete_transfers(s)
    np.testing.assert_array_equal(out, a)
    # and by another stream's synchronize (a completion seen across streams)
    s2 = be.create_stream(0)
    out2 = np.zeros(n, dtype=np.int32)
    be.copy_to_host(out2, buf, s)
    ev = be.record_event(s)
    be.wait_event(s2, ev)
    be.synchronize(s2)
    np.testing.assert_array_equal(out2, a)
    be.free(buf, s)
    be.synchronize(s)
    be.destroy_stream(s)
    be.destroy_stream(s2)


def test_fill_and_arange_are_bit_exact_for_every_dtype(cuda: Cuda) -> None:
    be = cuda.be
    s = be.create_stream(0)
    count = 3000
    fills: list[np.generic] = [
        np.float16(1.5), np.float32(-2.25), np.float64(3.5), np.float64(0.0),
        np.int8(-3), np.int16(-300), np.int32(123456), np.int64(-5), np.int64(-1),
        np.uint8(200), np.uint16(60000), np.uint32(4_000_000_000), np.uint64(2**63 + 5),
        np.bool_(True), np.complex64(1 + 2j),
    ]  # fmt: skip
    wrong = []
    for v in fills:
        buf = be.alloc(0, (count + 1) * v.itemsize, s)
        be.fill(buf, v.dtype.type(0), count + 1, s)
        be.fill(buf, v, count, s)  # the last element keeps its zero
        got = to_host(be, buf, v.dtype, count + 1, s)
        exp = np.full(count + 1, v, dtype=v.dtype)
        exp[-1] = 0
        if not np.array_equal(got.view(np.uint8), exp.view(np.uint8)):
            wrong.append(str(v.dtype))
        be.free(buf, s)
    assert not wrong, f"fill wrong for {wrong}"
    cases: list[tuple[np.generic, np.generic]] = [
        (np.float16(-3.0), np.float16(0.1)), (np.float32(0.5), np.float32(0.1)),
        (np.float64(-1.0), np.float64(1e-3)), (np.int8(-100), np.int8(3)),
        (np.int16(7), np.int16(-11)), (np.int32(-5), np.int32(1000)),
        (np.int64(2**40), np.int64(-3)), (np.uint8(250), np.uint8(1)),
        (np.uint16(1), np.uint16(31)), (np.uint32(5), np.uint32(7)),
        (np.uint64(2**63), np.uint64(2**40 + 1)), (np.bool_(False), np.bool_(True)),
        (np.bool_(True), np.bool_(False)),
    ]  # fmt: skip
    wrong = []
    for start, step in cases:
        dt = start.dtype
        buf = be.alloc(0, count * dt.itemsize, s)
        be.arange(buf, start, step, count, s)
        got = to_host(be, buf, dt, count, s)
        with np.errstate(all="ignore"):
            exp = start + np.arange(count).astype(dt) * step
        diff = int(np.count_nonzero(got.view(np.uint8) != exp.view(np.uint8)))
        if diff:
            wrong.append(f"{dt}: {diff} bytes differ")
        be.free(buf, s)
    assert not wrong, "arange not bit-exact against NumPy: " + "; ".join(wrong)
    be.destroy_stream(s)


def test_kernel_arguments_and_a_launch_from_a_new_thread(cuda: Cuda) -> None:
    be, k = cuda.be, cuda.k
    s = be.create_stream(0)
    n = 10000
    x = np.arange(n, dtype=np.float32)
    bx = from_host(be, x, s)
    by = from_host(be, np.ones(n, np.float32), s)
    args: list[Arg] = [
        ptr(bx, np.float32, n, False), ptr(by, np.float32, n), np.float32(2.5), np.int32(n),
    ]  # fmt: skip
    be.launch(k["saxpy"], blocks(n), (256, 1, 1), 0, args, s)
    y = to_host(be, by, np.float32, n, s)
    np.testing.assert_allclose(y, 2.5 * x + 1, rtol=1e-6)
    bo = be.alloc(0, 8 * 8, s)
    mixed: list[Arg] = [
        ptr(bo, np.float64, 8), np.int64(-(2**40) - 7), np.float64(0.125), np.uint8(250),
        np.int16(-1234), np.uint64(2**52 + 3), np.float32(-1.5), np.bool_(True), np.int8(-7),
    ]  # fmt: skip
    be.launch(k["mix"], (1, 1, 1), (1, 1, 1), 0, mixed, s)
    o = to_host(be, bo, np.float64, 8, s)
    assert list(o) == [-(2**40) - 7, 0.125, 250, -1234, 2**52 + 3, -1.5, 1.0, -7]
    # a thread that never used the device: the backend makes the context current there
    err: list[BaseException] = []

    def other() -> None:
        try:
            args: list[Arg] = [ptr(by, np.float32, n), np.int32(n)]
            be.launch(k["add1"], blocks(n), (256, 1, 1), 0, args, s)
            be.synchronize(s)
        except BaseException as exc:
            err.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert not err
    np.testing.assert_allclose(to_host(be, by, np.float32, n, s), y + 1)
    for b in (bx, by, bo):
        be.free(b, s)
    be.destroy_stream(s)


def test_events_order_work_across_streams(cuda: Cuda) -> None:
    be, k = cuda.be, cuda.k
    a, b = be.create_stream(0), be.create_stream(0)
    n = 4096
    buf = from_host(be, np.zeros(n, np.float32), a)
    dst = be.alloc(0, 4 * n, b)
    be.synchronize(a)
    be.launch(k["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(30 * MS)], a)
    busy = be.query(a)
    be.launch(k["add1"], blocks(n), (256, 1, 1), 0, [ptr(buf, np.float32, n), np.int32(n)], a)
    ev = be.record_event(a)
    be.wait_event(b, ev)
    be.copy_device(dst, buf, 4 * n, b)
    got = to_host(be, dst, np.float32, n, b)
    assert busy is False  # queried while the 30 ms kernel ran
    assert np.all(got == 1.0)  # the copy on b waited for the kernel on a
    be.synchronize(a)
    assert be.query(a) is True
    del ev  # its CUevent goes back to the pool, to be recorded again
    ev2 = be.record_event(a)
    be.wait_event(b, ev2)
    be.synchronize(b)
    be.free(buf, a)
    be.free(dst, b)
    be.destroy_stream(a)
    be.destroy_stream(b)


@pytest.mark.parametrize("marks", MARKS)
def test_marks_are_reached_in_order_and_other_streams_wait_for_them(
    marks: str, cuda_for: Callable[[str], Cuda]
) -> None:
    import os

    cuda = cuda_for(marks)
    be, k = cuda.be, cuda.k
    s1, s2, s3 = be.create_stream(0), be.create_stream(0), be.create_stream(0)
    read1, read2 = be.completion_reader(s1), be.completion_reader(s2)
    base1 = read1()
    numbers = []
    for _ in range(3):
        be.launch(k["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(20 * MS)], s1)
        numbers.append(be.mark(s1))
    assert numbers == [base1 + 1, base1 + 2, base1 + 3]  # numbered in order
    be.launch(k["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(200 * MS)], s2)
    late = be.mark(s2)
    # s3 waits for s1's second mark only, not for the long kernel of s2
    n = 256
    buf = from_host(be, np.zeros(n, np.float32), s3)
    be.wait_mark(s3, s1, numbers[1])
    be.launch(k["add1"], blocks(n), (256, 1, 1), 0, [ptr(buf, np.float32, n), np.int32(n)], s3)
    r, w = os.pipe()
    try:
        assert be.enqueue_close(s1, w)  # the GPU closes w right after s1's third mark
        seen = []
        deadline = time.monotonic() + 5
        while read1() < numbers[-1] and time.monotonic() < deadline:
            seen.append(read1())
        assert read1() == numbers[-1] and seen == sorted(seen)  # reached, in order
        assert pipe_closed(r, 1.0)  # and the pipe was closed
    finally:
        os.close(r)
    got = to_host(be, buf, np.float32, n, s3)
    assert np.all(got == 1.0) and read2() < late  # s3 did not wait for s2's kernel
    be.synchronize(s2)
    assert read2() == late
    be.wait_mark(s3, s2, late)  # reached already: nothing to wait for
    be.synchronize(s3)
    lat = []
    for _ in range(500):
        t0 = time.perf_counter()
        be.launch(k["empty"], (1, 1, 1), (1, 1, 1), 0, (), s1)
        number = be.mark(s1)
        while read1() < number:
            pass
        lat.append(time.perf_counter() - t0)
    measure(f"[{marks}] launch + mark + read until reached, median",
            statistics.median(lat) * 1e6, "us")
    t0 = time.perf_counter()
    for _ in range(2000):
        be.mark(s1)
    measure(f"[{marks}] mark", (time.perf_counter() - t0) / 2000 * 1e6, "us/call")
    be.synchronize(s1)
    assert read1() == numbers[-1] + 500 + 2000
    be.free(buf, s3)
    for s in (s1, s2, s3):
        be.destroy_stream(s)


@pytest.mark.parametrize("marks", MARKS)
def test_silent_marks_are_reached_and_waited_for_beside_marks_of_the_word(
    marks: str, cuda_for: Callable[[str], Cuda]
) -> None:
    """A silent mark (a run no loop reads) is an event, not a write of the
    word, in the stream's one numbering: the reader sees it reached, another
    stream waits for it and not for what follows it, a wait for one already
    reached is no wait, and a stream destroyed after one has its word
    written up to it (with event marks, every mark is one already)."""
    cuda = cuda_for(marks)
    be, k = cuda.be, cuda.k
    s1: Any = be.create_stream(0)  # (read inside: the cuda backend's own)
    s3 = be.create_stream(0)
    read1 = be.completion_reader(s1)
    spin = [(50 * MS, False), (50 * MS, True), (600 * MS, False)]
    numbers = []
    for ns, polled in spin:
        be.launch(k["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(ns)], s1)
        numbers.append(be.mark(s1, polled))
    first, _word, last = numbers
    assert numbers == [first, first + 1, first + 2]  # one numbering for both kinds
    n = 256
    buf = from_host(be, np.zeros(n, np.float32), s3)
    be.wait_mark(s3, s1, first)  # the first silent mark only
    be.launch(k["add1"], blocks(n), (256, 1, 1), 0, [ptr(buf, np.float32, n), np.int32(n)], s3)
    got = to_host(be, buf, np.float32, n, s3)
    assert np.all(got == 1.0) and read1() < last  # not after the long kernel
    deadline = time.monotonic() + 5
    while read1() < first and time.monotonic() < deadline:
        time.sleep(0.001)
    assert first <= read1() < last  # the silent mark seen reached, the last one not
    be.wait_mark(s3, s1, last)
    be.synchronize(s3)
    assert read1() == last
    be.wait_mark(s3, s1, first)  # reached, its event recycled: nothing to wait for
    be.synchronize(s3)
    be.free(buf, s3)
    be.launch(k["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(20 * MS)], s1)
    final = be.mark(s1, False)
    word = s1.word
    be.destroy_stream(s1)
    be.destroy_stream(s3)
    if word is not None:
        deadline = time.monotonic() + 5
        while word.read() < final and time.monotonic() < deadline:
            time.sleep(0.001)
        assert word.read() == final  # (so another stream may take the word)


def test_out_of_memory_is_raised_and_not_sticky(cuda: Cuda) -> None:
    be = cuda.be
    s = be.create_stream(0)
    with pytest.raises(OutOfMemoryError, match="OUT_OF_MEMORY") as info:
        be.alloc(0, 10 * 2**40, s)
    assert info.value.code == 2
    buf = be.alloc(0, 1 << 20, s)
    be.fill(buf, np.uint8(7), 1 << 20, s)
    assert np.all(to_host(be, buf, np.uint8, 1 << 20, s) == 7)
    assert be.device_fault(0) is None
    be.free(buf, s)
    be.destroy_stream(s)


def test_bad_launch_configuration_is_raised_and_not_sticky(cuda: Cuda) -> None:
    be, k = cuda.be, cuda.k
    s = be.create_stream(0)
    with pytest.raises(LaunchError, match="INVALID_VALUE"):
        be.launch(k["empty"], (1, 1, 1), (2048, 1, 1), 0, [], s)
    be.launch(k["empty"], (1, 1, 1), (1, 1, 1), 0, [], s)
    be.synchronize(s)
    assert be.device_fault(0) is None
    be.destroy_stream(s)


@pytest.mark.parametrize("marks", MARKS)
def test_graph_capture_of_two_streams_replays_with_a_mark_after_each(
    marks: str, cuda_for: Callable[[str], Cuda]
) -> None:
    cuda = cuda_for(marks)
    be, k = cuda.be, cuda.k
    s1, s2 = be.create_stream(0), be.create_stream(0)
    n = 1024
    p = be.alloc(0, 4 * n, s1)
    q = be.alloc(0, 4 * n, s1)
    be.fill(p, np.float32(0), n, s1)
    be.fill(q, np.float32(0), n, s1)
    be.synchronize(s1)
    pa: list[Arg] = [ptr(p, np.float32, n), np.int32(n)]
    qa: list[Arg] = [ptr(q, np.float32, n), np.int32(n)]
    be.begin_capture(s1)
    with pytest.raises(UsageError, match="already being captured"):
        be.begin_capture(s1)
    for _ in range(3):
        be.launch(k["add1"], blocks(n), (256, 1, 1), 0, pa, s1)
    fork = be.record_event(s1)
    be.wait_event(s2, fork)  # s2 joins the capture
    be.launch(k["add1"], blocks(n), (256, 1, 1), 0, qa, s2)
    tmp = be.alloc(0, 4096, s2)  # taken outside the graph
    be.free(tmp, s2)  # deferred to the end of the capture
    assert not tmp.freed
    join = be.record_event(s2)
    be.wait_event(s1, join)
    with pytest.raises(UsageError, match="captured"):
        be.mark(s1)  # a mark belongs after a replay, not in the graph
    assert not be.enqueue_close(s1, -1)  # nor a pipe's close (refused, nothing enqueued)
    captured_query = be.query(s1)
    graph = be.end_capture(s1)
    assert isinstance(captured_query, bool)  # a query during a capture answers
    assert tmp.freed  # the deferred free was done at end_capture
    be.synchronize(s1)
    assert np.all(to_host(be, p, np.float32, n, s1) == 0)  # capturing ran nothing
    read = be.completion_reader(s1)
    be.launch_graph(graph, s1)
    first = be.mark(s1)
    be.launch_graph(graph, s1)
    second = be.mark(s1)
    be.synchronize(s1)
    gp = to_host(be, p, np.float32, n, s1)
    gq = to_host(be, q, np.float32, n, s1)
    assert np.all(gp == 6) and np.all(gq == 2)  # both streams' work, twice
    assert second == first + 1 and read() == second
    # replay cost of 100 empty kernels
    be.begin_capture(s1)
    for _ in range(100):
        be.launch(k["empty"], (1, 1, 1), (1, 1, 1), 0, (), s1)
    g100 = be.end_capture(s1)
    be.launch_graph(g100, s1)
    be.synchronize(s1)
    t0 = time.perf_counter()
    for _ in range(50):
        be.launch_graph(g100, s1)
    be.synchronize(s1)
    measure("graph of 100 empty kernels, per replay", (time.perf_counter() - t0) / 50 * 1e6, "us")
    del graph, g100
    be.free(p, s1)
    be.free(q, s1)
    be.synchronize(s1)
    be.destroy_stream(s1)
    be.destroy_stream(s2)


def test_launches_pass_their_arguments_as_the_raw_driver_does(cuda: Cuda) -> None:
    """The launch wrapper against raw cuLaunchKernel on the same kernels: the
    arguments arrive (the 4-argument kernel writes s + n).  The costs are
    printed for reading (``-rP``); the bench, not this test, judges them."""
    be, k = cuda.be, cuda.k
    raw = RawDriver(be)
    cu = raw.cu
    s = be.create_stream(0)
    hs = cu.CUstream(be.stream_handle(s))
    per, batches = 2000, 15

    def timed(*fns: Callable[[], object]) -> list[float]:
        """Median µs per call of each, their batches interleaved (drift hits all alike)."""
        vals: list[list[float]] = [[] for _ in fns]
        for _ in range(batches):
            for fn, v in zip(fns, vals, strict=True):
                be.synchronize(s)
                t0 = time.perf_counter()
                for _ in range(per):
                    fn()
                v.append((time.perf_counter() - t0) / per * 1e6)
        be.synchronize(s)
        return [statistics.median(v) for v in vals]

    f0 = raw.function("empty")
    f4 = raw.function("four")
    empty, k4 = k["empty"], k["four"]
    no_args: tuple[Any, ...] = ()
    a = be.alloc(0, 64, s)
    b = be.alloc(0, 64, s)
    raw_types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float)
    raw_args = ((a.ptr, b.ptr, 5, 1.5), raw_types)
    our_args: list[Arg] = [
        ptr(a, np.float32, 16, False), ptr(b, np.float32, 16), np.int32(5), np.float32(1.5),
    ]  # fmt: skip

    def raw_empty() -> None:
        cu.cuLaunchKernel(f0, 1, 1, 1, 1, 1, 1, 0, hs, 0, 0)

    def ours_empty() -> None:
        be.launch(empty, (1, 1, 1), (1, 1, 1), 0, no_args, s)

    def raw_four() -> None:
        cu.cuLaunchKernel(f4, 1, 1, 1, 32, 1, 1, 0, hs, raw_args, 0)

    def ours_four() -> None:
        be.launch(k4, (1, 1, 1), (32, 1, 1), 0, our_args, s)

    for fn in (raw_empty, ours_empty, raw_four, ours_four):
        fn()
    be.synchronize(s)
    r0, o0 = timed(raw_empty, ours_empty)
    r4, o4 = timed(raw_four, ours_four)
    measure("raw cuda.bindings cuLaunchKernel, empty kernel", r0, "us/launch")
    measure("gpuflow launch, empty kernel", o0, "us/launch")
    measure("raw cuda.bindings cuLaunchKernel, 4 args", r4, "us/launch")
    measure("gpuflow launch, 4 args (2 pointers, int, float)", o4, "us/launch")
    got = to_host(be, b, np.float32, 1, s)
    assert float(got[0]) == 6.5  # the 4-argument launch wrote s + n
    (ev_cost,) = timed(lambda: be.record_event(s))
    measure("record_event (pooled)", ev_cost, "us/call")
    (mark_cost,) = timed(lambda: be.mark(s))
    measure("mark (a completion word write)", mark_cost, "us/call")
    be.synchronize(s)
    be.free(a, s)
    be.free(b, s)
    be.destroy_stream(s)
    raw.close()


@pytest.mark.parametrize("marks", MARKS)
def test_neither_a_mark_nor_a_wake_up_waits_for_the_gil(
    marks: str, cuda_for: Callable[[str], Cuda]
) -> None:
    """The stream is held by a mark, or by the pipe's close, while Python
    holds the GIL for 20 ms: neither may wait for the GIL.  One that took
    the GIL would hold the stream for most of the 20 ms (5.2 ms measured for
    a cuda.bindings host function); the bench reports the figure."""
    import os

    cuda = cuda_for(marks)
    be, k = cuda.be, cuda.k
    raw = RawDriver(be)
    cu = raw.cu
    s = be.create_stream(0)
    e0 = _ok(cu.cuEventCreate(0))
    e1 = _ok(cu.cuEventCreate(0))
    hs = cu.CUstream(be.stream_handle(s))
    libc = ctypes.CDLL(None, use_errno=True)
    libcuda = ctypes.CDLL("libcuda.so.1")
    launch_host_func = libcuda.cuLaunchHostFunc
    launch_host_func.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    sem_post = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
    scratch = ctypes.create_string_buffer(64)  # a semaphore nobody waits on
    assert libc.sem_init(scratch, 0, 0) == 0
    pipes: list[int] = []

    def one_host_function() -> None:  # the reference: one raw sem_post host function
        assert launch_host_func(be.stream_handle(s), sem_post, ctypes.addressof(scratch)) == 0

    def wake_up() -> None:
        r, w = os.pipe()
        pipes.append(r)
        assert be.enqueue_close(s, w)

    def hold(enqueue: Callable[[], object]) -> list[float]:
        held = []
        for _ in range(25):
            be.launch(k["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(MS // 2)], s)
            cu.cuEventRecord(e0, hs)
            enqueue()
            cu.cuEventRecord(e1, hs)
            t0 = time.perf_counter()
            x = 0
            while time.perf_counter() - t0 < 0.02:  # pure Python, holding the GIL
                x += 1
            be.synchronize(s)
            held.append(_ok(cu.cuEventElapsedTime(e0, e1)))
        return held

    floor = statistics.median(hold(one_host_function))
    measure("stream held by ONE raw sem_post host function, median", floor, "ms")
    for name, enqueue in (("mark", lambda: be.mark(s)), ("pipe wake-up", wake_up)):
        med = statistics.median(hold(enqueue))
        measure(f"[{marks}] stream held by a {name} while the GIL is busy, median", med, "ms")
        assert med < 2.0, f"{name} held {med:.3f} ms (one raw host function: {floor:.3f} ms)"
    assert all(pipe_closed(r, 1.0) for r in pipes)
    for r in pipes:
        os.close(r)
    cu.cuEventDestroy(e0)
    cu.cuEventDestroy(e1)
    be.destroy_stream(s)
    raw.close()


@pytest.mark.faults_device
def test_a_sticky_fault_then_a_reset() -> None:
    """An illegal address: no signal after it, every call raises the fault
    (code 700) while free and destroy_stream stay silent; then
    ``reset_device`` either recovers the device (old handles stale, new work
    correct) or, where the driver refuses (driver 580 on the H200), raises
    the fault with the driver's code and leaves the device faulted."""
    be = CudaBackend(None)  # its own: the fault ends it
    k = {name: be.load_kernel(0, MOD, name) for name in ("empty", "bad")}
    s = be.create_stream(0)
    keep = be.alloc(0, 4096, s)
    be.synchronize(s)
    read = be.completion_reader(s)
    be.launch(k["bad"], (1, 1, 1), (32, 1, 1), 0, [np.uint64(0)], s)
    try:
        after = be.mark(s)
    except DeviceFaultError:
        after = read() + 1  # the fault was already seen: fine too
    time.sleep(0.2)
    assert read() < after  # no mark is reached after an illegal address
    fault = None
    deadline = time.monotonic() + 3
    while fault is None and time.monotonic() < deadline:
        try:
            be.query(s)
            time.sleep(0.01)
        except DeviceFaultError as exc:
            fault = exc
    assert fault is not None, "query never reported the fault"
    assert (fault.code, fault.name) == (700, "CUDA_ERROR_ILLEGAL_ADDRESS")
    assert be.device_fault(0) is fault
    with pytest.raises(DeviceFaultError, match="ILLEGAL_ADDRESS") as info:
        be.launch(k["empty"], (1, 1, 1), (1, 1, 1), 0, (), s)
    assert info.value.code == 700
    with pytest.raises(DeviceFaultError, match="ILLEGAL_ADDRESS"):
        be.synchronize(s)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        be.free(keep, s)  # leaks, never raises
        be.destroy_stream(s)
    assert not w, [str(x.message) for x in w]

    t0 = time.perf_counter()
    refused: DeviceFaultError | None = None
    for _attempt in range(2):
        try:
            be.reset_device(0)
            refused = None
            break
        except DeviceFaultError as exc:
            refused = refused or exc
            print(f"  reset_device raised: {exc}; trace: {be.last_reset_trace}", flush=True)
        time.sleep(1.0)  # does the driver clear it after a while?
    measure("reset_device", (time.perf_counter() - t0) * 1e3, "ms")
    if refused is not None:
        # the driver keeps the fault: the first refusal carries its code, and
        # the device stays faulted, loudly for new work and silently for cleanup
        assert refused.code == 700, refused.name
        assert be.device_fault(0) is not None
        with pytest.raises(DeviceFaultError, match="ILLEGAL_ADDRESS"):
            be.create_stream(0)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            be.free(keep, s)
            read()
        assert not w, [str(x.message) for x in w]
        return
    assert be.device_fault(0) is None  # the reset cleared the fault
    with pytest.raises(UsageError, match="reset"):  # the old stream and kernel: the old context
        be.launch(k["empty"], (1, 1, 1), (1, 1, 1), 0, (), s)
    s2 = be.create_stream(0)
    add1 = be.load_kernel(0, MOD, "add1")
    n = 1000
    buf = from_host(be, np.full(n, 41, np.float32), s2)
    be.launch(add1, blocks(n), (256, 1, 1), 0, [ptr(buf, np.float32, n), np.int32(n)], s2)
    number = be.mark(s2)
    got = to_host(be, buf, np.float32, n, s2)
    # kernels, copies and marks work (the words were registered with the new context)
    assert np.all(got == 42) and be.completion_reader(s2)() == number
    be.fill(buf, np.float64(2.5), n // 2, s2)  # the built-in kernels were reloaded too
    be.arange(buf, np.int32(0), np.int32(2), n, s2)
    np.testing.assert_array_equal(to_host(be, buf, np.int32, n, s2), np.arange(0, 2 * n, 2))
    be.free(buf, s2)
    be.destroy_stream(s2)


@pytest.mark.parametrize(("given", "expected"), [(None, "32"), ("4", "4")])
def test_streams_get_32_hardware_queues_unless_the_user_chose(
    given: str | None, expected: str
) -> None:
    # read by the driver when the context is made: checked in a fresh process
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if given is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = given
    code = (
        "import os, gpuflow as gf; gf.init_device_contexts(backend='cuda'); "
        "print(os.environ['CUDA_DEVICE_MAX_CONNECTIONS'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [expected]
