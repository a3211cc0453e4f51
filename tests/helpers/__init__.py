"""What the tests share, in one place: the kernels (``kernels``), child
processes (``child``), the MPI ranks' program (``ranks``), and the helpers of
the completion (``completion``) and interop (``interop``) tests; and here,
how many CUDA devices the suite found."""

from __future__ import annotations


def _cuda_devices() -> int:
    try:
        # which backends the suite runs on is decided before any runtime exists
        from gpuflow._backends._cuda import cuda_device_count
    except ImportError:
        return 0
    return cuda_device_count()


CUDA_DEVICES = _cuda_devices()

#: Why every test's ``cuda`` variant is skipped where there is no GPU (about
#: half the suite there: the summary counts them on one line)
NO_CUDA = "cuda variant: no CUDA device present (the sim variant runs)"


def simulated() -> bool:
    """Whether the backend under test simulates its devices (``sim``, and
    any backend that says so): what differs is asked of it, never its name."""
    import gpuflow as gf

    return gf.lowlevel.current_backend_object().simulated


def cuda_native() -> bool:
    """Whether the backend under test drives CUDA devices through the driver."""
    import gpuflow as gf

    return gf.lowlevel.current_backend_object().cuda_native
