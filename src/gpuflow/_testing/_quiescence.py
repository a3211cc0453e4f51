"""Whether gpuflow is at rest: no run pending, no lease held, no use after free.

What :mod:`gpuflow.testing` checks after a test, in a blocking form (for
synchronous code and fixtures) and an awaitable one (for code running in an
event loop, which must not block it).
"""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel

from .._core import (
    current_runtime,
    ensure_runtime,
    refuse_blocking,
    resource_leaks,
    run_finalized,
)
from .._scopes import held_leases, leases_held

#: How often the waits look again whether every run has finished.
_POLL_S = 0.001


def pending_runs() -> int:
    """Runs handed to the completer that the GPU has not finished
    (what finalizers left, such as the release of another library's memory
    after gpuflow's uses, is handed over first).

    Any thread.

    Returns
    -------
    int
    """
    run_finalized()
    return ensure_runtime().completer.pending


def look() -> int | None:
    """One look at whether gpuflow is at rest: the runs pending (what
    finalizers left handed over first), or None where none is but work
    enqueued on one of gpuflow's own streams outside any run (through
    :mod:`gpuflow.lowlevel`) is not done yet (the ``sim`` backend sees a use
    after free only once the access runs, so the waits below wait for that
    work too).

    The waits report the runs their last look saw: one that appears after
    it (a release a finishing run dropped, handed over by the next look)
    came after the wait, and is not counted as one it waited for in vain."""
    pending = pending_runs()
    if pending:
        return pending
    rt = ensure_runtime()
    backend = rt.backend
    for stream in rt.own_streams():
        try:
            if rt.current(stream) and not backend.query(stream.raw):
                return None
        except Exception:  # (a fault, or destroyed meanwhile: nothing to wait for)
            continue
    return 0


def settle(timeout: float) -> int:
    """Wait up to ``timeout`` s, blocking the calling thread, for gpuflow to
    be at rest (:func:`look`); the runs the last look saw pending."""
    deadline = time.monotonic() + timeout
    while (pending := look()) != 0 and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return pending or 0


async def settle_async(timeout: float) -> int:
    """:func:`settle` sleeping in the event loop (a cancellation point)."""
    deadline = time.monotonic() + timeout
    await anyio.lowlevel.checkpoint()
    while (pending := look()) != 0 and time.monotonic() < deadline:
        await anyio.sleep(_POLL_S)
    return pending or 0


def use_after_free_count() -> int:
    """How many device accesses to freed memory the ``sim`` backend has caught
    (always 0 on ``cuda``, where compute-sanitizer is the detector).

    Any thread.

    Returns
    -------
    int
    """
    return ensure_runtime().backend.use_after_free_count()


class Baseline:
    """What was already there before the code under test ran (leases held by
    the caller, uses after free seen earlier): only what goes beyond it counts."""

    __slots__ = ("leases", "uses_after_free")

    def __init__(self, leases: frozenset[object] = frozenset(), uses_after_free: int = 0) -> None:
        self.leases = leases
        self.uses_after_free = uses_after_free

    @classmethod
    def now(cls) -> Baseline:
        if current_runtime() is None:  # (asking would make a runtime)
            return cls()
        return cls(frozenset(held_leases()), use_after_free_count())


def problems(
    timeout: float, since: Baseline | None = None, pending: int | None = None
) -> list[str]:
    """What is not at rest, once the wait for pending runs is over
    (``pending``: the runs its last :func:`look` saw; by default, a look now).
    A lease still held is named, with where it was entered."""
    base = since or Baseline()
    found = []
    if pending is None:
        pending = pending_runs()
    if pending:
        found.append(f"{pending} run(s) still pending after {timeout} s")
    held = [lease for lease in held_leases() if lease not in base.leases]
    # (one handed to a waiter that has not resumed yet counts, unnamed)
    unnamed = leases_held() - len(base.leases) - len(held)
    if held or unnamed > 0:
        names = ", ".join(map(repr, held))
        found.append(f"{len(held) + max(unnamed, 0)} stream lease(s) still held"
                     + (f": {names}" if names else ""))
    uaf = use_after_free_count() - base.uses_after_free
    if uaf > 0:
        found.append(f"{uaf} use(s) after free detected")
    if not pending:  # (what runs still hold is theirs until they end)
        found += _leaks()
    return found


#: How long the leak check lets finalizers finish what they began: a free
#: done drops the last reference to a stream, whose finalizer then retires it.
_LEAKS_SETTLE_S = 0.2


def _leaks() -> list[str]:
    """:func:`resource_leaks`, once what finalizers queued is done (each
    may queue more: the last reference a free held goes with it)."""
    deadline = time.monotonic() + _LEAKS_SETTLE_S
    while True:
        run_finalized()
        leaks = resource_leaks()
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(_POLL_S)


def _raise(found: list[str]) -> None:
    if found:
        raise AssertionError("gpuflow is not quiescent: " + "; ".join(found))


def assert_quiescent(timeout: float = 5.0) -> None:
    """Wait up to ``timeout`` s for every run, and any other work enqueued on
    gpuflow's streams, to finish; then assert that no run is pending, no
    stream lease is held, no use after free was seen, and nothing gpuflow
    made is left that nothing holds (backend streams, completion lanes,
    partitions of reserved SMs, pinned staging buffers, events on ``cuda``).

    The wait blocks the calling thread (it sleeps a millisecond at a time),
    so it is refused (:class:`gpuflow.UsageError`) in a thread that runs an
    event loop: in async code, await :func:`assert_quiescent_async` instead.

    Parameters
    ----------
    timeout
        Seconds to wait for the GPU.

    Raises
    ------
    AssertionError
        A run pending after ``timeout``, a stream lease held, a use after
        free seen, or a resource left, each named.
    gpuflow.UsageError
        Called in a thread that runs an event loop.
    """
    refuse_blocking(
        "gf.testing.assert_quiescent()",
        "in async code, `await gf.testing.assert_quiescent_async()`",
    )
    _raise(problems(timeout, pending=settle(timeout)))


async def assert_quiescent_async(timeout: float = 5.0) -> None:
    """:func:`assert_quiescent` for async code: the wait sleeps in the event
    loop (``anyio.sleep``), so other tasks, and the loop's own completion of
    the runs awaited, go on meanwhile.  A cancellation point.

    Parameters
    ----------
    timeout
        Seconds to wait for the GPU.

    Raises
    ------
    AssertionError
        As :func:`assert_quiescent`.
    """
    _raise(problems(timeout, pending=await settle_async(timeout)))
