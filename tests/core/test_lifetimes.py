"""What a run keeps alive lives exactly as long as the GPU work that uses it.

A run hands what its enqueued work still uses to ``ctx.keep``; gpuflow
releases it when the GPU has finished that work, never earlier (a dangling
host buffer or graph) and never later than need be (a leak), however the run
ends: a cancelled await, a cancelled graph launch, a ``sync()`` or ``await``
that fails half-way, a stream lease or device group left by an exception.

The evidence is structural.  A :class:`Probe` keeps a fresh object alive
through ``ctx.keep`` after a slow kernel and holds a weak reference to it.
While the kernel still runs, the object must be alive after a full garbage
collection; once the work is done it must be gone, and it must not have gone
before the kernel could have finished.  "Still runs" is what the backend's
own ``query`` of the stream says (not gpuflow's bookkeeping) and what the
kernel's wall-clock duration implies: it cannot end sooner than its duration
after it was enqueued.  The moment of release is compared with that bound,
not with a query made at that moment: such a query can lag the GPU (on
``sim`` a stream's last item stays queued for a moment after its effects
are seen), and a correct release was seen reported early that way.
"""

from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import kernels as K

import gpuflow as gf
from gpuflow._core._runtime import ensure_runtime

F32 = np.float32
N = 256
#: the slow kernel: long enough that the GPU is surely still at it after a
#: cancellation, a full collection and the checks, on a loaded machine
SLOW = 1.0
#: when the tests cancel an await of the slow kernel
CANCEL = 0.05
#: slack on "the kernel cannot have finished yet" (clock granularity)
EARLY = 0.01
#: bound on waits that end as soon as the GPU is done (never reached when all is well)
DEADLINE = 20.0




class _On:
    """A scheduling policy that runs on one given stream."""

    def __init__(self, stream: gf.Stream) -> None:
        self._stream = stream

    def next_stream(self, device: int) -> gf.Stream:
        return self._stream


_POLICIES: dict[str, gf.SingleStream] = {}


def _policy(name: str) -> gf.SingleStream:
    """A policy on a private stream of its own, the same all session long.

    The stream outlives every array it touches: a private stream collected in
    the same garbage cycle as an array it used is destroyed before the
    array's free can be ordered after it.
    """
    return _POLICIES.setdefault(name, gf.SingleStream(0))


class _Kept:
    """The object a probe keeps alive (weakly referenceable, owned by the run alone)."""


class Probe(gf.DeviceOperation[None]):
    """Keeps a fresh object alive for the work enqueued before it in its run.

    ``execute`` enqueues nothing; it hands a new object to ``ctx.keep``.
    ``kept`` is a weak reference to that object, ``released`` the monotonic
    times at which gpuflow let it go (one, when all is well).  The probe
    follows a slow kernel of ``seconds`` (:meth:`after_slow`, or one the test
    enqueues after calling :meth:`start`): the kernel cannot finish before
    ``started + seconds``.  A probe runs once.
    """

    def __init__(self, seconds: float = SLOW) -> None:
        self.seconds = seconds
        self.started: float | None = None
        self.stream: gf.Stream | None = None
        self.kept: weakref.ref[_Kept] | None = None
        self.released: list[float] = []

    def start(self) -> None:
        """Note the time: the slow kernel is enqueued after this."""
        self.started = time.monotonic()

    def after_slow(self) -> gf.DeviceOperation[None]:
        """The slow kernel over a fresh array, then this probe, in one run."""

        def slow(x: gf.DeviceArray) -> gf.DeviceOperation[Any]:
            self.start()
            return K.slow_fill(x, 1.0, self.seconds)

        return gf.zeros(N, F32).then(slow).then(lambda _: self)

    def execute(self, ctx: gf.ExecutionContext) -> None:
        assert self.kept is None, "a probe runs once"
        obj = _Kept()
        ctx.keep(obj)
        self.stream = ctx.stream
        self.kept = weakref.ref(obj)
        # called on whichever thread releases it (the completer's, usually)
        weakref.finalize(obj, lambda: self.released.append(time.monotonic()))

    @property
    def executed(self) -> bool:
        return self.kept is not None

    def surely_running(self) -> bool:
        """True while the slow kernel cannot have finished yet."""
        assert self.started is not None
        return time.monotonic() < self.started + self.seconds - EARLY

    def busy(self) -> bool:
        """Whether the backend reports work still running on the run's stream."""
        assert self.stream is not None, "the probe has not run"
        return not gf.lowlevel.current_backend_object().query(self.stream.raw)

    def look(self) -> bool | None:
        """After a full collection: is the object alive?  ``None`` when the
        kernel may have finished by the end of the look (it proves nothing then)."""
        assert self.kept is not None
        gc.collect()
        alive = self.kept() is not None
        if not self.surely_running():
            return None
        assert self.busy(), "the backend reports idle a stream whose kernel still runs"
        return alive

    def assert_alive_while_running(self) -> None:
        alive = self.look()
        assert alive is not None, "the kernel may have finished before the check was made"
        assert alive, "released while the GPU still runs the work that uses it"
        assert self.released == []

    def assert_released_after_the_work(self) -> None:
        """The work is done and gpuflow has seen it: the object is gone, and it
        did not go before the kernel could have finished."""
        assert self.kept is not None and self.started is not None
        gc.collect()
        assert self.kept() is None, "still kept after the GPU finished the work (a leak)"
        assert len(self.released) == 1
        early = self.started + self.seconds - EARLY - self.released[0]
        assert early <= 0, f"released {early:.3f} s before the kernel could have finished"

    async def finished(self) -> None:
        """Wait until the run's stream has finished everything enqueued so far
        and gpuflow has seen it: completions on one stream are handled in
        order, so an awaited run after it returns only once it was handled."""
        assert self.stream is not None
        with anyio.fail_after(DEADLINE):
            await gf.value(None).run(_On(self.stream))

    async def watch(self, checks: list[int]) -> None:
        """While the kernel surely runs, check again and again that the object
        is alive; ``checks[0]`` counts the checks."""
        with anyio.fail_after(DEADLINE):
            while not self.executed:
                await anyio.sleep(0.002)
        while True:
            alive = self.look()
            if alive is None:
                return
            assert alive, "released while the GPU still runs the work that uses it"
            checks[0] += 1
            await anyio.sleep(0.02)


def _fail(_: Any) -> gf.DeviceOperation[Any]:
    raise ValueError("failed half-way")


# -- a cancelled await ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_cancelled_await_keeps_what_its_work_uses_until_the_gpu_is_done() -> None:
    probe = Probe()
    with anyio.move_on_after(CANCEL) as scope:
        await probe.after_slow()
    assert scope.cancelled_caught and probe.executed
    probe.assert_alive_while_running()
    await probe.finished()
    probe.assert_released_after_the_work()


@pytest.mark.anyio
async def test_a_cancelled_graph_launch_keeps_its_graph_until_the_replay_is_done() -> None:
    pause = await gf.zeros(N, F32)  # allocated before the capture, which cannot allocate
    graph = K.slow_fill(pause, 1.0, SLOW).capture()
    graph_ref = weakref.ref(graph)
    graph_released: list[float] = []
    weakref.finalize(graph, lambda: graph_released.append(time.monotonic()))
    probe = Probe()  # after the replay, in the same run
    # The launch is made at run time, from a holder it empties: the awaited
    # operation does not refer to the graph, so neither does the cancelled
    # task's traceback (which the cancelled wait may keep while the work
    # runs); what the run keeps is then all that holds the graph.
    holder = [graph]
    del graph
    op = gf.with_context(lambda ctx: holder.pop().launch()).then(lambda _: probe)
    probe.start()
    with anyio.move_on_after(CANCEL) as scope:
        await op
    assert scope.cancelled_caught and probe.executed and holder == []
    gc.collect()
    alive = graph_ref() is not None
    assert probe.surely_running() and probe.busy()
    assert alive, "the graph was released while its replay still runs"
    probe.assert_alive_while_running()
    await probe.finished()
    gc.collect()
    assert graph_ref() is None, "the graph outlived its last replay (a leak)"
    assert probe.started is not None and len(graph_released) == 1
    assert graph_released[0] >= probe.started + SLOW - EARLY, "released before the replay ended"
    probe.assert_released_after_the_work()


# -- a run failing half-way -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_await_failing_half_way_keeps_what_it_enqueued_until_the_gpu_is_done() -> None:
    probe = Probe()
    with pytest.raises(ValueError, match="half-way"):
        await probe.after_slow().then(_fail)
    assert probe.executed
    probe.assert_alive_while_running()
    await probe.finished()
    probe.assert_released_after_the_work()


@pytest.mark.parametrize("entry", ["sync", "sync_on"])
def test_a_sync_failing_half_way_releases_what_it_keeps_once_the_stream_is_idle(
    entry: str,
) -> None:
    probe = Probe()
    op = probe.after_slow().then(_fail)
    stream = _policy("sync_on").stream
    caught: list[BaseException] = []

    def run() -> None:
        try:
            if entry == "sync":
                op.sync()
            else:
                op.sync_on(stream)
        except BaseException as exc:
            caught.append(exc)

    # sync() blocks its thread: the check while the GPU runs is made from another
    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + DEADLINE
    while not probe.executed and time.monotonic() < deadline:
        time.sleep(0.001)
    assert probe.executed
    probe.assert_alive_while_running()
    worker.join(DEADLINE)
    assert not worker.is_alive()
    assert len(caught) == 1 and isinstance(caught[0], ValueError), caught
    # sync() raised only after synchronising, and released only then
    assert not probe.busy(), "sync() returned with the stream still busy"
    probe.assert_released_after_the_work()


# -- scopes left by an exception ------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_stream_lease_left_by_an_exception_releases_only_after_the_gpu() -> None:
    cancelled, failed = Probe(), Probe(0.2)
    checks = [0]
    async with anyio.create_task_group() as tg:
        tg.start_soon(cancelled.watch, checks)
        with pytest.raises(ValueError, match="half-way"):
            async with gf.open_stream_lease() as lease:
                with anyio.move_on_after(CANCEL) as scope:
                    await cancelled.after_slow()
                assert scope.cancelled_caught and cancelled.stream == lease.stream
                cancelled.assert_alive_while_running()
                # leaves the scope with both runs still on the GPU (one after the other)
                await failed.after_slow().then(_fail)
        left = time.monotonic()
        assert cancelled.started is not None
        assert left >= cancelled.started + SLOW - EARLY, "the lease exit did not wait for the GPU"
        # what the runs kept went, and not before their kernels could have finished
        cancelled.assert_released_after_the_work()
        failed.assert_released_after_the_work()
    assert checks[0] >= 1, "no check was made while the GPU ran"


@pytest.mark.anyio
async def test_a_device_group_left_by_an_exception_releases_only_after_the_gpu() -> None:
    probe = Probe()
    checks = [0]
    device = gf.open_device_group().devices[-1]

    async def doomed() -> None:
        await probe.after_slow()  # cancelled when its sibling fails

    async def failing() -> None:
        while not probe.executed:
            await anyio.sleep(0.002)
        raise ValueError("child failed")

    async with anyio.create_task_group() as tg:
        tg.start_soon(probe.watch, checks)
        with pytest.raises(ExceptionGroup) as info:
            async with gf.open_device_group() as group:
                group.start_soon(doomed, device=device)
                group.start_soon(failing, device=device)
        left = time.monotonic()
        assert info.group_contains(ValueError, match="child failed")
        assert probe.started is not None
        assert left >= probe.started + SLOW - EARLY, "the group exit did not wait for the GPU"
        probe.assert_released_after_the_work()
    assert checks[0] >= 1, "no check was made while the GPU ran"


# -- a shared host value consumed on another stream -----------------------------------------------


@pytest.mark.anyio
async def test_a_shared_host_value_is_ready_the_moment_another_streams_await_returns() -> None:
    x = await gf.zeros(N, F32)
    producers: list[gf.Stream] = []

    def produced_on(ctx: gf.ExecutionContext, a: gf.DeviceArray) -> gf.DeviceOperation[Any]:
        producers.append(ctx.stream)
        return gf.value(a)

    src = gf.to_host(
        K.slow_fill(x, 7.0, 0.5).then(lambda a: gf.with_context(lambda ctx: produced_on(ctx, a)))
    ).shared()
    pa, pb = _policy("producer"), _policy("consumer")
    assert pa.stream != pb.stream
    got: dict[str, np.ndarray] = {}

    async def consume(name: str, policy: gf.SingleStream) -> None:
        out = await src.clone().run(policy)
        got[name] = out.copy()  # at once: nothing else may have waited for the GPU since

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume, "a", pa)
        with anyio.fail_after(DEADLINE):
            while not producers:
                await anyio.sleep(0.001)
        assert producers == [pa.stream]  # A's run enqueued the work, on its stream
        await consume("b", pb)  # another task, another stream, started after it
    np.testing.assert_array_equal(got["b"], np.full(N, 7, F32))
    np.testing.assert_array_equal(got["a"], np.full(N, 7, F32))


# -- finalizers ------------------------------------------------------------------------------
#
# A finalizer runs on whatever thread drops the last reference or runs the
# garbage collector: also one inside a lock of gpuflow's, whose work the
# finalizer's own (a free in stream order, a release after gpuflow's uses,
# retiring a stream) would take again.  Each test drops the last reference
# on a thread that holds such a lock, as a collection triggered inside it
# would: the thread must not wait for itself, and the work must still be
# done afterwards without any further call into gpuflow.


class _Producer:
    """Another library's array (``__cuda_array_interface__`` only), whose
    release by gpuflow is seen through a weak reference."""

    def __init__(self, backing: gf.DeviceArray) -> None:
        self.backing = backing
        self.__cuda_array_interface__ = backing.__cuda_array_interface__


def _drop_holding(lock: Any, holder: list[Any]) -> None:
    def drop() -> None:
        with lock:
            holder.clear()

    t = threading.Thread(target=drop, daemon=True)
    t.start()
    t.join(DEADLINE / 2)
    assert not t.is_alive(), "a finalizer waited for a lock its own thread holds"


def _eventually(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE} s"
        time.sleep(0.001)


@pytest.mark.sim_only
def test_an_array_dropped_inside_the_backends_lock_is_freed_afterwards() -> None:
    x = K.slow_fill(gf.zeros(N, F32).sync(), 1.0, 0.05).sync()
    buffer: Any = x._allocation.buffer
    holder = [x]
    del x
    _drop_holding(ensure_runtime().backend.cond, holder)  # type: ignore[attr-defined]
    _eventually(lambda: buffer.freed, "the dropped array's memory is freed")


def test_an_import_and_a_stream_dropped_inside_the_completers_lock_go_afterwards() -> None:
    a = gf.arange(N, dtype=F32).sync()
    producer = _Producer(a)
    released = weakref.ref(producer)
    b = gf.from_dlpack(producer)
    np.testing.assert_array_equal(gf.to_host(b).sync(), np.arange(N, dtype=F32))
    s = gf.new_stream()
    gf.to_host(b).sync_on(s)
    holder: list[Any] = [b, s, producer]
    del b, s, producer
    _drop_holding(ensure_runtime().completer._lock, holder)
    _eventually(lambda: released() is None, "the import's owner is released")


def test_a_stream_collected_with_what_it_used_frees_and_releases_them() -> None:
    # One collection finds a stream, an array it wrote and an import it read
    # unreachable together (a cycle): the stream's finalizer runs first, so
    # the free and the release must go on a stream that still exists, after
    # the same uses, and neither may be leaked.
    a = gf.arange(N, dtype=F32).sync()
    producer = _Producer(a)
    released = weakref.ref(producer)
    b = gf.from_dlpack(producer)
    s = gf.new_stream()
    x = K.slow_fill(gf.zeros(N, F32).sync_on(s), 1.0, 0.05).sync_on(s)
    gf.to_host(b).sync_on(s)
    buffer: Any = x._allocation.buffer
    holder: list[Any] = [x, b, s, producer]
    holder.append(holder)
    del x, b, s, producer, holder
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gc.collect()
        _eventually(lambda: buffer.freed, "the array's memory is freed")
        _eventually(lambda: released() is None, "the import's owner is released")
        gf.memory_stats()  # a safe point: what is still queued runs here
    assert not [str(w.message) for w in seen if "gpuflow" in str(w.message)]


def test_finalizers_work_is_done_in_the_order_it_was_left_whoever_drains() -> None:
    # The reaper and a safe point may drain at once: a later item (a free)
    # must never start while an earlier one (its stream's retirement) runs.
    from gpuflow._core import _finalizers

    log: list[str] = []

    def slow(name: str) -> None:
        log.append(name + " starts")
        time.sleep(0.05)
        log.append(name + " ends")

    _finalizers.finalize_later(slow, "first")  # wakes the reaper, which drains
    _finalizers.finalize_later(slow, "second")
    time.sleep(0.02)  # the reaper is inside "first" now
    _finalizers.run_finalized()  # a safe point on this thread
    _eventually(lambda: len(log) == 4, "both items done")
    assert log == ["first starts", "first ends", "second starts", "second ends"]


def test_an_array_last_written_by_a_stream_collected_with_it_is_freed() -> None:
    # An export to gpuflow's own stream makes that stream the array's writer
    # with no known point: the free waits for everything the stream was given,
    # which must still be possible once the stream is destroyed (its finalizer
    # ran first in the collection that found both).
    x = gf.arange(N, dtype=F32).sync()
    s = gf.new_stream()
    K.slow_fill(gf.zeros(N, F32).sync(), 1.0, 0.05).enqueue_on(s)  # busy a while
    x.__dlpack__(stream=s.__cuda_stream__()[1])  # (dropped unconsumed: released...)
    gf.from_dlpack(gf.zeros(1, F32).sync())  # (...at the next exchange)
    assert x._allocation.writer == s
    buffer: Any = x._allocation.buffer
    holder: list[Any] = [x, s]
    holder.append(holder)
    del x, s, holder
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gc.collect()
        _eventually(lambda: buffer.freed, "the array's memory is freed")
    assert not [str(w.message) for w in seen if "gpuflow" in str(w.message)]
