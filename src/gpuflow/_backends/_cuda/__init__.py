"""The ``cuda`` backend: the interface of :mod:`.._base` on the CUDA driver.

The only package of gpuflow (with :mod:`.._nvrtc`) that touches CUDA, one
concern a module:

* :mod:`._driver`: cuda.bindings' driver module, and how a driver result
  becomes a gpuflow error (codes and names from :mod:`.._codes`, the table
  the ``sim`` backend uses too);
* :mod:`._native`: libcuda and libc through ctypes, for the calls made once
  or more per operation, and the semaphores the GIL-free host function posts;
* :mod:`._handles`: a device's state and the handles gpuflow hands out
  (streams, events, buffers, modules, kernels, graphs), whose finalizers
  leak rather than destroy anything in a context that is gone or faulted;
* :mod:`._kernels`: the per-thread parameter buffer, argument packing, and
  the built-in kernels (fill, arange);
* :mod:`._staging`: pinned staging buffers for host copies;
* :mod:`._timing`: the activity record, items timed by CUDA events;
* :mod:`._contexts`: the primary contexts: set-up, the context current on
  each thread, peer access, how completion marks are made, and reset;
* :mod:`._backend`: :class:`CudaBackend` itself, on those contexts: streams,
  events, memory, copies, kernels, the native half of the completion
  bridge, communicators and graphs.

The driver is reached two ways: ``cuda.bindings.driver`` for everything set
up once or rarely (contexts, streams, events, modules, memory pools, copies,
graphs) and for ``cuLaunchKernel``; libcuda through :mod:`ctypes` for the
small per-operation calls and ``cuLaunchHostFunc``.  cuda.core is not used at
run time: its objects own their handles with finalizers of their own, which
would destroy them after a primary-context reset or after a sticky fault,
where gpuflow must leak instead; and its per-call overhead is above the 1 µs
gpuflow may add to a launch.
"""

from __future__ import annotations

from ._backend import CudaBackend
from ._driver import cuda_detect, cuda_device_count, cuda_probe

__all__ = ["CudaBackend", "cuda_detect", "cuda_device_count", "cuda_probe"]
