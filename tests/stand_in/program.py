"""A program on the cuda backend, run against the stand-in libcuda (argv[1]).

Run by tests/backends/test_cuda_stand_in.py in a process of its own, with warnings as
errors: every line here goes through ``_backends/_cuda``'s Python, and the
stand-in's memory is host memory, so copies come back as they went.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import time
from typing import Any, cast

from gpuflow._backends import _nvrtc

# NVRTC asks the driver for tables of its own the first time it compiles,
# which the stand-in does not have: it compiles once before the stand-in is
# loaded.  cuda-bindings then finds the stand-in by its soname.
_nvrtc.compile_source('extern "C" __global__ void warm() {}', "sm_90", ())
standin = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)

import anyio  # noqa: E402
import numpy as np  # noqa: E402

import gpuflow as gf  # noqa: E402
from gpuflow import testing  # noqa: E402

assert gf.init_device_contexts(backend="cuda") == "cuda"
backend = gf.lowlevel.current_backend_object()
assert type(backend).__name__ == "CudaBackend" and gf.device_count() == 1

# copies: through the pinned staging buffers (small) and directly (large)
for n in (8, 1 << 20):
    host = np.arange(n, dtype=np.float32)
    x = gf.from_host(host).sync()
    np.testing.assert_array_equal(gf.to_host(x).sync(), host)
    np.testing.assert_array_equal(gf.to_host(gf.copy(x)).sync(), host)
np.testing.assert_array_equal(gf.to_host(gf.zeros(16, np.int32)).sync(), np.zeros(16, np.int32))

# launches with and without pointer arguments, blocking and enqueued
mod = gf.compile(
    'extern "C" __global__ void scale(float* x, float s, int n) {}\n'
    'extern "C" __global__ void nothing() {}'
)
x = gf.from_host(np.ones(64, np.float32)).sync()
mod.scale(gf.LaunchConfig(1, 64), x, 2.0, 64).sync()
empty = mod.nothing(gf.LaunchConfig(1, 1))
s = gf.new_stream()
for _ in range(100):
    empty.enqueue_on(s)
s.synchronize()

# stream priorities the right way round: gpuflow's level 5 is CUDA's -5 (its
# highest), and a level past the device's range is refused, never clamped
made_with = ctypes.c_int.in_dll(standin, "standin_priority")
urgent = gf.new_stream(priority=5)
assert urgent.priority == 5 and made_with.value == -5
assert gf.new_stream(priority=2).priority == 2 and made_with.value == -2
try:
    gf.new_stream(priority=6)
    raise AssertionError("priority 6 was taken")
except gf.UsageError as exc:
    assert "0 (the default) to 5" in str(exc), exc
empty.enqueue_on(urgent)
urgent.synchronize()

# what a launch passes: scalar arguments packed once into a launch's own
# parameter array, and its later runs (enqueued, traced, on another stream)
# pass the same values; another launch of the kernel passes its own
recorded = (ctypes.c_uint64 * 8).in_dll(standin, "standin_params")
ctypes.c_int.in_dll(standin, "standin_record").value = 3
put = gf.compile('extern "C" __global__ void put(float v, int i, unsigned long long p) {}').put


def passed() -> tuple[float, int, int]:
    raw = bytes(recorded)
    return (
        float(np.frombuffer(raw[0:4], np.float32)[0]),
        int(np.frombuffer(raw[8:12], np.int32)[0]),
        int(np.frombuffer(raw[16:24], np.uint64)[0]),
    )


one = put(gf.LaunchConfig(1, 1), 2.5, -7, 0x123456789)
other = put(gf.LaunchConfig(1, 1), -1.25, 3, 42)
for op, want in ((one, (2.5, -7, 0x123456789)), (other, (-1.25, 3, 42))):
    for run in range(3):
        recorded[:] = [0] * 8
        op.sync() if run == 0 else op.enqueue_on(s)
        assert passed() == want, (run, passed(), want)
recorded[:] = [0] * 8
with testing.record_activity():  # (timed launches take the checked path)
    one.sync_on(gf.new_stream())
assert passed() == (2.5, -7, 0x123456789), passed()
s.synchronize()
ctypes.c_int.in_dll(standin, "standin_record").value = 0

# awaits under each loop: the completion words, the poller, the inline read
stats = gf.lowlevel.current_completion_statistics


async def awaits() -> None:
    for _ in range(50):
        await empty
    async with anyio.create_task_group() as tg:
        for _ in range(16):
            tg.start_soon(lambda: mod.scale(gf.LaunchConfig(1, 64), x, 2.0, 64).run())
    assert (await gf.to_host(x)).shape == (64,)
    await testing.assert_quiescent_async(timeout=5.0)


for loop in ("asyncio", "trio"):
    before = stats()
    anyio.run(awaits, backend=loop)
    after = stats()
    assert after.spun + after.polled > before.spun + before.polled, (before, after)

# silent marks (runs no task awaits) beside marks of the word, on one stream:
# a use on another stream waits on the silent mark's event (the stand-in
# refuses a wait on the word for a number it does not hold: on a GPU, a hang)
hold = ctypes.c_int.in_dll(standin, "standin_hold_events")
event_waits = ctypes.c_int.in_dll(standin, "standin_event_waits")
u, v = gf.new_stream(), gf.new_stream()
a = gf.from_host(np.arange(8, dtype=np.float32)).sync()
b, c = gf.zeros(8, np.float32).sync(), gf.zeros(8, np.float32).sync()
hold.value = 1  # the "GPU" is behind from here
gf.copy(a, out=b).enqueue_on(u)
lane = u._lane
assert lane is not None and lane.read() < lane.issued  # its event, asked: not reached
waits = event_waits.value
gf.copy(b, out=c).enqueue_on(v)  # after the copy into b: on its event
assert event_waits.value == waits + 1
anyio.run(lambda: empty.run(gf.SingleStream()))  # (a word mark elsewhere meanwhile)
hold.value = 0
assert lane.read() == lane.issued  # the event, reached
np.testing.assert_array_equal(gf.to_host(c).sync(), np.arange(8, dtype=np.float32))
# a stream whose last mark was silent has its word written up to it when
# destroyed (so that the word can serve another stream)
raw: Any = backend.create_stream(0)  # (read inside: the cuda backend's own)
backend.mark(raw, False)
assert raw.word.read() < raw.issued
backend.destroy_stream(raw)
assert raw.word.read() == raw.issued
s.synchronize()
testing.assert_quiescent(timeout=5.0)

# a captured graph, replayed
graph = empty.then(lambda _: empty).capture(gf.new_stream())
graph.launch().sync()
anyio.run(lambda: graph.launch().run())

# a stream dropped with an array it wrote: both go, in order, without a word
live = gf.memory_stats().live_allocations
t = gf.new_stream()
y = gf.zeros(1024, np.float32).sync_on(t)
assert gf.memory_stats().live_allocations == live + 1
del t, y
gc.collect()
testing.assert_quiescent(timeout=5.0)
assert gf.memory_stats().live_allocations == live
# reserved SMs: green contexts of 16 SMs (12 asked, rounded up to 8s) and
# of the 116 left, where the pools' streams are made; a run of the class
# runs in its green context, its kernel and a fill loaded there
green = ctypes.c_int.in_dll(standin, "standin_green_contexts")
green_streams = ctypes.c_int.in_dll(standin, "standin_green_streams")
green_sms = ctypes.c_int.in_dll(standin, "standin_green_sms")
modules = ctypes.c_int.in_dll(standin, "standin_modules")
gf.init_device_contexts(backend="cuda", reserve_sms={"interactive": 12})
backend = gf.lowlevel.current_backend_object()
assert green.value == 2, green.value
assert backend.sm_count(0) == 132
made = green_streams.value
gf.new_stream(priority=1)  # (a stream made now: not one of the spares made at start)
assert green_streams.value == made + 1 and green_sms.value == 116, green_sms.value
made = green_streams.value
fast = gf.new_stream(sms="interactive", priority=2)
assert green_streams.value == made + 1 and green_sms.value == 16 and made_with.value == -2
# a class's first runs make no stream and load no module: every class's pool
# was made, and the modules compiled so far and the built-in kernels loaded
# into every green context, when the runtime started (under load, either
# would wait for the device's running kernels)
loaded, streams = modules.value, ctypes.c_int.in_dll(standin, "standin_streams")
made = streams.value
for cls in [dict(sms="interactive"), dict(priority=5), dict(sms="interactive", priority=3)]:
    with gf.latency_class(**cls):  # type: ignore[arg-type]
        z = gf.arange(64, dtype=np.float32).sync()  # a built-in kernel
        mod.scale(gf.LaunchConfig(1, 64), z, 2.0, 64).sync()
assert green_sms.value in (16, 116) and modules.value == loaded, modules.value - loaded
assert streams.value == made, streams.value - made
# a module compiled now is loaded into each context at once (the device's and
# the two green contexts'), never at a first launch; a load waits for the
# kernels running on the device, as the driver's does: a class's first run
# under load then waits for nothing
kernel_ns = ctypes.c_longlong.in_dll(standin, "standin_kernel_ns")
load_waits = ctypes.c_int.in_dll(standin, "standin_load_waits")
# (each launch: 1.5 s of "running" kernel, longer than a compile on a loaded machine)
kernel_ns.value = 1_500_000_000
mod.nothing(gf.LaunchConfig(1, 1)).sync()
t0 = time.monotonic()
late = gf.compile('extern "C" __global__ void late() {}')
assert time.monotonic() - t0 > 0.1 and load_waits.value == 1, load_waits.value  # it waited
assert modules.value == loaded + 3, modules.value - loaded
mod.nothing(gf.LaunchConfig(1, 1)).sync()  # the batch, "running" 1.5 s
t0 = time.monotonic()
with gf.latency_class(sms="interactive", priority=5):
    late.late(gf.LaunchConfig(1, 1)).sync()
    gf.zeros(4, np.float64).sync()  # (8-byte fills: a built-in kernel)
assert time.monotonic() - t0 < 0.75 and load_waits.value == 1, load_waits.value
assert modules.value == loaded + 3, modules.value - loaded
kernel_ns.value = 0
# two partitions: the second split off a green context of what the first
# left (the driver splits no split's output), that context destroyed after
gf.init_device_contexts(backend="cuda", reserve_sms={"interactive": 12, "bulk": 8})
assert green.value == 3, green.value
for name, sms in [(None, 108), ("bulk", 8), ("interactive", 16)]:
    gf.new_stream(sms=name, priority=1)
    assert green_sms.value == sms, (name, green_sms.value)
# a new runtime on the same backend: the old runtime's green contexts, which
# no stream uses any more, are destroyed (a stream the program holds keeps its own)
held = gf.new_stream(sms="bulk", priority=1)
reused = gf.lowlevel.current_backend_object()
gf.init_device_contexts(backend=reused)
assert green.value == 1, green.value  # the one of the stream still held
del held
gc.collect()
gf.memory_stats()  # (a safe point: the dropped stream's finalizer's work is done)
assert green.value == 0, green.value  # (went with its last stream)
for reserve, words in [
    ({"interactive": 126}, "128 SMs (rounded up to multiples of 8, at least 8 a partition) and at "
     "least 8 left for the rest do not fit in the device's 132"),
]:
    try:
        gf.init_device_contexts(backend="cuda", reserve_sms=reserve)
        raise AssertionError(f"{reserve} was taken")
    except gf.UsageError as exc:
        assert words in str(exc), exc
ctypes.c_int.in_dll(standin, "standin_driver_version").value = 12030
try:
    gf.init_device_contexts(backend="cuda", reserve_sms={"interactive": 8})
    raise AssertionError("reserved SMs on a driver without green contexts")
except gf.UsageError as exc:
    assert "need a driver of CUDA 12.4 or later" in str(exc) and "CUDA 12.3" in str(exc), exc
ctypes.c_int.in_dll(standin, "standin_driver_version").value = 13000
# a green context the driver cannot make: those made before it are destroyed
gf.init_device_contexts(backend="cuda")
assert green.value == 0, green.value
ctypes.c_int.in_dll(standin, "standin_green_fail_after").value = 2
try:
    gf.init_device_contexts(backend="cuda", reserve_sms={"interactive": 12, "bulk": 8})
    raise AssertionError("a green context that failed was taken")
except gf.DeviceError as exc:
    assert "cuGreenCtxCreate" in str(exc), exc
assert green.value == 0, green.value
gf.init_device_contexts(backend="cuda")
assert green.value == 0, green.value  # destroyed with the backend that made them
testing.assert_quiescent(timeout=5.0)

# every event the backend made is pooled or held by what uses it: one lost
# (taken from the pool and dropped) is named by the quiescence check
cuda_backend: Any = gf.lowlevel.current_backend_object()
dev0 = cuda_backend._devices[0]
lost = cuda_backend._record(dev0, cast(Any, gf.lowlevel.pool_streams()[0].raw).handle)
try:
    testing.assert_quiescent(timeout=5.0)
    raise AssertionError("an event lost went unseen")
except AssertionError as exc:
    assert "1 event(s) neither pooled nor held by anything" in str(exc), exc
dev0.events.append(lost)
testing.assert_quiescent(timeout=5.0)
print("stand-in program done")
