"""Helpers for testing programs that use gpuflow (and gpuflow itself).

They read the runtime's state; they never change it (the activity record
only watches).  Safe from any thread, except the awaitable ones, which run
in an event loop: :func:`assert_quiescent_async` and
:func:`cancel_at_every_point`, which runs a pipeline once for each point
where a cancellation can reach it.  Installing gpuflow also installs a
pytest plugin: the ``gpuflow_runtime`` fixture and the options
``--gpuflow-backend`` and ``--gpuflow-devices``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ._backends import Activity as Activity
from ._core import ensure_runtime
from ._scopes import leases_held as leases_held
from ._testing import CancellationPoint as CancellationPoint
from ._testing import CancellationReport as CancellationReport
from ._testing import Stall as Stall
from ._testing import assert_no_stall as assert_no_stall
from ._testing import assert_quiescent as assert_quiescent
from ._testing import assert_quiescent_async as assert_quiescent_async
from ._testing import cancel_at_every_point as cancel_at_every_point
from ._testing import pending_runs as pending_runs
from ._testing import use_after_free_count as use_after_free_count

__all__ = [
    "assert_quiescent", "assert_quiescent_async", "pending_runs", "leases_held",
    "use_after_free_count", "cancel_at_every_point", "CancellationReport",
    "CancellationPoint", "record_activity", "Activity", "overlapped", "assert_no_stall",
    "Stall",
]


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

    Yields
    ------
    list[Activity]
        Filled as the streams run (on ``cuda``: when the block exits).

    Raises
    ------
    gpuflow.UsageError
        The backend keeps no record.
    """
    backend = ensure_runtime().backend
    record = backend.start_activity_record()
    try:
        yield record
    finally:
        try:
            backend.update_activity_records()
        finally:
            backend.stop_activity_record(record)


def overlapped(a: Activity, b: Activity) -> bool:
    """True when ``a`` and ``b`` were running at the same moment.

    Any thread.

    Parameters
    ----------
    a, b
        Two items of :func:`record_activity`.

    Returns
    -------
    bool
    """
    return a.start < b.end and b.start < a.end
