"""Memory: device arrays and what they give other libraries.

:class:`DeviceArray` and the operations that make and move arrays
(allocations, fills, transfers, copies), and the exchange protocols an
array speaks (DLPack capsules through ``dlpack``, ``__cuda_array_interface__``),
ordered on the consumer's stream.  Builds on :mod:`gpuflow._core` only.
"""

from . import _dlpack as dlpack
from ._array import DeviceArray as DeviceArray
from ._array import allocate as allocate
from ._array import arange as arange
from ._array import as_dtype as as_dtype
from ._array import as_shape as as_shape
from ._array import copy as copy
from ._array import empty as empty
from ._array import empty_like as empty_like
from ._array import from_host as from_host
from ._array import full as full
from ._array import full_like as full_like
from ._array import ones as ones
from ._array import ones_like as ones_like
from ._array import resolve_array as resolve_array
from ._array import to_host as to_host
from ._array import zeros as zeros
from ._array import zeros_like as zeros_like

__all__ = [
    "DeviceArray",
    "allocate",
    "arange",
    "as_dtype",
    "as_shape",
    "copy",
    "dlpack",
    "empty",
    "empty_like",
    "from_host",
    "full",
    "full_like",
    "ones",
    "ones_like",
    "resolve_array",
    "to_host",
    "zeros",
    "zeros_like",
]
