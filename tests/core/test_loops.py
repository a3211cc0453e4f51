"""The loop adapters' fast paths: each answers from what the loop already
keeps, and each is checked here against the AnyIO, Trio and asyncio this
suite runs with, so that a release that keeps them otherwise fails a test
rather than making every await slower without a word.  Each adapter names
its fast paths (``Loop.fast_paths``) and whether it found what each reaches
for; every one, by name, must be found:

* Whether the task's cancel scope is cancelled (an await enqueues nothing
  then): AnyIO's record of its asyncio tasks' scopes, Trio's task state.
* Which loop runs this thread: the adapter found last, asked whether its
  loop still runs here (asyncio's own loops keep the thread running them;
  asking asyncio itself costs a ``getpid`` system call).
"""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

import gpuflow as gf
from gpuflow._core import _loops

pytestmark = pytest.mark.anyio

#: Every fast path of each loop, by the name its adapter gives it.
FAST_PATHS = {
    "asyncio": [
        "AnyIO's record of a task's cancel scopes",
        "AnyIO's backend checkpoint_if_cancelled",
        "asyncio's Runner counts Ctrl-C",
        "asyncio's loop keeps its thread",
        "asyncio's loop keeps its ready callbacks",
        # (before Python 3.12, where asyncio.current_task is Python code; from
        # 3.12 it is C, as fast as the dictionary, and the public call is taken)
        *(["asyncio's dictionary of current tasks"] if _loops._current_task_is_python() else []),
    ],
    "uvloop": [
        "AnyIO's record of a task's cancel scopes",
        "AnyIO's backend checkpoint_if_cancelled",
        "asyncio's Runner counts Ctrl-C",
    ],
    "trio": [
        "Trio's task cancel status",
        "Trio's run queue",
        "Trio's park trap",
        "Trio's nursery pending errors",
    ],
}


def _loop_name(anyio_backend_name: str, anyio_backend_options: dict[str, object]) -> str:
    if anyio_backend_name == "asyncio" and anyio_backend_options.get("use_uvloop"):
        return "uvloop"
    return anyio_backend_name


async def test_every_fast_path_finds_what_it_reaches_for(
    anyio_backend_name: str, anyio_backend_options: dict[str, object]
) -> None:
    found = _loops.current_loop().fast_paths()
    names = FAST_PATHS[_loop_name(anyio_backend_name, anyio_backend_options)]
    assert sorted(found) == sorted(names), "a fast path was added or removed: name it here"
    # each one missing is named: the slower public way is taken there
    assert [name for name, ok in found.items() if not ok] == []


async def test_a_fast_path_not_found_is_reported_as_such(anyio_backend_name: str) -> None:
    # the report itself: an adapter whose cancellation check fell back says so
    loop = _loops.current_loop()
    name = next(n for n in loop.fast_paths() if "cancel" in n)
    real = loop.may_be_cancelled
    loop.may_be_cancelled = _loops._true
    try:
        assert loop.fast_paths()[name] is False
    finally:
        loop.may_be_cancelled = real
    assert loop.fast_paths()[name] is True


async def test_the_cancellation_check_reads_the_loops_own_record(anyio_backend_name: str) -> None:
    loop = _loops.current_loop()
    assert loop.may_be_cancelled is not _loops._true, "the fast check fell back: a new layout?"
    assert loop.may_be_cancelled() is False
    with anyio.CancelScope() as scope:
        scope.cancel()
        assert loop.may_be_cancelled() is True
        with anyio.CancelScope(shield=True):
            assert loop.may_be_cancelled() is False
        x = gf.zeros(8, dtype=np.float32)
        await x  # (cancelled before anything is enqueued)
    assert scope.cancelled_caught
    assert loop.may_be_cancelled() is False


async def test_the_loop_of_a_thread_is_known_without_asking_asyncio(
    anyio_backend_name: str, anyio_backend_options: dict[str, object]
) -> None:
    loop = _loops.current_loop()
    assert loop.running_in(threading.get_ident())
    assert _loops.current_loop() is loop  # (the adapter is made once a loop)
    if anyio_backend_name == "asyncio" and not anyio_backend_options.get("use_uvloop"):
        assert loop._tells_thread  # type: ignore[attr-defined]  # (asyncio's own loop)
    # another thread runs no loop: it is not this loop's
    other: list[bool] = []
    t = threading.Thread(target=lambda: other.append(loop.running_in(threading.get_ident())))
    t.start()
    t.join()
    assert other == [False]
