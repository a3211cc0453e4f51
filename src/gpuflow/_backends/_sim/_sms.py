"""A simulated device's SMs, and the kernel blocks that wait for them.

What a GPU does with a kernel's grid, kept to what latency classes need to
be real without a GPU:

* a device has ``count`` SMs; a kernel runs as ``blocks`` blocks, each
  holding one SM for the kernel's per-block time (a real SM holds several
  blocks at once, up to its occupancy: here one, so that a grid runs in
  waves of ``count`` blocks);
* when an SM is free, it takes a block of the launch that ranks first
  among those waiting for it: the highest stream priority, then the
  earliest launch (a launch joins when it reaches the head of its stream,
  as a kernel reaches the GPU's scheduler).  Running blocks are never
  preempted, so an urgent kernel behind a saturating one starts within one
  block's time, where one of the same priority waits until every block
  launched before it has started;
* a partition (reserved SMs: CUDA's green contexts) is a set of the
  device's SMs; a stream made in one runs its blocks on those SMs only.
  A stream of no partition may use every SM, as a stream of CUDA's primary
  context may;
* a kernel with no per-block time takes none: its blocks still need a free
  SM, and pass through one at once (on an idle device, at no cost at all).

Nobody runs the clock: the stream workers that wait for their launches do.
Whichever wakes first, at the time an SM frees up, frees the SMs whose
blocks are done and gives them to the launches that rank first; then every
waiter looks at its own launch.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: SMs of a simulated device where none are given: an H200's (and an H100 SXM's)
DEFAULT_SMS = 132
#: The smallest partition, and the multiple every partition's size is
#: rounded up to, as CUDA's green contexts do on compute capability 9.0
PARTITION_GRANULE = 8


@dataclass(frozen=True, eq=False)
class SimPartition:
    """SMs of one device reserved for the streams made in it."""

    device: int
    sms: frozenset[int]
    #: the SMs its owner asked for, before rounding up to the granule
    asked: int

    def __repr__(self) -> str:
        return f"<sim partition of {len(self.sms)} SMs on device {self.device}>"


class _Launch:
    """A kernel's blocks, from the time it reaches the scheduler until the last is done."""

    __slots__ = ("allowed", "arrived", "block_s", "dispatch", "priority", "running", "seq")

    def __init__(
        self,
        seq: int,
        priority: int,
        allowed: frozenset[int] | None,
        blocks: int,
        block_s: float,
        arrived: float,
    ) -> None:
        self.arrived = arrived
        self.seq = seq
        self.priority = priority
        self.allowed = allowed  # the SMs it may use (None: any)
        self.dispatch = blocks  # blocks not yet on an SM
        self.running = 0  # blocks on an SM now
        self.block_s = block_s

    def rank(self) -> tuple[int, int]:
        return (-self.priority, self.seq)


class SimSMs:
    """The SMs of one simulated device."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._cond = threading.Condition(threading.Lock())
        # per SM: the launch whose block it runs and when that block is done
        self._busy: list[tuple[_Launch, float] | None] = [None] * count
        # per SM: when its last block was done (a free SM's next block starts
        # then, or when its launch arrived)
        self._free_at = [0.0] * count
        self._waiting: list[_Launch] = []
        self._seq = itertools.count()
        #: blocks run so far (what a test of the model counts)
        self.blocks_run = 0

    def partition(self, device: int, sizes: list[int]) -> list[SimPartition]:
        """Partitions of ``sizes`` SMs each (rounded up to the granule),
        then one of every SM left; ValueError where they do not fit with at
        least a granule left over."""
        rounded = [max(PARTITION_GRANULE, -(-n // PARTITION_GRANULE) * PARTITION_GRANULE)
                   for n in sizes]  # fmt: skip
        if sum(rounded) + PARTITION_GRANULE > self.count:
            raise ValueError(
                f"{' + '.join(map(str, rounded))} SMs (rounded up to multiples of "
                f"{PARTITION_GRANULE}) and at least {PARTITION_GRANULE} left for the rest "
                f"do not fit in the device's {self.count}"
            )
        parts = []
        start = 0
        for asked, n in zip([*sizes, 0], [*rounded, self.count - sum(rounded)], strict=True):
            parts.append(SimPartition(device, frozenset(range(start, start + n)), asked))
            start += n
        return parts

    def run(
        self,
        blocks: int,
        block_s: float,
        priority: int,
        partition: SimPartition | None,
        abandoned: Callable[[], bool],
    ) -> bool:
        """Run ``blocks`` blocks of ``block_s`` seconds each: True once the
        last is done, False once ``abandoned()`` (the device faulted or was
        reset: the kernel runs no further; the blocks on SMs keep them until
        their time is up)."""
        allowed = None if partition is None else partition.sms
        cond = self._cond
        with cond:
            if block_s <= 0 and not self._waiting:
                # nothing ranks before it: a free SM passes every block at once
                for sm, held in enumerate(self._busy):
                    if held is None and (allowed is None or sm in allowed):
                        self.blocks_run += blocks
                        return True
            now = time.monotonic()
            launch = _Launch(next(self._seq), priority, allowed, blocks, block_s, now)
            self._waiting.append(launch)
            self._schedule(now)
            try:
                while launch.dispatch or launch.running:
                    if abandoned():
                        return False
                    cond.wait(self._next_free() - time.monotonic())
                    self._schedule(time.monotonic())
            finally:
                if launch in self._waiting:
                    self._waiting.remove(launch)
            return True

    def wake(self) -> None:
        """Wake the waiters to look again (a fault, a reset: they may be abandoned)."""
        with self._cond:
            self._cond.notify_all()

    def _next_free(self) -> float:
        """When the first busy SM is done (in an hour where none is: a
        launch that waits for SMs waits for one to free up)."""
        ends = [held[1] for held in self._busy if held is not None]
        return min(ends) if ends else time.monotonic() + 3600.0

    def _schedule(self, now: float) -> None:
        """Under the lock: free the SMs whose blocks are done by ``now``,
        and give each free SM a block of the launch that ranks first among
        those that may use it; wake the waiters where anything changed.

        A block starts when its SM freed up (or when its launch arrived, if
        later), not when a waiter woke to see it: the clock of the model
        keeps to the blocks' times, whatever a thread's wake-up costs, and
        a late wake-up runs every wave that fitted meanwhile."""
        changed = False
        while True:
            freed = self._free(now)
            dispatched = self._dispatch()
            changed = changed or freed or dispatched
            if not freed:
                break
        if changed:
            self._cond.notify_all()

    def _free(self, now: float) -> bool:
        freed = False
        busy = self._busy
        for sm, held in enumerate(busy):
            if held is not None and held[1] <= now:
                held[0].running -= 1
                busy[sm] = None
                self._free_at[sm] = held[1]
                freed = True
        return freed

    def _dispatch(self) -> bool:
        waiting = self._waiting
        if not waiting:
            return False
        waiting.sort(key=_Launch.rank)
        busy = self._busy
        dispatched = False
        for sm in range(self.count):
            if busy[sm] is not None:
                continue
            for launch in waiting:
                if launch.dispatch and (launch.allowed is None or sm in launch.allowed):
                    break
            else:
                continue
            dispatched = True
            start = max(self._free_at[sm], launch.arrived)
            if launch.block_s <= 0:
                # zero-time blocks pass through the SM at once, all of them
                self.blocks_run += launch.dispatch
                launch.dispatch = 0
            else:
                launch.dispatch -= 1
                launch.running += 1
                self.blocks_run += 1
                busy[sm] = (launch, start + launch.block_s)
        if dispatched:
            self._waiting = [w for w in waiting if w.dispatch]
        return dispatched
