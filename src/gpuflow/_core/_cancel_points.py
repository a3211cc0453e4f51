"""Cancellation points: where gpuflow lets a cancellation reach a task.

Each await of an operation (before anything is enqueued, and while the GPU
runs what was) and each boundary of a scope (entering and leaving a stream
lease or a device group) calls :data:`watcher` when one is installed.
:func:`gpuflow.testing.cancel_at_every_point` installs one to count the
points a pipeline reaches and to cancel it at each in turn; otherwise
:data:`watcher` is None and a point costs one check.
"""

from __future__ import annotations

from typing import Protocol


class Watcher(Protocol):
    async def __call__(self, what: str, op: object = None) -> None:
        """The running task reached a cancellation point: ``what`` says which,
        ``op`` is the operation being awaited (None at a scope's boundary).
        May raise the loop's cancellation (where a point cancels); never
        suspends the task otherwise."""


#: None unless a :func:`gpuflow.testing.cancel_at_every_point` runs.
watcher: Watcher | None = None

#: The points, as a failure names them (after the operation, if any).
BEFORE_ENQUEUE = "before it is enqueued"
IN_FLIGHT = "after it was enqueued, while the GPU runs it"
ENTER_LEASE = "entering a stream lease"
LEAVE_LEASE = "leaving a stream lease (its GPU work done, its stream given back)"
ENTER_GROUP = "entering a device group"
LEAVE_GROUP = "leaving a device group (its tasks and their GPU work done)"
