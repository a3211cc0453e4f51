"""The CUDA driver's result codes gpuflow names, and the error each becomes.

A :class:`DeviceError` keeps the driver's code and name, and the ``sim``
backend raises the errors the driver would raise: both backends take the
numbers and the names from this one table, so that they cannot disagree.
The values are those of ``cuda.bindings.driver.CUresult`` (a test checks
every one against it).  Which gpuflow error a code becomes is decided here
too (:func:`error_class`).
"""

from __future__ import annotations

from typing import Final

from .._errors import DeviceError, DeviceFaultError, LaunchError, OutOfMemoryError

CUDA_SUCCESS: Final = 0
CUDA_ERROR_INVALID_VALUE: Final = 1
CUDA_ERROR_OUT_OF_MEMORY: Final = 2
CUDA_ERROR_NO_DEVICE: Final = 100
CUDA_ERROR_INVALID_IMAGE: Final = 200
CUDA_ERROR_INVALID_CONTEXT: Final = 201
CUDA_ERROR_NO_BINARY_FOR_GPU: Final = 209
CUDA_ERROR_ECC_UNCORRECTABLE: Final = 214
CUDA_ERROR_NVLINK_UNCORRECTABLE: Final = 220
CUDA_ERROR_CONTAINED: Final = 226
CUDA_ERROR_INVALID_HANDLE: Final = 400
CUDA_ERROR_NOT_FOUND: Final = 500
CUDA_ERROR_NOT_READY: Final = 600
CUDA_ERROR_ILLEGAL_ADDRESS: Final = 700
CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: Final = 701
CUDA_ERROR_LAUNCH_TIMEOUT: Final = 702
CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING: Final = 703
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: Final = 704
CUDA_ERROR_CONTEXT_IS_DESTROYED: Final = 709
CUDA_ERROR_ASSERT: Final = 710
CUDA_ERROR_HARDWARE_STACK_ERROR: Final = 714
CUDA_ERROR_ILLEGAL_INSTRUCTION: Final = 715
CUDA_ERROR_MISALIGNED_ADDRESS: Final = 716
CUDA_ERROR_INVALID_ADDRESS_SPACE: Final = 717
CUDA_ERROR_INVALID_PC: Final = 718
CUDA_ERROR_LAUNCH_FAILED: Final = 719
CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: Final = 720
CUDA_ERROR_TENSOR_MEMORY_LEAK: Final = 721

#: The name of every code above (the constant's own name, as CUDA spells it).
NAMES: Final[dict[int, str]] = {
    code: name for name, code in list(globals().items()) if name.startswith("CUDA_")
}

#: Errors after which the context is unusable until a reset: a sticky fault.
STICKY_ERRORS: Final = frozenset(
    {
        CUDA_ERROR_ECC_UNCORRECTABLE,
        CUDA_ERROR_NVLINK_UNCORRECTABLE,
        CUDA_ERROR_CONTAINED,
        CUDA_ERROR_ILLEGAL_ADDRESS,
        CUDA_ERROR_LAUNCH_TIMEOUT,
        CUDA_ERROR_ASSERT,
        CUDA_ERROR_HARDWARE_STACK_ERROR,
        CUDA_ERROR_ILLEGAL_INSTRUCTION,
        CUDA_ERROR_MISALIGNED_ADDRESS,
        CUDA_ERROR_INVALID_ADDRESS_SPACE,
        CUDA_ERROR_INVALID_PC,
        CUDA_ERROR_LAUNCH_FAILED,
        CUDA_ERROR_TENSOR_MEMORY_LEAK,
    }
)

#: Errors of ``cuLaunchKernel`` that mean "this launch cannot be made as asked".
LAUNCH_ERRORS: Final = frozenset(
    {
        CUDA_ERROR_INVALID_VALUE,
        CUDA_ERROR_INVALID_IMAGE,
        CUDA_ERROR_NO_BINARY_FOR_GPU,
        CUDA_ERROR_INVALID_HANDLE,
        CUDA_ERROR_NOT_FOUND,
        CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
        CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING,
        CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
    }
)

#: The calling thread's current context is not the one the call needs: set it
#: again and retry (someone changed it behind gpuflow's per-thread cache).
CONTEXT_ERRORS: Final = frozenset({CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_CONTEXT_IS_DESTROYED})


def error_class(code: int, *, launch: bool = False) -> type[DeviceError]:
    """The gpuflow error a failed call with ``code`` raises.

    A sticky code is a :class:`DeviceFaultError`, out of memory an
    :class:`OutOfMemoryError`, a launch that cannot be made as asked (``launch``:
    the code came from a kernel launch) a :class:`LaunchError`; any other code
    a plain :class:`DeviceError`.
    """
    if code in STICKY_ERRORS:
        return DeviceFaultError
    if code == CUDA_ERROR_OUT_OF_MEMORY:
        return OutOfMemoryError
    if launch and code in LAUNCH_ERRORS:
        return LaunchError
    return DeviceError


# -- NCCL's result codes (``ncclResult_t``), for communicator errors ---------------
NCCL_SYSTEM_ERROR: Final = 2
NCCL_INTERNAL_ERROR: Final = 3
NCCL_INVALID_ARGUMENT: Final = 4
NCCL_INVALID_USAGE: Final = 5
NCCL_REMOTE_ERROR: Final = 6

#: NCCL's own names of the codes above (and of those gpuflow only passes on).
NCCL_NAMES: Final[dict[int, str]] = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    NCCL_SYSTEM_ERROR: "ncclSystemError",
    NCCL_INTERNAL_ERROR: "ncclInternalError",
    NCCL_INVALID_ARGUMENT: "ncclInvalidArgument",
    NCCL_INVALID_USAGE: "ncclInvalidUsage",
    NCCL_REMOTE_ERROR: "ncclRemoteError",
    7: "ncclInProgress",
}
