"""A blocking call of a communicator's, awaited without blocking the loop.

Joining and destroying a communicator block in NCCL (or in the simulation's
rendezvous) for as long as a peer takes, perhaps for ever; the thread that
makes such a call must not be the loop's, nor one that keeps the process
from exiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from .._core import current_loop, post

T = TypeVar("T")


async def off_loop(fn: Callable[[], T], abandoned: Callable[[T], object] | None = None) -> T:
    """``fn()`` in a daemon thread of its own, awaited cancellably.

    A blocking call that may never return (NCCL's initialisation waiting for
    a rank that never comes) must neither block the loop nor keep the
    process from exiting, as a worker thread of AnyIO's would.  If the wait
    is cancelled, the thread goes on; ``abandoned(result)`` then runs in it
    when ``fn`` returns.
    """
    loop = current_loop()
    done = anyio.Event()
    box: list[tuple[bool, Any]] = []
    gave_up: list[bool] = []
    lock = threading.Lock()  # the result is released exactly once, here or there

    def work() -> None:
        try:
            result: tuple[bool, Any] = (True, fn())
        except BaseException as exc:
            result = (False, exc)
        with lock:
            box.append(result)
            nobody = bool(gave_up)
        if not nobody:
            post(loop.target, loop.post, [done.set])
        elif result[0] and abandoned is not None:
            abandoned(result[1])

    threading.Thread(target=work, name="gpuflow-communicator", daemon=True).start()
    try:
        await done.wait()
    except BaseException:
        with lock:
            gave_up.append(True)
            ended = box[0] if box else None
        if ended is not None and ended[0] and abandoned is not None:  # it ended meanwhile
            abandoned(ended[1])
        raise
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
