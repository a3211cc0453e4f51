"""gpuflow's pytest plugin: the ``gpuflow_runtime`` fixture and its options.

pytest loads it through the ``pytest11`` entry point named ``gpuflow``, so
installing gpuflow is enough (``-p no:gpuflow`` turns it off; with plugin
autoloading disabled, ``-p gpuflow`` loads it).  Nothing happens to a test
that does not ask for the fixture.

* ``--gpuflow-backend`` ``sim`` (the default: any machine, CI), ``cuda``,
  ``auto`` (``cuda`` where a CUDA device is present, else ``sim``) or the
  name of any backend registered with
  :func:`gpuflow.lowlevel.register_backend` (by a plugin, or the
  ``conftest.py`` of the directory pytest starts in), and
  ``--gpuflow-devices N`` (default: every device the backend has; ``sim``
  has one unless told).
* ``gpuflow_runtime`` initialises gpuflow on that backend before the test
  (a runtime of its own for each test; a backend that drives CUDA devices
  is shared by the session, as a long-running program has one) and yields the
  backend's name.  After the test function, it waits for the GPU to finish
  what the test enqueued (up to :data:`DRAIN_S` seconds) and fails the
  test, saying what, when a run is still pending, a stream lease is still
  held or a use after free was seen (``sim``).

It works with AnyIO's plugin (``@pytest.mark.anyio``, the ``anyio_backend``
fixture: asyncio, uvloop, Trio) and with plain synchronous tests.  The
check runs once the test function has returned, while no event loop runs
in the thread: runs that a loop would complete are then completed by
gpuflow's completer thread.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from .._backends import Backend, backend_names, cuda_probe, load_backend
from .._core import device_count_option, discard_runtime, init_device_contexts
from ._quiescence import Baseline, problems, settle

#: How long, after a test, the GPU may take to finish what the test enqueued.
DRAIN_S = 5.0

_FIXTURE = "gpuflow_runtime"
_baseline_key = pytest.StashKey[Baseline]()
_shared_key = pytest.StashKey[Backend]()
_simulated_key = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpuflow", "gpuflow (the gpuflow_runtime fixture)")
    group.addoption(
        "--gpuflow-backend",
        default="sim",
        metavar="NAME",
        help="the backend gpuflow_runtime initialises: sim (default; needs no GPU), "
        "cuda, auto (cuda where a CUDA device is present, else sim), or any name "
        "given to gpuflow.lowlevel.register_backend",
    )
    group.addoption(
        "--gpuflow-devices",
        type=device_count_option,
        default=None,
        metavar="N",
        help="how many devices gpuflow_runtime initialises (default: every device "
        "of the backend; sim has one unless told)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a backend nobody registered, before any test (a plugin or
    the root ``conftest.py`` registers one before this runs)."""
    choice = str(config.getoption("gpuflow_backend"))
    names = backend_names()
    if choice not in names:
        raise pytest.UsageError(
            f"--gpuflow-backend {choice!r}: no backend of that name is registered "
            f"(registered: {', '.join(names)})"
        )


def _backend(config: pytest.Config, devices: int | None) -> str | Backend:
    """The backend to initialise: a simulation's name (a new backend for
    each test), or the session's backend of real devices, made on first use
    and again after a fault."""
    choice = str(config.getoption("gpuflow_backend"))
    if choice == "auto":
        choice = "cuda" if cuda_probe()[0] else "sim"
    if config.stash.get(_simulated_key, False):
        return choice
    be = config.stash.get(_shared_key, None)
    if be is not None and any(be.device_fault(d) is not None for d in range(be.device_count)):
        be = None  # a sticky fault lasts as long as the backend
    if be is None:
        be = load_backend(choice, devices)
        if be.simulated:  # (cheap to make: each test's own, nothing of one seen by the next)
            be.close()
            config.stash[_simulated_key] = True
            return choice
        config.stash[_shared_key] = be
    return be


@pytest.fixture
def gpuflow_runtime(request: pytest.FixtureRequest) -> Iterator[str]:
    """gpuflow, initialised on ``--gpuflow-backend`` for this test; yields the
    backend's name (``"sim"``, ``"cuda"``, ...).  The test fails when, once it
    has returned and the GPU has had up to 5 s to finish, a run is still
    pending, a stream lease is still held or a use after free was seen."""
    config = request.config
    devices = config.getoption("gpuflow_devices")
    backend = _backend(config, devices)
    # whatever a test before left in flight (which failed that test) goes
    discard_runtime(keep=backend)
    name = init_device_contexts(num_devices=devices, backend=backend)
    # the replaced runtime is garbage now: collect it before the test's GPU
    # work starts (a collection during the test could wait for that work)
    gc.collect()
    request.node.stash[_baseline_key] = Baseline.now()
    yield name
    # the test's verdict is in (pytest_runtest_call); leave the GPU idle
    # for the next test, whatever this one left behind
    gc.collect()
    settle(DRAIN_S)


@pytest.hookimpl(trylast=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """After a test that uses the fixture, fail it where gpuflow is not at rest.

    Called after pytest's own implementation has run the test function, and
    only when it passed (a failure there ends the call).  A plain
    implementation, not a wrapper: any pluggy that pytest 7 or 8 brings
    takes it."""
    base = item.stash.get(_baseline_key, None)
    if base is not None and _FIXTURE in getattr(item, "fixturenames", ()):
        gc.collect()  # arrays only a reference cycle held go now, in stream order
        found = problems(DRAIN_S, base, settle(DRAIN_S))
        if found:
            pytest.fail(
                "gpuflow is not quiescent after the test: " + "; ".join(found), pytrace=False
            )
