"""DLPack through ctypes: its C structures, and capsules made and consumed.

DLPack (``dlpack.h``) is a C ABI.  One strided array is a ``DLTensor``
inside a ``DLManagedTensor`` (or, since DLPack 1.0, a
``DLManagedTensorVersioned``, which adds a version and flags), whose
``deleter`` the consumer calls once it no longer needs the memory.  In
Python the struct travels in a PyCapsule named ``"dltensor"``
(``"dltensor_versioned"``); a consumer that takes ownership renames the
capsule ``"used_dltensor"`` (``"used_dltensor_versioned"``), after which
only the deleter releases the memory.

Export (:func:`export_capsule`): the struct, its shape and strides are
ctypes objects kept in a registry keyed by the struct's address, together
with a ``release`` callable that keeps the exported memory alive; the
deleter pops the entry and calls ``release``.

Import (:func:`read_capsule`, then :func:`take_capsule`): the struct is
read and checked while the capsule is still the producer's (a refusal
leaves it to the producer's own capsule destructor), then the capsule is
renamed and a :class:`ManagedTensor` owns it, calling the producer's
deleter once when it is dropped.

Threads and the GIL, chosen per call:

* the PyCapsule C-API is called through ``ctypes.pythonapi`` (the
  ``PYFUNCTYPE`` convention): those functions need the GIL held, and a
  Python error they set is raised;
* gpuflow's deleter is a ``CFUNCTYPE`` callback: consumers call it from
  any thread, with or without the GIL (PyTorch frees tensors from C++),
  and ctypes' callback trampoline takes the GIL (``PyGILState_Ensure``)
  around the Python body whatever the prototype, so the C calling
  convention of the struct's function pointer is the one to declare;
* a producer's deleter is called through a ``CFUNCTYPE`` prototype, which
  releases the GIL for the call: DLPack deleters may be called without it
  (CuPy's and cuda.core's take it themselves, NumPy's calls
  ``PyGILState_Ensure``), and holding it across a deleter that takes locks
  of its own (an allocator's mutex) could deadlock against a thread that
  holds such a lock and waits for the GIL.

Capsules gpuflow makes have no destructor.  A capsule destructor written in
Python (a ctypes callback) runs inside the capsule's deallocation, which
can happen while an exception propagates (a consumer that fails after
calling ``__dlpack__``): a Python callback cannot run there without
replacing that exception with a ``SystemError``.  Instead the capsules
given out are kept in :data:`_pending` and swept at every export and
import: one renamed by its consumer is forgotten, one that nobody else
references any more was dropped unconsumed, and its deleter runs then.
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._backends import DType
from .._errors import UsageError

# -- dlpack.h -------------------------------------------------------------------------------

KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_ROCM_HOST = 11
KDL_CUDA_MANAGED = 13

FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1

#: The DLPack version gpuflow produces and understands (the structures of 1.0
#: and 1.1 are the same; 1.1 only adds types gpuflow does not pass).
VERSION = (1, 1)

_INT, _UINT, _FLOAT, _BFLOAT, _COMPLEX, _BOOL = 0, 1, 2, 4, 5, 6
_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat", 5: "complex",
               6: "bool", 7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz",
               10: "float8_e4m3fn", 11: "float8_e4m3fnuz", 12: "float8_e5m2",
               13: "float8_e5m2fnuz", 14: "float8_e8m0fnu", 15: "float6_e2m3fn",
               16: "float6_e3m2fn", 17: "float4_e2m1fn"}  # fmt: skip
_KIND_CODES = {"i": _INT, "u": _UINT, "f": _FLOAT, "c": _COMPLEX, "b": _BOOL}
_CODE_KINDS = {code: kind for kind, code in _KIND_CODES.items()}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensor*)
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensorVersioned*)
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


#: The C type of both deleters: ``void (*)(void* self)``.
DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# Capsule names must outlive their capsules: module constants, never freed.
_UNUSED = b"dltensor"
_USED = b"used_dltensor"
_UNUSED_V = b"dltensor_versioned"
_USED_V = b"used_dltensor_versioned"

# Prototypes of gpuflow's own (ctypes.pythonapi's shared function objects
# may have their argtypes set by anyone): the PYFUNCTYPE convention holds the
# GIL across the call and raises a Python error the function sets.
_py_object, _ptr, _str, _int = ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
_capsule_new = ctypes.PYFUNCTYPE(_py_object, _ptr, _str, _ptr)(
    ("PyCapsule_New", ctypes.pythonapi)
)
_capsule_is_valid = ctypes.PYFUNCTYPE(_int, _py_object, _str)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_get_pointer = ctypes.PYFUNCTYPE(_ptr, _py_object, _str)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_capsule_set_name = ctypes.PYFUNCTYPE(_int, _py_object, _str)(
    ("PyCapsule_SetName", ctypes.pythonapi)
)


# -- dtypes ---------------------------------------------------------------------------------


def dl_dtype(dtype: DType) -> tuple[int, int]:
    """DLPack's ``(code, bits)`` of a dtype gpuflow arrays hold."""
    return _KIND_CODES[dtype.kind], dtype.itemsize * 8


def np_dtype(code: int, bits: int, lanes: int) -> DType:
    """The NumPy dtype of a DLPack dtype; UsageError for one gpuflow cannot pass."""
    kind = _CODE_KINDS.get(code)
    name = _CODE_NAMES.get(code, f"type code {code}")
    if lanes != 1:
        raise UsageError(
            f"DLPack dtype {name}{bits}x{lanes} is a vector type: gpuflow passes scalars"
        )
    try:
        if kind is None:
            raise TypeError
        dt = np.dtype(f"{kind}{bits // 8}") if bits % 8 == 0 else None
    except TypeError:
        dt = None
    if dt is None or dt.itemsize * 8 != bits or (kind == "b" and bits != 8):
        raise UsageError(
            f"DLPack dtype {name}{bits} has no gpuflow dtype (gpuflow arrays hold bool, "
            "int8..int64, uint8..uint64, float16, float32, float64, complex64, complex128)"
        )
    return dt


# -- export ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _Export:
    """The C memory of one exported tensor, and what keeps its array alive."""

    struct: ctypes.Structure
    shape: Any
    strides: Any
    release: Callable[[], None]


#: Exported tensors whose deleter has not run, by the struct's address.
_exports: dict[int, _Export] = {}
#: Capsules given out that were not yet seen consumed or dropped:
#: id -> (capsule, struct address, its unused name).
_pending: dict[int, tuple[Any, int, bytes]] = {}


def _delete(address: int | None) -> None:
    export = _exports.pop(address or 0, None)  # (atomic: a deleter runs once)
    if export is None:
        return
    try:
        export.release()
    except BaseException as exc:  # never into the consumer's C code
        warnings.warn(f"gpuflow: releasing an exported array failed: {exc!r}", stacklevel=1)


#: The C function pointer consumers call; lives as long as the process.
_deleter_callback = DELETER(_delete)
_DELETER_ADDRESS: int = ctypes.cast(_deleter_callback, ctypes.c_void_p).value or 0


def export_capsule(
    ptr: int,
    device: int,
    shape: tuple[int, ...],
    dtype: DType,
    release: Callable[[], None],
    *,
    version: tuple[int, int] | None,
    flags: int = 0,
) -> Any:
    """A DLPack capsule of the C-contiguous array at ``ptr`` on CUDA device ``device``.

    ``release`` runs once, when the consumer calls the deleter (on any
    thread, with the GIL), or when the capsule is dropped unconsumed (at a
    later :func:`sweep`); it must not raise.  ``version`` None makes a
    legacy ``"dltensor"`` capsule, else a versioned one with ``flags``.
    """
    sweep()
    ndim = len(shape)
    strides = [1] * ndim
    for i in range(ndim - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_arr = (ctypes.c_int64 * max(ndim, 1))(*strides)
    managed: DLManagedTensor | DLManagedTensorVersioned
    if version is None:
        managed = DLManagedTensor()
        name = _UNUSED
    else:
        managed = DLManagedTensorVersioned()
        managed.version = DLPackVersion(*version)
        managed.flags = flags
        name = _UNUSED_V
    t = managed.dl_tensor
    t.data = ptr
    t.device = DLDevice(KDL_CUDA, device)
    t.ndim = ndim
    t.dtype = DLDataType(*dl_dtype(dtype), 1)
    t.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    address = ctypes.addressof(managed)
    managed.manager_ctx = address
    managed.deleter = _DELETER_ADDRESS
    _exports[address] = _Export(managed, shape_arr, strides_arr, release)
    try:
        capsule = _capsule_new(address, name, None)
    except BaseException:
        del _exports[address]
        raise
    _pending[id(capsule)] = (capsule, address, name)
    return capsule


def _refs(entry: tuple[Any, int, bytes]) -> int:
    return sys.getrefcount(entry[0])


# the count _refs gives for a capsule that only its _pending entry holds
_ONLY_OURS = _refs({0: (object(), 0, b"")}[0])


def sweep() -> None:
    """Forget the capsules consumers renamed; release those dropped unconsumed."""
    for key in list(_pending):
        entry = _pending.get(key)
        if entry is None:
            continue
        # renamed: a consumer took it, and its deleter call releases
        consumed = not _capsule_is_valid(entry[0], entry[2])
        if consumed or _refs(entry) <= _ONLY_OURS:
            if _pending.pop(key, None) is not None and not consumed:
                _delete(entry[1])  # (pop: another thread may be sweeping too)


def mark_copied(capsule: object) -> None:
    """Set ``IS_COPIED`` on a versioned capsule not yet consumed (no-op on a legacy one)."""
    if _capsule_is_valid(capsule, _UNUSED_V):
        address = _capsule_get_pointer(capsule, _UNUSED_V)
        DLManagedTensorVersioned.from_address(address).flags |= FLAG_IS_COPIED


def capsule_name(capsule: object) -> str | None:
    """The name of a DLPack capsule, one of the four; None for anything else."""
    if type(capsule).__name__ != "PyCapsule":
        return None
    for name in (_UNUSED, _USED, _UNUSED_V, _USED_V):
        if _capsule_is_valid(capsule, name):
            return name.decode()
    return None


# -- import ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """What a DLPack capsule describes (read before the capsule is taken)."""

    address: int  # of the managed struct
    deleter: int  # its deleter's address (0: none)
    versioned: bool
    ptr: int  # data + byte_offset
    device_type: int
    device_id: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None  # in elements; None: C-contiguous
    code: int
    bits: int
    lanes: int
    readonly: bool
    copied: bool  # the producer made a copy (DLPack 1.0's IS_COPIED flag)
    version: tuple[int, int] | None  # None: a legacy capsule


def is_capsule(x: object) -> bool:
    return type(x).__name__ == "PyCapsule"


def read_capsule(capsule: object) -> Tensor:
    """Read an unconsumed DLPack capsule; it stays the producer's."""
    if _capsule_is_valid(capsule, _UNUSED_V):
        address = _capsule_get_pointer(capsule, _UNUSED_V) or 0
        mv = DLManagedTensorVersioned.from_address(address)
        if mv.version.major != VERSION[0]:
            raise UsageError(
                f"the DLPack capsule is version {mv.version.major}.{mv.version.minor}; "
                f"gpuflow understands {VERSION[0]}.x"
            )
        t, deleter, versioned = mv.dl_tensor, mv.deleter, True
        readonly = bool(mv.flags & FLAG_READ_ONLY)
        copied = bool(mv.flags & FLAG_IS_COPIED)
        version: tuple[int, int] | None = (int(mv.version.major), int(mv.version.minor))
    elif _capsule_is_valid(capsule, _UNUSED):
        address = _capsule_get_pointer(capsule, _UNUSED) or 0
        m = DLManagedTensor.from_address(address)
        t, deleter, versioned, readonly, copied = m.dl_tensor, m.deleter, False, False, False
        version = None
    else:
        raise UsageError(
            f"{capsule_name(capsule) or 'the capsule'!r} is not a DLPack capsule that can be "
            "consumed (a capsule is consumed once: 'used_dltensor' means it was)"
        )
    ndim = int(t.ndim)
    if ndim < 0:
        raise UsageError(f"the DLPack tensor has ndim {ndim}")
    shape = tuple(int(t.shape[i]) for i in range(ndim)) if ndim else ()
    strides = tuple(int(t.strides[i]) for i in range(ndim)) if ndim and t.strides else None
    return Tensor(
        address=address,
        deleter=int(deleter or 0),
        versioned=versioned,
        ptr=int(t.data or 0) + int(t.byte_offset),
        device_type=int(t.device.device_type),
        device_id=int(t.device.device_id),
        shape=shape,
        strides=strides,
        code=int(t.dtype.code),
        bits=int(t.dtype.bits),
        lanes=int(t.dtype.lanes),
        readonly=readonly,
        copied=copied,
        version=version,
    )


class ManagedTensor:
    """Ownership of a consumed DLPack tensor: its producer's deleter is called
    once, when this object is dropped (on whichever thread drops it)."""

    __slots__ = ("_address", "_deleter")

    def __init__(self, address: int, deleter: int) -> None:
        self._address = address
        self._deleter = deleter

    def __del__(self) -> None:
        deleter, self._deleter = self._deleter, 0
        if deleter and not sys.is_finalizing():  # (at exit the producer may be gone)
            DELETER(deleter)(self._address)

    def __repr__(self) -> str:
        return f"<gpuflow DLPack tensor 0x{self._address:x}>"


def take_capsule(capsule: object, tensor: Tensor) -> ManagedTensor:
    """Consume the capsule ``tensor`` was read from: rename it, own the tensor."""
    used = _USED_V if tensor.versioned else _USED
    if _capsule_set_name(capsule, used) != 0:
        raise UsageError("the DLPack capsule could not be renamed")  # (Python error set too)
    return ManagedTensor(tensor.address, tensor.deleter)
