"""How the runs' completions were seen: the record
:func:`gpuflow.lowlevel.current_completion_statistics` returns, of counts the
completer keeps (``_completion``) as the awaiting tasks, the loops' pollers and
its thread see runs done, and as loops arm their sleeping wake-ups."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompletionStatistics:
    """How the completions of runs were seen, since the runtime started
    (:func:`gpuflow.lowlevel.current_completion_statistics`): what a busy
    poll saves, and what it costs, on this machine.

    Each count is of runs completed (``pipes_armed`` and
    ``watched_by_thread`` of wake-ups armed).  The counts are kept without a
    lock: exact while one thread awaits, approximate where several race.
    """

    #: seen done by the awaiting task itself before it parked (its inline spin)
    spun: int
    #: seen done by a read once per loop turn: a loop's poller's (busy poll,
    #: or after a wake-up), or a lone await's own past its inline spin
    polled: int
    #: seen done by the completer thread (runs no loop awaits, loops that
    #: slept on a wake-up the thread watches, loops that stopped)
    by_thread: int
    #: sleeping wake-ups armed as a pipe the GPU closes (no thread involved)
    pipes_armed: int
    #: sleeping wake-ups left to the completer thread (the run had work
    #: queued behind it on its stream, or no pipe could be had)
    watched_by_thread: int
