"""One suite for every backend and every event loop.

Every test runs on ``sim`` (always) and on ``cuda`` (where a CUDA device is
present; skipped, never failed, elsewhere).  Async tests run under asyncio
and Trio through AnyIO's pytest plugin.  After each test the runtime must be
quiescent: nothing pending, no lease held, no use after free seen.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

import gpuflow as gf
from gpuflow import testing


def _cuda_devices() -> int:
    try:
        from gpuflow._backends._cuda import cuda_device_count
    except ImportError:
        return 0
    return cuda_device_count()


CUDA_DEVICES = _cuda_devices()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(
    params=["sim", pytest.param("cuda", marks=pytest.mark.gpu)], autouse=True, scope="function"
)
def device_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Initialise gpuflow on each backend; ``sim`` gets two devices."""
    name = str(request.param)
    if name == "cuda" and CUDA_DEVICES == 0:
        pytest.skip("no CUDA device present")
    if name == "sim" and request.node.get_closest_marker("cuda_only"):
        pytest.skip("needs a real CUDA device")
    if name == "cuda" and request.node.get_closest_marker("sim_only"):
        pytest.skip("exercises a property of the simulator itself")
    gf.init_device_contexts(backend=name, num_devices=2 if name == "sim" else None)
    yield name
    gc.collect()
    testing.assert_quiescent(timeout=5.0)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sim_only: runs on the sim backend only")
    config.addinivalue_line("markers", "cuda_only: runs on a CUDA device only")
