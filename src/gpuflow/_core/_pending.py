"""Host values that become valid only when a run's GPU work is done.

Host data produced by the device (:func:`gpuflow.to_host`) is written by an
enqueued copy, so inside a run it is a *pending* value: the runners resolve
it once the run has completed, ``map`` over it is deferred until then, and
``then`` over it is refused (await first).  A leaf module: operations make
pending values, runners resolve them, and neither needs the other for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._backends import HostArray


class Pending:
    """A host value that is valid only once the run's GPU work is done."""

    __slots__ = ()

    def resolve(self) -> Any:
        raise NotImplementedError


class PendingHost(Pending):
    """A host array the device is copying into."""

    __slots__ = ("array",)

    def __init__(self, array: HostArray) -> None:
        self.array = array

    def resolve(self) -> Any:
        return self.array


class PendingMap(Pending):
    """``fn`` applied to a pending value once it is ready."""

    __slots__ = ("fn", "value")

    def __init__(self, fn: Callable[[Any], Any], value: object) -> None:
        self.fn = fn
        self.value = value

    def resolve(self) -> Any:
        return self.fn(resolve(self.value))


def is_pending(value: object) -> bool:
    """Whether ``value`` (or an element of a tuple or list) waits for the GPU."""
    if isinstance(value, Pending):
        return True
    if isinstance(value, (tuple, list)):  # (a tuple of types: no union made each call)
        for v in value:  # (a loop, not any() of a generator: a run's output is asked)
            if is_pending(v):
                return True
    return False


def has_map(value: object) -> bool:
    """Whether a host-side ``map`` waits for ``value`` to become valid."""
    if isinstance(value, PendingMap):
        return True
    if isinstance(value, (tuple, list)):
        for v in value:
            if has_map(v):
                return True
    return False


def resolve(value: object) -> Any:
    """The output of a completed run: pending host values made concrete."""
    if isinstance(value, Pending):
        return value.resolve()
    if isinstance(value, (tuple, list)):
        for v in value:
            if is_pending(v):
                made = [resolve(v) for v in value]
                return tuple(made) if isinstance(value, tuple) else made
    return value
