"""The testing toolkit behind :mod:`gpuflow.testing`, and the pytest plugin.

Quiescence checks, ``cancel_at_every_point`` and stall detection.  The
pytest plugin (``_pytest_plugin``) is loaded by pytest through its entry
point, never by gpuflow.  Builds on every layer below.
"""

from ._activity import block_time as block_time
from ._activity import overlapped as overlapped
from ._activity import record_activity as record_activity
from ._cancel_at_every_point import CancellationPoint as CancellationPoint
from ._cancel_at_every_point import CancellationReport as CancellationReport
from ._cancel_at_every_point import cancel_at_every_point as cancel_at_every_point
from ._quiescence import assert_quiescent as assert_quiescent
from ._quiescence import assert_quiescent_async as assert_quiescent_async
from ._quiescence import pending_runs as pending_runs
from ._quiescence import use_after_free_count as use_after_free_count
from ._stalls import Stall as Stall
from ._stalls import assert_no_stall as assert_no_stall

__all__ = [
    "CancellationPoint",
    "CancellationReport",
    "Stall",
    "assert_no_stall",
    "assert_quiescent",
    "assert_quiescent_async",
    "block_time",
    "cancel_at_every_point",
    "overlapped",
    "pending_runs",
    "record_activity",
    "use_after_free_count",
]
