"""Tasks of any event loop, in any thread, waiting in turn to be handed something.

A stream lease waits for a pool stream another scope gives back; an await
whose device has every stream busy waits for one to go idle.  Both wait in
the order they came, across loops and threads: the one that hands out (a
scope leaving in another task, the completer thread seeing a stream idle)
takes the first waiter under its own lock and wakes it with a post, which
never blocks and is dropped where the waiter's loop has finished.
"""

from __future__ import annotations

import collections
from typing import Any

import anyio

from ._loops import current_loop, post


class Ticket:
    """One task's place in a :class:`Handoff`: what it was handed, once it was."""

    __slots__ = ("event", "handed", "poster", "queued", "target", "value")

    def __init__(self) -> None:
        loop = current_loop()
        self.target = loop.target
        self.poster = loop.post
        self.event = anyio.Event()
        self.queued = True
        self.handed = False
        self.value: Any = None

    def wake(self) -> None:
        """After :meth:`Handoff.hand` chose it, outside the lock: wake its task."""
        post(self.target, self.poster, [self.event.set])


class Handoff:
    """A FIFO of :class:`Ticket`\\ s.  Every method but :meth:`wait` is called
    under the owner's lock (one lock guards the queue and what it hands out).

    A waiter handed its turn keeps it until it leaves (every waiter leaves,
    handed or not): where waiters also look for themselves (an await looks at
    the streams every ``stall_s``, whoever was to wake it), the next one's
    turn comes only then, not while the first is still on its way to take
    what it was woken for.
    """

    __slots__ = ("_handed", "_queue")

    def __init__(self) -> None:
        self._queue: collections.deque[Ticket] = collections.deque()
        #: the waiters handed their turn that have not left yet
        self._handed = 0

    def __len__(self) -> int:
        return len(self._queue)

    def join(self, first: bool = False) -> Ticket:
        """The calling task's ticket, at the end of the queue (at its head where
        ``first``: a waiter that was woken and found nothing left for it)."""
        ticket = Ticket()
        if first:
            self._queue.appendleft(ticket)
        else:
            self._queue.append(ticket)
        return ticket

    def hand(self, value: Any) -> Ticket | None:
        """Give ``value`` to the first waiter; its ticket, to :meth:`Ticket.wake`
        once the lock is released (None where nobody waits)."""
        if not self._queue:
            return None
        ticket = self._queue.popleft()
        ticket.queued = False
        ticket.handed = True
        ticket.value = value
        self._handed += 1
        return ticket

    def first(self, ticket: Ticket) -> bool:
        """Whether it is ``ticket``'s turn: it was handed something, or it is
        at the head of the queue and no waiter handed its turn before it is
        still on its way."""
        if ticket.handed:
            return True
        return not self._handed and bool(self._queue) and self._queue[0] is ticket

    def leave(self, ticket: Ticket) -> bool:
        """Take ``ticket`` out of the queue; whether it was handed something
        first (which its owner, leaving, must then pass on)."""
        if ticket.queued:
            ticket.queued = False
            self._queue.remove(ticket)
        elif ticket.handed:
            self._handed -= 1
        return ticket.handed
