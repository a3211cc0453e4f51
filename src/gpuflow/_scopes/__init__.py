"""Scopes: stream leases and device groups.

A stream lease lends a task one stream for its scope; a device group runs a
task per device.  Each scope waits at its exit for the runs it tracked, and
starts runs at once that a task awaits later (``StartedRun``).
Builds on :mod:`gpuflow._core`.
"""

from ._scope import DeviceGroup as DeviceGroup
from ._scope import StartedRun as StartedRun
from ._scope import StreamLease as StreamLease
from ._scope import Tracked as Tracked
from ._scope import held_leases as held_leases
from ._scope import leases_held as leases_held
from ._scope import open_device_group as open_device_group
from ._scope import open_stream_lease as open_stream_lease

__all__ = [
    "DeviceGroup",
    "StartedRun",
    "StreamLease",
    "Tracked",
    "held_leases",
    "leases_held",
    "open_device_group",
    "open_stream_lease",
]
