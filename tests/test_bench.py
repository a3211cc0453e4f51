"""``python -m gpuflow bench`` ships with the package: it runs wherever
gpuflow is installed, not only from a checkout of the repository."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

import gpuflow as gf
from gpuflow.__main__ import main as gpuflow_main
from gpuflow._bench import main as bench_main


def test_bench_runs_from_an_installed_copy_of_the_package(
    device_backend: str, tmp_path: Path
) -> None:
    # a copy of the package alone, away from the repository: what an install leaves
    site = tmp_path / "site"
    shutil.copytree(
        Path(gf.__file__).parent, site / "gpuflow", ignore=shutil.ignore_patterns("__pycache__")
    )
    work = tmp_path / "work"
    work.mkdir()
    # the copy first; what else is on the path (its dependencies) stays
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OUT=str(work))
    where = subprocess.run(
        [sys.executable, "-c", "import gpuflow; print(gpuflow.__file__)"],
        cwd=work, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).parent == site / "gpuflow"

    cmd = ["-m", "gpuflow", "bench", "--backend", device_backend, "--quick", "--only", "throughput",
           "--trace", "run.json"]
    proc = subprocess.run(
        [sys.executable, *cmd], cwd=work, env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"gpuflow bench on backend {device_backend!r}" in proc.stdout
    report = json.loads((work / "bench.json").read_text())
    assert report["backend"] == device_backend
    names = [r["name"] for r in report["rows"]]
    loops = ["asyncio"] + [m for m in ("uvloop", "trio") if find_spec(m)]
    assert names == [
        name
        for loop in loops
        for name in (
            f"awaited ops per second ({loop})", f"awaited ops per second, 1,000 tasks ({loop})"
        )
    ]
    assert all(r["unit"] == "op/s" and r["value"] > 0 for r in report["rows"])
    # --trace: a timeline of every run; each loop awaited at least 3 x 64 x 20 kernels
    events = json.loads((work / "run.json").read_text())["traceEvents"]
    runs = [e for e in events if e.get("cat") == "gpuflow.run"]
    assert len(runs) >= len(loops) * 3 * 64 * 20
    assert {e["name"] for e in runs} == {"kernel empty"}


# -- the command line's help ---------------------------------------------------------------------


@pytest.mark.sim_only  # no backend involved
def test_the_command_line_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpuflow_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m gpuflow COMMAND [options]")
    for command in ("demo", "bench", "info"):
        assert f"\n  {command}  " in out, command
    for markup in ("``", ":class:", ":func:"):  # reStructuredText a terminal shows raw
        assert markup not in out
    assert gpuflow_main([]) == 2 and "usage:" in capsys.readouterr().err
    assert gpuflow_main(["nope"]) == 2 and "expected one of demo" in capsys.readouterr().err


@pytest.mark.sim_only  # no backend involved
def test_bench_help_describes_it_and_every_name_only_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        bench_main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "gpuflow's benchmarks. Each row:" in out
    names = out[out.index("names for --only"):]
    for name in ("launch", "throughput", "chain", "hold", "lease", "deadlines", "fanout",
                 "torch", "nccl", "fault"):
        assert f"\n  {name:<11} " in names, name
    with pytest.raises(SystemExit) as done:  # a misspelt name runs nothing, and says so
        bench_main(["--only", "lanch"])
    assert done.value.code == 2
    assert "invalid choice: 'lanch' (choose from 'launch'" in capsys.readouterr().err


@pytest.mark.sim_only  # no backend involved
def test_info_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        gpuflow_main(["info", "--help"])
    assert done.value.code == 0
    assert "what a bug report needs" in capsys.readouterr().out
