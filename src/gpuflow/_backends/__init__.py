"""Device backends behind one interface (:mod:`._base`), found by name.

A backend is chosen once, by :func:`gpuflow.init_device_contexts`, by name
from a registry (``"cuda"``, ``"sim"`` and any registered with
:func:`register_backend`), or given as an instance.  ``"auto"`` is the name
in ``GPUFLOW_BACKEND`` where that is set, else ``cuda`` where the driver
reports a device, else ``sim``: with a warning where a driver is installed
but unusable, since the program then runs its kernels' NumPy references.

The layers above import from this package the names in ``__all__``: the
interface, its records, NVRTC compilation, and the registry.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import warnings
from collections.abc import Callable

from .._errors import DeviceError, GpuflowError, UsageError
from ._base import Backend as Backend
from ._nvrtc import CHECK_ARCH as CHECK_ARCH
from ._nvrtc import compile_source as compile_source
from ._records import BLOCK_TIME_ATTR as BLOCK_TIME_ATTR
from ._records import COMM_DTYPES as COMM_DTYPES
from ._records import REDUCTIONS as REDUCTIONS
from ._records import Activity as Activity
from ._records import CollectiveCall as CollectiveCall
from ._records import DType as DType
from ._records import HostArray as HostArray
from ._records import LaunchLimits as LaunchLimits
from ._records import PointerArg as PointerArg
from ._records import RawBuffer as RawBuffer
from ._records import RawComm as RawComm
from ._records import RawEvent as RawEvent
from ._records import RawGraph as RawGraph
from ._records import RawKernel as RawKernel
from ._records import RawPartition as RawPartition
from ._records import RawStream as RawStream
from ._records import Step as Step
from ._records import activity_tag as activity_tag
from ._sim import SimBackend as SimBackend

__all__ = [
    "BACKEND_ENV", "BLOCK_TIME_ATTR", "CHECK_ARCH", "COMM_DTYPES", "REDUCTIONS", "Activity",
    "Backend", "BackendFactory", "SimBackend", "CollectiveCall", "LaunchLimits", "PointerArg",
    "DType", "HostArray", "RawBuffer", "RawComm", "RawEvent", "RawGraph", "RawKernel",
    "RawPartition", "RawStream", "Step", "activity_tag", "new_sim_backend",
    "backend_names", "compile_source", "cuda_probe", "load_backend", "register_backend",
]

log = logging.getLogger("gpuflow")

#: Makes a backend for ``num_devices`` devices (None: every device it has).
BackendFactory = Callable[[int | None], Backend]

#: The environment variable naming the backend that ``"auto"`` stands for.
BACKEND_ENV = "GPUFLOW_BACKEND"


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _cuda_detect() -> tuple[int, str | None]:
    """``(CUDA devices, why a driver that is installed cannot be used)``."""
    try:
        from ._cuda import cuda_detect
    except ImportError as exc:
        # cuda-bindings is a dependency: missing beside a driver, the install is broken
        if _libcuda_loads():
            return 0, f"cuda-bindings cannot be imported ({exc})"
        return 0, None
    return cuda_detect()


def cuda_probe() -> tuple[int, str | None, str | None]:
    """What the CUDA driver reports, without making a backend or a context.

    Returns
    -------
    tuple
        ``(devices, driver, problem)``: how many CUDA devices the driver
        reports, its version (``"12.8"``; None where no driver loads), and
        why there is no device (None where there is one).

    Safe from any thread; never raises.
    """
    try:
        from ._cuda import cuda_probe as probe
    except ImportError as exc:
        return 0, None, f"cuda-bindings cannot be imported ({exc})"
    return probe()


def _make_cuda(num_devices: int | None) -> Backend:
    try:
        from ._cuda import CudaBackend
    except ImportError as exc:
        raise UsageError(f"backend 'cuda' needs cuda-python: {exc}") from exc
    devices, problem = _cuda_detect()
    if devices == 0:
        raise DeviceError(
            "backend 'cuda' was asked for, but no CUDA device is present"
            + (f": {problem}" if problem else "")
        )
    return CudaBackend(num_devices)


_registry: dict[str, BackendFactory] = {"cuda": _make_cuda, "sim": SimBackend}
_registry_lock = threading.Lock()


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``init_device_contexts(backend=name)`` use ``factory(num_devices)``.

    ``name`` must be new (``"auto"``, ``"cuda"`` and ``"sim"`` are taken).
    Safe from any thread.

    Parameters
    ----------
    name
        The backend's name, new.
    factory
        Makes the backend for a number of devices (None: all it has).

    Raises
    ------
    gpuflow.UsageError
        ``name`` is taken or not a name, or ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise UsageError(f"a backend name must be a non-empty string other than 'auto': {name!r}")
    if not callable(factory):
        raise UsageError(f"register_backend({name!r}): the factory must be callable")
    with _registry_lock:
        if name in _registry:
            raise UsageError(f"a backend named {name!r} is registered already")
        _registry[name] = factory


def backend_names() -> tuple[str, ...]:
    """Every name ``init_device_contexts(backend=...)`` takes."""
    with _registry_lock:
        return ("auto", *_registry)


def load_backend(name: str | Backend, num_devices: int | None) -> Backend:
    """A backend, made as :func:`gpuflow.init_device_contexts` makes it, but
    for no runtime: for tools that describe the machine.

    Any thread.

    Parameters
    ----------
    name
        ``"cuda"``, ``"sim"``, a name given to :func:`register_backend`, or
        ``"auto"``: the one named by ``GPUFLOW_BACKEND`` where that is set,
        else ``cuda`` where the driver reports a device, else ``sim``.  A
        :class:`Backend` instance is returned as it is.
    num_devices
        How many devices it serves (None: every device it has).

    Returns
    -------
    Backend

    Raises
    ------
    gpuflow.UsageError
        ``name`` is no backend's.
    gpuflow.DeviceError
        The backend could not be started (the note says when ``"auto"``
        chose it, and why).
    """
    if isinstance(name, Backend):
        return name
    chosen_by = None
    if name == "auto":
        name, chosen_by = _auto()
    with _registry_lock:
        factory = _registry.get(name) if isinstance(name, str) else None
    if factory is None:
        raise UsageError(
            f"backend must be one of {', '.join(map(repr, backend_names()))} or a "
            f"gpuflow.lowlevel.Backend instance, not {name!r}"
        )
    try:
        be = factory(num_devices)
    except GpuflowError as exc:
        if chosen_by is not None:
            exc.add_note(f"(the backend was chosen by {chosen_by})")
        raise
    log.info("gpuflow: backend %r (%d device(s))", be.name, be.device_count)
    return be


def _auto() -> tuple[str, str | None]:
    """What ``"auto"`` stands for, and the variable that chose it (if one did).

    ``GPUFLOW_BACKEND`` names the backend where it is set; else ``cuda`` when
    the driver reports a device, else ``sim``.  Falling back to ``sim``
    where a CUDA driver is installed is a warning, not a log line: a node
    whose driver broke would otherwise run every kernel as its NumPy
    reference, quietly and slowly, and report success.
    """
    chosen = os.environ.get(BACKEND_ENV, "")
    if chosen and chosen != "auto":
        names = backend_names()
        if chosen not in names:
            raise UsageError(
                f"{BACKEND_ENV}={chosen!r} names no backend: it must be one of "
                f"{', '.join(map(repr, names))}"
            )
        log.info("gpuflow: backend %r, from %s", chosen, BACKEND_ENV)
        return chosen, f"{BACKEND_ENV}={chosen}"
    devices, problem = _cuda_detect()
    if devices > 0:
        return "cuda", None
    if problem is None:
        log.info("gpuflow: no CUDA driver or device present; backend 'sim'")
    else:
        warnings.warn(
            f"gpuflow: a CUDA driver is installed but gpuflow cannot use it: {problem}. "
            "Running on backend 'sim' instead, a CPU simulation that runs each kernel as "
            f"its NumPy reference. Set {BACKEND_ENV}=sim (or backend='sim') to choose the "
            f"simulation, or {BACKEND_ENV}=cuda to fail instead.",
            RuntimeWarning,
            stacklevel=4,  # the caller of init_device_contexts
        )
    return "sim", None


def new_sim_backend(
    num_devices: int | None = None, *, memory_bytes: int = 2 << 30, sms: int = 132
) -> Backend:
    """A ``sim`` backend of the sizes given: what ``init_device_contexts(backend="sim")``
    makes with the defaults.

    ``gf.init_device_contexts(backend=gf.lowlevel.new_sim_backend(2, sms=16))``
    simulates two devices of 16 SMs each: a small device, whose SMs a few
    blocks fill (see :func:`gpuflow.testing.block_time`).  The runtime that
    takes it closes it.  Any thread.

    Parameters
    ----------
    num_devices
        How many devices (None: 1).
    memory_bytes
        Each device's memory (2 GiB by default); an allocation past it is an
        out-of-memory error, as on a GPU.
    sms
        Each device's SMs (132 by default, an H200's).

    Returns
    -------
    Backend

    Raises
    ------
    gpuflow.UsageError
        ``sms`` is not a positive int.
    """
    return SimBackend(num_devices, memory_bytes=memory_bytes, sms=sms)
