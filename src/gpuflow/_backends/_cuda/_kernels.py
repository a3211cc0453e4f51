"""What a kernel launch needs: the per-thread parameter buffer, argument
packing, and gpuflow's own built-in kernels (fills wider than a memset, arange).

``cuLaunchKernel`` is called through cuda.bindings with the address of a
per-thread parameter array (measured: faster than libcuda through ctypes,
whose per-argument conversions cost more than the bindings' whole call).
Every argument takes one 8-byte slot; a :class:`struct.Struct` per tuple of
argument types packs a launch's values straight into the slots.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._errors import UsageError
from .._records import DType, PointerArg

if TYPE_CHECKING:
    from ._handles import Token

MAX_ARGS = 512  # 8-byte slots of the per-thread parameter buffer
FILL_THREADS = 256  # built-in kernels: threads a block
FILL_MAX_BLOCKS = 8192  # built-in kernels: blocks at most (each thread loops)


class ThreadState(threading.local):
    """Per thread: which context is current, and a kernel-parameter buffer.

    The parameter buffer is ``MAX_ARGS`` pointers followed by ``MAX_ARGS``
    8-byte value slots; pointer ``i`` always points at slot ``i``, so a launch
    only packs its values (the driver copies them during ``cuLaunchKernel``).
    """

    def __init__(self) -> None:
        self.token: Token | None = None
        self.params, self.params_addr = param_array(MAX_ARGS)


def param_array(n: int) -> tuple[Any, int]:
    """``n`` pointers followed by the ``n`` 8-byte value slots they point at:
    ``(the array, to keep alive while it is used; its address)``."""
    buf = (ctypes.c_uint64 * (2 * n))()
    base = ctypes.addressof(buf)
    for i in range(n):
        buf[i] = base + 8 * (n + i)
    return buf, base


VALUES_OFFSET = 8 * MAX_ARGS


def packed(key: tuple[type, ...], values: tuple[Any, ...]) -> tuple[Any, int]:
    """A parameter array of its own for arguments that never change, laid out
    as a thread's: ``(the array, its address)``."""
    n = len(values)
    buf, base = param_array(n)
    plan(key).pack_into(buf, 8 * n, *values)
    return buf, base

_SCALAR_CODES = {
    ("f", 2): "e", ("f", 4): "f", ("f", 8): "d",
    ("i", 1): "b", ("i", 2): "h", ("i", 4): "i", ("i", 8): "q",
    ("u", 1): "B", ("u", 2): "H", ("u", 4): "I", ("u", 8): "Q",
    ("b", 1): "?",
}  # fmt: skip


def plan(key: tuple[type, ...]) -> struct.Struct:
    """How to pack arguments of the types ``key`` into the value slots."""
    if len(key) > MAX_ARGS:
        raise UsageError(f"at most {MAX_ARGS} kernel arguments, not {len(key)}")
    return struct.Struct("<" + "".join(_slot_code(t) for t in key))


def _slot_code(t: type) -> str:
    if t is PointerArg:
        return "Q"
    if issubclass(t, np.generic):
        dt = np.dtype(t)
        code = _SCALAR_CODES.get((dt.kind, dt.itemsize))
        if code is not None:
            return code + "x" * (8 - dt.itemsize)
    raise UsageError(f"kernel argument of type {t.__name__} is not supported by the cuda backend")


# -- built-in kernels: fill with 8-byte patterns, arange --------------------------
BUILTIN_SOURCE = r"""
typedef unsigned long long u64;
#define GF_LOOP for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; \
                     i += (u64)gridDim.x * blockDim.x)
__device__ __forceinline__ unsigned short gf_f2h(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float gf_h2f(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
extern "C" __global__ void gf_fill_u64(u64* p, u64 v, u64 n) { GF_LOOP p[i] = v; }
/* integers: start + (T)i * step, wrapping as NumPy does (two's complement) */
#define GF_ARANGE_U(NAME, T) \
  extern "C" __global__ void NAME(T* p, T start, T step, u64 n) { \
    GF_LOOP p[i] = (T)(i * (u64)step + (u64)start); }
GF_ARANGE_U(gf_arange_u8, unsigned char)
GF_ARANGE_U(gf_arange_u16, unsigned short)
GF_ARANGE_U(gf_arange_u32, unsigned int)
GF_ARANGE_U(gf_arange_u64, u64)
/* floats: round i to T, then one rounding per operation (no FMA), as NumPy */
extern "C" __global__ void gf_arange_f32(float* p, float start, float step, u64 n) {
  GF_LOOP p[i] = __fadd_rn(__fmul_rn(__ll2float_rn((long long)i), step), start);
}
extern "C" __global__ void gf_arange_f64(double* p, double start, double step, u64 n) {
  GF_LOOP p[i] = __dadd_rn(__dmul_rn(__ll2double_rn((long long)i), step), start);
}
extern "C" __global__ void gf_arange_f16(unsigned short* p, unsigned short start,
                                         unsigned short step, u64 n) {
  GF_LOOP {
    unsigned short hi = gf_f2h(__ll2float_rn((long long)i));
    unsigned short prod = gf_f2h(__fmul_rn(gf_h2f(hi), gf_h2f(step)));
    p[i] = gf_f2h(__fadd_rn(gf_h2f(prod), gf_h2f(start)));
  }
}
/* bool: start + astype(i, bool) * step is start | (i != 0 & step) */
extern "C" __global__ void gf_arange_b8(unsigned char* p, unsigned char start,
                                        unsigned char step, u64 n) {
  GF_LOOP p[i] = (unsigned char)(start | ((i != 0) & step));
}
"""

BUILTIN_NAMES = (
    "gf_fill_u64", "gf_arange_u8", "gf_arange_u16", "gf_arange_u32", "gf_arange_u64",
    "gf_arange_f16", "gf_arange_f32", "gf_arange_f64", "gf_arange_b8",
)  # fmt: skip
UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
BUILTIN_STRUCT = struct.Struct("<QQQQ")  # pointer, start, step, n: each in an 8-byte slot
FILL_STRUCT = struct.Struct("<QQQ")
ARANGE_F32_STRUCT = struct.Struct("<Qf4xf4xQ")
ARANGE_F64_STRUCT = struct.Struct("<QddQ")


def arange_kernel(dtype: DType) -> str:
    if dtype.kind == "f" and dtype.itemsize in (2, 4, 8):
        return f"gf_arange_f{dtype.itemsize * 8}"
    if dtype.kind in "iu" and dtype.itemsize in (1, 2, 4, 8):
        return f"gf_arange_u{dtype.itemsize * 8}"
    if dtype.kind == "b":
        return "gf_arange_b8"
    raise UsageError(f"arange does not support dtype {dtype} on the cuda backend")
