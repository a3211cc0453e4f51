"""What the suite tells the person who runs it.

Without a GPU about half the tests are reported skipped (every test also has
a ``cuda`` variant): the report's header says so up front, and the skips are
counted by reason at the end, one line each, not one line a test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CUDA_DEVICES, NO_CUDA
from helpers.child import run_child

pytestmark = pytest.mark.sim_only  # a property of the suite, the same on every backend

ROOT = Path(__file__).resolve().parents[2]


def test_the_report_explains_the_skips() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
         "tests/core/test_usage_errors.py::test_a_wrong_value_is_a_usage_error_and_a_value_error"],
        cwd=ROOT, capture_output=True, text=True, timeout=100,
        env=dict(os.environ, PYTEST_ADDOPTS=""),
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    if CUDA_DEVICES:
        assert "gpuflow: every test on sim and on cuda" in out
        return
    assert "every test's cuda variant is skipped (the summary counts them)" in out
    summary = out[out.index("skipped tests, by reason"):]
    # the four cases, run on sim, and their cuda variants skipped: one line says it
    assert re.search(rf"\n +4  {re.escape(NO_CUDA)}\n", summary), summary
    assert "4 passed, 4 skipped" in summary
    assert "SKIPPED [" not in out  # no line a test


def test_a_child_that_hangs_fails_its_test_with_the_child_s_stacks() -> None:
    # a thread of the child waits for ever in a function of its own
    child = (
        "import threading\n"
        "def wait_for_a_signal_that_never_comes():\n"
        "    threading.Event().wait()\n"
        "t = threading.Thread(target=wait_for_a_signal_that_never_comes)\n"
        "t.start()\n"
        "print('waiting ' + 'for ever', flush=True)\n"
    )
    with pytest.raises(pytest.fail.Exception) as failed:
        run_child([sys.executable, "-c", child], timeout=2)
    message = str(failed.value)
    assert "still ran after 2 s" in message
    assert "waiting for ever" in message  # what it printed
    assert "in wait_for_a_signal_that_never_comes" in message  # the stuck thread's stack
    # a child that ends in time: as subprocess.run
    done = run_child([sys.executable, "-c", "print('ok'); raise SystemExit(3)"], timeout=30)
    assert (done.returncode, done.stdout) == (3, "ok\n")
