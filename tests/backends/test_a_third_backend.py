"""A backend that is neither ``sim`` nor ``cuda`` runs the suite unchanged.

As AnyIO runs its whole suite on every backend named in one list, gpuflow's
suite runs on every backend ``--backends`` names: a third one, registered
by a plugin (``tests/helpers/third_backend.py``: ``sim`` under another
name), runs a core part of the suite, in a child pytest, with no test
knowing its name.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers.child import run_child

ROOT = Path(__file__).resolve().parents[2]

#: the core of the suite: running and its policy, hazards, scopes
CORE = [
    "tests/core/test_running.py",
    "tests/core/test_policy.py",
    "tests/core/test_hazards.py",
    "tests/scopes/test_scopes.py",
]


@pytest.mark.sim_only
@pytest.mark.timeout(300)  # (one process: the alone tests' run would write its own report)
def test_a_third_backend_runs_the_core_of_the_suite_unchanged(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")]))
    proc = run_child(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         "-p", "helpers.third_backend", "--backends", "third",
         f"--junitxml={report}", *CORE],
        env=env, cwd=ROOT, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes: dict[str, str] = {}
    for case in cases:
        name = case.get("name", "")
        skipped = case.find("skipped") is not None
        outcomes[f"{case.get('classname')}::{name}"] = "skipped" if skipped else "passed"
    # every test ran on the third backend, and most of them ran
    assert outcomes and all("[third" in n for n in outcomes), sorted(outcomes)[:5]
    passed = [n for n, o in outcomes.items() if o == "passed"]
    assert len(passed) > 0.9 * len(outcomes), (len(passed), len(outcomes))
    for path in CORE:
        module = path.removesuffix(".py").replace("/", ".")
        assert any(n.startswith(module) for n in passed), path
    # the backend the tests found was the third one, by its own name
    assert any("test_init_device_contexts_returns_the_backend[third]" in n for n in passed)
