"""A kernel's arrays as its NumPy reference sees them on ``sim``: bounded.

On a GPU a kernel that writes past the end of its array faults the device
(an illegal address).  NumPy clips a slice that reaches past the end of an
array silently, so a reference run as it is would hide the bug that faults
on the GPU: the sim backend gives each reference :class:`Bounded` views,
whose slices past the end raise instead (the launch then faults the
simulated device, as the GPU's does).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from .._records import HostArray


def _check_bounds(a: HostArray, key: object) -> None:
    for axis, k in enumerate(key if isinstance(key, tuple) else (key,)):
        if not isinstance(k, slice) or axis >= a.ndim:
            continue  # (an int or an index array: NumPy checks those itself)
        n = a.shape[axis]
        for end in (k.start, k.stop):
            if end is not None and not -n <= operator.index(end) <= n:
                raise IndexError(
                    f"out of bounds: [{k.start if k.start is not None else ''}:"
                    f"{k.stop if k.stop is not None else ''}] of an array of {n} elements "
                    "(a kernel that reads or writes past the end of its array)"
                )


class Bounded(np.ndarray):
    """A kernel's array as its reference sees it: a slice that reaches past
    the end of the array (``y[:n]`` with ``n`` larger than ``y``) is an
    out-of-bounds access, an :class:`IndexError` (a sticky fault of the
    device, as an illegal address is on a GPU), not NumPy's silent
    clipping of the slice to the array.  Arrays computed from it check
    their own bounds the same way."""

    def __getitem__(self, key: Any) -> Any:
        _check_bounds(self, key)
        return super().__getitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        _check_bounds(self, key)
        super().__setitem__(key, value)
