"""Helpers for testing programs that use gpuflow (and gpuflow itself).

They read the runtime's state; they never change it (the activity record
only watches).  Safe from any thread, except the awaitable ones, which run
in an event loop: :func:`assert_quiescent_async` and
:func:`cancel_at_every_point`, which runs a pipeline once for each point
where a cancellation can reach it.  Installing gpuflow also installs a
pytest plugin: the ``gpuflow_runtime`` fixture and the options
``--gpuflow-backend`` and ``--gpuflow-devices``.
"""

from ._backends import Activity as Activity
from ._scopes import leases_held as leases_held
from ._testing import CancellationPoint as CancellationPoint
from ._testing import CancellationReport as CancellationReport
from ._testing import Stall as Stall
from ._testing import assert_no_stall as assert_no_stall
from ._testing import assert_quiescent as assert_quiescent
from ._testing import assert_quiescent_async as assert_quiescent_async
from ._testing import block_time as block_time
from ._testing import cancel_at_every_point as cancel_at_every_point
from ._testing import overlapped as overlapped
from ._testing import pending_runs as pending_runs
from ._testing import record_activity as record_activity
from ._testing import use_after_free_count as use_after_free_count

__all__ = [
    "assert_quiescent", "assert_quiescent_async", "pending_runs", "leases_held",
    "use_after_free_count", "cancel_at_every_point", "CancellationReport",
    "CancellationPoint", "record_activity", "Activity", "overlapped", "assert_no_stall",
    "Stall", "block_time",
]
