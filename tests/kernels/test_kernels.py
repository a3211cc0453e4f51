"""gf.compile, kernel signatures, argument checks, launches and LaunchConfig."""

from __future__ import annotations

import functools
import itertools
import re
import time
import uuid
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K
from helpers import simulated

import gpuflow as gf

pytestmark = pytest.mark.anyio

F32 = np.float32

SIGNATURES = r"""
// comments are not kernels: extern "C" __global__ void commented(int a) {}
/* nor are block comments: extern "C" __global__ void blocked(float* x) {} */
extern "C" {
__global__ void in_block(const double* __restrict__ a, double *b, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) b[i] = 2.0 * a[i];
}

__global__ void scalars(long long a, unsigned char b, short c, bool d, size_t e,
                        __half* h, void* raw) {}
}

extern "C" __global__ void __launch_bounds__(128) bounded(const int* const x, int* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}

extern "C" __global__ void no_args() {}

// C++ linkage: a mangled name that cannot be looked up, so not a gpuflow kernel
__global__ void mangled(int* x) {}
"""

HEADER = "struct __half;\n"  # the pointer needs no definition (and NVRTC no include path)


def _params(k: gf.Kernel) -> list[tuple[str, str, Any, bool, bool]]:
    return [(p.name, p.ctype, p.dtype, p.pointer, p.const) for p in k.params]


def test_compile_parses_signatures() -> None:
    mod = gf.compile(HEADER + SIGNATURES)
    assert set(mod.kernels) == {"in_block", "scalars", "bounded", "no_args"}
    assert _params(mod.in_block) == [
        ("a", "double", np.dtype(np.float64), True, True),
        ("b", "double", np.dtype(np.float64), True, False),
        ("n", "unsigned int", np.dtype(np.uint32), False, False),
    ]
    assert _params(mod.scalars) == [
        ("a", "long long", np.dtype(np.int64), False, False),
        ("b", "unsigned char", np.dtype(np.uint8), False, False),
        ("c", "short", np.dtype(np.int16), False, False),
        ("d", "bool", np.dtype(np.bool_), False, False),
        ("e", "size_t", np.dtype(np.uint64), False, False),
        ("h", "__half", np.dtype(np.float16), True, False),
        ("raw", "void", None, True, False),
    ]
    assert _params(mod.bounded) == [
        ("x", "int", np.dtype(np.int32), True, True),
        ("y", "int", np.dtype(np.int32), True, False),
        ("n", "int", np.dtype(np.int32), False, False),
    ]
    assert mod.no_args.params == ()
    assert mod.in_block.signature == "in_block(const double* a, double* b, unsigned int n)"
    with pytest.raises(AttributeError, match="mangled"):
        _ = mod.mangled
    with pytest.raises(AttributeError, match="commented"):
        _ = mod.commented


def test_compile_parses_the_shared_kernels() -> None:
    mod = K.module()
    assert mod.saxpy.signature == "saxpy(float a, const float* x, float* y, int n)"
    assert mod.slow_fill.signature == "slow_fill(float* x, float v, int n, long long ns)"
    assert K.fault_module().null_write.signature == "null_write(int n)"


def test_syntax_error_raises_compile_error_with_the_log() -> None:
    bad = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_name + ; }'
    with pytest.raises(gf.CompileError, match=r"(?s)could not compile.*undefined_name") as info:
        gf.compile(bad)
    err = info.value
    assert isinstance(err, gf.GpuflowError)
    assert err.log.strip()
    assert "error" in err.log and "undefined_name" in err.log
    assert err.log in str(err)


HALF = r"""
#include <cuda_fp16.h>
extern "C" __global__ void twice_h(const __half* x, __half* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __hadd(x[i], x[i]);
}
"""


def test_toolkit_headers_are_found_where_the_toolkit_is_installed() -> None:
    from gpuflow._backends._nvrtc import include_dirs  # the search path itself is under test

    if not include_dirs():
        # no toolkit headers on this machine: a clear compile error, naming the header
        with pytest.raises(gf.CompileError, match=r"cuda_fp16\.h"):
            gf.compile(HALF)
        return

    def twice_h(x: np.ndarray, y: np.ndarray, n: int) -> None:
        y[:n] = x[:n] + x[:n]

    mod = gf.compile(HALF, references={"twice_h": twice_h})
    assert mod.twice_h.signature == "twice_h(const __half* x, __half* y, int n)"
    n = 300
    x = gf.from_host(np.linspace(0, 2, n).astype(np.float16)).sync()
    y = gf.zeros(n, np.float16).sync()
    mod.twice_h(gf.LaunchConfig.for_num_elems(n), x, y, n).sync()
    np.testing.assert_array_equal(gf.to_host(y).sync(), np.linspace(0, 2, n).astype(np.float16) * 2)


def test_compile_checks_references() -> None:
    with pytest.raises(gf.UsageError, match="nope"):
        gf.compile(K.SOURCE, references={"nope": lambda: None})
    with pytest.raises(gf.UsageError, match="reference for kernel 'saxpy' is not callable"):
        gf.compile(K.SOURCE, references={"saxpy": 3})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"expected CUDA C\+\+ source text, got bytes"):
        gf.compile(b"extern")  # type: ignore[arg-type]


def test_compile_checks_each_reference_takes_the_kernels_arguments() -> None:
    src = 'extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {}'

    def defaults(a: float, x: Any, y: Any, n: int, extra: int = 0) -> None: ...

    # what can be called with the kernel's four arguments is taken
    for ok in (lambda a, x, y, n: None, lambda *args: None, lambda a, *rest: None, defaults,
               functools.partial(lambda k, a, x, y, n: None, 1), max):  # max: no signature to read
        gf.compile(src, references={"saxpy": ok})
    # what cannot is refused at once, naming the kernel and its parameters
    for bad in (lambda a, x, y: None, lambda a, x, y, n, m: None, lambda a, x, y, n, *, k: None):
        with pytest.raises(gf.UsageError) as info:
            gf.compile(src, references={"saxpy": bad})
        assert isinstance(info.value, TypeError)
        assert "reference for kernel 'saxpy' takes (a, x, y" in str(info.value)
        assert "saxpy(float a, const float* x, float* y, int n)" in str(info.value)
    with pytest.raises(gf.UsageError, match=r"kernel 'empty' takes \(x\).* in order: empty\(\)$"):
        gf.compile('extern "C" __global__ void empty() {}', references={"empty": lambda x: None})


def test_compile_documents_the_reference_convention() -> None:
    doc = gf.compile.__doc__ or ""
    for point in ("one argument per kernel parameter", "flat, 1-D NumPy view",
                  "read-only", "Python numbers", "in place"):
        assert point in " ".join(doc.split()), point


async def test_launch_with_arrays_and_scalars() -> None:
    m = K.module()
    n = 1000
    x = await gf.from_host(np.arange(n, dtype=F32))
    y = await gf.full(n, 1.0, F32)
    out = await m.saxpy(K.cfg(n), 2.0, x, y, n)
    assert out is y
    np.testing.assert_array_equal(await gf.to_host(y), 2 * np.arange(n, dtype=F32) + 1)
    # ints are fine for float parameters; NumPy scalars of the right kind too
    await m.scale(K.cfg(n), y, 3, np.int32(n))
    np.testing.assert_array_equal(await gf.to_host(y), 3 * (2 * np.arange(n, dtype=F32) + 1))


async def test_launch_with_operations_producing_arrays() -> None:
    m = K.module()
    n = 300
    # argument operations run first, in order, on the launch's stream
    op = m.vadd(K.cfg(n), gf.arange(n, dtype=F32), gf.full(n, 10.0, F32), gf.zeros(n, F32), n)
    out = await op
    assert isinstance(out, gf.DeviceArray) and out.shape == (n,)
    np.testing.assert_array_equal(await gf.to_host(out), np.arange(n, dtype=F32) + 10)
    # and through then(): the output of one launch feeds the next
    chained = await gf.to_host(
        m.scale(K.cfg(n), gf.arange(n, dtype=F32), 2.0, n).then(
            lambda a: m.saxpy(K.cfg(n), 1.0, a, gf.ones(n, F32), n)
        )
    )
    np.testing.assert_array_equal(chained, 2 * np.arange(n, dtype=F32) + 1)


def _two_ref(a: np.ndarray, b: np.ndarray, c: np.ndarray, n: int) -> None:
    b[:n] = a[:n] + 1
    c[:n] = a[:n] * 2


async def test_launch_output_is_the_written_arrays() -> None:
    m = gf.compile(
        r"""
        extern "C" __global__ void two(const int* a, int* b, int* c, int n) {
            int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) { b[i] = a[i] + 1; c[i] = a[i] * 2; }
        }
        extern "C" __global__ void none(const int* a, int n) {}
        """,
        references={"two": _two_ref, "none": lambda a, n: None},
    )
    a = await gf.arange(5, dtype=np.int32)
    b, c = await gf.zip(gf.zeros(5, np.int32), gf.zeros(5, np.int32))
    out = await m.two(K.cfg(5), a, b, c, 5)
    assert isinstance(out, tuple) and len(out) == 2
    assert out[0] is b and out[1] is c
    np.testing.assert_array_equal(await gf.to_host(b), np.arange(5) + 1)
    np.testing.assert_array_equal(await gf.to_host(c), np.arange(5) * 2)
    assert await m.none(K.cfg(5), a, 5) is None


async def test_reference_gets_flat_typed_views_and_python_scalars() -> None:
    seen: dict[str, Any] = {}

    def ref(x: np.ndarray, s: float, n: int) -> None:
        seen.update(dtype=x.dtype, ndim=x.ndim, size=x.size, s=type(s), n=type(n))
        x[:n] *= s

    m = gf.compile(K.SOURCE, references={**K.REFERENCES, "scale": ref})
    x = await gf.from_host(np.ones((4, 8), F32))
    await m.scale(K.cfg(32), x, 2.0, 32)
    np.testing.assert_array_equal(await gf.to_host(x), np.full((4, 8), 2, F32))
    if simulated():
        assert seen == {"dtype": np.dtype(F32), "ndim": 1, "size": 32, "s": float, "n": int}


async def test_argument_checks_name_the_kernel_and_the_parameter() -> None:
    m = K.module()
    c = K.cfg(4)
    x32 = await gf.zeros(4, F32)
    x64 = await gf.zeros(4, np.float64)
    cases: list[tuple[tuple[Any, ...], str]] = [
        ((2.0, x32, x32), "takes 4 arguments, got 3"),
        ((2.0, x32, x32, 4, 5), "takes 4 arguments, got 5"),
        ((2.0, x64, x32, 4), r"const float\* x.*float32.*float64"),
        ((2.0, x32, x64, 4), r"float\* y.*float32.*float64"),
        ((2.0, x32, x32, 4.0), r"int n.*expected an int scalar, got float"),
        ((2.0, x32, x32, 2**31), r"int n.*out of range"),
        ((2.0, x32, x32, -(2**31) - 1), r"int n.*out of range"),
        ((2.0, x32, x32, True), r"int n.*bool"),
        (("2", x32, x32, 4), r"float a.*str"),
        ((2.0, np.zeros(4, F32), x32, 4), r"const float\* x.*needs a DeviceArray.*ndarray"),
        ((2.0, x32, 7, 4), r"float\* y.*needs a DeviceArray.*int"),
        # an operation whose output is known before it runs is checked at once too
        ((2.0, gf.ones(4), x32, 4), r"const float\* x': needs a float32 array, got an "
         r"operation \(<gpuflow.DeviceOperation full \(4,\) float64 = 1.0>\), which makes a "
         r"float64 one"),
        ((2.0, x32, gf.copy(x64), 4), r"float\* y.*needs a float32 array.*makes a float64"),
        ((2.0, x32, gf.from_host(np.zeros(4, np.int32)), 4), r"float\* y.*makes a int32"),
        ((2.0, x32, x32, gf.zeros(1, np.int32)), r"int n': expected an int scalar, got an "
         r"operation .*which makes an array"),
    ]
    for args, pattern in cases:
        with pytest.raises(gf.UsageError, match=pattern) as info:
            m.saxpy(c, *args)
        assert "saxpy" in str(info.value)
    with pytest.raises(gf.UsageError, match=r"must be a gf\.LaunchConfig .*, got tuple"):
        m.saxpy((1, 4), 2.0, x32, x32, 4)  # type: ignore[arg-type]
    with pytest.raises(gf.UsageError, match=re.escape(
        "the first argument must be a gf.LaunchConfig (e.g. gf.LaunchConfig.for_num_elems(n)), "
        "got an operation (<gpuflow.DeviceOperation full (8,) float64 = 1.0>)"
    )):  # fmt: skip
        m.saxpy(gf.ones(8), 2.0, x32, x32, 4)  # type: ignore[arg-type]
    # what an operation makes is not known before it runs: checked then, as before
    assert m.saxpy(c, 2.0, x32, gf.value(x32).then(gf.value), 4) is not None


async def test_bad_arguments_enqueue_nothing() -> None:
    m = K.module()
    counter = await gf.zeros(1, np.int32)
    x64 = await gf.zeros(4, np.float64)
    with pytest.raises(gf.UsageError, match=r"saxpy.*const float\* x.*float32.*float64"):
        m.saxpy(K.cfg(4), 2.0, x64, x64, 4)
    # an operation argument is checked when it has produced its array, before the launch
    op = K.bump(counter).then(
        lambda _: m.saxpy(K.cfg(4), 2.0, gf.zeros(4, np.float64), gf.zeros(4, F32), 4)
    )
    with pytest.raises(gf.UsageError, match=r"saxpy.*const float\* x.*float64"):
        await op
    y = await gf.full(4, 1.0, F32)
    with pytest.raises(gf.UsageError, match=r"saxpy.*int n"):
        await m.saxpy(K.cfg(4), 2.0, y, y, gf.value(4.5))
    np.testing.assert_array_equal(await gf.to_host(y), np.ones(4, F32))
    assert (await gf.to_host(counter))[0] == 1  # only the bump before the bad launch ran


@pytest.mark.sim_only
async def test_kernel_without_a_reference_fails_naming_it() -> None:
    m = gf.compile(K.SOURCE, references={"saxpy": K.saxpy_ref})
    x = await gf.ones(4, F32)
    with pytest.raises(gf.GpuflowError, match=r"'scale'.*reference"):
        await m.scale(K.cfg(4), x, 2.0, 4)
    np.testing.assert_array_equal(await gf.to_host(x), np.ones(4, F32))
    # the module's other kernels still run
    await m.saxpy(K.cfg(4), 1.0, x, x, 4)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(4, 2, F32))


def test_launch_config_validation() -> None:
    cfg = gf.LaunchConfig(4, 128)
    assert cfg.grid == (4, 1, 1) and cfg.block == (128, 1, 1) and cfg.shmem == 0
    cfg = gf.LaunchConfig((2, 3), (8, 8, 2), shmem=1024)
    assert cfg.grid == (2, 3, 1) and cfg.block == (8, 8, 2) and cfg.shmem == 1024
    assert gf.LaunchConfig(np.int64(2), 32) == gf.LaunchConfig((2, 1, 1), (32,))
    assert hash(gf.LaunchConfig(2, 32)) == hash(gf.LaunchConfig((2,), (32, 1)))
    for grid, block, shmem, field, bad in [
        (0, 32, 0, "grid", 0),
        (1, 0, 0, "block", 0),
        ((1, 2, 3, 4), 32, 0, "grid", (1, 2, 3, 4)),
        ((), 32, 0, "grid", ()),
        (1.5, 32, 0, "grid", 1.5),
        (1, 32, -1, "shmem", -1),
        (1, 32, 1.0, "shmem", 1.0),
        (-2, 32, 0, "grid", -2),
        ("1", 32, 0, "grid", "1"),
    ]:
        refused = rf"LaunchConfig: {field} must be .*, not {re.escape(repr(bad))}$"
        with pytest.raises(gf.UsageError, match=refused):
            gf.LaunchConfig(grid, block, shmem)  # type: ignore[arg-type]


def test_launch_config_for_num_elems() -> None:
    assert gf.LaunchConfig.for_num_elems(1000) == gf.LaunchConfig(4, 256)
    assert gf.LaunchConfig.for_num_elems(1024) == gf.LaunchConfig(4, 256)
    assert gf.LaunchConfig.for_num_elems(1025) == gf.LaunchConfig(5, 256)
    assert gf.LaunchConfig.for_num_elems(1) == gf.LaunchConfig(1, 256)
    assert gf.LaunchConfig.for_num_elems(0) == gf.LaunchConfig(1, 256)
    assert gf.LaunchConfig.for_num_elems(100, block=32) == gf.LaunchConfig(4, 32)
    for bad in (-1, 2.5, "10"):
        refused = rf"for_num_elems: n must be a non-negative int, not {re.escape(repr(bad))}$"
        with pytest.raises(gf.UsageError, match=refused):
            gf.LaunchConfig.for_num_elems(bad)  # type: ignore[arg-type]


def _past_limits() -> list[tuple[gf.LaunchConfig, str]]:
    """A launch one past each of device 0's limits, and what refuses it."""
    lim = gf.lowlevel.current_backend_object().launch_limits(0)
    gx, gy, gz = lim.max_grid
    bx, by, bz = lim.max_block
    return [
        (gf.LaunchConfig((gx + 1, 1, 1), 32),
         rf"grid=\({gx + 1}, 1, 1\) asks for {gx + 1} along x, past the device's limit of {gx} "
         r"\(the most blocks a grid has along x\)"),
        (gf.LaunchConfig((1, gy + 1, 1), 32), rf"along y, past the device's limit of {gy}"),
        (gf.LaunchConfig((1, 1, gz + 1), 32), rf"along z, past the device's limit of {gz}"),
        (gf.LaunchConfig(1, (bx + 1, 1, 1)),
         rf"block=\({bx + 1}, 1, 1\) asks for {bx + 1} along x, past the device's limit of "
         rf"{bx} \(the most threads a block has along x\)"),
        (gf.LaunchConfig(1, (1, by + 1, 1)), rf"along y, past the device's limit of {by}"),
        (gf.LaunchConfig(1, (1, 1, bz + 1)), rf"along z, past the device's limit of {bz}"),
        (gf.LaunchConfig(1, (32, lim.max_threads_per_block // 32 + 1)),
         rf"is {32 * (lim.max_threads_per_block // 32 + 1)} threads, past the device's limit "
         rf"of {lim.max_threads_per_block} threads a block"),
        (gf.LaunchConfig(1, 32, shmem=lim.max_shared_memory_per_block + 1),
         rf"shmem={lim.max_shared_memory_per_block + 1} bytes, past the device's limit of "
         rf"{lim.max_shared_memory_per_block} bytes of shared memory a block"),
    ]  # fmt: skip


async def test_a_launch_past_the_devices_limits_is_refused_when_built() -> None:
    m = K.module()
    x = await gf.ones(4, F32)
    for config, refused in _past_limits():
        with pytest.raises(gf.UsageError, match=r"kernel 'scale' on device 0: .*" + refused):
            m.scale(config, x, 2.0, 4)
    # each limit itself is within: built (not run: a grid that large takes long)
    lim = gf.lowlevel.current_backend_object().launch_limits(0)
    edges: list[tuple[tuple[int, int, int], tuple[int, int, int]]] = [
        (lim.max_grid, (1, 1, 1)), ((1, 1, 1), (lim.max_block[0], 1, 1)),
        ((1, 1, 1), (1, 1, lim.max_block[2])),
    ]  # fmt: skip
    for grid, block in edges:
        m.scale(gf.LaunchConfig(grid, block), x, 2.0, 4)
    m.scale(gf.LaunchConfig(1, 32, shmem=lim.max_shared_memory_per_block), x, 2.0, 4)
    # nothing was enqueued; the device works on
    await m.scale(gf.LaunchConfig(1, lim.max_threads_per_block), x, 2.0, 4)
    np.testing.assert_array_equal(await gf.to_host(x), np.full(4, 2, F32))


@pytest.mark.sim_only  # (a backend whose two devices differ)
async def test_a_launch_run_on_another_device_is_checked_against_that_devices_limits() -> None:
    from gpuflow._backends import LaunchLimits, SimBackend

    class Unequal(SimBackend):
        def launch_limits(self, device: int) -> LaunchLimits:
            small = LaunchLimits((64, 64, 64), (1024, 1024, 64), 128, 1024)
            return super().launch_limits(device) if device == 0 else small

    gf.init_device_contexts(backend=Unequal(2))
    m = gf.compile(K.SOURCE, references=K.REFERENCES)
    op = m.spin(gf.LaunchConfig(1, 256), 0)  # within device 0's limits
    await op
    with gf.use_device(1), pytest.raises(
        gf.UsageError, match=r"kernel 'spin' on device 1: block=\(256, 1, 1\) is 256 threads, "
        r"past the device's limit of 128 threads a block"
    ):
        await op
    with gf.testing.record_activity() as record, gf.use_device(1):
        with pytest.raises(gf.UsageError):
            await op
    assert not [a for a in record if a.what.startswith("kernel")]  # nothing was enqueued


async def test_kernels_of_one_module_on_two_devices() -> None:
    if K.num_devices() < 2:
        pytest.skip("needs two devices")
    m = K.module()
    policy = gf.SingleStream(device=1)
    x = await m.scale(K.cfg(8), gf.arange(8, dtype=F32), 3.0, 8).run(policy)
    assert x.device == 1
    np.testing.assert_array_equal(await gf.to_host(x).run(policy), 3 * np.arange(8, dtype=F32))
    y = await gf.arange(8, dtype=F32)
    with pytest.raises(gf.UsageError, match=r"device 0.*device 1"):
        await m.scale(K.cfg(8), y, 3.0, 8).run(policy)


def test_dropping_a_module_while_a_kernel_runs_stalls_no_collection() -> None:
    """Unloading a CUDA module waits until the device is idle, so gpuflow never
    unloads one from a finalizer: a garbage collection (in an event loop, in
    the completer) must not wait for the GPU work in flight."""
    import gc
    import time
    import uuid

    # a module of its own (a source no other test compiles), loaded by a launch
    tag = uuid.uuid4().hex
    src = f'extern "C" __global__ void own_{tag}(int* c) {{ c[0] += 1; }}'
    mod = gf.compile(src, references={f"own_{tag}": lambda c: c.__setitem__(0, c[0] + 1)})
    counter = K.counter()
    getattr(mod, f"own_{tag}")(gf.LaunchConfig(1, 1), counter).sync()
    assert K.read_count(counter) == 1
    x = gf.zeros(64, F32).sync()
    stream = gf.new_stream()
    K.slow_fill(x, 1.0, 1.0).enqueue_on(stream)  # a second of GPU work
    t0 = time.monotonic()
    del mod
    gc.collect()
    took = time.monotonic() - t0
    assert took < 0.5, f"the collection waited {took:.2f} s for the GPU"
    stream.synchronize()


def test_compiling_leaves_the_interpreters_own_objects_alone() -> None:
    """NVRTC writes its log into the buffer gpuflow hands it; a log of one byte
    (a clean compile: its NUL) once went into the interpreter's cached
    ``b" "``, after which every ``" ".encode()`` of the process gave
    ``b"\\x00"`` (and ``import torch`` failed parsing a schema)."""
    import uuid

    tag = uuid.uuid4().hex  # a source no cache has seen: NVRTC runs
    gf.compile(f'extern "C" __global__ void clean_{tag}(float* x) {{ x[0] = 1; }}')
    # (compared by value: ``b" "`` itself is the cached object)
    space = " "
    assert list(space.encode()) == [32]
    assert list(b" ") == [32]


_IMPORT_AFTER_COMPILE = {
    "torch": "import torch; from torch.library import infer_schema\n"
    "def annotate(tag: str) -> None: ...\n"
    "print(infer_schema(annotate, mutates_args=()))",
    "cupy": "import cupy; print(cupy.__version__)",
    "jax": "import jax; print(jax.__version__)",
}


@pytest.mark.sim_only
@pytest.mark.parametrize("library", sorted(_IMPORT_AFTER_COMPILE))
def test_a_library_imported_after_a_compile_works(library: str) -> None:
    """In a fresh process: compile first, then import the other library (its
    module code, with no GPU needed, must run as in a process without gpuflow)."""
    import subprocess
    import sys
    from importlib.util import find_spec

    if find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    code = (
        "import gpuflow as gf\n"
        "gf.init_device_contexts(backend='sim')\n"
        "gf.compile('extern \"C\" __global__ void k(float* x) { x[0] = 1; }')\n"
        + _IMPORT_AFTER_COMPILE[library]
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if library == "torch":
        assert "(str tag) -> ()" in proc.stdout


@pytest.mark.sim_only
def test_modules_load_ahead_where_loading_waits_for_running_kernels() -> None:
    """Where loading a module waits for the device's running kernels (CUDA,
    and sim as it does), a module is loaded into every context that runs it
    when it is compiled or when a runtime starts, never at a first launch
    (which would stall the thread launching)."""
    tag = uuid.uuid4().hex
    src = (
        f'extern "C" __global__ void a_{tag}(int* x) {{}}\n'
        f'extern "C" __global__ void b_{tag}(int* x) {{}}'
    )
    refs = {f"a_{tag}": lambda x: None, f"b_{tag}": lambda x: None}
    before = gf.compile(src.replace(tag, tag + "0"), references={
        k.replace(tag, tag + "0"): v for k, v in refs.items()
    })
    gf.init_device_contexts(backend="sim", num_devices=2, reserve_sms={"interactive": 8})
    be: Any = gf.lowlevel.current_backend_object()
    assert be.loads_wait_for_kernels
    # the runtime started: what was compiled is loaded in each device's own
    # context and its two partitions' (the reserved SMs, the SMs left)
    where = be.loads.loaded(before.source)
    assert {d for d, _c in where} == {0, 1} and len(where) == 2 * (1 + 2), where
    assert sum(c is None for _d, c in where) == 2
    mod = gf.compile(src, references=refs)  # compiled with a runtime: loaded now
    assert len(be.loads.loaded(mod.source)) == 2 * 3
    count = be.loads.count
    x = gf.zeros(4, np.int32).sync()
    getattr(mod, f"a_{tag}")(gf.LaunchConfig(1, 1), x).sync()
    getattr(before, f"b_{tag}0")(gf.LaunchConfig(1, 1), x).sync()
    with gf.latency_class(sms="interactive"):
        getattr(mod, f"b_{tag}")(gf.LaunchConfig(1, 1), x).sync()
    assert be.loads.count == count  # the first launches loaded nothing


# -- a module's load waits for the device's running kernels -------------------------------------


def _new_source() -> str:
    """The test kernels' source as a module never loaded before: a kernel of
    its own (a comment would leave the binary, which the driver loads, as it was)."""
    return K.SOURCE + f'\nextern "C" __global__ void new_{uuid.uuid4().hex}() {{}}\n'


async def _while_a_kernel_runs(seconds: float, work: Any) -> tuple[float, float]:
    """Run ``work()`` (an async function) 20 ms into a kernel of ``seconds``;
    how long it took, and the longest the loop went without running a
    ticking task meanwhile."""
    ticks: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while True:
            ticks.append(time.monotonic())  # (the turn after a stall is counted too)
            if done.is_set():
                return
            await anyio.sleep(0.002)

    async with anyio.create_task_group() as tg:
        tg.start_soon(K.spin(1, seconds).run)
        await anyio.sleep(0.02)
        tg.start_soon(ticker)
        await anyio.sleep(0.01)
        t0 = time.monotonic()
        await work()
        took = time.monotonic() - t0
        done.set()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    return took, max(gaps)


@pytest.mark.alone  # (compares the loop's gaps with a kernel's time)
async def test_a_compile_in_the_loop_stalls_it_behind_running_kernels_and_compile_async_does_not(
) -> None:
    K.module()  # (NVRTC and the spin kernel's module, before anything is timed)
    got: list[gf.Module] = []

    async def in_a_worker() -> None:
        got.append(await gf.compile_async(_new_source(), references=K.REFERENCES))

    took, gap = await _while_a_kernel_runs(0.5, in_a_worker)
    assert took > 0.3, took  # the load waited for the kernel
    assert gap < 0.15, gap  # the loop served meanwhile
    x = await gf.zeros(4, np.float32)
    await got[0].scale(K.cfg(4), x, 2.0, 4)  # loaded: it runs

    async def in_the_loop() -> None:
        got.append(gf.compile(_new_source(), references=K.REFERENCES))

    took, gap = await _while_a_kernel_runs(0.5, in_the_loop)
    assert took > 0.3 and gap > 0.3, (took, gap)  # the loop stood still behind the kernel


async def test_compile_async_checks_its_source_before_any_thread() -> None:
    with pytest.raises(gf.UsageTypeError, match=r"compile_async\(\) expected CUDA C\+\+ source"):
        await gf.compile_async(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(gf.CompileError):
        await gf.compile_async('extern "C" __global__ void broken( {')
