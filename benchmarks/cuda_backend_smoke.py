"""GPU smoke test of gpuflow's ``cuda`` backend, method by method (no front end).

Run on a machine with a CUDA device:

    PYTHONPATH=src python3 benchmarks/cuda_backend_smoke.py

Prints one PASS/FAIL line per check, the launch-cost and host-function
measurements, and a summary; exits 1 when a check failed.  The fault check
runs last: it puts the device in a sticky error and resets it.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuflow._backends._base import PointerArg
from gpuflow._backends._cuda import CudaBackend, cuda_device_count
from gpuflow._backends._nvrtc import compile_source
from gpuflow._errors import DeviceFaultError, LaunchError, OutOfMemoryError, UsageError

RESULTS: list[tuple[str, bool]] = []
MEASURED: dict[str, float] = {}


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, bool(ok)))
    print(f"{'PASS' if ok else 'FAIL'}: {name}" + (f" ({detail})" if detail else ""), flush=True)
    return bool(ok)


def measure(name: str, value: float, unit: str) -> None:
    MEASURED[name] = value
    print(f"  measured {name}: {value:.3f} {unit}", flush=True)


def run(fn: Callable[[], None]) -> None:
    print(f"# {fn.__name__}", flush=True)
    t0 = time.perf_counter()
    try:
        fn()
    except Exception:
        traceback.print_exc()
        check(f"{fn.__name__} ran to the end", False)
    print(f"# {fn.__name__}: {time.perf_counter() - t0:.2f} s", flush=True)


class Module:
    """What ``load_kernel`` needs of a compiled module (a ModuleSource)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.references: dict[str, Callable[..., Any]] = {}

    def binary_for(self, arch: str) -> bytes:
        return compile_source(self.source, arch, ())


SRC = r"""
extern "C" __global__ void empty() {}
extern "C" __global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
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

be: CudaBackend
mod = Module(SRC)
K: dict[str, Any] = {}
SPIN_MS = 1_980_000  # clock64 cycles per ms, about, at H200 boost clock


def ptr(buf: Any, dtype: Any, count: int, writes: bool = True) -> PointerArg:
    return PointerArg(buf, np.dtype(dtype), count, writes)


def blocks(n: int, t: int = 256) -> tuple[int, int, int]:
    return ((n + t - 1) // t, 1, 1)


def to_host(buf: Any, dtype: Any, count: int, stream: Any) -> np.ndarray[Any, Any]:
    out = np.empty(count, dtype=dtype)
    be.copy_to_host(out, buf, stream)
    be.synchronize(stream)
    return out


def from_host(arr: np.ndarray[Any, Any], stream: Any) -> Any:
    buf = be.alloc(0, arr.nbytes, stream)
    be.copy_from_host(buf, np.ascontiguousarray(arr), stream)
    return buf


# -- checks -----------------------------------------------------------------------
def t_basics() -> None:
    check("device_count >= 1", be.device_count >= 1, f"{be.device_count}")
    name = be.device_name(0)
    check("device_name", isinstance(name, str) and len(name) > 0, name)
    s = be.create_stream(0)
    h = be.stream_handle(s)
    check("stream_handle is a nonzero int", isinstance(h, int) and h != 0, hex(h))
    check("query on a fresh stream is True", be.query(s) is True)
    for name in ("empty", "spin", "saxpy", "add1", "mix", "four", "bad"):
        K[name] = be.load_kernel(0, mod, name)
    check("load_kernel x7", True, be.device_arch(0))
    try:
        be.load_kernel(0, mod, "nope")
        check("load_kernel of a missing name raises", False)
    except Exception as exc:
        check("load_kernel of a missing name raises", True, type(exc).__name__)
    be.destroy_stream(s)
    be.destroy_stream(s)  # twice: no error
    check("destroy_stream (twice)", True)


def t_memory() -> None:
    s = be.create_stream(0)
    for n in (1000, 4 << 20):  # direct (4 KB) and staged (16 MB) host-to-device paths
        a = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        buf = from_host(a, s)
        back = to_host(buf, np.float32, n, s)
        check(f"H2D + D2H of {a.nbytes} bytes", np.array_equal(a, back))
        buf2 = be.alloc(0, a.nbytes, s)
        be.copy_device(buf2, buf, a.nbytes, s)
        back2 = to_host(buf2, np.float32, n, s)
        check(f"D2D copy of {a.nbytes} bytes", np.array_equal(a, back2))
        be.free(buf, s)
        be.free(buf2, s)
        be.free(buf2, s)  # twice: ignored
    # staged D2H delivered by take_signals (the dispatcher's path), not synchronize
    n = 1 << 20
    a = np.arange(n, dtype=np.int32)
    buf = from_host(a, s)
    be.synchronize(s)
    out = np.zeros(n, dtype=np.int32)
    be.launch(K["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(20 * SPIN_MS)], s)
    be.copy_to_host(out, buf, s)
    be.enqueue_signal(s)
    got = 0
    deadline = time.monotonic() + 5
    while got == 0 and time.monotonic() < deadline:
        be.wait_signals(1.0)
        got += be.take_signals(s)
    check("staged D2H delivered by take_signals", got == 1 and np.array_equal(a, out), f"{got=}")
    # a second stream's sweep delivers it too (cross-stream completion)
    s2 = be.create_stream(0)
    out2 = np.zeros(n, dtype=np.int32)
    be.copy_to_host(out2, buf, s)
    ev = be.record_event(s)
    be.wait_event(s2, ev)
    be.synchronize(s2)
    check("staged D2H delivered by another stream's synchronize", np.array_equal(a, out2))
    be.free(buf, s)
    be.synchronize(s)
    be.destroy_stream(s)
    be.destroy_stream(s2)


def t_fill_arange() -> None:
    s = be.create_stream(0)
    count = 3000
    fills = [
        np.float16(1.5), np.float32(-2.25), np.float64(3.5), np.float64(0.0),
        np.int8(-3), np.int16(-300), np.int32(123456), np.int64(-5), np.int64(-1),
        np.uint8(200), np.uint16(60000), np.uint32(4_000_000_000), np.uint64(2**63 + 5),
        np.bool_(True), np.complex64(1 + 2j),
    ]  # fmt: skip
    bad = []
    for v in fills:
        buf = be.alloc(0, (count + 1) * v.itemsize, s)
        be.fill(buf, np.zeros((), v.dtype)[()], count + 1, s)
        be.fill(buf, v, count, s)
        got = to_host(buf, v.dtype, count + 1, s)
        exp = np.full(count + 1, v, dtype=v.dtype)
        exp[-1] = 0
        if not np.array_equal(got.view(np.uint8), exp.view(np.uint8)):
            bad.append(str(v.dtype))
        be.free(buf, s)
    check(f"fill of {len(fills)} dtypes", not bad, f"wrong: {bad}" if bad else "")
    cases = [
        (np.float16(-3.0), np.float16(0.1)), (np.float32(0.5), np.float32(0.1)),
        (np.float64(-1.0), np.float64(1e-3)), (np.int8(-100), np.int8(3)),
        (np.int16(7), np.int16(-11)), (np.int32(-5), np.int32(1000)),
        (np.int64(2**40), np.int64(-3)), (np.uint8(250), np.uint8(1)),
        (np.uint16(1), np.uint16(31)), (np.uint32(5), np.uint32(7)),
        (np.uint64(2**63), np.uint64(2**40 + 1)), (np.bool_(False), np.bool_(True)),
        (np.bool_(True), np.bool_(False)),
    ]  # fmt: skip
    bad = []
    for start, step in cases:
        dt = start.dtype
        buf = be.alloc(0, count * dt.itemsize, s)
        be.arange(buf, start, step, count, s)
        got = to_host(buf, dt, count, s)
        with np.errstate(all="ignore"):
            exp = start + np.arange(count).astype(dt) * step
        diff = int(np.count_nonzero(got.view(np.uint8) != exp.view(np.uint8)))
        if diff:
            bad.append(f"{dt}: {diff} bytes differ")
        be.free(buf, s)
    check(f"arange of {len(cases)} dtype cases (bit-exact vs NumPy)", not bad, "; ".join(bad))
    be.destroy_stream(s)


def t_kernels() -> None:
    s = be.create_stream(0)
    n = 10000
    x = np.arange(n, dtype=np.float32)
    bx = from_host(x, s)
    by = from_host(np.ones(n, np.float32), s)
    be.launch(
        K["saxpy"], blocks(n), (256, 1, 1), 0,
        [ptr(bx, np.float32, n, False), ptr(by, np.float32, n), np.float32(2.5), np.int32(n)], s,
    )  # fmt: skip
    y = to_host(by, np.float32, n, s)
    check("saxpy (pointer + scalar args)", np.allclose(y, 2.5 * x + 1, rtol=1e-6))
    bo = be.alloc(0, 8 * 8, s)
    args = [
        ptr(bo, np.float64, 8), np.int64(-(2**40) - 7), np.float64(0.125), np.uint8(250),
        np.int16(-1234), np.uint64(2**52 + 3), np.float32(-1.5), np.bool_(True), np.int8(-7),
    ]  # fmt: skip
    be.launch(K["mix"], (1, 1, 1), (1, 1, 1), 0, args, s)
    o = to_host(bo, np.float64, 8, s)
    exp = [-(2**40) - 7, 0.125, 250, -1234, 2**52 + 3, -1.5, 1.0, -7]
    check("8 scalar types in one launch", list(o) == exp, f"{list(o)}")
    # launch from another thread: its context is made current there
    err: list[BaseException] = []

    def other() -> None:
        try:
            args = [ptr(by, np.float32, n), np.int32(n)]
            be.launch(K["add1"], blocks(n), (256, 1, 1), 0, args, s)
            be.synchronize(s)
        except BaseException as exc:
            err.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    y2 = to_host(by, np.float32, n, s)
    check("launch from a new thread", not err and np.allclose(y2, y + 1), f"{err}")
    for b in (bx, by, bo):
        be.free(b, s)
    be.destroy_stream(s)


def t_events() -> None:
    a, b = be.create_stream(0), be.create_stream(0)
    n = 4096
    buf = from_host(np.zeros(n, np.float32), a)
    dst = be.alloc(0, 4 * n, b)
    be.synchronize(a)
    be.launch(K["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(30 * SPIN_MS)], a)
    busy = be.query(a)
    be.launch(K["add1"], blocks(n), (256, 1, 1), 0, [ptr(buf, np.float32, n), np.int32(n)], a)
    ev = be.record_event(a)
    be.wait_event(b, ev)
    be.copy_device(dst, buf, 4 * n, b)
    got = to_host(dst, np.float32, n, b)
    check("query is False while a kernel runs", busy is False)
    check("cross-stream wait_event orders the copy", bool(np.all(got == 1.0)))
    be.synchronize(a)
    check("query is True after synchronize", be.query(a) is True)
    del ev  # the event goes back to the pool
    ev2 = be.record_event(a)
    be.wait_event(b, ev2)
    be.synchronize(b)
    check("pooled event reused", True)
    be.free(buf, a)
    be.free(dst, b)
    be.destroy_stream(a)
    be.destroy_stream(b)


def t_signals() -> None:
    mode = "event" if be._event_signals else "hostfunc"
    print(f"  signals={mode!r}")
    s1, s2 = be.create_stream(0), be.create_stream(0)
    for _ in range(3):
        be.launch(K["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(2 * SPIN_MS)], s1)
        be.enqueue_signal(s1)
    for _ in range(2):
        be.launch(K["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(3 * SPIN_MS)], s2)
        be.enqueue_signal(s2)
    c1 = c2 = wakeups = 0
    deadline = time.monotonic() + 5
    while (c1 < 3 or c2 < 2) and time.monotonic() < deadline:
        be.wait_signals(1.0)
        wakeups += 1
        c1 += be.take_signals(s1)
        c2 += be.take_signals(s2)
    be.wait_signals(0.05)
    c1 += be.take_signals(s1)
    c2 += be.take_signals(s2)
    check(f"[{mode}] signal counts on 2 streams", (c1, c2) == (3, 2), f"{c1=} {c2=} {wakeups=}")
    t0 = time.perf_counter()
    be.wait_signals(0.1)
    dt = time.perf_counter() - t0
    check("wait_signals times out", 0.08 <= dt < 0.5, f"{dt * 1e3:.1f} ms")
    timer = threading.Timer(0.05, be.wake)
    timer.start()
    t0 = time.perf_counter()
    be.wait_signals(5.0)
    dt = time.perf_counter() - t0
    timer.join()
    check("wait_signals returns on wake()", dt < 1.0, f"{dt * 1e3:.1f} ms")
    check("wake() is no signal", be.take_signals(s1) == 0 and be.take_signals(s2) == 0)
    lat = []
    for _ in range(500):
        t0 = time.perf_counter()
        be.enqueue_signal(s1)
        got = 0
        while not got:
            be.wait_signals(1.0)
            got = be.take_signals(s1)
        lat.append(time.perf_counter() - t0)
    measure(f"[{mode}] signal round trip (idle stream), median", statistics.median(lat) * 1e6, "us")
    t0 = time.perf_counter()
    for _ in range(2000):
        be.enqueue_signal(s1)
    measure(f"[{mode}] enqueue_signal", (time.perf_counter() - t0) / 2000 * 1e6, "us/call")
    be.synchronize(s1)
    be.wait_signals(0)
    taken = be.take_signals(s1)
    check(f"[{mode}] 2000 signals counted", taken == 2000, f"{taken}")
    be.destroy_stream(s1)
    be.destroy_stream(s2)


def t_oom() -> None:
    s = be.create_stream(0)
    try:
        be.alloc(0, 10 * 2**40, s)
        check("10 TB alloc raises OutOfMemoryError", False)
    except OutOfMemoryError as exc:
        check("10 TB alloc raises OutOfMemoryError", exc.code == 2, f"{exc.name}")
    buf = be.alloc(0, 1 << 20, s)
    be.fill(buf, np.uint8(7), 1 << 20, s)
    got = to_host(buf, np.uint8, 1 << 20, s)
    check("normal alloc after OOM", bool(np.all(got == 7)) and be.device_fault(0) is None)
    be.free(buf, s)
    be.destroy_stream(s)


def t_bad_launch() -> None:
    s = be.create_stream(0)
    try:
        be.launch(K["empty"], (1, 1, 1), (2048, 1, 1), 0, [], s)
        check("block of 2048 raises LaunchError", False)
    except LaunchError as exc:
        check("block of 2048 raises LaunchError", True, f"{exc.name}")
    be.launch(K["empty"], (1, 1, 1), (1, 1, 1), 0, [], s)
    be.synchronize(s)
    check("launch after a bad configuration works", be.device_fault(0) is None)
    be.destroy_stream(s)


def t_graph() -> None:
    s1, s2 = be.create_stream(0), be.create_stream(0)
    n = 1024
    p = be.alloc(0, 4 * n, s1)
    q = be.alloc(0, 4 * n, s1)
    be.fill(p, np.float32(0), n, s1)
    be.fill(q, np.float32(0), n, s1)
    be.synchronize(s1)
    pa = [ptr(p, np.float32, n), np.int32(n)]
    qa = [ptr(q, np.float32, n), np.int32(n)]
    be.begin_capture(s1)
    try:
        be.begin_capture(s1)
        check("begin_capture twice raises UsageError", False)
    except UsageError:
        check("begin_capture twice raises UsageError", True)
    for _ in range(3):
        be.launch(K["add1"], blocks(n), (256, 1, 1), 0, pa, s1)
    fork = be.record_event(s1)
    be.wait_event(s2, fork)  # s2 joins the capture
    be.launch(K["add1"], blocks(n), (256, 1, 1), 0, qa, s2)
    tmp = be.alloc(0, 4096, s2)  # taken outside the graph
    be.free(tmp, s2)  # deferred to the end of the capture
    join = be.record_event(s2)
    be.wait_event(s1, join)
    be.enqueue_signal(s1)  # a host node: one signal per replay
    captured_query = be.query(s1)
    graph = be.end_capture(s1)
    check("query during capture answers", isinstance(captured_query, bool))
    check("deferred free done at end_capture", tmp.freed)
    be.synchronize(s1)
    before = to_host(p, np.float32, n, s1)
    check("capture does not execute", bool(np.all(before == 0)))
    be.launch_graph(graph, s1)
    be.launch_graph(graph, s1)
    be.synchronize(s1)
    gp = to_host(p, np.float32, n, s1)
    gq = to_host(q, np.float32, n, s1)
    check("graph x2 (fork/join of 2 streams)", bool(np.all(gp == 6) and np.all(gq == 2)))
    time.sleep(0.01)
    be.wait_signals(0.5)
    sig = be.take_signals(s1)
    check("captured signal fires once per replay", sig == 2, f"{sig}")
    # replay cost vs eager, 100 empty kernels
    be.begin_capture(s1)
    for _ in range(100):
        be.launch(K["empty"], (1, 1, 1), (1, 1, 1), 0, (), s1)
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


def t_launch_timing() -> None:
    from cuda.bindings import driver as cu

    s = be.create_stream(0)
    k = K["empty"]
    f = cu.CUfunction(k.func)
    hs = cu.CUstream(be.stream_handle(s))
    per, batches = 2000, 15

    def timed(fn: Callable[[], object]) -> float:
        vals = []
        for _ in range(batches):
            be.synchronize(s)
            t0 = time.perf_counter()
            for _ in range(per):
                fn()
            vals.append((time.perf_counter() - t0) / per * 1e6)
            be.synchronize(s)
        return statistics.median(vals)

    def raw_empty() -> None:
        cu.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, hs, 0, 0)

    no_args: tuple[Any, ...] = ()

    def ours_empty() -> None:
        be.launch(k, (1, 1, 1), (1, 1, 1), 0, no_args, s)

    a = be.alloc(0, 64, s)
    b = be.alloc(0, 64, s)
    f4 = cu.CUfunction(K["four"].func)
    raw_types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float)
    raw_args = ((a.ptr, b.ptr, 5, 1.5), raw_types)
    our_args = [ptr(a, np.float32, 16, False), ptr(b, np.float32, 16), np.int32(5), np.float32(1.5)]
    k4 = K["four"]

    def raw_four() -> None:
        cu.cuLaunchKernel(f4, 1, 1, 1, 32, 1, 1, 0, hs, raw_args, 0)

    def ours_four() -> None:
        be.launch(k4, (1, 1, 1), (32, 1, 1), 0, our_args, s)

    for fn in (raw_empty, ours_empty, raw_four, ours_four):
        fn()
    be.synchronize(s)
    r0 = timed(raw_empty)
    o0 = timed(ours_empty)
    r4 = timed(raw_four)
    o4 = timed(ours_four)
    measure("raw cuda.bindings cuLaunchKernel, empty kernel", r0, "us/launch")
    measure("gpuflow launch, empty kernel", o0, "us/launch")
    measure("raw cuda.bindings cuLaunchKernel, 4 args", r4, "us/launch")
    measure("gpuflow launch, 4 args (2 pointers, int, float)", o4, "us/launch")
    check("empty-kernel launch within 1 us of raw", o0 <= r0 + 1.0, f"{o0:.2f} vs {r0:.2f} us")
    check("4-arg launch within 1 us of raw", o4 <= r4 + 1.0, f"{o4:.2f} vs {r4:.2f} us")
    got = to_host(b, np.float32, 1, s)
    check("4-arg launch wrote s + n", float(got[0]) == 6.5, f"{got[0]}")
    ev_cost = timed(lambda: be.record_event(s))
    measure("record_event (pooled)", ev_cost, "us/call")
    sig_cost = timed(lambda: be.enqueue_signal(s))
    measure("enqueue_signal (2 host functions)", sig_cost, "us/call")
    be.synchronize(s)
    be.take_signals(s)
    be.wait_signals(0)
    be.free(a, s)
    be.free(b, s)
    be.destroy_stream(s)


def t_hold() -> None:
    """How long the stream is held by the signal while Python holds the GIL."""
    from cuda.bindings import driver as cu

    mode = "event" if be._event_signals else "hostfunc"
    s = be.create_stream(0)
    be.launch(K["empty"], (1, 1, 1), (1, 1, 1), 0, (), s)  # this thread's context is current
    _, e0 = cu.cuEventCreate(0)
    _, e1 = cu.cuEventCreate(0)
    hs = cu.CUstream(be.stream_handle(s))
    scratch = ctypes.create_string_buffer(64)
    be._n.sem_init(scratch, 0, 0)

    def one_host_function() -> None:  # reference: one raw sem_post host function
        post = be._n.sem_post_addr
        be._n.launch_host_func(be.stream_handle(s), post, ctypes.addressof(scratch))

    def hold(enqueue: Callable[[], None]) -> list[float]:
        held = []
        for _ in range(25):
            be.launch(K["spin"], (1, 1, 1), (1, 1, 1), 0, [np.int64(SPIN_MS // 2)], s)
            cu.cuEventRecord(e0, hs)
            enqueue()
            cu.cuEventRecord(e1, hs)
            t0 = time.perf_counter()
            x = 0
            while time.perf_counter() - t0 < 0.02:  # pure Python, holding the GIL
                x += 1
            be.synchronize(s)
            _, ms = cu.cuEventElapsedTime(e0, e1)
            held.append(ms)
            be.wait_signals(0.05)
            be.take_signals(s)
        return held

    ref = hold(one_host_function)
    measure("stream held by ONE raw sem_post host function, median", statistics.median(ref), "ms")
    held = hold(lambda: be.enqueue_signal(s))
    med = statistics.median(held)
    floor = statistics.median(ref)
    measure(f"[{mode}] stream held by enqueue_signal while the GIL is busy, median", med, "ms")
    check(f"[{mode}] signal hold <= 0.2 ms", med <= 0.2, f"{med:.3f} ms, max {max(held):.3f}")
    check(
        f"[{mode}] signal hold within 25% of one raw host function's",
        med <= 1.25 * floor,
        f"{med:.3f} vs {floor:.3f} ms",
    )
    cu.cuEventDestroy(e0)
    cu.cuEventDestroy(e1)
    be.destroy_stream(s)


def t_fault() -> None:
    s = be.create_stream(0)
    keep = be.alloc(0, 4096, s)
    be.synchronize(s)
    be.launch(K["bad"], (1, 1, 1), (32, 1, 1), 0, [np.uint64(0)], s)
    try:
        be.enqueue_signal(s)
    except DeviceFaultError:
        pass  # the fault was already seen: fine too
    be.wait_signals(0.2)
    got = be.take_signals(s)
    check("no signal after an illegal address", got == 0, f"{got}")
    fault = None
    deadline = time.monotonic() + 3
    while fault is None and time.monotonic() < deadline:
        try:
            be.query(s)
            time.sleep(0.01)
        except DeviceFaultError as exc:
            fault = exc
    check(
        "query raises DeviceFaultError 700",
        fault is not None and fault.code == 700 and fault.name == "CUDA_ERROR_ILLEGAL_ADDRESS",
        f"{fault}",
    )
    check("device_fault(0) returns it", be.device_fault(0) is fault and fault is not None)
    try:
        be.launch(K["empty"], (1, 1, 1), (1, 1, 1), 0, (), s)
        check("launch after the fault raises DeviceFaultError", False)
    except DeviceFaultError as exc:
        check("launch after the fault raises DeviceFaultError", exc.code == 700)
    try:
        be.synchronize(s)
        check("synchronize after the fault raises DeviceFaultError", False)
    except DeviceFaultError:
        check("synchronize after the fault raises DeviceFaultError", True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        be.free(keep, s)  # leaks, never raises
        be.destroy_stream(s)
    check("free/destroy_stream after the fault are silent", not w, f"{[str(x.message) for x in w]}")
    t0 = time.perf_counter()
    recovered = False
    for attempt in range(2):
        try:
            be.reset_device(0)
            recovered = True
        except DeviceFaultError as exc:
            print(f"  reset_device raised: {exc}", flush=True)
            if attempt == 0:
                check(
                    "a failed reset raises DeviceFaultError with the driver's code",
                    exc.code == 700 and be.device_fault(0) is not None,
                    f"{exc.name}",
                )
        print(f"  reset trace: {be.last_reset_trace}", flush=True)
        if recovered:
            break
        time.sleep(1.0)  # does the driver clear it after a while?
    measure("reset_device", (time.perf_counter() - t0) * 1e3, "ms")
    check("reset_device recovers the device (driver permitting)", recovered)
    if not recovered:
        try:
            be.create_stream(0)
            check("after a failed reset: calls still raise the fault", False)
        except DeviceFaultError:
            check("after a failed reset: calls still raise the fault", True)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            be.free(keep, s)
            be.take_signals(s)
        check("after a failed reset: free/take_signals silent", not w)
        try:  # diagnostic: would a fresh, non-primary context work?
            from cuda.bindings import driver as cu

            err, _ctx = cu.cuCtxCreate(None, 0, cu.CUdevice(0))
            print(f"  diagnostic cuCtxCreate after the fault: {err}")
            if int(err) == 0:
                print(f"  diagnostic cuCtxSynchronize in it: {cu.cuCtxSynchronize()[0]}")
                err2, _ = cu.cuMemAlloc(1024)
                print(f"  diagnostic cuMemAlloc in it: {err2}")
        except Exception as exc:
            print(f"  diagnostic cuCtxCreate raised {exc!r}")
        return
    check("reset clears the fault", be.device_fault(0) is None)
    try:
        be.launch(K["empty"], (1, 1, 1), (1, 1, 1), 0, (), s)
        check("old stream/kernel after reset raise UsageError", False)
    except UsageError:
        check("old stream/kernel after reset raise UsageError", True)
    s2 = be.create_stream(0)
    add1 = be.load_kernel(0, mod, "add1")
    n = 1000
    buf = from_host(np.full(n, 41, np.float32), s2)
    be.launch(add1, blocks(n), (256, 1, 1), 0, [ptr(buf, np.float32, n), np.int32(n)], s2)
    be.enqueue_signal(s2)
    got_out = to_host(buf, np.float32, n, s2)
    be.wait_signals(1.0)
    sig = be.take_signals(s2)
    check("after reset: kernel, copies and signals work", bool(np.all(got_out == 42)) and sig == 1)
    be.fill(buf, np.float64(2.5), n // 2, s2)  # built-ins reloaded too
    be.arange(buf, np.int32(0), np.int32(2), n, s2)
    got_i = to_host(buf, np.int32, n, s2)
    check("after reset: fill/arange work", np.array_equal(got_i, np.arange(0, 2 * n, 2)))
    be.free(buf, s2)
    be.destroy_stream(s2)


def main() -> int:
    global be
    import importlib.metadata as md

    for p in ("cuda-bindings", "cuda-core", "numpy"):
        try:
            print(f"{p} {md.version(p)}")
        except Exception:
            print(f"{p} absent")
    print(f"python {sys.version.split()[0]}")
    n = cuda_device_count()
    print(f"cuda_device_count() = {n}")
    if n == 0:
        print("FAIL: no CUDA device")
        return 1
    t0 = time.perf_counter()
    be = CudaBackend(None)
    print(f"CudaBackend({n} devices) in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    for fn in (
        t_basics, t_memory, t_fill_arange, t_kernels, t_events, t_signals, t_oom,
        t_bad_launch, t_graph, t_launch_timing, t_hold,
    ):  # fmt: skip
        run(fn)
    be._event_signals = True  # the alternative signal (an event and one host function)
    for fn in (t_signals, t_graph, t_hold):
        run(fn)
    be._event_signals = False
    run(t_fault)
    passed = sum(ok for _, ok in RESULTS)
    failed = [name for name, ok in RESULTS if not ok]
    print("\n== measured ==")
    for k, v in MEASURED.items():
        print(f"  {k}: {v:.3f}")
    print(f"== SUMMARY: {passed} passed, {len(failed)} failed ==")
    for name in failed:
        print(f"   FAILED: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
