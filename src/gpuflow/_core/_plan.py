"""A plan: what the run path needs to know of an operation before it runs it.

Every :class:`DeviceOperation` has one (``op._plan``), made once where the
operation allows and replaced when what it says changes: most share
:data:`ANYWHERE`, which says nothing, and run wherever the policy, a lease
or a class puts them.  The run path reads the plan, never asks the
operation: a plan is data, so the core calls nothing of the folders above
it to learn where a run goes or how it is enqueued.

A plan says, each where it applies:

* a *step*: the call that enqueues the operation's work on a raw stream
  of one device context generation (:class:`Stream` ``_generation``),
  prepared once for it (a launch whose arguments are final, loaded; a
  copy between two given arrays), with the memory it *uses* (each
  allocation, and whether the step writes it: reads first), which the run
  path orders after the hazards they meet (:func:`enqueue_step`), and the
  step's *output* (the arrays a launch writes, a copy's destination);
* a *foreign home*: another library's stream (its handle, and its device
  where the library said it) on which an await of the operation itself (not composed)
  completes, enqueueing nothing but its mark there (``gf.wait_stream``);
* a *preference*: per device, the stream the default policy looks at first
  (a collective's: its rank's previous collective's stream).  An operation
  with one is not *ordinary*: its await takes the policy's path, which
  reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ._hazards import enqueue_ordered

if TYPE_CHECKING:
    from .._backends import Step
    from ._hazards import Allocation
    from ._run import Run
    from ._stream import Stream


class Plan:
    """What the run path needs to know of an operation before it runs it
    (see the module's docstring).  Immutable once made; safe to read from
    any thread."""

    __slots__ = ("foreign", "generation", "ordinary", "output", "prefer", "step", "uses")

    def __init__(
        self,
        generation: int = 0,
        step: Step | None = None,
        foreign: tuple[int, int | None] | None = None,
        prefer: Mapping[int, Stream] | None = None,
        uses: tuple[tuple[Allocation, bool], ...] | None = None,
        output: object = None,
    ) -> None:
        #: the device context generation ``step`` is valid in (0: none)
        self.generation = generation
        #: enqueues the operation's work on a raw stream of that generation
        self.step = step
        #: (handle, device or None) of the stream an await of it itself completes on
        self.foreign = foreign
        #: per device, the stream the default policy looks at first
        self.prefer = prefer
        #: the memory ``step`` uses, (allocation, whether it writes it), reads
        #: first; None: none
        self.uses = uses
        #: what a run of ``step`` produces
        self.output = output
        #: nothing in the plan keeps an await of it from its shortest form
        self.ordinary = prefer is None


#: The plan of an operation that runs wherever it is put, enqueued by
#: ``execute``: most operations' own.
ANYWHERE = Plan()


def enqueue_step(plan: Plan, stream: Stream, run: Run) -> object:
    """Enqueue ``plan``'s step for ``run`` on ``stream`` (of the plan's
    generation), ordered after the hazards its uses meet; its output.
    (The run path calls a step of no uses itself, inline.)"""
    assert plan.step is not None and plan.uses is not None
    enqueue_ordered(run, [(a, stream, w) for a, w in plan.uses], plan.step, stream.raw)
    return plan.output
