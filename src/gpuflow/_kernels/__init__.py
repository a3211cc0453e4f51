"""Kernels: NVRTC modules and their launches as operations.

:func:`compile` makes a :class:`Module`; its :class:`Kernel` objects, called
with a :class:`LaunchConfig` and arguments, are operations whose arguments
are checked against the kernel's signature when the operation is built.
Builds on :mod:`gpuflow._core` and :mod:`gpuflow._memory`.
"""

from ._kernel import Kernel as Kernel
from ._kernel import LaunchConfig as LaunchConfig
from ._kernel import Module as Module
from ._kernel import compile as compile
from ._kernel import compile_async as compile_async

__all__ = [
    "Kernel",
    "LaunchConfig",
    "Module",
    "compile",
    "compile_async",
]
