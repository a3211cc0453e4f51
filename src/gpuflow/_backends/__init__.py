"""Device backends behind one interface (:mod:`._base`), found by name.

A backend is chosen once, by :func:`gpuflow.init_device_contexts`, by name
from a registry (``"cuda"``, ``"sim"`` and any registered with
:func:`register_backend`), or given as an instance.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .._errors import DeviceError, UsageError
from ._base import Backend
from ._sim import SimBackend

log = logging.getLogger("gpuflow")

#: Makes a backend for ``num_devices`` devices (None: every device it has).
BackendFactory = Callable[[int | None], Backend]


def _cuda_device_count() -> int:
    try:
        from ._cuda import cuda_device_count  # cuda-bindings is loaded only when asked for
    except ImportError:
        return 0
    return cuda_device_count()


def cuda_probe() -> tuple[int, str | None, str | None]:
    """``(CUDA devices, driver version, why none)``, without making a backend."""
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
    if _cuda_device_count() == 0:
        raise DeviceError("backend 'cuda' was asked for, but no CUDA device is present")
    return CudaBackend(num_devices)


_registry: dict[str, BackendFactory] = {"cuda": _make_cuda, "sim": SimBackend}
_registry_lock = threading.Lock()


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``init_device_contexts(backend=name)`` use ``factory(num_devices)``.

    ``name`` must be new (``"auto"``, ``"cuda"`` and ``"sim"`` are taken).
    Safe from any thread.
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
    """The backend called ``name`` (``"auto"``: ``cuda`` when a device is
    present, else ``sim``), or ``name`` itself when it is a backend."""
    if isinstance(name, Backend):
        return name
    if name == "auto":
        name = "cuda" if _cuda_device_count() > 0 else "sim"
        if name == "sim":
            log.info("gpuflow: no CUDA device present; backend 'sim'")
    with _registry_lock:
        factory = _registry.get(name) if isinstance(name, str) else None
    if factory is None:
        raise UsageError(
            f"backend must be one of {', '.join(map(repr, backend_names()))} or a "
            f"gpuflow.lowlevel.Backend instance, not {name!r}"
        )
    be = factory(num_devices)
    log.info("gpuflow: backend %r (%d device(s))", be.name, be.device_count)
    return be
