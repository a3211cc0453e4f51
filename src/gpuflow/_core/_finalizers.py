"""Finalizers never take a lock: they leave their work for later.

A finalizer (``__del__``, :func:`weakref.finalize`) runs wherever the last
reference goes or the garbage collector happens to run: on any thread, also
one that is inside a lock of gpuflow's, its backend's or the completer's,
in the middle of changing what that lock guards.  The work of gpuflow's
finalizers (freeing memory in stream order, releasing another library's
memory after gpuflow's uses, retiring a dropped stream) takes those locks:
done in the finalizer, it could wait for its own thread for ever.

So a finalizer only appends its work to a queue (:func:`finalize_later`; a
deque's append is atomic and takes no lock), and :func:`run_finalized` does
it where no lock is held: when a run starts, when a stream is synchronized,
when memory or pending runs are asked about, when a runtime closes.  A
program that does none of these soon after dropping an array still gets its
memory back: the first finalizer after a drain writes one byte to a pipe (a
non-blocking write, no lock), which wakes the *reaper*, a thread that waits
on the pipe and drains the queue about a millisecond later, so that a loop
dropping an array per iteration wakes it at most about a thousand times a
second, not once per array.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

#: what finalizers left, in the order they left it (a hot path asks whether
#: it is empty by its truth value: no call)
queue: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()

#: the pipe that wakes the reaper (None until it is started)
_wake_fd: int | None = None
#: whether a wake-up was written that the reaper has not taken yet
_wake_sent = False
_start_lock = threading.Lock()

#: how long the reaper lets finalizers' work gather before it drains
COALESCE_S = 0.001


def finalize_later(fn: Callable[..., None], *args: object) -> None:
    """From a finalizer: call ``fn(*args)`` soon, where no lock is held.
    Never blocks, never raises."""
    global _wake_sent
    queue.append((fn, args))
    fd = _wake_fd
    if not _wake_sent and fd is not None:
        # (two finalizers may both write: a spare wake-up is harmless; one
        # that sees a wake-up sent finds its work drained by that one, which
        # clears the flag only before it drains)
        _wake_sent = True
        try:
            os.write(fd, b"\0")
        except OSError:  # the pipe is full: the reaper is awake anyway
            pass


#: one thread drains at a time, so that the work is done in the order it was
#: left: a collection that finds a stream and an array it wrote unreachable
#: together leaves the stream's retirement first, and the free must see the
#: stream destroyed (and go on another), never race with its destruction
_drain_lock = threading.Lock()
_draining = threading.local()


#: how long a safe point waits for another thread's drain before it leaves
#: the work to that thread (a drain is short; a stuck one must not hang it)
DRAIN_WAIT_S = 1.0


def run_finalized() -> None:
    """Do what finalizers left, in the order they left it: on return, all
    they left before the call is done, by this thread or by another thread
    whose drain was under way (that drain is waited for: it may have taken
    the last of the queue, and a caller asking whether runs are pending, or
    how much memory is in use, must see what it does).  Any thread that
    holds none of gpuflow's locks; it waits up to :data:`DRAIN_WAIT_S` for
    another thread's drain, then leaves the work to that one.  A failure is
    a warning, as it would have been in the finalizer."""
    if not queue and not _drain_lock.locked():
        return  # nothing left, and no drain under way (no call: a hot path asks)
    if getattr(_draining, "on", False):
        return  # a safe point inside this thread's own drain
    if not _drain_lock.acquire(timeout=DRAIN_WAIT_S):
        return
    _draining.on = True
    try:
        _drain()
    finally:
        _draining.on = False
        _drain_lock.release()


def _drain() -> None:
    work = queue
    while work:
        fn, args = work.popleft()  # (only the drainer pops)
        try:
            fn(*args)
        except Exception as exc:
            warnings.warn(f"gpuflow: {fn.__name__} after a finalizer failed: {exc!r}",
                          stacklevel=1)


def start_reaper() -> None:
    """Start the reaper thread (once per process; never from a finalizer:
    starting a thread takes locks)."""
    global _wake_fd
    if _wake_fd is not None:
        return
    with _start_lock:
        if _wake_fd is not None:
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        threading.Thread(target=_reap, args=(r,), name="gpuflow-finalizers", daemon=True).start()
        _wake_fd = w


def _reap(fd: int) -> None:
    global _wake_sent
    while True:
        try:
            os.read(fd, 4096)
        except OSError:  # pragma: no cover - the pipe is ours and stays open
            return
        time.sleep(COALESCE_S)
        _wake_sent = False  # before draining: work left after this wakes us again
        run_finalized()


def _forget_reaper() -> None:
    # a forked child has no reaper thread (only the forking one survives a
    # fork, perhaps holding the drain lock): its next runtime starts one of
    # its own
    global _wake_fd, _wake_sent, _drain_lock, _draining
    _wake_fd = None
    _wake_sent = False
    _drain_lock = threading.Lock()
    _draining = threading.local()


os.register_at_fork(after_in_child=_forget_reaper)
