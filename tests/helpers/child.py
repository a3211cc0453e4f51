"""A child Python process that a test runs: where it hangs, the test says where.

A child that never ends leaves a test that only times out, with the stacks
of the parent (waiting for it) and none of the child's.  :func:`run_child`
enables Python's fault handler in the child and, once the child has run
past its time, sends it SIGABRT: the handler prints every thread's stack of
the child, and the test fails with them.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

#: how long an aborted child has to print its stacks and end
_ABORT_S = 10.0


def run_child(
    args: Sequence[str],
    *,
    timeout: float,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True, ...)``, except
    that a child still running after ``timeout`` seconds fails the test with
    every thread's stack of the child (keep ``timeout`` and the abort's
    10 s under the test's own timeout)."""
    child_env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    with subprocess.Popen(
        list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=cwd, env=child_env,
    ) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                out, err = proc.communicate(timeout=_ABORT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(
                f"{shlex.join(args)} still ran after {timeout} s; what it printed, then "
                f"every thread's stack:\n{out[-4000:]}\n{err[-16000:]}",
                pytrace=False,
            )
    return subprocess.CompletedProcess(list(args), proc.returncode, out, err)
