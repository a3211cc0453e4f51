"""Helpers for testing programs that use gpuflow (and gpuflow itself).

They read the runtime's state; they never change it.  Safe from any thread.
"""

from __future__ import annotations

import time

from ._runtime import get_runtime
from ._scope import leases_held as leases_held


def pending_runs() -> int:
    """Runs handed to the completion dispatcher that the GPU has not finished."""
    return get_runtime().dispatcher.pending


def use_after_free_count() -> int:
    """How many device accesses to freed memory the ``sim`` backend has caught
    (always 0 on ``cuda``, where compute-sanitizer is the detector)."""
    return int(getattr(get_runtime().backend, "use_after_free", 0))


def assert_quiescent(timeout: float = 5.0) -> None:
    """Wait up to ``timeout`` s for every run to finish; then assert that no run
    is pending, no stream lease is held and no use after free was seen."""
    deadline = time.monotonic() + timeout
    while pending_runs() and time.monotonic() < deadline:
        time.sleep(0.001)
    problems = []
    if pending_runs():
        problems.append(f"{pending_runs()} run(s) still pending after {timeout} s")
    if leases_held():
        problems.append(f"{leases_held()} stream lease(s) still held")
    if use_after_free_count():
        problems.append(f"{use_after_free_count()} use(s) after free detected")
    if problems:
        raise AssertionError("gpuflow is not quiescent: " + "; ".join(problems))
