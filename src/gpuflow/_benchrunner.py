"""``python -m gpuflow bench``: run the benchmarks kept in the repository's
``benchmarks/`` folder (they are not part of the installed package)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def _find() -> Path | None:
    env = os.environ.get("GPUFLOW_BENCHMARKS")
    candidates = [Path(env)] if env else []
    candidates += [Path.cwd() / "benchmarks", Path(__file__).resolve().parents[2] / "benchmarks"]
    for c in candidates:
        if (c / "gpuflow_bench.py").is_file():
            return c
    return None


def main(argv: list[str]) -> int:
    where = _find()
    if where is None:
        print(
            "benchmarks/gpuflow_bench.py not found: run from a gpuflow checkout "
            "(or set GPUFLOW_BENCHMARKS to its benchmarks folder)",
            file=sys.stderr,
        )
        return 2
    spec = importlib.util.spec_from_file_location("gpuflow_bench", where / "gpuflow_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rc: int = module.main(argv)
    return rc
