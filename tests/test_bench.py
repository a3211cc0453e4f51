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

import gpuflow as gf


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
    loops = ["asyncio", "uvloop", "trio"] if find_spec("uvloop") else ["asyncio", "trio"]
    assert names == [f"awaited ops per second ({loop})" for loop in loops]
    assert all(r["unit"] == "op/s" and r["value"] > 0 for r in report["rows"])
    # --trace: a timeline of every run; each loop awaited at least 3 x 64 x 20 kernels
    events = json.loads((work / "run.json").read_text())["traceEvents"]
    runs = [e for e in events if e.get("cat") == "gpuflow.run"]
    assert len(runs) >= len(loops) * 3 * 64 * 20
    assert {e["name"] for e in runs} == {"kernel empty"}
