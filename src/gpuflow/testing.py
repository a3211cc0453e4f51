"""Helpers for testing programs that use gpuflow (and gpuflow itself).

They read the runtime's state; they never change it (the activity record
only watches).  Safe from any thread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from ._backends._base import Activity as Activity
from ._runtime import get_runtime
from ._scope import leases_held as leases_held
from ._stalls import Stall as Stall
from ._stalls import assert_no_stall as assert_no_stall

__all__ = [
    "assert_quiescent", "pending_runs", "leases_held", "use_after_free_count",
    "record_activity", "Activity", "overlapped", "assert_no_stall", "Stall",
]


def pending_runs() -> int:
    """Runs handed to the completion dispatcher that the GPU has not finished."""
    return get_runtime().dispatcher.pending


def use_after_free_count() -> int:
    """How many device accesses to freed memory the ``sim`` backend has caught
    (always 0 on ``cuda``, where compute-sanitizer is the detector)."""
    return get_runtime().backend.use_after_free_count()


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


@contextlib.contextmanager
def record_activity() -> Iterator[list[Activity]]:
    """Record what the device's streams run while the block is open.

    Yields a list that fills with one :class:`Activity` ``(device, stream,
    what, start, end)`` per item a stream runs: a kernel (``"kernel 'name'"``),
    a copy, a fill, an event record or wait, a run's completion mark or a wait
    for one, a host signal (a sleeping loop's wake-up), a graph replay (one
    item, ``"graph of N nodes"``, however many nodes it has).  The record
    is the simulated device's own: each stream's worker thread appends the
    item it ran, with :func:`time.perf_counter` times it took right before and
    right after running it, so two items whose intervals overlap really ran at
    the same time, and the order of a stream's items is the order it ran them.
    Once a run has completed (``sync``, ``await``) every item it enqueued
    before its completion mark is in the list.  Items that straddle the
    opening or closing of the block may be missing; nothing is appended once
    the block has exited.

    On ``cuda`` the record holds only the kernels, copies, fills and graph
    replays gpuflow enqueued on its own streams, timed by CUDA events, and
    it fills when the block exits, with the items done by then.  A backend
    that keeps no record raises :class:`gpuflow.UsageError`.
    """
    backend = get_runtime().backend
    record = backend.start_activity_record()
    try:
        yield record
    finally:
        try:
            backend.update_activity_records()
        finally:
            backend.stop_activity_record(record)


def overlapped(a: Activity, b: Activity) -> bool:
    """True when ``a`` and ``b`` were running at the same moment."""
    return a.start < b.end and b.start < a.end
