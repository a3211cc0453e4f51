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
    """A FIFO of :class:`Ticket`\\ s.  Every method is called under the
    owner's lock (one lock guards the queue and what it hands out).

    A waiter keeps its place until it leaves, handed something or not:
    :meth:`hand` marks the first waiter not yet handed anything, and where
    waiters take what they were woken for themselves (an await takes an
    idle stream), only the first in the queue may take (:meth:`first`).
    Waiters woken together (several streams went idle at once) thus take in
    the order they came, whatever order their loop resumes them in; one
    woken that finds nothing left (a run that cannot wait took it) keeps its
    place at the head.
    """

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: collections.deque[Ticket] = collections.deque()

    def __len__(self) -> int:
        """The waiters, handed something or not."""
        return len(self._queue)

    def waiting(self) -> int:
        """The waiters not handed anything yet."""
        return sum(not t.handed for t in self._queue)

    def join(self, first: bool = False) -> Ticket:
        """The calling task's ticket, at the end of the queue (at its head where
        ``first``)."""
        ticket = Ticket()
        if first:
            self._queue.appendleft(ticket)
        else:
            self._queue.append(ticket)
        return ticket

    def hand(self, value: object) -> Ticket | None:
        """Give ``value`` to the first waiter not handed anything yet; its
        ticket, to :meth:`Ticket.wake` once the lock is released (None where
        every waiter was handed something)."""
        for ticket in self._queue:
            if not ticket.handed:
                ticket.handed = True
                ticket.value = value
                return ticket
        return None

    def first(self, ticket: Ticket) -> bool:
        """Whether it is ``ticket``'s turn to take: it is first in the queue.
        One that is not, woken all the same, waits again (its event made
        anew: the head's leaving wakes it)."""
        if self._queue and self._queue[0] is ticket:
            return True
        if ticket.event.is_set():
            ticket.event = anyio.Event()  # (in its own task: the caller's)
        return False

    def found_nothing(self, ticket: Ticket) -> bool:
        """``ticket``, first, was woken for what it then did not find (taken
        by one who cannot wait).  Whether to look again at once: another
        waiter was handed something meanwhile, which goes to ``ticket``
        instead; else ``ticket`` waits for the next hand, in its place."""
        for other in self._queue:
            if other is not ticket and other.handed:
                other.handed = False
                ticket.handed = True
                return True
        ticket.handed = False
        ticket.event = anyio.Event()
        return False

    def leave(self, ticket: Ticket) -> tuple[bool, Ticket | None]:
        """Take ``ticket`` out of the queue: whether it was handed something
        (which its owner, leaving, must then pass on), and the next waiter
        to wake (outside the lock): the new first, where ``ticket`` was
        first (its turn now, to take what it was handed or to look again
        from time to time, as only the first does)."""
        was_first = bool(self._queue) and self._queue[0] is ticket
        if ticket.queued:
            ticket.queued = False
            self._queue.remove(ticket)
        return ticket.handed, (self._queue[0] if was_first and self._queue else None)
