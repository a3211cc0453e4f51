"""The communicators' half of the backend interface (NCCL's model): ranks
that meet by an id, their collectives enqueued on a stream, their
asynchronous errors, abort and destroy.  A backend without communicators
refuses each with a :class:`gpuflow.UsageError` (the default here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from .._errors import CommunicatorError, UsageError
from ._records import CollectiveCall, RawComm, RawStream, Step


class Communicators:
    """What :class:`._base.Backend` does for communicators; every method may
    be called from any thread."""

    name: ClassVar[str]

    def _no_comms(self) -> UsageError:
        return UsageError(f"the {self.name} backend has no communicators")

    def comm_unique_id(self) -> bytes:
        """A new id for the ranks of one communicator to meet by (made by one
        rank, handed to the others by the caller).

        Returns
        -------
        bytes
        """
        raise self._no_comms()

    def comm_init(
        self, devices: Sequence[int], ranks: Sequence[int], nranks: int, unique_id: bytes | None
    ) -> list[RawComm]:
        """The raw communicators of this process's ranks: ``ranks[i]`` on
        ``devices[i]``, of ``nranks`` in all.  ``unique_id`` None: the devices
        are every rank (one process).  Blocks until every rank has joined;
        a :class:`gpuflow.UsageError` for an id the backend did not make.

        Parameters
        ----------
        devices
            The devices, one a rank of this process.
        ranks
            The ranks of this process's devices.
        nranks
            How many ranks the communicator has.
        unique_id
            The ranks' meeting id (``comm_unique_id``'s).

        Returns
        -------
        list[RawComm]
        """
        raise self._no_comms()

    def comm_group(self, calls: Sequence[tuple[RawComm, CollectiveCall, RawStream]]) -> None:
        """Enqueue ``(comm, call, stream)`` calls as one group (NCCL's
        ``ncclGroupStart``/``End``): the parts of one collective on several
        devices of this process, or a send and the recv that matches it.
        :class:`gpuflow.CommunicatorError` where NCCL refuses them.

        Parameters
        ----------
        calls
            The collectives, each with its communicator and stream.
        """
        raise self._no_comms()

    def prepare_collective(self, comm: RawComm, call: CollectiveCall) -> Step:
        """:meth:`comm_group` of ``call`` alone, as a step: everything but
        the stream fixed, and called with a stream, it enqueues the call
        there, with the same checks and errors.  Made once for the many runs of one
        collective (a training loop's all-reduce); a backend may resolve
        the call's arguments once.

        Parameters
        ----------
        comm
            The backend's communicator.
        call
            The collective.

        Returns
        -------
        Step
        """

        def step(stream: RawStream) -> None:
            self.comm_group(((comm, call, stream),))

        return step

    def comm_async_error(self, comm: RawComm) -> CommunicatorError | None:
        """The error the communicator reported since (a peer left, NCCL failed),
        if any.  Never blocks, never raises.

        Parameters
        ----------
        comm
            The backend's communicator.

        Returns
        -------
        CommunicatorError | None
        """
        return None

    def comm_abort(self, comm: RawComm) -> None:
        """Stop the communicator's work in flight (its kernels return) and
        refuse more; its collectives still queued return at once when
        reached.  Frees nothing the GPU may still use: :meth:`comm_destroy`
        does, once the runs that used it are done.  Any thread; never raises
        (warns).

        Parameters
        ----------
        comm
            The backend's communicator.
        """

    def comm_destroy(self, comm: RawComm) -> None:
        """Release a communicator whose work is done (aborted or not).  Never
        raises (warns).

        Parameters
        ----------
        comm
            The backend's communicator.
        """
