"""What an operation sees while it enqueues: device, stream, backend.

An :class:`ExecutionContext` lives for one run.  Operations enqueue on
``ctx.stream`` and never create streams; a ``zip`` arm may ask the run's
policy for another stream of the same device (:meth:`fork`), and joins it
back with events.  Everything the enqueued work still uses after the run
returns is handed to :meth:`keep`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._backends import Backend
    from ._policy import SchedulingPolicy
    from ._run import Run
    from ._runtime import Runtime
    from ._stream import Stream


class ExecutionContext:
    """The device, stream and backend an operation enqueues on.

    Only valid during :meth:`DeviceOperation.execute`; safe to use from the
    thread running it.  ``device`` is the ordinal of the run's device,
    ``stream`` the :class:`gpuflow.Stream` to enqueue on, and ``run`` the
    :class:`gpuflow.lowlevel.Run` the work belongs to (what a use of an
    array made by this work is ordered after: ``Allocation.before_read``).
    """

    __slots__ = ("_capturing", "_policy", "_runtime", "device", "run", "stream")

    def __init__(
        self,
        runtime: Runtime,
        stream: Stream,
        policy: SchedulingPolicy | None,
        run: Run,
        capturing: bool = False,
    ) -> None:
        self._runtime = runtime
        self.stream = stream
        self.device = stream.device
        self._policy = policy
        self.run = run
        self._capturing = capturing

    @property
    def backend(self) -> Backend:
        """The backend the work is enqueued on."""
        return self._runtime.backend

    @property
    def backend_name(self) -> str:
        """The name of the backend (``"cuda"``, ``"sim"``)."""
        return self._runtime.backend.name

    @property
    def capturing(self) -> bool:
        """True while the run is being captured into a graph."""
        return self._capturing

    def keep(self, *objs: object) -> None:
        """Keep ``objs`` alive until the GPU has finished the work enqueued so far.

        Parameters
        ----------
        *objs
            Whatever the enqueued work still uses (buffers, modules, host memory).
        """
        self.run.hold(objs)

    def with_stream(self, stream: Stream) -> ExecutionContext:
        """The same run, enqueueing on ``stream``.

        Parameters
        ----------
        stream
            A stream of the run's device.

        Returns
        -------
        ExecutionContext
        """
        return ExecutionContext(
            self._runtime, stream, self._policy, self.run, self._capturing
        )

    def fork(self) -> Stream:
        """Another stream of this device for independent work (may be ``self.stream``).

        Returns
        -------
        Stream
            Join it back with :meth:`wait_for` before the run ends.
        """
        if self._policy is None:
            return self.stream
        return self._policy.next_stream(self.device)

    def wait_for(self, other: Stream) -> None:
        """Make later work on ``self.stream`` wait for what ``other`` has enqueued
        (the join of work this run forked onto ``other``): the event also
        marks, for hazard tracking, where the run's work on ``other`` ends.

        Parameters
        ----------
        other
            A stream this run forked work onto (:meth:`fork`).
        """
        if other != self.stream:
            be = self._runtime.backend
            event = be.record_event(other.raw)
            be.wait_event(self.stream.raw, event)
            run = self.run
            if run._arms is None:
                run._arms = {}
            run._arms[other.raw] = event

    def __repr__(self) -> str:
        return f"<gpuflow.ExecutionContext device={self.device} stream={self.stream!r}>"
