"""``cuda.bindings.driver``, and the one place a driver result becomes a gpuflow error.

The bindings are imported on first use, so that importing gpuflow needs no
CUDA.  Every failed driver call goes through :func:`error_for`: the error
keeps the driver's code and name, its class comes from the table both
backends share (:mod:`.._codes`), and a sticky code is recorded as the
device's fault, which every later call on the device raises until a reset.
A cuda.bindings result tuple is unpacked by :func:`check`; libcuda's ctypes
entry points (:mod:`._native`) return the bare code, which their callers
test in place (``if rc: raise error_for(...)``): they sit on the
per-operation path, where one more function call a result would show.
Callers that must not raise (finalizers, completion checks) still pass a
failure through :func:`error_for`, for the fault it records, and drop the
error it returns or, in a finalizer, warn about it (:func:`warn_unless_fault`).
"""

from __future__ import annotations

import glob
import os
import warnings
from typing import TYPE_CHECKING, Any

from ..._errors import DeviceError, DeviceFaultError, OutOfMemoryError
from .._codes import CUDA_ERROR_NO_DEVICE, error_class

if TYPE_CHECKING:
    from ._handles import Dev

_cu_module: Any = None


def driver() -> Any:
    """``cuda.bindings.driver``, imported on first use (no libcuda needed to import it)."""
    global _cu_module
    if _cu_module is None:
        # Independent streams must not queue behind each other's work: CUDA maps
        # streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues, 8 unless
        # set, and the default policy grows the pool past 8 when streams stall:
        # with 8 queues fast requests missed their deadlines behind slow ones
        # (docs/performance.md, "Measurements behind the code").  The driver
        # reads it once per process, so it applies unless CUDA was initialised
        # before gpuflow first touched it; a value the user set wins.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
        from cuda.bindings import driver as cu

        _cu_module = cu
    return _cu_module


def cuda_device_count() -> int:
    """How many CUDA devices the driver reports; 0 where there is no driver or device."""
    try:
        cu = driver()
        check(cu.cuInit(0), "cuInit")
        (n,) = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        return int(n)
    except Exception:  # no driver library, no device, broken install: no CUDA here
        return 0


def _device_nodes() -> list[str]:
    """The GPU device files of this machine (Linux's ``/dev/nvidia0``...,
    WSL's ``/dev/dxg``): there is a GPU for the driver to find."""
    return sorted(glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/dxg"))


def cuda_detect() -> tuple[int, str | None]:
    """``(devices, problem)``: how many CUDA devices the driver reports and,
    where it reports none although this machine has a driver, why not.

    A driver is there when its library loads, or when the machine has GPU
    device files.  ``problem`` is None where there is none (a machine
    without a GPU: nothing is wrong), else it names what failed, with the
    driver's code and name: ``cuInit`` failing (a driver that does not
    match its kernel module, a stub library, a broken install), or no
    device although device files exist (``CUDA_VISIBLE_DEVICES`` naming
    none, a container given the library but not the device).
    """
    try:
        cu = driver()
        cu.cuDriverGetVersion()  # raises where the driver library does not load
    except Exception:
        return 0, None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
    try:
        check(cu.cuInit(0), "cuInit")
        (n,) = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
    except DeviceError as exc:
        if exc.code == CUDA_ERROR_NO_DEVICE and not _device_nodes():
            return 0, None  # the library alone, on a machine with no GPU
        return 0, f"{exc}{hidden}"
    except Exception as exc:  # the driver library loads but cannot be called
        return 0, f"cuInit raised {type(exc).__name__}: {exc}"
    if int(n) == 0 and _device_nodes():
        return 0, f"the driver reports no device, but {_device_nodes()[0]} exists{hidden}"
    return int(n), None


def cuda_probe() -> tuple[int, str | None, str | None]:
    """``(devices, driver version, problem)``: what the driver says, without
    making a context; ``problem`` says why there is no device."""
    try:
        cu = driver()
        (v,) = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
    except Exception as exc:  # no driver library, broken install
        first = str(exc).splitlines()[0] if str(exc) else ""
        return 0, None, f"no CUDA driver ({type(exc).__name__}: {first})"
    version = f"{int(v) // 1000}.{int(v) % 1000 // 10}"
    try:
        check(cu.cuInit(0), "cuInit")
        (n,) = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
    except Exception as exc:
        return 0, version, str(exc)
    return int(n), version, None if int(n) else "the driver reports no device"


def err_name(rc: int) -> str:
    """The driver's name for ``rc`` (``CUDA_ERROR_...``)."""
    try:
        return str(driver().CUresult(rc).name)
    except Exception:
        return f"CUresult {rc}"


def error_for(
    rc: int,
    what: str,
    dev: Dev | None,
    *,
    launch: bool = False,
    message: str | None = None,
) -> DeviceError:
    """The error for the failed call ``what`` (``rc`` is not success), to raise.

    A sticky code with a device is that device's fault, recorded now if it is
    the first (the class table decides what is sticky).  Otherwise the class
    comes from the table (``launch``: the code came from a kernel launch), and
    the message is ``message`` or says which call failed.
    """
    name = err_name(rc)
    cls = error_class(rc, launch=launch)
    if cls is DeviceFaultError:
        if dev is not None:
            return _record_fault(dev, rc, name, what)
        cls = DeviceError  # no device to hold the fault
    index = None if dev is None else dev.index
    if message is None:
        if cls is OutOfMemoryError:
            message = f"{what}: out of memory on CUDA device {index}"
        else:
            message = f"{what} failed"
    return cls(message, code=rc, name=name, device=index)


def check(
    res: Any, what: str, dev: Dev | None = None, *, message: str | None = None
) -> tuple[Any, ...]:
    """Unpack a cuda.bindings result tuple, raising :func:`error_for` on an error code."""
    rc = int(res[0])
    if rc:
        raise error_for(rc, what, dev, message=message)
    return tuple(res[1:])


def warn_unless_fault(rc: int, what: str, dev: Dev, doing: str) -> None:
    """For a finalizer, which must not raise, the failed call ``what``: a sticky
    code records the device's fault (every later call raises it); any other
    code is a warning that ``doing`` failed."""
    err = error_for(rc, what, dev)
    if not isinstance(err, DeviceFaultError):
        warnings.warn(f"gpuflow: {doing} failed: {err.name}", stacklevel=3)


def _record_fault(dev: Dev, rc: int, name: str, what: str) -> DeviceFaultError:
    """``dev``'s fault: the first sticky code seen on the device, whichever call saw it."""
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
