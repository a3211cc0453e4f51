"""Streams: handles on one backend stream of one device.

gpuflow makes streams in exactly two places, both in :mod:`._runtime`: the
per-device pool that :func:`init_device_contexts` creates, and
:func:`new_stream`.  Operations never create streams; a scheduling policy
(:mod:`._policy`) picks one per run.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from . import _finalizers
from ._loops import refuse_blocking

if TYPE_CHECKING:
    from .._backends import RawEvent, RawStream
    from ._completion import Lane
    from ._runtime import Runtime

_blocking_lock = threading.Lock()

#: Every Stream alive, of every runtime (what the quiescence check holds the
#: backends' streams against: a backend stream no Stream holds is a leak).
_live: weakref.WeakSet[Stream] = weakref.WeakSet()


def live_streams() -> list[Stream]:
    """Every :class:`Stream` alive now, of every runtime.  Any thread."""
    return list(_live)


#: Every backend stream a runtime made, until gpuflow destroys it (or it goes
#: with its device's context or its backend), by id: its backend and itself.
#: What the quiescence check holds against the Streams alive: a backend
#: stream made and held by none is a leak.
_made: dict[int, tuple[object, Any]] = {}
_made_lock = threading.Lock()


def made(backend: object, raw: RawStream) -> None:
    """``backend`` made ``raw`` for a runtime."""
    with _made_lock:
        _made[id(raw)] = (backend, raw)


def gone(raws: list[RawStream]) -> None:
    """``raws`` were destroyed (or went with their context or backend)."""
    with _made_lock:
        for raw in raws:
            _made.pop(id(raw), None)


def made_streams(backend: object) -> list[RawStream]:
    """The backend streams runtimes made on ``backend`` and did not destroy."""
    with _made_lock:
        return [raw for be, raw in _made.values() if be is backend]


class Stream:
    """A device stream: work enqueued on it runs in order.

    Hashable; there is one ``Stream`` object for each underlying stream
    (``copy`` returns it), so two are equal when they are the same stream.
    Safe to use from any thread.  Implements
    ``__cuda_stream__``, so CuPy, PyTorch and cuda.core can enqueue on it
    (``torch.cuda.ExternalStream``, ``cupy.cuda.ExternalStream``); on
    ``sim`` its handle maps back to the simulated stream, for
    :func:`gpuflow.wait_stream` and the array protocols.

    Made by :func:`new_stream` and by the runtime's pools; not constructed
    directly.
    """

    __slots__ = (
        "__weakref__", "_final", "_generation", "_lane", "_runtime", "_syncs", "device",
        "leased", "priority", "raw", "sms",
    )  # fmt: skip

    def __init__(
        self,
        runtime: Runtime,
        device: int,
        raw: RawStream,
        generation: int,
        priority: int = 0,
        sms: str | None = None,
    ) -> None:
        #: the runtime that made the stream
        self._runtime = runtime
        #: the ordinal of the stream's device
        self.device = device
        #: the backend's own stream object, for code that calls the backend
        #: directly (:mod:`gpuflow.lowlevel`): operations enqueue on
        #: ``ctx.stream.raw`` through ``ctx.backend``
        self.raw = raw
        #: its priority level: 0 the default, higher more urgent (see
        #: :func:`gpuflow.new_stream`); 0 for another library's stream,
        #: whose priority gpuflow does not ask
        self.priority = priority
        #: the name of the reserved SMs it runs on (see
        #: :func:`gpuflow.init_device_contexts`), or None
        self.sms = sms
        #: the generation of the device context the stream was made in
        #: (unique in the process: see ``Runtime.generation``)
        self._generation = generation
        #: blocking runs (``sync``, ``sync_on``) on this stream now: the
        #: completer never sees them, a scheduling policy should
        self._syncs = 0
        #: the completion side's record of the stream's marks (set by the runtime)
        self._lane: Lane | None = None
        #: held by a stream lease: the default policy gives it to no other run
        self.leased = False
        #: once the stream is destroyed, an event recorded after all its work
        #: (what a free still ordered after a use on it waits for)
        self._final: list[RawEvent] = []
        _live.add(self)

    def current(self) -> bool:
        """The stream belongs to the runtime in use and to its device's
        context as it is now (not one that a reset or a new
        :func:`gpuflow.init_device_contexts` replaced).

        Returns
        -------
        bool
        """
        return self._runtime.current(self)

    # -- what a scheduling policy asks (reads without a lock: a race with the
    # GPU or another thread makes an answer slightly stale, never unsafe)
    def idle(self) -> bool:
        """Nothing is pending on the stream: the GPU has reached the end of
        every run enqueued on it, and no blocking run (``sync``) is in
        flight there.  At most a read of its completion word, no driver call.

        Returns
        -------
        bool
        """
        lane = self._lane
        # (what lane.idle() says, without the call: every run asks this)
        return not self._syncs and (
            lane is None
            or (
                not lane.unmarked
                and (lane.completed >= lane.issued or lane.read() >= lane.issued)
            )
        )

    def load(self) -> int:
        """How many runs on the stream the GPU has not finished (blocking
        runs in flight included).

        Returns
        -------
        int
        """
        lane = self._lane
        return self._syncs + (0 if lane is None else lane.backlog())

    def stalled(self, since: float) -> bool:
        """The stream has runs pending and finished none since ``since``
        (``time.monotonic``): it is running long work.

        Parameters
        ----------
        since
            A ``time.monotonic()`` reading.

        Returns
        -------
        bool
        """
        lane = self._lane
        # (an idle stream is not stalled: nothing of it waits to be finished)
        return (
            lane is not None
            and lane.since < since
            and lane.completed < lane.issued
            and lane.read() <= lane.completed
        )

    def _begin_blocking(self) -> None:
        """A blocking run (``sync``) starts on the stream: it counts as busy
        until :meth:`_end_blocking` (the completer never sees such a run).

        Returns
        -------
        None
        """
        with _blocking_lock:
            self._syncs += 1

    def _end_blocking(self) -> None:
        """The blocking run that :meth:`_begin_blocking` counted has ended.

        Returns
        -------
        None
        """
        with _blocking_lock:
            self._syncs -= 1

    def synchronize(self) -> None:
        """Block the calling thread until all work enqueued on the stream is done.

        Raises :class:`DeviceFaultError` if the device faulted, and
        :class:`UsageError` in a thread that runs an event loop, which it
        would stop: there, ``await gf.wait_stream(stream)`` waits for the
        same work without blocking.  The frees of arrays dropped before the
        call are enqueued first (on their own streams), so the memory of one
        dropped on this stream is freed when it returns.

        Raises
        ------
        gpuflow.DeviceFaultError
            The device faulted.
        gpuflow.UsageError
            Called in a thread that runs an event loop.
        """
        refuse_blocking(
            "stream.synchronize()", "in async code, `await gf.wait_stream(stream)`"
        )
        _finalizers.run_finalized()  # (at once where nothing is left)
        lane = self._lane
        if lane is not None and lane.unmarked:  # (its runs are done on return)
            lane.completer.mark_owed(lane)
        self._runtime.backend.synchronize(self.raw)

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol: ``(version, CUstream address)``."""
        return (0, self._runtime.backend.stream_handle(self.raw))

    # one Stream object for each backend stream, so that a Stream is equal
    # (and hashes equal) only to itself: hazard tracking keys its sets and
    # dicts by streams, and identity is what makes that cost nothing
    def __copy__(self) -> Stream:
        return self

    def __deepcopy__(self, memo: object) -> Stream:
        return self

    def __repr__(self) -> str:
        return f"<gpuflow.Stream device={self.device} {self.raw!r}>"
