"""The cuda backend's Python, run where there is no GPU.

``tests/stand_in/program.py`` runs a program on the ``cuda`` backend against
``tests/stand_in/libcuda.c``, a stand-in libcuda whose "device" memory is
host memory and which does each enqueued item at once (kernels do nothing).
What this shows: every path of ``_backends/_cuda`` the program takes runs
and keeps its promises to the front end (contexts set up, streams and their
completion words, copies both ways through staging and directly, launches,
marks, awaits under asyncio and Trio, ``enqueue_on``, a graph replayed, a
stream dropped with an array it wrote, a clean exit), in CI, which has no
GPU.  What it does not show: any timing, ordering or fault of a device;
the whole suite runs on the H200 for those.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CUDA_DEVICES

HERE = Path(__file__).parents[1] / "stand_in"

pytestmark = [
    pytest.mark.sim_only,  # (once: it starts a process of its own)
    pytest.mark.skipif(
        CUDA_DEVICES > 0, reason="a CUDA driver is here: the suite runs on the real one"
    ),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="an ELF soname stand-in"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for the stand-in"),
    pytest.mark.skipif(
        importlib.util.find_spec("cuda.bindings") is None, reason="cuda-bindings not installed"
    ),
]


def stand_in(tmp_path: Path) -> Path:
    """The stand-in libcuda, built into ``tmp_path``."""
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o", str(lib),
         str(HERE / "libcuda.c")],
        check=True,
    )  # fmt: skip
    return lib


def run_against_the_stand_in(tmp_path: Path, script: str, timeout: float) -> str:
    """What ``tests/stand_in/<script>`` prints, run in a process of its own
    against the stand-in (warnings as errors); it must exit 0."""
    done = subprocess.run(
        [sys.executable, "-W", "error", str(HERE / script), str(stand_in(tmp_path))],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def test_the_cuda_backend_runs_a_program_against_a_stand_in_driver(tmp_path: Path) -> None:
    assert run_against_the_stand_in(tmp_path, "program.py", 120).endswith("stand-in program done")


def test_the_run_path_rows_print_against_the_stand_in(tmp_path: Path) -> None:
    """``benchmarks/profile_frontend.py --stand-in LIB`` prints each of the
    run path's rows beside its baseline measured in the same process (a
    benchmark: what is checked is that it runs and prints its rows, never a
    figure)."""
    lib = stand_in(tmp_path)
    bench = HERE.parents[1] / "benchmarks"
    done = subprocess.run(
        [sys.executable, str(bench / "profile_frontend.py"), "--stand-in", str(lib), "--quick"],
        capture_output=True, text=True, timeout=300, cwd=bench,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    loops = ["asyncio"] + [m for m in ("uvloop", "trio") if importlib.util.find_spec(m)]
    for lib_name in loops:
        baseline = "gpuflow's own, asyncio" if lib_name == "trio" else f"plain loop {lib_name}"
        assert f"64 tasks x 20 awaits ({lib_name})" in out and baseline in out, out
    for name, baseline in [
        ("calls a run, 64-task row (asyncio)", "plain loop asyncio"),
        ("132-kernel chain, a step", "raw cuLaunchKernel x132 + sync"),
        ("await gf.wait_stream(another library's stream)", "await of an empty kernel"),
        ("enqueue_on of an empty kernel", ""),
        ("default policy next_stream", "round robin"),
    ]:
        (line,) = [ln for ln in out.splitlines() if ln.strip().startswith(name)]
        assert baseline in line and line.endswith(("met", "missed")), line
    assert out.splitlines()[-1].startswith(f"{len(loops) + 5} row(s) with an aim: ")


def test_runtimes_replaced_on_one_cuda_backend_keep_only_the_green_contexts_in_use(
    tmp_path: Path,
) -> None:
    """The cuda backend's stateful test (``tests/stand_in/stateful.py``):
    runtimes replaced on one backend, reserving SMs or not, with streams
    held across and dropped; the green contexts left are those in use."""
    assert run_against_the_stand_in(tmp_path, "stateful.py", 300) == "ok"
