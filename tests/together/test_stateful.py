"""Features combined: a stateful test of one runtime on ``sim``.

A Hypothesis ``RuleBasedStateMachine`` drives gpuflow as a program would,
step by step: it opens and leaves stream leases and device groups, enters
latency classes (priorities, reserved SMs), starts runs and awaits them or
not, awaits past a pool's bound, cancels awaits at random points, faults a
device and resets it, captures, updates and launches a graph (and has a
launch refused), hands arrays to another library and imports them back,
retires streams, replaces the runtime, and (under Trio) raises a Ctrl-C
nurseries above a lease.  After every step:

* every array holds what NumPy computes from the same steps (a cancelled
  await leaves either value: the GPU may or may not have been given its
  work, and the next read settles which);
* every run took the stream a user expects: its lease's, else one of the
  latency class in effect (priority and reserved SMs), never one a lease
  holds when it named its own policy;
* every started run's outcome is seen exactly once: at its await, or raised
  at its scope's exit when no task awaited it;
* awaits waiting for an idle stream at a pool's bound are served in the
  order they came;

and once every scope is left, the full quiescence check passes (runs,
leases, uses after free, and every resource gpuflow made).

The steps run in one task of an event loop in a thread of its own (the
*actor*): a scope a step enters stays entered, in that task, for the steps
after it, as in a program.  ``GPUFLOW_STATEFUL_EXAMPLES`` and
``GPUFLOW_STATEFUL_STEPS`` set how long it runs (docs/contributing.md).
The sequences behind the behaviours of ``test_features_together.py`` are
replayed first, as seeds.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import numpy as np
import pytest
from helpers import interop
from helpers import kernels as K
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import gpuflow as gf
from gpuflow import testing

pytestmark = pytest.mark.sim_only  # (reserves SMs of two simulated devices)

F32 = np.float32
N = interop.N  # (the other library's kernels' size)
SLOTS = 3
#: the most scopes open at once, and leases (four pool streams a level)
MAX_DEPTH, MAX_LEASES = 4, 3
EXAMPLES = int(os.environ.get("GPUFLOW_STATEFUL_EXAMPLES", "4"))
STEPS = int(os.environ.get("GPUFLOW_STATEFUL_STEPS", "20"))

LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("trio", {}), id="trio"),
]


#: SMs reserved as "x": not a multiple of the partition granule (8), so
#: that the driver's rounding (up, to 8) is in play
RESERVED = {"x": 6}


def _init(backend: gf.lowlevel.Backend) -> None:
    """A runtime of two simulated devices on ``backend`` (a new one, or one
    that goes on, as ``cuda``'s does, under a new runtime); the SMs it
    reserved never overlap those left to other work."""
    gf.init_device_contexts(backend=backend, reserve_sms=RESERVED)
    parts: list[Any] = backend.live_objects().get("partitions", [])
    for device in (0, 1):
        # (the simulated device's own record of which SMs each partition
        # runs on: what makes a grid beside a busy reservation run in one
        # wave, or two, on sim; a replaced runtime's, still in use by a
        # stream a program holds, may be there too, and overlaps)
        mine = [p.sms for p in parts if p.device == device]
        assert len(mine) >= 2, mine
        if len(mine) == 2:
            assert not mine[0] & mine[1], (
                f"device {device}: the reserved SMs overlap those left to other work: {mine}"
            )


# -- the actor: one task that runs every step ---------------------------------------------------


@dataclass
class _Box:
    done: anyio.Event = field(default_factory=anyio.Event)
    value: Any = None
    error: BaseException | None = None


class Actor:
    """One task of an event loop, in a thread of its own, that runs the
    steps it is given in turn (so that what a step enters, another leaves)."""

    def __init__(self, loop: tuple[str, dict[str, Any]]) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal(*loop)
        self._portal = self._portal_cm.__enter__()
        self._send, receive = anyio.create_memory_object_stream[tuple[Any, _Box]]()
        self._served = self._portal.start_task_soon(self._serve, receive)

    async def _serve(self, receive: Any) -> None:
        async with receive:
            async for fn, box in receive:
                try:
                    box.value = await fn()
                except Exception as exc:  # (the step's own: the machine looks at it)
                    box.error = exc
                box.done.set()

    async def _ask(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        box = _Box()
        await self._send.send((fn, box))
        with anyio.fail_after(60):  # (a step that hangs fails, naming itself)
            await box.done.wait()
        if box.error is not None:
            raise box.error
        return box.value

    def __call__(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        return self._portal.call(self._ask, fn)

    def close(self) -> None:
        self._portal.call(self._send.aclose)
        self._served.result(timeout=60)
        self._portal_cm.__exit__(None, None, None)


# -- the model ----------------------------------------------------------------------------------


@dataclass
class Entry:
    """A scope or class the actor is in, innermost last."""

    kind: str  # "lease", "group", "class"
    cm: Any
    level: dict[str, Any]  # what it names of the class (priority, sms)
    obj: Any = None  # the lease or group
    started: list[Started] = field(default_factory=list)


@dataclass
class Started:
    run: gf.StartedRun[Any]
    fails: bool
    seen: int = 0


def _leaves(exc: BaseException | None) -> list[BaseException]:
    if exc is None:
        return []
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def _key(a: np.ndarray) -> bytes:
    return a.tobytes()


class FeaturesTogether(RuleBasedStateMachine):
    loop: tuple[str, dict[str, Any]] = ("asyncio", {})

    def __init__(self) -> None:
        super().__init__()
        #: the backend every runtime of the machine's is made on (a runtime
        #: replaced on it must leave nothing of its own there)
        self.backend = gf.lowlevel.new_sim_backend(2)
        _init(self.backend)
        self.actor = Actor(self.loop)
        self.stack: list[Entry] = []
        #: per memory, what it may hold (one array, or more after a cancelled await)
        self.mem: dict[int, list[np.ndarray]] = {}
        self.slots: list[tuple[gf.DeviceArray, int]] = []
        #: the graph, the array it reads, its memory and the one it writes, updates pending
        self.graph: tuple[gf.Graph[Any], gf.DeviceArray, int, int, list[float]] | None = None
        self._mems = 0
        #: the streams runs took, held past a runtime's replacement (as a
        #: program holds ``lease.stream``): what the quiescence check sees of them
        self.took: set[gf.Stream] = set()
        self.actor(self._fresh)

    async def _fresh(self) -> None:
        """New arrays, another library, no graph (a new runtime's)."""
        self.slots = []
        for i in range(SLOTS):
            h = np.arange(N, dtype=F32) + i
            self.slots.append((await gf.from_host(h), self._new_mem([h])))
        self.fake = interop.FakeLib()
        self.graph = None

    def _new_mem(self, values: list[np.ndarray]) -> int:
        self._mems += 1
        self.mem[self._mems] = values
        return self._mems

    # -- what a user expects of where a run goes -------------------------------------------
    def _level(self) -> tuple[int, str | None]:
        level: dict[str, Any] = {"priority": 0, "sms": None}
        for e in self.stack:
            level.update(e.level)
        return level["priority"], level["sms"]

    def _lease(self) -> gf.Stream | None:
        for e in reversed(self.stack):
            if e.kind == "lease":
                return e.obj.stream  # type: ignore[no-any-return]
        return None

    def _probe(self, op: gf.DeviceOperation[Any], own_policy: bool) -> Any:
        """``op``, checking where it runs: on the lease's stream, else (or
        with a policy of its own) one of the class's level no lease holds."""
        lease = None if own_policy else self._lease()
        priority, sms = self._level()

        def fn(ctx: gf.ExecutionContext) -> gf.DeviceOperation[Any]:
            s = ctx.stream
            self.took.add(s)
            if lease is not None:
                assert s is lease, f"a run in a lease ran on {s!r}, not on {lease!r}"
            else:
                assert (s.priority, s.sms) == (priority, sms), (
                    f"a run of class (priority {priority}, sms {sms!r}) ran on {s!r} "
                    f"(priority {s.priority}, sms {s.sms!r})"
                )
                assert not s.leased, f"a run outside any lease took a leased stream {s!r}"
            return op

        return gf.with_context(fn)

    def _work(self, slot: int, kind: str, value: int) -> tuple[Any, list[np.ndarray]]:
        """The operation of a work step on ``slot``, and what its memory
        holds after it, each way it may hold before."""
        x, mem = self.slots[slot]
        cfg = K.cfg(N)
        if kind == "fill":
            op = K.slow_fill(x, float(value), 0.001 * (value % 3), n=N)
            after = [np.full(N, value, F32)]
        elif kind == "scale":
            s = [-1.0, 0.5, 2.0][value % 3]
            op = K.module().scale(cfg, x, s, N)
            after = [v * F32(s) for v in self.mem[mem]]
        else:  # copy from another slot
            src, src_mem = self.slots[(slot + 1 + value % 2) % SLOTS]
            op = K.module().copy_f32(cfg, src, x, N)
            after = [v.copy() for v in self.mem[src_mem]]
        return op, after

    def _merge(self, mem: int, values: list[np.ndarray]) -> None:
        seen = {_key(v): v for v in values}
        self.mem[mem] = list(seen.values())

    # -- steps ------------------------------------------------------------------------------
    @initialize()
    def start(self) -> None:
        pass

    @rule(
        slot=st.integers(0, SLOTS - 1),
        kind=st.sampled_from(["fill", "scale", "copy"]),
        value=st.integers(0, 5),
        how=st.sampled_from(["await", "start", "cancel", "thread", "retire"]),
        delay=st.sampled_from([0.0, 0.0002, 0.002]),
    )
    def work(self, slot: int, kind: str, value: int, how: str, delay: float = 0.0) -> None:
        op, after = self._work(slot, kind, value)
        mem = self.slots[slot][1]
        scope = next((e for e in reversed(self.stack) if e.kind != "class"), None)
        if how == "start" and scope is None:
            how = "await"
        if how == "await":
            self.actor(lambda: self._await(self._probe(op, False)))
            self.mem[mem] = after
        elif how == "start":
            assert scope is not None
            probed = self._probe(op, False)

            async def start() -> gf.StartedRun[Any]:
                if scope.kind == "lease":
                    return scope.obj.start_run(probed)  # type: ignore[no-any-return]
                return scope.obj.start_run(probed, device=0)  # type: ignore[no-any-return]

            scope.started.append(Started(self.actor(start), fails=False))
            self.mem[mem] = after
        elif how == "cancel":  # cancelled at a random point: the GPU has it, or not
            probed = self._probe(op, False)

            async def cancelled() -> None:
                with anyio.move_on_after(delay):
                    await probed

            self.actor(cancelled)
            self._merge(mem, self.mem[mem] + after)
        elif how == "thread":  # a blocking run, which cannot wait, with a policy of its own
            probed = self._probe(op, True)
            policy = gf.StreamPoolLeastLoaded(max_streams=4)
            self.actor(lambda: anyio.to_thread.run_sync(lambda: probed.sync(policy)))
            self.mem[mem] = after
        else:  # on a stream of its own, dropped at once: retired with its work

            async def retire() -> None:
                s = gf.new_stream(0)
                op.enqueue_on(s)

            self.actor(retire)
            self.mem[mem] = after

    @staticmethod
    async def _await(op: Any) -> Any:
        return await op

    @precondition(lambda self: any(not s.seen for e in self.stack for s in e.started))
    @rule(pick=st.integers(0, 100))
    def await_started(self, pick: int) -> None:
        waiting = [s for e in self.stack for s in e.started if not s.seen]
        s = waiting[pick % len(waiting)]
        try:
            self.actor(lambda: self._await(s.run))
        except gf.DeviceFaultError:
            assert s.fails, "a started run that could not fail raised a fault"
        else:
            assert not s.fails, "a started run that failed on the GPU gave no error"
        s.seen += 1

    @precondition(lambda self: len(self.stack) < MAX_DEPTH)
    @rule(
        kind=st.sampled_from(["lease", "group", "class"]),
        priority=st.sampled_from([None, 0, 1, 2]),
        sms=st.sampled_from([None, "", "x"]),  # (None: the enclosing's; "": no reserved SMs)
    )
    def enter(self, kind: str, priority: int | None, sms: str | None) -> None:
        level: dict[str, Any] = {}
        if priority is not None:
            level["priority"] = priority
        if sms is not None:
            level["sms"] = sms or None
        if kind == "lease" and sum(e.kind == "lease" for e in self.stack) >= MAX_LEASES:
            kind = "class"
        before = self._level()

        async def open_scope() -> tuple[Any, Any]:
            # (made in the actor, as in the task that enters it: the class
            # a lease or group takes is the one in effect where it is made)
            if kind == "class":
                cm: Any = gf.latency_class(**level)
                return cm, cm.__enter__()
            if kind == "lease":
                cm = gf.open_stream_lease(**level)
            else:
                cm = gf.open_device_group(**level)
            return cm, await cm.__aenter__()

        cm, obj = self.actor(open_scope)
        self.stack.append(Entry(kind, cm, level, obj))
        if kind == "class":
            return
        if kind == "lease":  # its stream is of the class it names, the rest the enclosing's
            want = {"priority": before[0], "sms": before[1], **level}
            s = obj.stream
            assert (s.priority, s.sms) == (want["priority"], want["sms"]), (s, want)

    @precondition(lambda self: bool(self.stack))
    @rule(child_error=st.booleans())
    def leave(self, child_error: bool = False) -> None:
        e = self.stack.pop()
        if e.kind == "class":

            async def leave_class() -> None:
                e.cm.__exit__(None, None, None)

            self.actor(leave_class)
            return
        child_error = child_error and e.kind == "group"

        async def exit_scope() -> BaseException | None:
            if child_error:

                async def child() -> None:
                    raise ValueError("a child's error")

                e.obj.start_soon(child, device=0)
            try:
                await e.cm.__aexit__(None, None, None)
            except BaseException as exc:  # (what the scope's exit raised)
                return exc
            return None

        raised = _leaves(self.actor(exit_scope))
        unseen = [s for s in e.started if not s.seen]
        faults = [x for x in raised if isinstance(x, gf.DeviceFaultError)]
        others = [x for x in raised if not isinstance(x, gf.DeviceFaultError)]
        want_faults = sum(s.fails for s in unseen)
        assert len(faults) == want_faults, (
            f"the {e.kind}'s exit raised {len(faults)} fault(s) for {want_faults} failed "
            f"run(s) nobody awaited: {raised!r}"
        )
        if child_error:
            assert [type(x) for x in others] == [ValueError], raised
        else:
            assert others == [], raised
        for s in unseen:
            s.seen += 1

    @precondition(lambda self: any(e.kind == "group" for e in self.stack))
    @rule()
    def start_a_failure(self) -> None:
        """A run of the innermost group on device 1 that fails (its device
        is reset under it), nobody awaiting it yet."""
        group = next(e for e in reversed(self.stack) if e.kind == "group")

        async def start() -> gf.StartedRun[Any]:
            x = await gf.copy(await gf.zeros(64, F32), device=1)
            started = group.obj.start_run(K.slow_fill(x, 1.0, 0.2, n=64), device=1)
            gf.reset_device(1)  # ("reset with work pending": the run fails)
            return started  # type: ignore[no-any-return]

        group.started.append(Started(self.actor(start), fails=True))

    @precondition(lambda self: not self.stack)
    @rule()
    def fault_and_reset(self) -> None:
        """A kernel faults (sticky: every device of the process), and the
        devices are reset: the arrays, the graph and the other library go."""
        op = K.fault_module().null_write(gf.LaunchConfig(1, 32), 32)

        async def fault() -> None:
            with gf.use_device(1), pytest.raises(gf.DeviceFaultError):
                await op

        self.actor(fault)
        self.slots, self.graph, self.mem = [], None, {}
        self.actor(self._drop_fake)
        for device in (1, 0):
            gf.reset_device(device)
        self.actor(self._fresh)

    @rule(waiters=st.integers(1, 5), newcomer=st.booleans())
    def burst(self, waiters: int, newcomer: bool = False) -> None:
        """Awaits past the bound of a policy of their own (every stream busy)
        are served in the order they came; with a ``newcomer``, a new await
        comes the moment a stream goes idle, before the first in line has
        looked (the loop held, as by a task that computes): it queues behind
        every await already waiting."""
        policy = gf.StreamPoolLeastLoaded(max_streams=4)

        async def burst() -> list[Any]:
            order: list[Any] = []
            unleased = [s for s in gf.lowlevel.pool_streams(0) if not s.leased]
            for i, s in enumerate(unleased):  # (with a newcomer, the first goes idle first)
                K.spin(1, 0.03 if i == 0 or not newcomer else 0.15).enqueue_on(s)

            def note(i: Any) -> Any:
                def fn(ctx: gf.ExecutionContext) -> Any:
                    order.append(i)
                    return gf.value(None)

                return gf.with_context(fn)

            async def waiter(i: Any) -> None:
                with gf.latency_class(priority=0, sms=None):  # (the default's pool)
                    await note(i).run(policy)

            async with anyio.create_task_group() as tg:
                for i in range(waiters):
                    tg.start_soon(waiter, i)
                    await anyio.sleep(0.002)  # (each comes before the next)
                if newcomer:
                    _block_until(unleased[0].idle)  # the first in line is woken...
                    time.sleep(0.02)  # ...and has not looked (however slow the waking)
                    await waiter("new")
            return order

        order = self.actor(burst)
        want: list[Any] = [*range(waiters), *(["new"] if newcomer else [])]
        assert order == want, f"awaits served out of turn: {order}"

    @rule()
    def blocking_beside_stalled(self) -> None:
        """A run that cannot wait (a blocking ``sync`` of another thread, with
        a policy of its own) while every pool stream no lease holds is
        stalled: it takes one of those, never a leased one."""
        policy = gf.StreamPoolLeastLoaded(max_streams=4, stall_s=0.02)

        async def blocking() -> None:
            busy = [s for s in gf.lowlevel.pool_streams(0)[:4] if not s.leased]
            for s in busy:
                K.spin(1, 0.3).enqueue_on(s)
            await anyio.sleep(0.05)  # (stalled: nothing finished for stall_s)
            seen: list[gf.Stream] = []

            def fn(ctx: gf.ExecutionContext) -> Any:
                seen.append(ctx.stream)
                return gf.value(None)

            def run() -> None:
                with gf.latency_class(priority=0, sms=None):  # (the default's pool)
                    gf.with_context(fn).sync(policy)

            await anyio.to_thread.run_sync(run)
            assert not seen[0].leased, f"a run that cannot wait took the leased {seen[0]!r}"
            for s in busy:
                await gf.wait_stream(s)

        self.actor(blocking)

    @rule(n=st.integers(5, 9), seconds=st.sampled_from([0.005, 0.03]))
    def crowd(self, n: int, seconds: float) -> None:
        """More awaits at once than a pool has streams, in the scopes and
        class in effect: the class's pool grows (into streams of its own)."""

        async def crowd() -> None:
            xs = [await gf.zeros(64, F32) for _ in range(n)]
            async with anyio.create_task_group() as tg:
                for x in xs:
                    op = K.slow_fill(x, 1.0, seconds, n=64)
                    tg.start_soon(self._await, self._probe(op, False))

        self.actor(crowd)

    @precondition(lambda self: any(e.kind != "class" for e in self.stack))
    @rule(n=st.integers(1, 80))
    def start_many(self, n: int) -> None:
        """Runs the innermost lease or group starts, nobody awaiting them yet
        (past the scope's pruning of its records, when there are many)."""
        scope = next(e for e in reversed(self.stack) if e.kind != "class")

        async def start() -> list[gf.StartedRun[Any]]:
            if scope.kind == "lease":
                return [scope.obj.start_run(gf.value(i)) for i in range(n)]
            return [scope.obj.start_run(gf.value(i), device=0) for i in range(n)]

        scope.started += [Started(run, fails=False) for run in self.actor(start)]

    @precondition(lambda self: self.graph is None)
    @rule(src=st.integers(0, SLOTS - 1))
    def capture(self, src: int) -> None:
        dst = (src + 1) % SLOTS
        (x, xm), (y, ym) = self.slots[src], self.slots[dst]

        async def capture() -> gf.Graph[Any]:
            return K.module().copy_f32(K.cfg(N), x, y, N).capture()

        self.graph = (self.actor(capture), x, xm, ym, [])

    @precondition(lambda self: self.graph is not None)
    @rule(value=st.integers(0, 9))
    def update(self, value: int) -> None:
        assert self.graph is not None
        graph, x, _xm, _ym, pending = self.graph
        graph.update(gf.copy(gf.from_host(np.full(N, value, F32)), out=x))
        pending.append(float(value))

    @precondition(lambda self: self.graph is not None)
    @rule(refused_first=st.booleans())
    def launch(self, refused_first: bool) -> None:
        assert self.graph is not None
        graph, _x, xm, ym, pending = self.graph
        if refused_first:  # on another device: refused, updates kept

            async def refused() -> None:
                with pytest.raises(gf.UsageError, match="launched on device 1"):
                    await graph.launch().run(gf.SingleStream(device=1))

            self.actor(refused)
        self.actor(lambda: self._await(self._probe(graph.launch(), False)))
        if pending:
            self.mem[xm] = [np.full(N, pending[-1], F32)]
            pending.clear()
        self.mem[ym] = [v.copy() for v in self.mem[xm]]

    @rule(
        slot=st.integers(0, SLOTS - 1),
        value=st.integers(0, 2),
        onto_ours=st.booleans(),
        between=st.booleans(),
    )
    def export(self, slot: int, value: int, onto_ours: bool, between: bool = False) -> None:
        """Another library scales the array, on its own stream or on one of
        gpuflow's; ``between`` gpuflow's own writes (in the scopes in effect,
        one step: nothing reads the array in between), the fill after
        enqueued while the other's write is still to come."""
        x, mem = self.slots[slot]
        s = [-1.0, 0.5, 2.0][value]
        seconds = 0.05 if between else 0.001
        if between:
            before, self.mem[mem] = self._work(slot, "fill", value + 1)
        self.mem[mem] = [v * F32(s) for v in self.mem[mem]]
        after_op, after = self._work(slot, "fill", value + 7)  # (scales would commute)

        async def export() -> None:
            if between:
                await self._probe(before, False)
            if onto_ours:
                consumer = gf.new_stream(0)
                with self.fake.on(consumer):
                    self.fake.late_scale(x, s, seconds=seconds)
            else:
                self.fake.late_scale(x, s, seconds=seconds)
            if between:
                await self._probe(after_op, False)

        self.actor(export)
        if between:
            self.mem[mem] = after

    @rule(source=st.integers(0, SLOTS - 1), into=st.integers(0, SLOTS - 1))
    def import_copy(self, source: int, into: int) -> None:
        """An array imported (as another library's, through DLPack) and
        copied, the copy taking the place of slot ``into`` (its old array
        dropped, freed in stream order)."""
        x, mem = self.slots[source]

        async def imported() -> gf.DeviceArray:
            y = gf.from_dlpack(interop.DlpackOnly(x))
            return await self._probe(gf.copy(y), False)  # type: ignore[no-any-return]

        z = self.actor(imported)
        self.slots[into] = (z, self._new_mem([v.copy() for v in self.mem[mem]]))

    @rule()
    def cancel_at_every_point(self) -> None:
        async def check() -> None:
            async def pipeline() -> None:
                x = await gf.zeros(64, F32)
                await K.slow_fill(x, 2.0, 0.0005)
                np.testing.assert_array_equal(await gf.to_host(x), np.full(64, 2.0, F32))

            await testing.cancel_at_every_point(pipeline)

        self.actor(check)

    @precondition(lambda self: self.loop[0] == "trio")
    @rule(depth=st.integers(1, 3))
    def interrupt(self, depth: int) -> None:
        """Under Trio, a Ctrl-C (the ``KeyboardInterrupt`` Trio raises in the
        task that ran the program) while a stream lease ``depth`` nurseries
        below waits for its GPU work: the lease leaves at once (what the GPU
        uses stays alive until it is done), not after the work.  (asyncio's
        runner answers Ctrl-C by cancelling its main task: not this.)"""
        if self.loop[0] != "trio":
            return
        gpu_s = 1.0

        async def interrupted() -> tuple[float, list[BaseException]]:
            x = await gf.zeros(64, F32)
            leased = anyio.Event()

            async def below(level: int) -> None:
                if level < depth:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(below, level + 1)
                    return
                async with gf.open_stream_lease() as lease:
                    K.slow_fill(x, 1.0, gpu_s, n=64).enqueue_on(lease.stream)
                    leased.set()
                    await anyio.sleep_forever()

            t0 = time.monotonic()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(below, 1)
                    await leased.wait()
                    t0 = time.monotonic()
                    raise KeyboardInterrupt  # (as Trio raises a Ctrl-C here)
            except BaseException as exc:  # (the interrupt, as Trio delivers it)
                return time.monotonic() - t0, _leaves(exc)
            raise AssertionError("the interrupt was lost")

        took, raised = self.actor(interrupted)
        assert [type(e) for e in raised] == [KeyboardInterrupt], raised
        assert took < gpu_s / 2, (
            f"a lease {depth} nurseries below the interrupt held it {took:.2f} s, "
            "until its GPU work was done"
        )

    @precondition(lambda self: not self.stack)
    @rule(keep_backend=st.booleans())
    def replace_runtime(self, keep_backend: bool = True) -> None:
        """A new runtime, on the backend the last one used (which must keep
        nothing of the last one's) or on a new one."""
        self.actor(testing.assert_quiescent_async)
        self.slots, self.graph, self.mem = [], None, {}
        self.actor(self._drop_fake)
        if not keep_backend:
            self.backend = gf.lowlevel.new_sim_backend(2)
        _init(self.backend)
        self.actor(self._fresh)

    async def _drop_fake(self) -> None:
        self.fake = None  # type: ignore[assignment]

    # -- after every step --------------------------------------------------------------------
    @invariant()
    def arrays_hold_what_numpy_computes(self) -> None:
        async def read() -> list[np.ndarray]:
            return [await gf.to_host(x) for x, _ in self.slots]

        for (_, mem), got in zip(self.slots, self.actor(read), strict=True):
            if not any(np.array_equal(got, v) for v in self.mem[mem]):
                raise AssertionError(
                    f"an array holds {got[:4]}..., none of {[v[:4] for v in self.mem[mem]]}"
                )
            self.mem[mem] = [got]  # (read: settled)

    def teardown(self) -> None:
        try:
            while self.stack:
                self.leave(child_error=False)
            self.slots, self.graph = [], None
            self.actor(self._drop_fake)
            self.actor(testing.assert_quiescent_async)
            self.took.clear()
        finally:
            self.actor.close()


def _block_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Hold the event loop (as a task that computes would) until ``cond()``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


# -- the seeds: the sequences behind test_features_together.py's behaviours -------------------
# Each says which planted bug of tests/mutations it finds (``python
# tests/mutations/mutate.py --tests
# tests/together/test_stateful.py::test_the_seeded_sequences_keep_every_invariant``).
# Every machine finds T3 as it starts (its reservation is rounded up).  The
# random examples alone (``GPUFLOW_STATEFUL_EXAMPLES=20``,
# ``--hypothesis-seed=1``, ``-k combined``) find T8, T8b, T8c, T8d, T10, T12
# and T14.  T4 (the cuda backend's green contexts) is the cuda backend's
# stateful test's (tests/stand_in/stateful.py, on the stand-in driver).

W = dict  # (a step's arguments)
SEEDS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    # finds T1, T1b
    "1 a class of reserved SMs at the default priority": [
        ("enter", W(kind="class", priority=0, sms="x")),
        ("crowd", W(n=8, seconds=0.03)),  # (its pool grows past its four)
        ("leave", W()),
        ("crowd", W(n=8, seconds=0.03)),  # (the default's, too)
        *[("work", W(slot=i % 3, kind="scale", value=2, how="await")) for i in range(3)],
    ],
    # finds T2
    "2 a runtime replaced on its backend after every level was used": [
        ("enter", W(kind="class", priority=2, sms="x")),
        ("work", W(slot=0, kind="fill", value=1, how="await")),
        ("leave", W()),
        ("enter", W(kind="class", priority=1, sms=None)),
        ("work", W(slot=1, kind="fill", value=1, how="await")),
        ("leave", W()),
        ("enter", W(kind="class", priority=0, sms="x")),
        ("work", W(slot=2, kind="fill", value=1, how="await")),
        ("leave", W()),
        ("replace_runtime", W(keep_backend=True)),
        ("replace_runtime", W(keep_backend=True)),
    ],
    # finds T5
    "5 a group that started many runs, one failed early": [
        ("enter", W(kind="group", priority=None, sms=None)),
        ("start_a_failure", W()),
        ("start_many", W(n=80)),
        ("leave", W()),
    ],
    # finds T6
    "6 a group left by a child's error with a failure nobody awaited": [
        ("enter", W(kind="group", priority=None, sms=None)),
        ("start_a_failure", W()),
        ("leave", W(child_error=True)),
        ("fault_and_reset", W()),
        ("work", W(slot=0, kind="scale", value=2, how="await")),
    ],
    # finds T7
    "7 a run that cannot wait beside a lease": [
        ("enter", W(kind="lease", priority=None, sms=None)),
        ("blocking_beside_stalled", W()),
        ("burst", W(waiters=2)),
        ("work", W(slot=0, kind="fill", value=3, how="thread")),
        ("leave", W()),
    ],
    # finds T8, T8b, T8c (under Trio, whose resumption order varies), T8d
    "8 awaits at the bound, and a newcomer": [
        ("burst", W(waiters=5)),
        ("burst", W(waiters=1, newcomer=True)),
        ("burst", W(waiters=3, newcomer=True)),
    ],
    # finds T9 (under Trio)
    "9 a Ctrl-C nurseries above a lease waiting for its GPU work": [
        ("interrupt", W(depth=1)),
        ("interrupt", W(depth=2)),
        ("interrupt", W(depth=3)),
    ],
    # finds T10
    "10 cancel_at_every_point inside a lease": [
        ("enter", W(kind="lease", priority=None, sms=None)),
        ("cancel_at_every_point", W()),
        ("leave", W()),
    ],
    # finds T11
    "11 a write on the last writer's stream after another library's use": [
        ("enter", W(kind="lease", priority=None, sms=None)),
        ("export", W(slot=0, value=2, onto_ours=False, between=True)),
        ("leave", W()),
    ],
    # finds T12
    "12 an export to one of gpuflow's streams": [
        ("export", W(slot=1, value=2, onto_ours=True, between=True)),
        ("export", W(slot=1, value=2, onto_ours=True)),
        ("work", W(slot=2, kind="copy", value=1, how="await")),
    ],
    # finds T13
    "13 a refused graph launch": [
        ("capture", W(src=0)),
        ("update", W(value=7)),
        ("launch", W(refused_first=True)),
        ("launch", W(refused_first=False)),
    ],
    # finds T14
    "14 streams retired with nothing pending": [
        *[("work", W(slot=i % 3, kind="fill", value=i, how="retire")) for i in range(4)],
        ("import_copy", W(source=0, into=1)),
    ],
    # finds U1
    "a reset after an array came from another library": [
        ("import_copy", W(source=0, into=1)),
        ("fault_and_reset", W()),
        ("import_copy", W(source=1, into=2)),
    ],
}


def _machine(loop: tuple[str, dict[str, Any]]) -> type[FeaturesTogether]:
    return type(f"FeaturesTogether_{loop[0]}", (FeaturesTogether,), {"loop": loop})


@pytest.mark.parametrize("loop", LOOPS)
def test_the_seeded_sequences_keep_every_invariant(loop: tuple[str, dict[str, Any]]) -> None:
    for name, steps in SEEDS.items():
        machine = _machine(loop)()
        try:
            machine.arrays_hold_what_numpy_computes()
            for step, kwargs in steps:
                getattr(machine, step)(**kwargs)
                machine.arrays_hold_what_numpy_computes()
        except BaseException as exc:
            exc.add_note(f"in the seed {name!r}")
            with contextlib.suppress(BaseException):
                machine.teardown()
            raise
        machine.teardown()


@pytest.mark.timeout(max(300, EXAMPLES * STEPS))
@pytest.mark.parametrize("loop", LOOPS)
def test_features_combined_keep_every_invariant(loop: tuple[str, dict[str, Any]]) -> None:
    run_state_machine_as_test(
        _machine(loop),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert threading.active_count() < 50  # (every actor's thread ended)
