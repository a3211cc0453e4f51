"""What the device ran (:func:`gpuflow.testing.record_activity`), and the
time a kernel's blocks hold the simulated device's SMs
(:func:`gpuflow.testing.block_time`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .._backends import BLOCK_TIME_ATTR, Activity
from .._core import ensure_runtime
from .._errors import UsageError, UsageTypeError

_F = TypeVar("_F", bound=Callable[..., Any])


@contextlib.contextmanager
def record_activity() -> Iterator[list[Activity]]:
    """Record what the device's streams run while the block is open.

    Yields a list that fills with one :class:`Activity` ``(device, stream,
    what, start, end)`` per item a stream runs: a kernel (``"kernel 'name'"``),
    a copy, a fill, an event record or wait, a run's completion mark or a wait
    for one, a host signal (a sleeping loop's wake-up), a graph replay (one
    item, ``"graph of N nodes"``, however many nodes it has).  The record
    is the simulated device's own: each stream's worker thread appends the
    item it ran, with :func:`time.perf_counter` times it took right before and
    right after running it, so two items whose intervals overlap really ran at
    the same time, and the order of a stream's items is the order it ran them.
    Once a run has completed (``sync``, ``await``) every item it enqueued
    before its completion mark is in the list.  Items that straddle the
    opening or closing of the block may be missing; nothing is appended once
    the block has exited.

    On ``cuda`` the record holds only the kernels, copies, fills and graph
    replays gpuflow enqueued on its own streams, timed by CUDA events, and
    it fills when the block exits, with the items done by then.  A backend
    that keeps no record raises :class:`gpuflow.UsageError`.

    Yields
    ------
    list[Activity]
        Filled as the streams run (on ``cuda``: when the block exits).

    Raises
    ------
    gpuflow.UsageError
        The backend keeps no record.
    """
    backend = ensure_runtime().backend
    record = backend.start_activity_record()
    try:
        yield record
    finally:
        try:
            backend.update_activity_records()
        finally:
            backend.stop_activity_record(record)


def overlapped(a: Activity, b: Activity) -> bool:
    """True when ``a`` and ``b`` were running at the same moment.

    Any thread.

    Parameters
    ----------
    a, b
        Two items of :func:`record_activity`.

    Returns
    -------
    bool
    """
    return a.start < b.end and b.start < a.end


def block_time(seconds: float | Callable[..., float]) -> Callable[[_F], _F]:
    """Give a kernel's NumPy reference the time each block takes on ``sim``.

    ``sim`` runs a kernel block by block on its device's SMs (132 by
    default, as an H200): each block holds an SM for ``seconds``, free SMs
    go to the blocks of the most urgent stream first, then in launch order,
    and a stream made in reserved SMs uses only those (docs/concepts.md,
    "Latency classes").  A reference without it takes no time on the SMs
    (only what it spends running).  ``seconds`` is a number, or a function
    of the kernel's arguments as the reference gets them (a spin kernel
    whose argument is nanoseconds: ``block_time(lambda ns: ns / 1e9)``).
    The cuda backend ignores it: the kernel takes the time it takes.  Any
    thread.

    Parameters
    ----------
    seconds
        The time one block holds an SM: 0 or more seconds, or a function
        of the kernel's arguments that gives them.

    Returns
    -------
    A decorator that marks the reference and returns it unchanged.

    Raises
    ------
    gpuflow.UsageTypeError
        ``seconds`` is neither a number nor a callable.
    gpuflow.UsageError
        ``seconds`` is a negative number.
    """
    if not callable(seconds):
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise UsageTypeError(
                f"block_time takes seconds (a number, or a function of the kernel's "
                f"arguments), got {type(seconds).__name__}"
            )
        if not 0 <= seconds < float("inf"):
            raise UsageError(f"block_time takes 0 or more seconds, got {seconds}")

    def mark(reference: _F) -> _F:
        setattr(reference, BLOCK_TIME_ATTR, seconds)
        return reference

    return mark
