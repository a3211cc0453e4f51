"""Every program in examples/ runs, as a user would run it, and says what it should.

Each runs in a subprocess on the backend under test; an example that needs
PyTorch or CuPy is skipped where that library is missing (and says so).  An
example that is a user's test file runs under pytest, as it would in the
user's project, and must fail, naming the point, once its pipeline is broken.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers.child import run_child

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

#: example -> (libraries it needs, lines its output must contain)
EXPECT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "graph_replay.py": ((), ("captured a graph of 3 nodes", "replay 2: input 3 -> output 9")),
    "asyncio_service.py": ((), ("request value=6 gpu=10 ms -> ok 50319360",
                                "request value=200 gpu=500 ms -> timeout")),
    "trio_multi_gpu.py": ((), ("device 0: sum of squares", "the group failed after",
                               ": the input was bad")),
    "torch_interop.py": (("torch",), ("one buffer, two views", "pipeline: correct",
                                      "ticks while the forward pass ran")),
    "cupy_interop.py": (("cupy",), ("cupy sees the same memory", "pipeline: correct",
                                    "awaited CuPy's stream")),
    "data_parallel.py": ((), ("rank 0: step 3 all-reduced", "rank 0 done")),
    "latency_classes.py": ((), ("without classes: interactive p50", "with classes: interactive p50",
                                "shorter with the classes")),
}


#: examples that are test files: run by pytest, with gpuflow's plugin
PYTEST_EXAMPLES = ("test_my_pipeline.py",)


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(
        name for name in [*EXPECT, *PYTEST_EXAMPLES] if (EXAMPLES / name).exists()
    )


#: examples that compare times (the classes against none): they run alone
TIMED = ("latency_classes.py",)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.alone) if n in TIMED else n for n in sorted(EXPECT)]
)
def test_the_example_runs(name: str, device_backend: str) -> None:
    path = EXAMPLES / name
    if not path.exists():
        pytest.skip(f"{name} is not written yet")
    needs, lines = EXPECT[name]
    # without its library, or on sim, such an example says it skips, and exits 0
    skips = (device_backend == "sim" and bool(needs)) or any(
        importlib.util.find_spec(lib) is None for lib in needs
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = run_child([sys.executable, str(path), "--backend", device_backend], timeout=100, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.splitlines()[0] == f"backend: {device_backend}" or out.startswith(
        f"backend: {device_backend},"
    ), out[:200]
    if skips:
        assert out.splitlines()[-1].startswith("skipped: "), out
        return
    for line in lines:
        assert line in out, out
    assert out.rstrip().endswith("ok"), out[-500:]


@pytest.mark.sim_only
def test_the_data_parallel_example_runs_under_mpiexec() -> None:
    """The example's other launcher: two ranks started by mpiexec (the mpich
    wheel's), meeting through mpi4py."""
    bindir = Path(sys.executable).parent
    mpiexec = shutil.which("mpiexec", path=os.pathsep.join([str(bindir), os.environ["PATH"]]))
    assert mpiexec is not None, "mpiexec is not installed (the test extra installs mpich)"
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, str(EXAMPLES / "data_parallel.py"),
         "--backend", "sim"],
        capture_output=True, text=True, timeout=100, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("backend: sim, ranks: 2 (mpiexec)"), out
    for rank in (0, 1):
        assert f"rank {rank}: step 3 all-reduced 16384 floats over 2 ranks, checked" in out, out
    # rank 0 says ok after a barrier; mpiexec may still forward rank 1's last
    # line after it (two pipes), so the line is looked for, not its place
    assert "ok" in out.splitlines(), out


#: The examples that run under Trio, which only the trio (and test) extra installs
TRIO_EXAMPLES = sorted(
    p.name for p in EXAMPLES.glob("*.py") if re.search(r"^\s*import trio$", p.read_text(), re.M)
)


@pytest.mark.sim_only
@pytest.mark.parametrize("name", TRIO_EXAMPLES)
def test_an_example_that_needs_trio_says_how_to_install_it(name: str) -> None:
    """What ``pip install -e .`` alone leaves: no Trio.  The example says
    which extra installs it, with no traceback."""
    hide_trio = (
        "import runpy, sys; sys.modules['trio'] = None; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    src = str(ROOT / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", hide_trio, str(EXAMPLES / name), "--backend", "sim"],
        capture_output=True, text=True, timeout=100, env=env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "pip install 'gpuflow[trio]'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.sim_only
def test_the_trio_extra_installs_trio_and_the_readme_says_so() -> None:
    assert TRIO_EXAMPLES == ["cupy_interop.py", "trio_multi_gpu.py"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert [r for r in extras["trio"] if r.startswith("trio")]
    assert [r for r in extras["test"] if r.startswith("trio")]  # the suite runs under Trio
    assert not [r for r in project["dependencies"] if r.startswith("trio")]
    readme = (ROOT / "README.md").read_text()
    assert "python3 -m pip install -e '.[trio]'" in readme


def _pytest_example(
    path: Path, backend: str, cwd: Path, timeout: float = 100
) -> subprocess.CompletedProcess[str]:
    """pytest on one example file, as in a user's project: gpuflow's plugin
    comes from the installed entry point (with ``-p`` where the installed
    metadata predates it), AnyIO's from its own."""
    installed = any(
        ep.name == "gpuflow" for ep in importlib.metadata.entry_points(group="pytest11")
    )
    plugin = [] if installed else ["-p", "gpuflow._testing._pytest_plugin"]
    src = str(ROOT / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    return run_child(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
         "--gpuflow-backend", backend, str(path)],
        timeout=timeout, env=env, cwd=cwd,
    )  # fmt: skip


def _loops() -> int:
    return 1 + sum(importlib.util.find_spec(lib) is not None for lib in ("uvloop", "trio"))


def test_the_test_file_example_passes(device_backend: str) -> None:
    proc = _pytest_example(EXAMPLES / "test_my_pipeline.py", device_backend, ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # three tests under every loop, one synchronous
    assert f"{3 * _loops() + 1} passed" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.timeout(300)
def test_the_test_file_example_fails_naming_the_point_once_broken(
    device_backend: str, tmp_path: Path
) -> None:
    # the handler forgets to count a request that was cancelled
    text = (EXAMPLES / "test_my_pipeline.py").read_text()
    assert text.count("        ledger.abandoned += 1\n") == 1, "the example changed: update this"
    broken = tmp_path / "test_my_pipeline.py"
    broken.write_text(text.replace("        ledger.abandoned += 1\n", "        pass\n"))
    # Hypothesis shrinks each loop's failing example, then explains it by
    # running its variants under a line tracer (sys.settrace before Python
    # 3.12): 45 s on a 2-core machine under its ``ci`` profile (the
    # environment has ``CI``: no example database, so under every loop)
    proc = _pytest_example(broken, device_backend, tmp_path, timeout=240)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{2 * _loops()} failed, {_loops() + 1} passed" in proc.stdout, proc.stdout[-3000:]
    line = text.splitlines().index("        async with gf.open_stream_lease():") + 1
    assert (
        f"AssertionError: cancelled at point 1 of 8 (entering a stream lease; at {broken}:{line} "
        "(in handle)): check() failed: AssertionError: Ledger(started=2, finished=1, abandoned=0)"
    ) in proc.stdout, proc.stdout[-3000:]
