"""Device backends behind one interface (:mod:`._base`), chosen once."""

from __future__ import annotations

import logging

from .._errors import DeviceError, UsageError
from ._base import Backend
from ._sim import SimBackend

log = logging.getLogger("gpuflow")

BACKENDS = ("auto", "cuda", "sim")


def load_backend(name: str, num_devices: int | None) -> Backend:
    """Make the backend called ``name``; ``"auto"`` prefers ``cuda`` when a device is present."""
    if name not in BACKENDS:
        raise UsageError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, not {name!r}")
    if name in ("auto", "cuda"):
        try:
            from ._cuda import CudaBackend, cuda_device_count

            available = cuda_device_count()
        except ImportError as exc:
            if name == "cuda":
                raise UsageError(f"backend 'cuda' needs cuda-python: {exc}") from exc
            available = 0
        if available > 0:
            log.info("gpuflow: backend 'cuda' (%d device(s))", available)
            return CudaBackend(num_devices)
        if name == "cuda":
            raise DeviceError("backend 'cuda' was asked for, but no CUDA device is present")
        log.info("gpuflow: no CUDA device present; backend 'sim'")
    return SimBackend(num_devices)
