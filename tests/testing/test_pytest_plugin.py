"""gpuflow's pytest plugin, as a user meets it: test files with no conftest,
run by pytest in a subprocess (pytester).

Installing gpuflow registers the plugin (the ``pytest11`` entry point); where
the installed metadata predates it (an editable install made before the
entry point existed), the subprocesses load it with ``-p`` instead.
"""

from __future__ import annotations

import importlib.metadata
import os
import textwrap
import tomllib
from pathlib import Path

import pytest

import gpuflow._testing._pytest_plugin as plugin
from gpuflow._backends import cuda_probe

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
ENTRY_POINT = "gpuflow._testing._pytest_plugin"


def _installed_entry_point() -> importlib.metadata.EntryPoint | None:
    for ep in importlib.metadata.entry_points(group="pytest11"):
        if ep.name == "gpuflow":
            return ep
    return None


#: how the subprocesses get the plugin: by themselves where it is installed
PLUGIN = [] if _installed_entry_point() is not None else ["-p", ENTRY_POINT]

#: the event loops of the user's tests, as a user parametrizes AnyIO's fixture
LOOPS = '''
import pytest

@pytest.fixture(params=[
    "asyncio",
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    "trio",
])
def anyio_backend(request):
    return request.param
'''

CORRECT = LOOPS + '''
import numpy as np
import gpuflow as gf
from gpuflow import testing

async def pipeline():
    async with gf.open_stream_lease():
        x = await gf.full(256, 2.0, dtype=np.float32)
        y = await gf.copy(x)
    return await gf.to_host(y)

@pytest.mark.anyio
async def test_pipeline(gpuflow_runtime):
    assert gpuflow_runtime == BACKEND
    assert float((await pipeline()).sum()) == 512.0

@pytest.mark.anyio
async def test_cancellation_safety(gpuflow_runtime):
    report = await testing.cancel_at_every_point(pipeline)
    assert (report.points, report.runs) == (8, 9)

def test_a_synchronous_test(gpuflow_runtime):
    assert gf.current_backend() == BACKEND
    assert gf.to_host(gf.ones(3)).sync().tolist() == [1.0, 1.0, 1.0]
'''

BROKEN_INVARIANT = LOOPS + '''
import gpuflow as gf
from gpuflow import testing

balance = {"a": 100, "b": 0}

async def transfer():
    x = await gf.full(4, 1.0)
    balance["a"] -= 10
    await gf.copy(x)  # money in flight
    balance["b"] += 10

def invariant():
    total = balance["a"] + balance["b"]
    balance.update(a=100, b=0)
    assert total == 100, f"{100 - total} lost"

@pytest.mark.anyio
async def test_transfer(gpuflow_runtime):
    await testing.cancel_at_every_point(transfer, check=invariant)
'''

LEASE_LEFT_OPEN = LOOPS + '''
import gpuflow as gf
from gpuflow import testing

async def by_hand():
    lease = gf.open_stream_lease()
    await lease.__aenter__()
    await gf.zeros(16)  # the lease is open
    await lease.__aexit__(None, None, None)

@pytest.mark.anyio
async def test_by_hand(gpuflow_runtime):
    await testing.cancel_at_every_point(by_hand)
'''


def _line(source: str, marker: str) -> int:
    (n,) = [i + 1 for i, text in enumerate(source.splitlines()) if text.endswith(f"# {marker}")]
    return n


@pytest.fixture
def user(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A user's project: no conftest, gpuflow importable (this checkout's)."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SRC), *([path] if path else [])]))
    return pytester


def _run(user: pytest.Pytester, backend: str, *args: str) -> pytest.RunResult:
    return user.runpytest_subprocess(
        *PLUGIN, "-p", "no:cacheprovider", "--gpuflow-backend", backend, *args, timeout=300
    )


def _source(text: str, backend: str) -> str:
    return f"BACKEND = {backend!r}\n" + textwrap.dedent(text)


# -- the entry point --------------------------------------------------------------------------


@pytest.mark.sim_only
def test_the_project_declares_the_entry_point() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"gpuflow": ENTRY_POINT}
    assert callable(plugin.gpuflow_runtime) and callable(plugin.pytest_addoption)


@pytest.mark.sim_only
def test_the_installed_distribution_declares_the_entry_point() -> None:
    ep = _installed_entry_point()
    if ep is None:
        pytest.skip(
            "the installed gpuflow's metadata predates its pytest11 entry point "
            "(an editable install made before it): `pip install -e .` again to refresh it"
        )
    assert ep.value == ENTRY_POINT
    assert ep.load() is plugin


# -- a user's test files ----------------------------------------------------------------------


def test_a_correct_pipeline_passes_under_every_loop(
    user: pytest.Pytester, device_backend: str
) -> None:
    user.makepyfile(test_user=_source(CORRECT, device_backend))
    result = _run(user, device_backend)
    result.assert_outcomes(passed=7)


def test_a_broken_invariant_fails_naming_the_point(
    user: pytest.Pytester, device_backend: str
) -> None:
    source = _source(BROKEN_INVARIANT, device_backend)
    user.makepyfile(test_user=source)
    result = _run(user, device_backend)
    result.assert_outcomes(failed=3)
    line = _line(source, "money in flight")
    result.stdout.fnmatch_lines([
        "*AssertionError: cancelled at point 3 of 4 (awaiting <gpuflow.DeviceOperation copy>, "
        f"before it is enqueued; at *test_user.py:{line} (in transfer)): "
        "check() failed: AssertionError: 10 lost",
    ])  # fmt: skip


def test_a_lease_entered_by_hand_and_left_open_fails_naming_the_point(
    user: pytest.Pytester, device_backend: str
) -> None:
    source = _source(LEASE_LEFT_OPEN, device_backend)
    user.makepyfile(test_user=source)
    result = _run(user, device_backend)
    result.assert_outcomes(failed=3)
    line = _line(source, "the lease is open")
    result.stdout.fnmatch_lines([
        "*AssertionError: cancelled at point 2 of 4 (awaiting <gpuflow.DeviceOperation full*>, "
        f"before it is enqueued; at *test_user.py:{line} (in by_hand)): "
        "gpuflow is not quiescent: 1 stream lease(s) still held: <gpuflow.StreamLease of "
        "device 0, held by task * at *test_user.py:*>",
    ])  # fmt: skip


def test_the_fixture_fails_a_test_that_leaves_gpuflow_busy_and_says_what(
    user: pytest.Pytester, device_backend: str
) -> None:
    user.makepyfile(test_user=_source(LOOPS + '''
import time
import numpy as np
import gpuflow as gf
import gpuflow._testing._pytest_plugin

gpuflow._testing._pytest_plugin.DRAIN_S = 0.2  # (the long kernel below outlasts it)
SLOW = gf.compile(
    'extern "C" __global__ void slow(float* x, long long ns) { }',
    references={"slow": lambda x, ns: time.sleep(ns / 1e9)},
)

@pytest.mark.anyio
async def test_without_the_fixture_nothing_is_checked():
    await gf.open_stream_lease().__aenter__()

@pytest.mark.anyio
async def test_lease_left_held(gpuflow_runtime):
    await gf.open_stream_lease().__aenter__()

def test_run_left_pending(gpuflow_runtime):
    if gpuflow_runtime != "sim":
        pytest.skip("a kernel that runs for seconds is the sim's reference here")
    x = gf.zeros(4, np.float32).sync()
    SLOW.slow(gf.LaunchConfig(1, 1), x, 3_000_000_000).enqueue_on(gf.new_stream())

def test_use_after_free(gpuflow_runtime):
    if gpuflow_runtime != "sim":
        pytest.skip("the sim catches a use after free; on cuda, compute-sanitizer does")
    be = gf.lowlevel.current_backend_object()
    s = gf.lowlevel.pool_streams()[0].raw
    buf = be.alloc(0, 16, s)
    be.free(buf, s)
    be.fill(buf, np.float32(1), 4, s)
''', device_backend))  # fmt: skip
    result = _run(user, device_backend)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([
        "*test_lease_left_held?asyncio?*",
        "gpuflow is not quiescent after the test: 1 stream lease(s) still held: "
        "<gpuflow.StreamLease of device 0, held by task * at *test_user.py:*>",
    ])  # fmt: skip
    if device_backend == "sim":
        result.assert_outcomes(failed=5, passed=3)
        result.stdout.fnmatch_lines([
            "*test_run_left_pending*",
            "gpuflow is not quiescent after the test: 1 run(s) still pending after 0.2 s",
        ])  # fmt: skip
        result.stdout.fnmatch_lines([
            "*test_use_after_free*",
            "gpuflow is not quiescent after the test: *1 use(s) after free detected",
        ])  # fmt: skip
    else:
        result.assert_outcomes(failed=3, passed=3, skipped=2)
    assert "FAILED test_user.py::test_without_the_fixture" not in out


# -- the options ------------------------------------------------------------------------------


@pytest.mark.sim_only
def test_the_options_choose_the_backend_and_the_devices(
    user: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    user.makepyfile(test_user='''
import os
import gpuflow as gf

def test_devices(gpuflow_runtime):
    assert (gpuflow_runtime, gf.device_count()) == ("sim", int(os.environ["WANT"]))
''')  # fmt: skip
    for args, want in [((), 1), (("--gpuflow-devices", "3"), 3)]:
        monkeypatch.setenv("WANT", str(want))
        _run(user, "sim", *args).assert_outcomes(passed=1)
    bad = _run(user, "sim", "--gpuflow-devices", "0")
    assert bad.ret != 0
    bad.stderr.fnmatch_lines(["*--gpuflow-devices: a positive number of devices, not '0'*"])
    wrong = user.runpytest_subprocess(*PLUGIN, "--gpuflow-backend", "tpu", timeout=120)
    assert wrong.ret != 0
    wrong.stderr.fnmatch_lines(["*--gpuflow-backend 'tpu': no backend of that name is "
                                "registered (registered: auto, cuda, sim)*"])
    helped = user.runpytest_subprocess(*PLUGIN, "--help", timeout=120)
    helped.stdout.fnmatch_lines(["*--gpuflow-backend=NAME*", "*--gpuflow-devices=N*"])


@pytest.mark.sim_only
def test_the_backend_option_takes_any_registered_name(user: pytest.Pytester) -> None:
    """A backend a user's conftest registers is one ``--gpuflow-backend``
    takes, as ``sim`` and ``cuda``; a name nobody registered is refused,
    listing those that are."""
    user.makeconftest('''
import gpuflow as gf
from gpuflow._backends import SimBackend

class Mine(SimBackend):
    name = "mine"

gf.lowlevel.register_backend("mine", Mine)
''')  # fmt: skip
    user.makepyfile(test_user='''
import gpuflow as gf

def test_backend(gpuflow_runtime):
    assert gpuflow_runtime == "mine" == gf.current_backend()
    assert gf.to_host(gf.ones(3)).sync().tolist() == [1.0, 1.0, 1.0]

def test_each_test_its_own(gpuflow_runtime):
    assert gf.lowlevel.current_backend_object().device_count == 2
''')  # fmt: skip
    _run(user, "mine", "--gpuflow-devices", "2").assert_outcomes(passed=2)
    wrong = _run(user, "theirs")
    assert wrong.ret != 0
    wrong.stderr.fnmatch_lines(["*--gpuflow-backend 'theirs': no backend of that name is "
                                "registered (registered: auto, cuda, sim, mine)*"])


@pytest.mark.sim_only
def test_auto_and_cuda_without_a_gpu(user: pytest.Pytester) -> None:
    if cuda_probe()[0]:
        pytest.skip("a CUDA device is present: auto is cuda here")
    user.makepyfile(test_user='''
def test_backend(gpuflow_runtime):
    assert gpuflow_runtime == "sim"
''')  # fmt: skip
    _run(user, "auto").assert_outcomes(passed=1)
    cuda = _run(user, "cuda")
    cuda.assert_outcomes(errors=1)
    cuda.stdout.fnmatch_lines(["*backend 'cuda' was asked for, but no CUDA device is present*"])


@pytest.mark.sim_only
def test_p_no_gpuflow_turns_the_installed_plugin_off(user: pytest.Pytester) -> None:
    if not _installed_entry_point():
        pytest.skip("the installed metadata has no entry point to turn off (see above)")
    user.makepyfile(test_user="def test_x(gpuflow_runtime): pass\n")
    result = user.runpytest_subprocess("-p", "no:gpuflow", timeout=120)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'gpuflow_runtime' not found*"])
