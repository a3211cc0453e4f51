"""One suite for every backend and every event loop.

Every test runs on each backend of one list, ``--backends`` (by default
``sim``, always, and ``cuda``, where a CUDA device is present: skipped,
never failed, elsewhere); a backend registered with
``gpuflow.lowlevel.register_backend`` by a plugin (``-p``) runs the suite
unchanged.  Async tests run under asyncio, uvloop (where installed) and
Trio through AnyIO's pytest plugin.  After each test the runtime must be
quiescent: nothing pending, no lease held, no use after free seen.
"""

from __future__ import annotations

import gc
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from importlib.util import find_spec
from typing import Any

import pytest
from helpers import CUDA_DEVICES, NO_CUDA
from helpers.child import run_child

import gpuflow as gf
from gpuflow import testing
from gpuflow._backends import backend_names
from gpuflow._core import discard_runtime

#: fixtures shared by the test folders (``lib``: the interop tests' other library)
pytest_plugins = ["helpers.interop"]

#: The event loops every async test runs under: asyncio, uvloop (an asyncio
#: loop many services run on) where it is installed, and Trio.  Tests that
#: name the loop take AnyIO's ``anyio_backend_name`` ("asyncio" for uvloop
#: too) and ``anyio_backend_options``.
UVLOOP = [pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")]
LOOPS = [
    pytest.param("asyncio", id="asyncio"),
    *(UVLOOP if find_spec("uvloop") else []),
    pytest.param("trio", id="trio"),
]


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backends",
        default="sim,cuda",
        metavar="NAMES",
        help="the backends every test runs on, comma-separated (default: sim,cuda; cuda's "
        "variants skip where no CUDA device is present); any name registered with "
        "gpuflow.lowlevel.register_backend, by a plugin given with -p",
    )


@pytest.hookimpl(tryfirst=True)  # (the backend first in a test's id: test_x[sim-trio])
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test, once a backend of ``--backends`` (``device_backend``)."""
    if "device_backend" not in metafunc.fixturenames:
        return
    names = [n.strip() for n in str(metafunc.config.getoption("backends")).split(",")]
    registered = backend_names()
    unknown = [n for n in names if n not in registered or n == "auto"]
    if unknown or not names:
        raise pytest.UsageError(
            f"--backends: {', '.join(unknown) or 'none named'}: not a registered backend "
            f"(registered: {', '.join(n for n in registered if n != 'auto')})"
        )
    params = [pytest.param(n, marks=pytest.mark.gpu) if n == "cuda" else n for n in names]
    metafunc.parametrize("device_backend", params, indirect=True)


#: The session's backends of real devices, by name: made once, as a
#: long-running program makes its backend (each test still gets a runtime of
#: its own: streams, pools, completer), and again where a test left a device
#: faulted.  A simulation is made anew for each test.
_SHARED: dict[str, Any] = {}
_SIMULATED: set[str] = {"sim"}


def _shared_backend(name: str) -> Any:
    """The session's backend ``name``, or None where it is a simulation."""
    from gpuflow._backends import load_backend

    if name in _SIMULATED:
        return None
    be = _SHARED.get(name)
    if be is not None and any(be.device_fault(d) is not None for d in range(be.device_count)):
        be = None
    if be is None:
        be = load_backend(name, None)
        if be.simulated:
            be.close()
            _SIMULATED.add(name)
            return None
        _SHARED[name] = be
    return be


@pytest.fixture(autouse=True, scope="function")
def device_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Initialise gpuflow on the test's backend (``--backends``); a
    simulation gets two devices."""
    name = str(request.param)
    if name == "cuda" and CUDA_DEVICES == 0:
        pytest.skip(NO_CUDA)
    backend = _shared_backend(name)
    if request.node.get_closest_marker("cuda_only") and (
        backend is None or not backend.cuda_native
    ):
        pytest.skip(f"{name} variant of a cuda-only test: needs a real CUDA device")
    if name != "sim" and request.node.get_closest_marker("sim_only"):
        pytest.skip("exercises a property of the simulator itself")
    # whatever a test before left in flight (which failed that test) goes
    discard_runtime(keep=backend)
    if backend is not None:
        gf.init_device_contexts(backend=backend)
    else:
        gf.init_device_contexts(backend=name, num_devices=2)
    # the replaced runtime is garbage now; on CUDA a finalizer of its driver
    # objects may wait for the device to be idle (seen on the H200), so a
    # collection during the test could stall until the test's own GPU work is
    # done: collect it before that work starts
    gc.collect()
    yield name
    gc.collect()
    testing.assert_quiescent(timeout=5.0)


def pytest_report_header(config: pytest.Config) -> str:
    loops = ", ".join(str(p.id) for p in LOOPS)
    backends = str(config.getoption("backends"))
    if backends != "sim,cuda":
        return f"gpuflow: every test on {backends}; loops {loops}"
    if CUDA_DEVICES:
        return f"gpuflow: every test on sim and on cuda ({CUDA_DEVICES} device(s)); loops {loops}"
    return (
        "gpuflow: every test on sim; no CUDA device present, so every test's cuda variant "
        f"is skipped (the summary counts them); loops {loops}"
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The skips counted by reason, one line each: ``-rs`` gives a line per
    test, hundreds without a GPU, and pytest's own count alone reads as breakage."""
    reasons: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section("skipped tests, by reason", sep="-")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:6d}  {reason}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What exists once the tests are collected (modules, the tests, their
    parameters: some 10^5 objects) lives as long as the session: kept out
    of every garbage collection from now on (``gc.freeze``), so that the
    collections each test's fixture makes go through what the tests made,
    not through the whole session again (a third of the suite's time)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    # (before the plugins' summaries: Hypothesis's asks the collector who
    # refers to a random generator, and a frozen referrer is not seen)
    gc.unfreeze()


# -- tests that must run alone ------------------------------------------------------------------
#
# The suite runs in worker processes (pytest-xdist, ``-n 4`` in pyproject):
# most of its time is waiting, not CPU.  A test that compares times taken on
# the simulated device (a latency class against no class) needs the CPU to
# itself: the simulated SMs are threads, and a test beside it on the same
# cores delays them.  Such tests (``@pytest.mark.alone``) are left out of
# the workers' run and run after it, in one process with nothing beside it.


def _workers(config: pytest.Config) -> bool:
    """Whether this run hands its tests to worker processes (the controller
    of a pytest-xdist run)."""
    return bool(getattr(config.option, "numprocesses", 0)) and not hasattr(config, "workerinput")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return  # (one process: every test runs where it is)
    alone = [item for item in items if item.get_closest_marker("alone")]
    if alone:
        items[:] = [item for item in items if not item.get_closest_marker("alone")]
        config.hook.pytest_deselected(items=alone)


class _Alone:
    """The run of the ``alone`` tests (a plugin of its own: its hook runs
    last, where the module's own ``pytest_sessionfinish`` runs first)."""

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """After the workers' run, once they have ended (pytest-xdist's
        own ``pytest_sessionfinish`` ends them): the ``alone`` tests of the
        same selection, in one process; their failure fails the session."""
        _run_alone(session)


def _run_alone(session: pytest.Session) -> None:
    config = session.config
    if not _workers(config) or session.exitstatus in (
        pytest.ExitCode.INTERRUPTED, pytest.ExitCode.USAGE_ERROR
    ):
        return
    mark = config.option.markexpr
    args = [*config.invocation_params.args, "-n", "0", "-p", "no:cacheprovider",
            "-m", f"({mark}) and alone" if mark else "alone"]  # fmt: skip
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.section("the tests that run alone (-m alone, one process)", sep="=")
    proc = run_child(
        [sys.executable, "-m", "pytest", *args], timeout=1800, cwd=config.invocation_params.dir
    )
    if reporter is not None:
        reporter.write(proc.stdout)
        reporter.write(proc.stderr)
    if proc.returncode not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Alone(), "gpuflow-alone")
    config.addinivalue_line(
        "markers",
        "alone: compares times taken on a loaded device: in a run of worker processes "
        "(pytest-xdist), runs after the others, in one process, with nothing beside it",
    )
    config.addinivalue_line("markers", "sim_only: runs on the sim backend only")
    config.addinivalue_line("markers", "cuda_only: runs on a CUDA device only")
    config.addinivalue_line(
        "markers", "faults_device: faults the device on purpose (on cuda: in a child process)"
    )


_CHILD = "GPUFLOW_TEST_CHILD"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """On a real GPU a sticky fault lasts as long as the process (the driver
    refuses to reset the context), so a test that faults the device on
    purpose runs in a fresh child process there, and its verdict is the child's."""
    callspec = getattr(pyfuncitem, "callspec", None)
    on_cuda = callspec is not None and callspec.params.get("device_backend") == "cuda"
    if not on_cuda or not pyfuncitem.get_closest_marker("faults_device") or os.environ.get(_CHILD):
        return None
    env = dict(os.environ, **{_CHILD: "1"})
    proc = run_child(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0",
         pyfuncitem.nodeid],
        env=env, timeout=100, cwd=pyfuncitem.config.rootpath,
    )  # fmt: skip
    if proc.returncode == 0 and re.search(r"\b1 skipped", proc.stdout):
        # the child's skip is the parent's (e.g. a test that needs two devices)
        reason = re.search(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", proc.stdout)
        pytest.skip(f"in a child process: {reason.group(1) if reason else 'skipped'}")
    if proc.returncode != 0 or not re.search(r"\b1 passed", proc.stdout):
        pytest.fail(f"in a child process:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    return True
