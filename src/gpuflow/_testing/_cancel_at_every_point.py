"""Running a pipeline once for each point where a cancellation can reach it
(:func:`cancel_at_every_point`).

The pipeline's task, and every task it starts, carries the run's
:class:`_Attempt` in a context variable; gpuflow's cancellation points
(:mod:`gpuflow._core._cancel_points`) report to it.  A first run counts the points and says
where each is; each later run cancels the pipeline's own cancel scope when
it reaches its point and makes the cancellation land right there (a
checkpoint), as the loop's own exception.  After every run the GPU is
waited for (in the loop), gpuflow must be at rest and the user's check
must pass.
"""

from __future__ import annotations

import gc
import inspect
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import anyio
import anyio.lowlevel

from .._core import UNUSUAL, cancel_points
from .._errors import UsageError, UsageTypeError
from ._quiescence import Baseline, problems, settle_async, use_after_free_count

#: Modules whose frames are not the user's: where a point is reported is the
#: first frame outside them (the line of the pipeline that awaited).
_LIBRARIES = frozenset(
    {"gpuflow", "anyio", "trio", "asyncio", "contextlib", "outcome", "sniffio", "uvloop"}
)
_REPR_MAX = 160


@dataclass(frozen=True)
class CancellationPoint:
    """One place where a cancellation can reach the pipeline."""

    #: 1 for the first point the pipeline reaches, 2 for the next, ...
    index: int
    #: what gpuflow does there: ``"awaiting <op>, before it is enqueued"``,
    #: ``"awaiting <op>, after it was enqueued, while the GPU runs it"``,
    #: ``"entering a stream lease"``, ``"leaving a device group (...)"``...
    what: str
    #: the pipeline's line that got there: ``"file:line (in function)"``
    where: str
    #: the name of the task that got there (the pipeline's, or a task it started)
    task: str = ""

    def __str__(self) -> str:
        by = f" in task {self.task!r}" if self.task else ""
        return f"point {self.index}: {self.what}; at {self.where}{by}"


@dataclass(frozen=True)
class CancellationReport:
    """What :func:`cancel_at_every_point` did, once every run passed."""

    #: how many cancellation points the pipeline reached when not cancelled
    points: int
    #: how many times it ran: once without a cancellation, then once per point
    runs: int
    #: the points of the run without a cancellation, in the order reached
    sites: tuple[CancellationPoint, ...]


class _Attempt:
    """One run of the pipeline: its cancel scope, the points it reached."""

    __slots__ = ("cancel_at", "cancelled", "landed", "record", "scope", "seen", "sites")

    def __init__(self, cancel_at: int) -> None:
        self.cancel_at = cancel_at  # 0: the run that counts, never cancelled
        self.record = cancel_at == 0
        self.scope: anyio.CancelScope | None = None
        self.seen = 0
        self.sites: list[CancellationPoint] = []
        #: the point where this run was cancelled, once it was
        self.cancelled: CancellationPoint | None = None
        #: the cancellation was raised into the pipeline there (not held
        #: back by a shield around the pipeline's code)
        self.landed = False


_attempt: ContextVar[_Attempt | None] = ContextVar("gpuflow_cancel_attempt", default=None)


def _where() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if not isinstance(name, str) or name.split(".", 1)[0] not in _LIBRARIES:
            code = frame.f_code
            return f"{code.co_filename}:{frame.f_lineno} (in {code.co_qualname})"
        frame = frame.f_back  # type: ignore[assignment]
    return "(no frame outside gpuflow and the event loop's libraries)"


def _task_name() -> str:
    try:
        return anyio.get_current_task().name or "?"
    except Exception:  # (no task: never, from a watcher; said rather than raised)
        return "?"


def _describe(what: str, op: object) -> str:
    if op is None:
        return what
    text = repr(op)
    if len(text) > _REPR_MAX:
        text = text[: _REPR_MAX - 3] + "..."
    return f"awaiting {text}, {what}"


async def _watch(what: str, op: object = None) -> None:
    """The watcher of :mod:`gpuflow._core._cancel_points`: counts, records, cancels at its point."""
    attempt = _attempt.get()
    if attempt is None or attempt.cancelled is not None:
        return  # another task's point, or past this run's cancellation
    attempt.seen += 1
    index = attempt.seen
    if attempt.record:
        attempt.sites.append(
            CancellationPoint(index, _describe(what, op), _where(), _task_name())
        )
    elif index == attempt.cancel_at:
        attempt.cancelled = CancellationPoint(index, _describe(what, op), _where(), _task_name())
        assert attempt.scope is not None
        attempt.scope.cancel()
        # the cancellation lands here, as the loop's own exception (unless a
        # shield around the pipeline's code holds it back for later)
        try:
            await anyio.lowlevel.checkpoint()
        except BaseException:
            attempt.landed = True
            raise


_installed_lock = threading.Lock()
_installed = 0


@contextmanager
def _watching() -> Iterator[None]:
    """Install the watcher for as long as any cancel_at_every_point runs (in
    any thread); the tasks it is not about pay a context variable lookup."""
    global _installed
    with _installed_lock:
        _installed += 1
        cancel_points.watcher = _watch
    UNUSUAL.begin()  # (runs take the long path, which reports to the watcher)
    try:
        yield
    finally:
        UNUSUAL.end()
        with _installed_lock:
            _installed -= 1
            if not _installed:
                cancel_points.watcher = None


def _is_cancellation(exc: BaseException) -> bool:
    cancelled = anyio.get_cancelled_exc_class()
    if isinstance(exc, cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(cancelled)[1] is None
    return False


async def cancel_at_every_point(
    pipeline: Callable[[], Awaitable[object]],
    *,
    check: Callable[[], object] | None = None,
    timeout: float = 5.0,
) -> CancellationReport:
    """Run ``pipeline()`` cancelled at each of its cancellation points in turn.

    ``await gf.testing.cancel_at_every_point(pipeline, check=check)`` runs
    ``await pipeline()`` once without a cancellation to count the points
    where a cancellation can reach it: every await of a gpuflow operation
    (before its work is enqueued, and once more after, while the GPU runs
    it) and every boundary of a stream lease or a device group (entering
    it; right after leaving it, where a cancellation that came while it was
    being left lands first), in the pipeline's task and every task it
    starts.  Then it runs the pipeline once more for each point *k*,
    cancelling it exactly there: the pipeline gets the event loop's own
    cancellation at that point, as from a timeout or a cancelled task group.

    After each run it waits (in the loop, up to ``timeout`` seconds) until
    the GPU has finished every run, and asserts that gpuflow is at rest: no
    run pending, no stream lease held beyond those held when it was called,
    no new use after free (``sim``); then it calls ``check()``, the
    pipeline's own invariants (a function or an async function; it raises
    when one does not hold).  By then what the run dropped has been
    collected, frames the cancellation went through hold nothing, and the
    GPU is idle, so a check may compare :func:`gpuflow.memory_stats` with
    its value before.  The first failure raises
    :class:`AssertionError` naming the point (its number, the operation
    there and the pipeline's source line), or saying that the run without a
    cancellation failed; a pipeline that raises anything but the
    cancellation fails too.  Every run passing, it returns a
    :class:`CancellationReport`.

    Each run is made in a cancel scope of its own, in the calling task; a
    cancellation of the caller's scope is not caught.  The points are
    numbered in the order the pipeline reaches them, so the pipeline must
    reach them in the same order each time: a pipeline whose tasks race
    each other (their GPU work taking different times) may number them
    differently from run to run.  Other GPU work of the program in flight
    meanwhile counts as pending.  Deterministic on ``sim``; on ``cuda`` too
    for a pipeline whose points do not depend on timing.

    Parameters
    ----------
    pipeline
        An async function of no arguments: the code under test.
    check
        The pipeline's own invariants, checked after each run (a function or
        an async function that raises where one does not hold).
    timeout
        Seconds to wait, after each run, for the GPU to finish.

    Returns
    -------
    CancellationReport
        The points, each with where it is and what the run did there.

    Raises
    ------
    AssertionError
        A run failed: naming the point, the operation and the line.
    gpuflow.UsageTypeError
        ``pipeline`` or ``check`` is not callable, or the pipeline returns no
        awaitable.
    gpuflow.UsageError
        ``timeout`` is not a positive number.
    """
    if not callable(pipeline):
        raise UsageTypeError(
            "cancel_at_every_point() takes an async function to call, not "
            f"{type(pipeline).__name__}"
        )
    if check is not None and not callable(check):
        raise UsageTypeError(f"check must be callable, not {type(check).__name__}")
    if not timeout > 0:
        raise UsageError(f"timeout must be a positive number of seconds, not {timeout!r}")
    leases = Baseline.now().leases
    with _watching():
        first = _Attempt(0)
        await _run(pipeline, first, check, timeout, leases, 0)
        sites = tuple(first.sites)
        for k in range(1, len(sites) + 1):
            await _run(pipeline, _Attempt(k), check, timeout, leases, len(sites))
    return CancellationReport(len(sites), len(sites) + 1, sites)


async def _run(
    pipeline: Callable[[], Awaitable[object]],
    attempt: _Attempt,
    check: Callable[[], object] | None,
    timeout: float,
    leases: frozenset[object],
    total: int,
) -> None:
    base = Baseline(leases, use_after_free_count())
    failure, swallowed = await _attempt_run(pipeline, attempt)
    # what the run dropped goes now, while its GPU work may still run: an
    # array freed too early is caught in this run, not in a later one; and
    # a cancelled run's arrays, held by cycles through its traceback, are
    # not left to a collection at some point of a later run
    gc.collect()
    found = problems(timeout, base, await settle_async(timeout))
    if failure is not None:
        raised = f"the pipeline raised {failure!r}"
        if attempt.cancel_at:
            raised += " instead of the cancellation"
        raise AssertionError(_failed(attempt, total, "; ".join([raised, *found]))) from failure
    if swallowed is not None:
        raise AssertionError(_failed(attempt, total, "; ".join([swallowed, *found])))
    if attempt.cancel_at and attempt.cancelled is None:
        # (a point never reached was never tested: fail rather than pass)
        raise AssertionError(_failed(attempt, total, "; ".join(["it ended uncancelled", *found])))
    if found:
        raise AssertionError(
            _failed(attempt, total, "gpuflow is not quiescent: " + "; ".join(found))
        )
    if check is not None:
        try:
            result = check()
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            raise AssertionError(
                _failed(attempt, total, f"check() failed: {type(exc).__name__}: {exc}")
            ) from exc


async def _attempt_run(
    pipeline: Callable[[], Awaitable[object]], attempt: _Attempt
) -> tuple[BaseException | None, str | None]:
    """Run the pipeline once in a cancel scope of its own: what it raised,
    other than that scope's cancellation; and, where the cancellation was
    raised into it and it ended without it, how it ended (it swallowed it)."""
    try:
        awaitable = pipeline()
    except Exception as exc:
        return exc, None
    if not inspect.isawaitable(awaitable):
        raise UsageTypeError(
            f"the pipeline returned {type(awaitable).__name__}, not an awaitable: "
            "pass an async function (`async def pipeline(): ...`)"
        )
    result: object = None
    try:
        with anyio.CancelScope() as scope:
            attempt.scope = scope
            token = _attempt.set(attempt)
            try:
                result = await awaitable
            except BaseException as exc:
                if attempt.cancelled is not None and _is_cancellation(exc):
                    # the event loop may keep the cancellation (asyncio's task
                    # does): its traceback must not keep the pipeline's
                    # arrays alive past the run, as if they had leaked
                    _clear_frames(exc)
                raise
            finally:
                _attempt.reset(token)
    except BaseException as exc:
        if _is_cancellation(exc) or isinstance(exc, KeyboardInterrupt | SystemExit):
            raise  # the caller's own cancellation (the run's own stops at its scope)
        return exc, None
    if attempt.landed and not scope.cancelled_caught:
        text = repr(result)
        if len(text) > _REPR_MAX:
            text = text[: _REPR_MAX - 3] + "..."
        return None, (
            f"the pipeline returned {text} instead of ending with the cancellation: it "
            "swallowed the event loop's cancellation (an `except` of "
            "anyio.get_cancelled_exc_class(), BaseException or a bare `except:` that "
            "does not raise it again)"
        )
    return None, None


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames ``exc`` (and, for a group, its
    members) went through: what the pipeline held when it was cancelled."""
    traceback.clear_frames(exc.__traceback__)
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            _clear_frames(inner)


def _failed(attempt: _Attempt, total: int, why: str) -> str:
    k = attempt.cancel_at
    if k == 0:
        return f"the pipeline, run without a cancellation (to count its points): {why}"
    site = attempt.cancelled
    if site is None:
        return (
            f"cancelled at point {k} of {total}, which this run never reached (it reached "
            f"{attempt.seen}: its points depend on timing?): {why}"
        )
    return f"cancelled at point {k} of {total} ({site.what}; at {site.where}): {why}"
