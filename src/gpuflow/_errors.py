"""The exception hierarchy.

Everything gpuflow raises on purpose derives from :class:`GpuflowError`.
Device failures keep the driver's code and name where the driver gave one,
so that a CUDA user can look them up; the cancellation exception of the
running event loop is never wrapped or replaced.
"""

from __future__ import annotations


class GpuflowError(Exception):
    """Base class of every error gpuflow raises on purpose."""


class UsageError(GpuflowError, ValueError):
    """The program asked for something gpuflow cannot do as asked.

    Raised before anything is enqueued: a wrong argument, a blocking call
    from inside an event loop, an operation that cannot be captured.  A
    :class:`ValueError`, as Python's own errors for bad values are; an
    argument of the wrong type raises :class:`UsageTypeError`, which is also
    a :class:`TypeError`.
    """


class UsageTypeError(UsageError, TypeError):
    """An argument of the wrong type (``except TypeError`` catches it too)."""


class DeviceError(GpuflowError):
    """The device (or the driver) reported a failure.

    ``code`` and ``name`` are the driver's (``CUresult``) where there is one,
    else ``None``; ``device`` is the ordinal of the device concerned.
    """

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        name: str | None = None,
        device: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.name = name
        self.device = device

    def __str__(self) -> str:
        msg = super().__str__()
        if self.name is not None and self.name not in msg:
            msg = f"{msg} [{self.name}" + (f" ({self.code})]" if self.code is not None else "]")
        return msg


class DeviceFaultError(DeviceError):
    """A sticky device fault (illegal address, a trapped kernel, ...).

    Every operation pending on the device fails with it, and every later one
    fails at once, until :func:`gpuflow.reset_device` is called.
    """


class OutOfMemoryError(DeviceError):
    """A device allocation failed.  Not sticky: free memory and retry."""


class LaunchError(DeviceError):
    """A kernel could not be launched (bad configuration, too many resources)."""


class CommunicatorError(DeviceError):
    """A communicator failed: NCCL reported an error (its ``ncclResult_t`` code
    and name), a peer left, or the communicator was aborted.

    Every run pending on the communicator fails with it, and later
    collectives on it fail at once: an aborted communicator is not usable
    again.  ``rank`` is the rank that reports it.
    """

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        name: str | None = None,
        device: int | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(message, code=code, name=name, device=device)
        self.rank = rank


class CompileError(GpuflowError):
    """NVRTC rejected the source.  ``log`` holds the compiler's log."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(f"{message}\n{log}" if log else message)
        self.log = log
