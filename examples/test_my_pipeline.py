"""Testing a pipeline's cancellation safety: a user's test file, with no conftest.

Shows: the ``gpuflow_runtime`` fixture of gpuflow's pytest plugin (installing
gpuflow installs it), ``@pytest.mark.anyio`` under asyncio, uvloop and Trio,
``gf.testing.cancel_at_every_point`` with the pipeline's own invariant, and
the same check over random batch shapes with Hypothesis.

The pipeline is a request handler: it copies a batch to the GPU, normalises
it with a kernel and brings it back, inside a stream lease, while a ledger
counts the requests started, finished and abandoned.  A request that a
timeout or a cancelled task group stops half-way must still be counted:
the invariant is ``started == finished + abandoned``.

Run it:  python -m pytest examples/test_my_pipeline.py
         (--gpuflow-backend cuda on a GPU; the test extra installs what it uses)
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuflow as gf
from gpuflow import testing

# Every event loop the handler may run under: AnyIO's plugin runs each
# @pytest.mark.anyio test once per parameter.
UVLOOP = pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")
LOOPS = [
    pytest.param("asyncio", id="asyncio"),
    *([UVLOOP] if find_spec("uvloop") else []),
    *([pytest.param("trio", id="trio")] if find_spec("trio") else []),
]


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param


NORMALISE = gf.compile(
    r"""
extern "C" __global__ void normalise(float* x, float mean, float scale, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = (x[i] - mean) * scale;
}""",
    # what the simulator runs in place of the CUDA code
    references={"normalise": lambda x, mean, scale, n: x.__setitem__(
        slice(0, n), (x[:n] - np.float32(mean)) * np.float32(scale))},
)  # fmt: skip


@dataclass
class Ledger:
    started: int = 0
    finished: int = 0
    abandoned: int = 0


async def handle(ledger: Ledger, batch: np.ndarray) -> np.ndarray:
    """Normalise ``batch`` on the GPU; every request is counted, however it ends."""
    ledger.started += 1
    try:
        async with gf.open_stream_lease():
            x = await gf.from_host(batch.astype(np.float32).ravel())
            n = x.size
            mean, spread = float(batch.mean()), float(batch.std()) or 1.0
            await NORMALISE.normalise(gf.LaunchConfig.for_num_elems(n), x, mean, 1 / spread, n)
            out = await gf.to_host(x)
    except anyio.get_cancelled_exc_class():
        ledger.abandoned += 1
        raise
    ledger.finished += 1
    return out.reshape(batch.shape)


@pytest.mark.anyio
async def test_the_handler_normalises(gpuflow_runtime: str) -> None:
    ledger = Ledger()
    batch = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = await handle(ledger, batch)
    np.testing.assert_allclose(out, (batch - batch.mean()) / batch.std(), rtol=1e-5)
    assert ledger == Ledger(started=1, finished=1)


@pytest.mark.anyio
async def test_the_handler_is_cancellation_safe(gpuflow_runtime: str) -> None:
    ledger = Ledger()
    batch = np.ones((4, 256), dtype=np.float32)

    def invariant() -> None:
        assert ledger.started == ledger.finished + ledger.abandoned, ledger

    report = await testing.cancel_at_every_point(lambda: handle(ledger, batch), check=invariant)
    # the lease's two boundaries and two points for each of the three awaits
    assert report.points == 8
    assert ledger.finished == 1 and ledger.abandoned == report.points


@settings(max_examples=5, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(shape=st.lists(st.integers(1, 64), min_size=1, max_size=3))
@pytest.mark.anyio
async def test_every_batch_shape_is_cancellation_safe(
    gpuflow_runtime: str, shape: list[int]
) -> None:
    ledger = Ledger()
    batch = np.random.default_rng(len(shape)).normal(size=shape).astype(np.float32)

    def invariant() -> None:
        assert ledger.started == ledger.finished + ledger.abandoned, ledger
        assert gf.memory_stats().live_allocations == 0  # nothing of the request is left

    await testing.cancel_at_every_point(lambda: handle(ledger, batch), check=invariant)


def test_a_synchronous_caller(gpuflow_runtime: str) -> None:
    # the fixture serves plain tests too: no event loop, blocking calls
    x = gf.from_host(np.array([1.0, 3.0], dtype=np.float32)).sync()
    NORMALISE.normalise(gf.LaunchConfig(1, 2), x, 2.0, 1.0, 2).sync()
    assert gf.to_host(x).sync().tolist() == [-1.0, 1.0]
