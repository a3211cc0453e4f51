"""The structured scopes a task runs in: stream leases and device groups,
innermost last, as a context variable the task and the tasks it starts
share.  A run started in a scope is tracked by each (its exit waits for it),
and a stream lease's pins its runs to its stream."""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from ._unusual import UNUSUAL

if TYPE_CHECKING:
    from ._run import Run
    from ._stream import Stream


class Scope(Protocol):
    """A structured scope that tracks the runs started inside it (gpuflow's
    own: stream leases and device groups)."""

    def _track(self, run: Run) -> None:
        """Wait for ``run`` at the scope's exit: a run started inside it."""

    @property
    def _pinned(self) -> Stream | None:
        """The stream every run started inside stays on (a stream lease's),
        or None."""


#: The scopes the current task runs in, innermost last.
current_scopes: ContextVar[tuple[Scope, ...]] = ContextVar("gpuflow_scopes", default=())


def enter_scope(scope: Scope) -> Any:
    """Put ``scope`` on :data:`current_scopes` for this task and the tasks it
    starts: runs take the long path from now on (:mod:`._unusual`), which
    gives the scope each run started in it; the token :func:`leave_scope`
    takes."""
    token = current_scopes.set((*current_scopes.get(), scope))
    UNUSUAL.begin()
    return token


def leave_scope(token: Any) -> None:
    """Take a scope off :data:`current_scopes`.  An async generator holding
    the scope may be closed from another task, whose context never had it:
    then there is nothing to take off, and the scope must still be left."""
    UNUSUAL.end()
    try:
        current_scopes.reset(token)
    except ValueError:
        pass
