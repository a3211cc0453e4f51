"""``sim``: gpuflow's CPU simulation of a CUDA device.

``_backend`` (the devices, streams, memory and kernels run through their
NumPy references), ``_marks`` (completion: marks a stream's worker writes
into its word, waits of one stream for another's mark, host signals) and
``_comm`` (communicators: ranks meeting in a directory).
"""

from ._backend import SimBackend as SimBackend

__all__ = [
    "SimBackend",
]
