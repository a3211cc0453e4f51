"""``cuda.bindings.driver``, and how a driver result becomes a gpuflow error.

The bindings are imported on first use, so that importing gpuflow needs no
CUDA.  A failed driver call becomes a :class:`DeviceError` that keeps the
driver's code and name; the class comes from the table both backends share
(:mod:`.._codes`); a sticky code is recorded as the device's fault, which
every later call on the device raises until a reset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

from ..._errors import DeviceError, DeviceFaultError, OutOfMemoryError
from .._codes import CUDA_SUCCESS, error_class

if TYPE_CHECKING:
    from ._handles import Dev

_cu_module: Any = None


def driver() -> Any:
    """``cuda.bindings.driver``, imported on first use (no libcuda needed to import it)."""
    global _cu_module
    if _cu_module is None:
        from cuda.bindings import driver as cu

        _cu_module = cu
    return _cu_module


def cuda_device_count() -> int:
    """How many CUDA devices the driver reports; 0 where there is no driver or device."""
    try:
        cu = driver()
        (err,) = cu.cuInit(0)
        if int(err) != CUDA_SUCCESS:
            return 0
        err, n = cu.cuDeviceGetCount()
        return int(n) if int(err) == CUDA_SUCCESS else 0
    except Exception:  # no driver library, no device, broken install: no CUDA here
        return 0


def err_name(rc: int) -> str:
    """The driver's name for ``rc`` (``CUDA_ERROR_...``)."""
    try:
        return str(driver().CUresult(rc).name)
    except Exception:
        return f"CUresult {rc}"


def check(res: Any, what: str, dev: Dev | None = None) -> tuple[Any, ...]:
    """Unpack a cuda.bindings result tuple, raising on an error code."""
    rc = int(res[0])
    if rc != CUDA_SUCCESS:
        fail(rc, what, dev)
    return tuple(res[1:])


def fail(rc: int, what: str, dev: Dev | None, launch: bool = False) -> NoReturn:
    name = err_name(rc)
    index = None if dev is None else dev.index
    cls = error_class(rc, launch=launch)
    if cls is DeviceFaultError:
        if dev is not None:
            raise record_fault(dev, rc, name, what)
        cls = DeviceError  # no device to hold the fault
    if cls is OutOfMemoryError:
        raise OutOfMemoryError(
            f"{what}: out of memory on CUDA device {index}", code=rc, name=name, device=index
        )
    raise cls(f"{what} failed", code=rc, name=name, device=index)


def record_fault(dev: Dev, rc: int, name: str, what: str) -> DeviceFaultError:
    with dev.lock:
        if dev.fault is None:
            dev.fault = DeviceFaultError(
                f"CUDA device {dev.index} ({dev.name}) has a sticky fault, seen by {what}; "
                "until a reset (which the driver may refuse: then restart the process) "
                "every call on the device fails",
                code=rc,
                name=name,
                device=dev.index,
            )
        return dev.fault
