"""Plant known lifetime and ordering bugs in a copy of ``src/`` and check
that the test suite catches every one.

Each mutation below is a bug that once slipped past a green suite, or one
worth guarding in the same places: the run, bridge, hazard, scope, policy
and simulator code.  For each, this script copies ``src/`` to a temporary
directory, applies the mutation (an exact, unique text replacement: if the
code moved, the script says so rather than testing nothing), runs the tests
that should catch it on ``sim`` against the copy, and reports whether they
failed.  A control run first checks that the same tests pass unmutated.

Run it before changing the run, bridge, hazard or scope code, and after:

    python tests/mutations/mutate.py              # every mutation
    python tests/mutations/mutate.py M3 M5        # some of them
    python tests/mutations/mutate.py --list

It needs nothing but the standard library and pytest; it takes a few
minutes (it is not part of the default test run).  Exit status 0 means
every mutation was caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str  # relative to src/gpuflow
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments (files or node ids), run on sim


MUTATIONS = [
    Mutation(
        "M3",
        'a cancelled await releases what its enqueued work uses',
        '_core/_run.py',
        '    finally:\n'
        '        loop.awaiting -= 1\n'
        '    if run.error is not None:\n'
        '        raise run.error\n',
        '    except BaseException:\n'
        '        run._keep = None\n'
        '        raise\n'
        '    finally:\n'
        '        loop.awaiting -= 1\n'
        '    if run.error is not None:\n'
        '        raise run.error\n',
        ('tests/core/test_lifetimes.py',),
    ),
    Mutation(
        "M3b",
        'a cancelled await marks its run finished at once',
        '_core/_run.py',
        '    finally:\n'
        '        loop.awaiting -= 1\n'
        '    if run.error is not None:\n'
        '        raise run.error\n',
        '    except BaseException:\n'
        '        run.complete(None, None, {})\n'
        '        raise\n'
        '    finally:\n'
        '        loop.awaiting -= 1\n'
        '    if run.error is not None:\n'
        '        raise run.error\n',
        ('tests/core/test_lifetimes.py',),
    ),
    Mutation(
        "M10",
        'a sync() that fails half-way releases without synchronising the stream',
        '_core/_run.py',
        '    except BaseException:\n'
        '        # what was enqueued finishes before what it uses is released\n'
        '        try:\n'
        '            stream.synchronize()\n'
        '        finally:\n'
        '            completer.finish(run)\n',
        '    except BaseException:\n'
        '        completer.finish(run)\n',
        ('tests/core/test_lifetimes.py',),
    ),
    Mutation(
        "M2b",
        'a shared() clone consumed on another stream does not wait for the producer',
        '_core/_operation.py',
        '            ctx.backend.wait_event(ctx.stream.raw, st.event)\n',
        '            pass\n',
        ('tests/core/test_lifetimes.py', 'tests/core/test_operations.py',
         'tests/core/test_hazards.py'),
    ),
    Mutation(
        "M5",
        "zip arms on separate streams run one after another",
        "_core/_operation.py",
        "            for op, arm in builtins.zip(self._ops, arms, strict=True):\n"
        "                outs.append(op.execute(arm))\n",
        "            prev = None\n"
        "            for op, arm in builtins.zip(self._ops, arms, strict=True):\n"
        "                if prev is not None and arm.stream != prev:\n"
        "                    be = ctx.backend\n"
        "                    be.wait_event(arm.stream.raw, be.record_event(prev.raw))\n"
        "                outs.append(op.execute(arm))\n"
        "                prev = arm.stream\n",
        ("tests/core/test_operations.py",),
    ),
    Mutation(
        "M6",
        "sim no longer poisons freed memory",
        "_backends/_sim/_backend.py",
        "            buffer.data.fill(_POISON)\n",
        "            pass\n",
        ("tests/memory/test_arrays.py", "tests/core/test_running.py", "tests/core/test_faults.py"),
    ),
    Mutation(
        "M7",
        'a read on another stream does not wait for the last write (read after write)',
        '_core/_hazards.py',
        '                order_after(be, stream, self.writer, self.wrote)\n'
        '                self.synced.add(stream)\n',
        '                self.synced.add(stream)\n',
        ('tests/core/test_hazards.py', 'tests/memory/test_arrays.py'),
    ),
    Mutation(
        "M8",
        'a write on another stream does not wait for earlier reads (write after read)',
        '_core/_hazards.py',
        '    for s, point in uses.readers.items():\n'
        '        order_after(backend, stream, s, point)\n',
        '    pass\n',
        ('tests/core/test_hazards.py',),
    ),
    Mutation(
        "M9",
        'an allocation is freed without waiting for its readers on other streams',
        '_core/_hazards.py',
        '        wait_for_uses(uses, stream)\n'
        '        uses.backend.free(buffer, stream.raw)\n',
        '        uses.backend.free(buffer, stream.raw)\n',
        ('tests/core/test_hazards.py', 'tests/core/test_cancellation.py'),
    ),
    Mutation(
        "M11",
        "the zip join does not wait for the arms on other streams",
        "_core/_operation.py",
        "            for s in forked:\n                ctx.wait_for(s)\n",
        "            pass\n",
        ("tests/core/test_operations.py",),
    ),
    Mutation(
        "M12",
        "leaving a scope does not wait for the GPU work it started",
        "_scopes/_scope.py",
        "                run = self._runs.pop()\n"
        "                if not run.done:\n"
        "                    try:\n"
        "                        await run.wait()\n",
        "                run = self._runs.pop()\n"
        "                if not run.done:\n"
        "                    try:\n"
        "                        await anyio.lowlevel.checkpoint()\n",
        ("tests/scopes/test_scopes.py", "tests/core/test_lifetimes.py"),
    ),
    Mutation(
        "M13",
        "a completed run keeps what it kept (a leak)",
        '_core/_run.py',
        '        self.error = error\n'
        '        self._keep = None\n',
        '        self.error = error\n',
        ("tests/core/test_lifetimes.py",),
    ),
    Mutation(
        "B1",
        'a reached mark completes every run of its stream, not only those up to it',
        '_core/_completion.py',
        '                while runs and runs[0].number <= reached:\n',
        '                while runs:\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B2",
        'the completer thread never completes what a loop that stopped left behind',
        '_core/_completion.py',
        '            return reached if now - lane.reached_at >= WATCHDOG_S else None\n',
        '            return None\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B3",
        "a fired pipe's read end is never closed (a descriptor leak)",
        '_core/_completion.py',
        '            for fd in fired:\n'
        '                os.close(fd)  # (also leaves the epoll set)\n',
        '            pass\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B4",
        "a word is read as reached too early (the stream's last mark enqueued, not reached)",
        '_backends/_sim/_marks.py',
        '        reader: Callable[[], int] = functools.partial(getattr, stream, "word")\n',
        '        reader: Callable[[], int] = functools.partial(getattr, stream, "issued")\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',
         'tests/core/test_lifetimes.py',
         'tests/core/test_hazards.py'),
    ),
    Mutation(
        "B5",
        "a loop's poller stops polling while runs are pending (and arms nothing)",
        '_core/_completion.py',
        '            if now < busy.deadline:\n'
        '                held = busy.held_until(now)\n'
        '                for lane in self.lanes:\n'
        '                    lane.polled_until = held\n'
        '                self.polling = True\n'
        '                return True\n',
        '            if now < busy.deadline:\n'
        '                self.polling = False\n'
        '                return False\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B6",
        'a spin that ends never arms the sleeping wake-up',
        '_core/_completion.py',
        '            self.polling = False\n'
        '            self.arm()\n',
        '            self.polling = False\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "C1",
        "a cancelled await of a collective leaves its communicator waiting for the peer",
        '_core/_run.py',
        '            for comm in run.comms:\n'
        '                comm.abort(',
        '            for comm in []:\n'
        '                comm.abort(',
        ("tests/comm/test_comm.py",),
    ),
    Mutation(
        "C2",
        'the watchdog never asks a busy communicator for its asynchronous error',
        '_core/_completion.py',
        '        for comm in comms:\n'
        '            try:\n',
        '        for comm in []:\n'
        '            try:\n',
        ('tests/comm/test_comm.py',),
    ),
    Mutation(
        "C7",
        "a communicator is never handed to the watchdog (nobody asks it for its errors)",
        '_comm/_communicator.py',
        '        self._rt.completer.watch_communicator(self)\n',
        '        pass\n',
        ('tests/comm/test_comm.py',),
    ),
    Mutation(
        "M14",
        "the watchdog never fails the runs of a faulted device",
        "_core/_completion.py",
        "        for device, err in faulted.items():\n"
        "            self.fail_device(device, err)\n",
        "        pass\n",
        ("tests/core/test_faults.py",),
    ),
    Mutation(
        "M15",
        'the default policy deals streams whatever is pending on them (round robin)',
        '_core/_policy.py',
        '            if not s.leased and s.idle():\n'
        '                return s\n',
        '            if True:\n'
        '                return s\n',
        ('tests/core/test_policy.py',),
    ),
    Mutation(
        "M16",
        'the default policy never grows the pool, however busy',
        '_core/_policy.py',
        '        if n < self._max:\n',
        '        if False:\n',
        ('tests/core/test_policy.py',),
    ),
    Mutation(
        "M17",
        "the default policy does not see blocking runs in flight",
        "_core/_stream.py",
        "            self._syncs += 1\n",
        "            pass\n",
        ("tests/core/test_policy.py",),
    ),
    Mutation(
        "G1",
        'a graph replay is no reader of its inputs: an update does not wait for it',
        '_core/_capture.py',
        '                alloc.before_read(ctx.stream, ctx.run)\n'
        '        ctx.backend.launch_graph(rec.raw, ctx.stream.raw)\n',
        '                alloc.before_read(ctx.stream, ctx.run)\n'
        '                alloc.readers.pop(ctx.stream, None)\n'
        '        ctx.backend.launch_graph(rec.raw, ctx.stream.raw)\n',
        ('tests/core/test_graph.py',),
    ),
    Mutation(
        "M18",
        "leaving a scope waits for its last run only (as if runs ended in order everywhere)",
        "_scopes/_scope.py",
        "            while self._runs:\n                run = self._runs.pop()\n",
        "            for run in self._runs[-1:]:\n",
        ("tests/scopes/test_scopes.py",),
    ),
    Mutation(
        "I1",
        "an export does not make another library's stream wait for gpuflow's uses",
        '_memory/_export.py',
        '        else:\n'
        '            wait_for_uses(alloc, consumer)\n',
        '        else:\n'
        '            pass\n',
        ('tests/interop/test_interop_arrays.py', 'tests/interop/test_interop_work.py',),
    ),
    Mutation(
        "I2",
        "an export to one of gpuflow's streams is no use on that stream",
        "_memory/_export.py",
        "            alloc.before_write(consumer)\n",
        "            pass\n",
        ("tests/interop/test_interop_arrays.py", "tests/interop/test_interop_work.py",),
    ),
    Mutation(
        "I3",
        "a consumer that lets go of an export leaves no event to wait for",
        "_memory/_export.py",
        "    alloc.after_foreign(key, event)\n",
        "    pass\n",
        ("tests/interop/test_interop_arrays.py", "tests/interop/test_interop_work.py",),
    ),
    Mutation(
        "I4",
        "an import's owner is released at once, not after gpuflow's uses",
        '_interop/_libraries.py',
        '        release = Run(stream.device)\n'
        '        release.hold((owner,))\n'
        '        rt.completer.submit(stream.raw, release, polled=False)  # (no task awaits it)\n',
        '        pass\n',
        ("tests/interop/test_interop_arrays.py", "tests/interop/test_interop_work.py",),
    ),
    Mutation(
        "I5",
        "a __cuda_array_interface__ import ignores the producer's stream",
        "_interop/_libraries.py",
        "        _arrive_after(rt, s, producer, device)\n"
        "    return DeviceArray(ImportedAllocation(rt.backend, buffer, s, x, bool(readonly)), "
        "shape, dtype)\n",
        "        pass\n"
        "    return DeviceArray(ImportedAllocation(rt.backend, buffer, s, x, bool(readonly)), "
        "shape, dtype)\n",
        ("tests/interop/test_interop_arrays.py", "tests/interop/test_interop_work.py",),
    ),
    Mutation(
        "I6",
        "wait_stream waits for nothing",
        "_interop/_libraries.py",
        "        if own:\n"
        "            ctx.wait_for(s)\n"
        "        elif s is not here:\n",
        "        if False:\n"
        "            ctx.wait_for(s)\n"
        "        elif False:\n",
        ("tests/interop/test_interop_arrays.py", "tests/interop/test_interop_work.py",),
    ),
    Mutation(
        "I7",
        "foreign() leaves the other library on its own stream",
        "_interop/_libraries.py",
        "                for adapter in adapters:\n"
        "                    cm = adapter(stream)\n"
        "                    if cm is not None:\n"
        "                        on_stream.enter_context(cm)\n",
        "                pass\n",
        ("tests/interop/test_interop_arrays.py", "tests/interop/test_interop_work.py",),
    ),
    Mutation(
        "I8",
        "foreign() does not order the arrays it is given",
        "_interop/_libraries.py",
        "            for a in arrays:  # the code may write any array it gets\n"
        "                a.allocation.before_write(stream, ctx.run)\n",
        "            pass\n",
        ("tests/interop/test_interop_arrays.py", "tests/interop/test_interop_work.py",),
    ),
    Mutation(
        "I9",
        "__cuda_array_interface__ names a stream that does not follow the reads",
        "_memory/_export.py",
        "        alloc.before_write(alloc.writer)\n",
        "        pass\n",
        ("tests/interop/test_interop_arrays.py", "tests/interop/test_interop_work.py",),
    ),
    Mutation(
        "I10",
        "a read after another library's use does not wait for it",
        '_core/_hazards.py',
        '                for ev in self.foreign.values():\n'
        '                    be.wait_event(stream.raw, ev)\n'
        '                order_after(be, stream, self.writer, self.wrote)\n',
        '                order_after(be, stream, self.writer, self.wrote)\n',
        ('tests/interop/test_interop_arrays.py', 'tests/interop/test_interop_work.py',),
    ),
    Mutation(
        "I11",
        "a free does not wait for another library's use",
        '_core/_hazards.py',
        '        for ev in uses.foreign.values():\n'
        '            backend.wait_event(stream.raw, ev)\n'
        '        order_after(backend, stream, uses.writer, uses.wrote)\n',
        '        order_after(backend, stream, uses.writer, uses.wrote)\n',
        ('tests/interop/test_interop_arrays.py', 'tests/interop/test_interop_work.py',),
    ),
    Mutation(
        "I12",
        "an import's release waits on the interop stream, which later imports wait for",
        "_interop/_libraries.py",
        "            stream = next(iter(uses.readers), None) or rt.pool(stream.device)[0]\n",
        "            pass\n",
        ("tests/interop/test_interop_arrays.py", "tests/interop/test_interop_work.py",),
    ),
    Mutation(
        "I13",
        "a capsule's tensor names device 0, whatever device the array is on",
        "_memory/_dlpack.py",
        "    t.device = DLDevice(KDL_CUDA, device)\n",
        "    t.device = DLDevice(KDL_CUDA, 0)\n",
        ("tests/interop/test_interop_arrays.py", "tests/interop/test_interop_work.py",),
    ),
    Mutation(
        "I14",
        "a read-only DLPack capsule is imported writable",
        "_interop/_libraries.py",
        "(rt.backend, buffer, s, owner, t.readonly)",
        "(rt.backend, buffer, s, owner, False)",
        ("tests/interop/test_interop_arrays.py", "tests/interop/test_interop_work.py",),
    ),

    Mutation(
        "B7",
        'a wake-up is armed on the stream even behind work queued after the run',
        '_core/_completion.py',
        '            if first != lane.issued or lane.unmarked or not self._pipe(lane, first):\n',
        '            if not self._pipe(lane, first):\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B8",
        "a hazard waits on a zip arm's join event recorded before the run was submitted",
        '_core/_run.py',
        '        if lane is None:\n'
        '            # still being enqueued',
        '        if False:\n'
        '            # still being enqueued',
        ('tests/core/test_cancellation.py', 'tests/core/test_hazards.py'),
    ),
    Mutation(
        "B9",
        "a use on another stream waits for whatever the writer's stream ran later",
        '_core/_hazards.py',
        '    if point is None or not point.order(backend, stream.raw, on.raw):\n',
        '    if True:\n',
        ('tests/core/test_hazards.py',),
    ),
    Mutation(
        "I15",
        "an import's first use waits for the interop stream's later imports too",
        '_interop/_libraries.py',
        '        if stream.runtime.is_interop(stream):\n',
        '        if False:\n',
        ('tests/interop/test_interop_arrays.py', 'tests/interop/test_interop_work.py',),
    ),
    Mutation(
        "I16",
        "the import of a capsule handed over as it is waits not for the legacy default stream",
        '_interop/_libraries.py',
        '        _arrive_after(rt, s, producer, device)  # (before the import marks its '
        'arrival there)\n',
        '        pass\n',
        ('tests/interop/test_interop_arrays.py::test_a_capsule_handed_over_as_it_is_waits_for_its_producers_work',),
    ),
    Mutation(
        "S1",
        "an item wakes every stream's worker, not its own",
        '_backends/_sim/_backend.py',
        '        if len(stream.queue) == 1:\n'
        '            stream.cv.notify_all()  # the worker sleeps only on an empty queue\n',
        '        self._wake_all()\n',
        ('tests/backends/test_sim.py',),
    ),
    Mutation(
        "P1",
        'a stream lease takes the first free stream, however busy',
        '_scopes/_scope.py',
        '        best = min(range(len(self.free)), key=lambda i: self.free[i].load())\n',
        '        best = 0\n',
        ('tests/testing/test_stalls.py',),
    ),
    Mutation(
        "K1",
        'a module is loaded at its first launch, not ahead',
        '_kernels/_kernel.py',
        '        if not rt.backend.setup_waits_for_idle or not rt.live:\n',
        '        if True:\n',
        ('tests/kernels/test_kernels.py',),
    ),
    Mutation(
        "K2",
        "a launch operation keeps the kernel it loaded past a reset of its device",
        '_kernels/_kernel.py',
        '        if c is None or c[0] is not life:\n',
        '        if c is None:\n',
        ('tests/core/test_faults.py',),
    ),
    Mutation(
        "K3",
        "a launch with scalar arguments only keeps its kernel past a reset of its device",
        '_kernels/_kernel.py',
        '            if c is None or c[0] is not stream.life:\n',
        '            if c is None:\n',
        ('tests/core/test_faults.py',),
    ),
    Mutation(
        "B10",
        "an await spins while other awaits of its loop are in progress",
        '_core/_run.py',
        '    alone = not loop.awaiting  # (the one place that decides: a lone await)\n',
        '    alone = True\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B11",
        "the busy-poll budget runs out in turns the loop spent on other work",
        '_core/_completion.py',
        '        if ran_other or self.ran_other:\n',
        '        if False:\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B28",
        "a loop under a tracer counts its every turn as other work, and polls until the run "
        "is done",
        '_core/_completion.py',
        '        ran_other = gap > BUSY_TURN_S and not _turns_slowed()\n',
        '        ran_other = gap > BUSY_TURN_S\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B14",
        "the completer thread takes the runs of a busy loop that still reads their words",
        '_core/_completion.py',
        '        return max(self.deadline, now + LOOP_STALL_S)\n',
        '        return self.deadline\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B15",
        "a loop going to sleep keeps its streams' runs from the completer thread a while longer",
        '_core/_completion.py',
        '            lane.polled_until = 0.0  # (no more reads: the thread may take its runs)\n',
        '            pass\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B12",
        "a lone await reads its own word past the busy-poll budget (a long await spins to its end)",
        '_core/_run.py',
        '        if now >= busy.deadline or loop.awaiting > 1 or d.others_polled(loop):\n',
        '        if loop.awaiting > 1 or d.others_polled(loop):\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B13",
        "a lone await goes on reading its own word once another await of its loop starts",
        '_core/_run.py',
        '        if now >= busy.deadline or loop.awaiting > 1 or d.others_polled(loop):\n',
        '        if now >= busy.deadline:\n',
        ('tests/core/test_completion.py', 'tests/core/test_completion_lifetimes.py',),
    ),
    Mutation(
        "B16",
        "a run wakes only the first task parked on it",
        '_core/_run.py',
        '            loop, park = more.pop() if more else (None, None)\n',
        '            loop = None\n',
        ('tests/core/test_completion_lifetimes.py::test_every_task_waiting_for_one_run_is_woken_once_it_is_done',),
    ),
    Mutation(
        "B17",
        "a task parks on a run that finished as it parked (nobody wakes it)",
        '_core/_run.py',
        '        parked = not run.done\n',
        '        parked = True\n',
        ('tests/core/test_completion_lifetimes.py::test_a_task_does_not_park_on_a_run_finished_as_it_parks',),
    ),
    Mutation(
        "B18",
        "a completion wakes a task of another loop directly, from the wrong thread",
        '_core/_run.py',
        '            if target is here:\n',
        '            if True:\n',
        ('tests/core/test_completion_lifetimes.py::test_every_task_waiting_for_one_run_is_woken_once_it_is_done',),
    ),
    Mutation(
        "B19",
        "a run whose mark failed takes its stream's last mark's number, not its next (seen done "
        "before its work)",
        '_core/_completion.py',
        '                number = self.issued + 1  # covered by the next mark\n',
        '                number = self.issued\n',
        ('tests/core/test_completion_lifetimes.py::test_runs_no_loop_awaits_have_their_owed_mark_enqueued_by_the_'
         'completer_thread',),
    ),
    Mutation(
        "B20",
        "the completer thread never enqueues the marks that runs whose mark failed owe",
        '_core/_completion.py',
        '        owed = [x for x in active if x.unmarked and self._mine(x, now) '
        'is not None]\n',
        '        owed: list[_Lane] = []\n',
        ('tests/core/test_completion_lifetimes.py::test_runs_no_loop_awaits_have_their_owed_mark_enqueued_by_the_'
         'completer_thread',),
    ),
    Mutation(
        "B26",
        "the completer thread decides from one read of a word and completes from another",
        '_core/_completion.py',
        '                return reached  # (an earlier run of the lane may be reached)\n',
        '                return lane.read()\n',
        ('tests/core/test_completion.py::test_a_mark_reached_while_the_thread_looks_is_left_to_the_'
         'pipe_that_wakes_the_loop',),
    ),
    Mutation(
        "B21",
        "a stream destroyed with a mark owed never gets it (its runs never complete)",
        '_core/_completion.py',
        '        if lane is not None and lane.unmarked:\n'
        '            self.mark_owed(lane)\n'
        '        with self._lock:\n',
        '        with self._lock:\n',
        ('tests/core/test_completion_lifetimes.py::test_a_stream_dropped_with_a_mark_owed_enqueues_it_first',),
    ),
    Mutation(
        "B22",
        "a synchronize returns with its stream's runs still owing their mark",
        '_core/_stream.py',
        '        if lane is not None and lane.unmarked:  # (its runs are done on return)\n',
        '        if False:\n',
        ('tests/core/test_completion_lifetimes.py::test_a_synchronize_enqueues_the_mark_its_streams_runs_owe',),
    ),
    Mutation(
        "B23",
        "a loop going to sleep arms a pipe for a run whose stream owes a mark for work queued "
        "behind it (the wake-up waits for that work)",
        '_core/_completion.py',
        '            if first != lane.issued or lane.unmarked or not self._pipe(lane, first):\n',
        '            if first != lane.issued or not self._pipe(lane, first):\n',
        ('tests/core/test_completion.py::test_a_fast_await_is_not_held_by_slow_work_queued_behind_it',),
    ),
    Mutation(
        "B24",
        "a lone await of a run that owes its mark never enqueues it (it waits for the budget to "
        "end)",
        '_core/_run.py',
        "    if lane.unmarked:  # (a run's mark failed: the next one covers it)\n",
        '    if False:\n',
        ('tests/core/test_completion_lifetimes.py::test_an_await_of_a_run_that_owes_its_mark_enqueues_it',),
    ),
    Mutation(
        "B25",
        "a loop's poller never enqueues the mark runs it waits for owe (they wait for the budget "
        "to end, or for ever while the loop stays busy)",
        '_core/_completion.py',
        '                if lane.unmarked:  # (a mark that failed, among its runs\': no one else '
        'would)\n',
        '                if False:\n',
        ('tests/core/test_completion_lifetimes.py::test_an_await_of_a_run_that_owes_its_mark_enqueues_it',),
    ),
    Mutation(
        "C3",
        "a run asks only the innermost cancel scope whether it may start (asyncio)",
        '_core/_loops.py',
        '                scope = scope._parent_scope\n',
        '                break\n',
        ('tests/core/test_cancellation.py::test_a_cancelled_outer_scope_stops_a_run_and_a_shield_inside_it_does_not',),
    ),
    Mutation(
        "C4",
        "a run never asks AnyIO's checkpoint whether it may start (asyncio)",
        '_core/_loops.py',
        '                if scope._cancel_called:\n                    return True\n',
        '                if False:\n                    return True\n',
        ('tests/core/test_cancellation.py::test_an_already_cancelled_task_enqueues_nothing',),
    ),
    Mutation(
        "C10",
        "a parked Trio await drops the outcome it is woken with (its cancellation is lost)",
        '_core/_loops.py',
        '        (yield trap(self._abort)).unwrap()\n',
        '        (yield trap(self._abort))\n',
        ('tests/core/test_completion.py::test_a_parked_await_wakes_with_its_run_and_raises_its_cancellation',),
    ),
    Mutation(
        "C11",
        "a collective is not ordered after the rank's previous collective on another stream",
        '_comm/_communicator.py',
        '                order_after(be, s, tail[0], tail[1])\n',
        '                pass\n',
        ('tests/comm/test_comm.py::test_a_collective_run_from_its_plan_runs_after_the_ranks_previous_one',),
    ),
    Mutation(
        "C12",
        "a collective reads before a write on another stream ends",
        '_comm/_communicator.py',
        '            for arr, s in p.reads:\n'
        '                arr.allocation.before_read(s, run)\n',
        '',
        ('tests/comm/test_comm.py::test_a_collective_run_from_its_plan_orders_its_uses_as_a_first_run',),
    ),
    Mutation(
        "C13",
        "a collective writes before a write on another stream ends",
        '_comm/_communicator.py',
        '            for arr, s in p.writes:\n'
        '                arr.allocation.before_write(s, run)\n',
        '',
        ('tests/comm/test_comm.py::test_a_collective_run_from_its_plan_orders_its_uses_as_a_first_run',),
    ),
    Mutation(
        "C14",
        "the default policy takes a collective's previous stream though it is busy",
        '_core/_policy.py',
        '            if not prefer.leased and prefer.idle() and prefer in streams:\n',
        '            if not prefer.leased and prefer in streams:\n',
        ('tests/comm/test_comm.py::test_the_default_policy_puts_a_collective_after_the_previous_one_when_idle',),
    ),
    Mutation(
        "C15",
        "the default policy takes a collective's previous stream though a lease holds it",
        '_core/_policy.py',
        '            if not prefer.leased and prefer.idle() and prefer in streams:\n',
        '            if prefer.idle() and prefer in streams:\n',
        ('tests/comm/test_comm.py::test_the_default_policy_puts_a_collective_after_the_previous_one_when_idle',),
    ),
    Mutation(
        "C16",
        "the default policy looks past a collective's previous stream",
        '_core/_policy.py',
        '        if prefer is not None:\n'
        '            # step 1',
        '        if False:\n'
        '            # step 1',
        ('tests/comm/test_comm.py::test_the_default_policy_puts_a_collective_after_the_previous_one_when_idle',),
    ),
    Mutation(
        "C17",
        "the default policy takes a collective's previous stream from a runtime replaced since",
        '_core/_policy.py',
        '            if not prefer.leased and prefer.idle() and prefer in streams:\n',
        '            if not prefer.leased and prefer.idle() and '
        'prefer in prefer.runtime.streams(device):\n',
        ('tests/comm/test_comm.py::test_a_collective_of_a_replaced_runtime_names_its_array',),
    ),
    Mutation(
        "W1",
        "a lone await of another library's stream waits for it on a stream of gpuflow's",
        '_interop/_libraries.py',
        '    awaited_alone = True\n',
        '    awaited_alone = False\n',
        ('tests/interop/test_interop_work.py::test_a_lone_wait_stream_holds_up_no_stream_of_gpuflow',),
    ),
    Mutation(
        "W2",
        "a refused mark on another library's stream leaves its run in flight",
        '_core/_run.py',
        '        if not run.done:  # refused (a fault fails it instead)\n',
        '        if False:\n',
        ('tests/interop/test_interop_work.py::test_a_refused_wait_stream_leaves_no_run_in_flight',),
    ),
    Mutation(
        "W3",
        "a lone await of another library's stream keeps nothing of it while its run is in flight",
        '_core/_run.py',
        '        run.hold((op,))  # (what it names is used until the mark is reached)\n',
        '        pass\n',
        ('tests/interop/test_interop_work.py::test_a_cancelled_lone_wait_keeps_the_stream_object_until_the_work_is_done',),
    ),
    Mutation(
        "W3b",
        "a lone await of another library's stream in a scope keeps nothing of it while its "
        "run is in flight",
        '_core/_run.py',
        '        run.hold((op,))  # (as on the straight line: used until the mark is reached)\n',
        '        pass\n',
        ('tests/interop/test_interop_work.py::test_a_cancelled_lone_wait_keeps_the_stream_object_until_the_work_is_done',),
    ),
    Mutation(
        "Q1",
        "asking what finalizers left returns at once while another thread's drain is doing it",
        '_core/_finalizers.py',
        '    if not queue and not _drain_lock.locked():\n',
        '    if not queue:\n',
        ('tests/testing/test_quiescence.py::test_the_check_waits_for_a_finalizers_work_another_thread_is_doing',),
    ),
    Mutation(
        "Q2",
        "the quiescence checks look again to report: a run handed over after their wait counts",
        '_testing/_quiescence.py',
        '    if pending is None:\n        pending = pending_runs()\n',
        '    pending = pending_runs()\n',
        ('tests/testing/test_quiescence.py::test_the_check_reports_the_runs_its_last_look_saw',),
    ),
    Mutation(
        "D1",
        "the completer thread, woken from its sleep by new work, keeps its old idle grace",
        '_core/_completion.py',
        '                    idle_since = None\n'
        '                active = list(self._active)\n',
        '                    pass\n'
        '                active = list(self._active)\n',
        ('tests/core/test_completion.py::test_awaits_of_short_runs_do_not_wake_the_completer_thread_each',),
    ),
    Mutation(
        "C5",
        "a collective run again keeps the arrays of its first run, though its lists changed",
        '_comm/_communicator.py',
        '    return len(v) == len(kept) and all(map(operator.is_, v, kept))\n',
        '    return True\n',
        ('tests/comm/test_comm.py::test_a_collective_run_again_takes_its_arrays_as_they_are_then',),
    ),
    Mutation(
        "C8",
        "a collective run from its plan makes the calls an earlier plan's run made",
        '_comm/_communicator.py',
        '        if memo is not None and memo[0] is plan:\n',
        '        if memo is not None:\n',
        ('tests/comm/test_comm.py::test_a_collective_run_again_enqueues_on_that_runs_stream',),
    ),
    Mutation(
        "C9",
        "a collective run from its plan enqueues on the stream of its earlier run",
        '_comm/_communicator.py',
        'known = memo[1].get(ctx.stream)',
        'known = next(iter(memo[1].values()), None)',
        ('tests/comm/test_comm.py::test_a_collective_run_again_enqueues_on_that_runs_stream',),
    ),
    Mutation(
        "C6",
        "a collective run from its plan takes arrays of a device reset since",
        '_comm/_communicator.py',
        '            if x is not None:\n'
        '                x.check_usable(ctx, what)\n'
        '                if read:\n'
        '                    reads.append((x, stream))\n'
        '            if o is not None:\n'
        '                if o is not x:\n'
        '                    o.check_usable(ctx, what)\n',
        '            if x is not None:\n'
        '                if read:\n'
        '                    reads.append((x, stream))\n'
        '            if o is not None:\n'
        '                if o is not x:\n'
        '                    pass\n',
        ('tests/comm/test_comm.py::test_a_collective_run_again_refuses_arrays_of_a_reset_device',),
    ),
    Mutation(
        "B27",
        "a run submitted while its stream has runs pending shares the stream's next mark",
        '_core/_completion.py',
        '            try:\n'
        '                self.issued = number = self.mark(polled)\n'
        '                self.unmarked = False  # (that mark covers one owed)\n',
        '            try:\n'
        '                if self.runs and not foreign:\n'
        '                    number = self.issued + 1\n'
        '                    self.unmarked = True\n'
        '                else:\n'
        '                    self.issued = number = self.mark(polled)\n'
        '                    self.unmarked = False\n',
        ('tests/core/test_completion_lifetimes.py::test_a_use_on_another_stream_waits_for_its_run_not_for_later_work',),
    ),
    Mutation(
        "E1",
        "a use on another stream waits for a silent mark on the stream's word, which the GPU "
        "never writes with its number",
        '_backends/_cuda/_words.py',
        '        if other.mark_events:\n'
        '            rc = self._events.wait(dev, stream, other, number, exact=True)\n',
        '        if False:\n'
        '            rc = self._events.wait(dev, stream, other, number, exact=True)\n',
        ('tests/backends/test_cuda_stand_in.py',),
    ),
    Mutation(
        "E2",
        "a stream whose last mark was silent is destroyed with its word below that mark: the "
        "word is never reached, or serves another stream too early",
        '_backends/_cuda/_words.py',
        '        if stream.worded >= stream.issued:\n',
        '        if True:\n',
        ('tests/backends/test_cuda_stand_in.py',),
    ),
    Mutation(
        "E3",
        "a silent mark's event is recycled before its number is recorded as reached (a wait in "
        "between waits on the word for it)",
        '_backends/_cuda/_words.py',
        '                stream.reached = number  # (before its event goes: see ``wait``)\n'
        '                while q and q[0][0] <= number:\n'
        '                    dev.events.append(q.popleft()[1])\n',
        '                while q and q[0][0] <= number:\n'
        '                    dev.events.append(q.popleft()[1])\n',
        ('tests/backends/test_cuda_stand_in.py',),
    ),
    Mutation(
        "E4",
        "a run no task awaits takes a mark the loops read (a word written between kernels)",
        '_core/_run.py',
        'rt.completer.submit(stream.raw, run, polled=False)',
        'rt.completer.submit(stream.raw, run)',
        ('tests/core/test_completion_lifetimes.py::test_silent_marks_and_marks_a_loop_reads_share_a_stream',),
    ),
    Mutation(
        "M19",
        "a write on the stream of the last write does not wait for the reads since",
        '_core/_hazards.py',
        'self.writer is stream and not self.readers and',
        'self.writer is stream and',
        ('tests/core/test_hazards.py',),
    ),
    Mutation(
        "F1",
        "a dropped stream is destroyed with no event after its work, which a free may still need",
        '_core/_runtime.py',
        '        final.append(rt.backend.record_event(raw))\n',
        '        pass\n',
        ('tests/core/test_lifetimes.py::test_an_array_last_written_by_a_stream_collected_with_it_is_freed',),
    ),
    Mutation(
        "F2",
        "a free goes on its writer's stream even once that stream was destroyed",
        '_core/_hazards.py',
        '    if backend.stream_destroyed(stream.raw):\n',
        '    if False:\n',
        ('tests/core/test_lifetimes.py::test_a_stream_collected_with_what_it_used_frees_and_releases_them',),
    ),
    Mutation(
        "F3",
        "two threads drain the finalizers' queue at once",
        '_core/_finalizers.py',
        '    if not _drain_lock.acquire(timeout=DRAIN_WAIT_S):\n'
        '        return\n'
        '    _draining.on = True\n'
        '    try:\n'
        '        _drain()\n'
        '    finally:\n'
        '        _draining.on = False\n'
        '        _drain_lock.release()\n',
        '    _draining.on = True\n'
        '    try:\n'
        '        _drain()\n'
        '    finally:\n'
        '        _draining.on = False\n',
        ('tests/core/test_lifetimes.py',),
    ),
    Mutation(
        "F4",
        "a finalizer frees at once, on the thread that dropped the array",
        '_core/_hazards.py',
        '        finalize_later(_free, self.buffer, self.uses())\n',
        '        _free(self.buffer, self.uses())\n',
        ('tests/core/test_lifetimes.py',),
    ),
    Mutation(
        "Y1",
        "a lone await never owes its loop a turn once a millisecond has passed",
        '_core/_run.py',
        '            yield_now = not _slept(loop, since)\n',
        '            yield_now = False\n',
        ('tests/core/test_completion.py::test_a_lone_await_owes_its_loop_a_turn_after_a_millisecond_of_running',),
    ),
    Mutation(
        "Y2",
        "a loop thread the system kept from running counts as one that slept, its loop turning",
        '_core/_run.py',
        '    slept = waits > loop.slept_waits and cpu - loop.slept_cpu < since / 2\n',
        '    slept = cpu - loop.slept_cpu < since / 2\n',
        ('tests/core/test_completion.py::test_a_lone_await_owes_its_loop_a_turn_after_a_millisecond_of_running',),
    ),
    # -- what the suite let through before (each with the test that pins it down)
    Mutation(
        "N1",
        "a stream retired with runs in flight keeps its lane for ever",
        "_core/_completion.py",
        "                        if lane.retired:\n"
        "                            self._lanes.pop(lane.raw, None)\n"
        "                        waiters",
        "                        waiters",
        ("tests/core/test_completion_lifetimes.py::test_a_stream_dropped_with_runs_in_flight_leaves_nothing_behind",),
    ),
    Mutation(
        "N2",
        "a scope that prunes its records of runs forgets the pending ones",
        "_scopes/_scope.py",
        "            runs[:] = [s for s in runs if not s.done]\n",
        "            runs.clear()\n",
        ("tests/scopes/test_scopes.py::test_a_scope_that_tracked_many_runs_still_waits_for_each_pending_one",),
    ),
    Mutation(
        "N3",
        "the first of two cancel_at_every_point to end removes the other's watcher",
        "_testing/_cancel_at_every_point.py",
        "            if not _installed:\n"
        "                cancel_points.watcher = None\n",
        "            cancel_points.watcher = None\n",
        ("tests/testing/test_cancel_points.py::test_two_checks_at_once_each_count_and_cancel_their_own_points_to_the_end",),
    ),
    Mutation(
        "N4",
        "the blocking quiescence wait takes \"cannot tell yet\" for at rest",
        "_testing/_quiescence.py",
        "    while (pending := look()) != 0 and time.monotonic() < deadline:\n"
        "        time.sleep(_POLL_S)\n",
        "    while (pending := look()) and time.monotonic() < deadline:\n"
        "        time.sleep(_POLL_S)\n",
        ("tests/testing/test_quiescence.py::test_the_blocking_check_waits_for_work_on_gpuflows_streams_outside_any_run",),
    ),
    Mutation(
        "N5",
        "assert_no_stall removes the profile hook that was there before it",
        "_testing/_stalls.py",
        "        sys.setprofile(previous)\n",
        "        sys.setprofile(None)\n",
        ("tests/testing/test_stalls.py::test_the_profile_hook_installed_before_is_restored_after",),
    ),
    Mutation(
        "N6",
        "a graph update is applied again at every later launch",
        "_core/_operation.py",
        "            updates, g._updates = g._updates, []\n",
        "            updates = list(g._updates)\n",
        ("tests/core/test_graph.py::test_an_update_is_applied_once_not_again_at_later_launches",),
    ),
    Mutation(
        "N7",
        "a write waits for reads on other streams only, not on the array's last writer's",
        "_core/_hazards.py",
        "    for s, point in uses.readers.items():\n"
        "        order_after(backend, stream, s, point)\n",
        "    for s, point in uses.readers.items():\n"
        "        if s is not uses.writer:\n"
        "            order_after(backend, stream, s, point)\n",
        ("tests/core/test_hazards.py::test_a_write_waits_for_a_read_on_the_arrays_own_last_writer_stream",),
    ),
    Mutation(
        "N8",
        "a Trio await cancelled in flight is rescheduled when its run completes",
        "_core/_loops.py",
        "        self.parked = False  # cancelled: a later wake-up must not reschedule\n",
        "        pass\n",
        ("tests/core/test_cancellation.py::test_an_await_cancelled_in_flight_is_not_woken_when_its_run_completes",),
    ),
    Mutation(
        "N9",
        "an export that copies (DLPack copy=True) is not a read of the array",
        "_memory/_export.py",
        "            alloc.before_read(s)\n"
        "            be.copy_device(copy.buffer",
        "            be.copy_device(copy.buffer",
        ("tests/interop/test_interop_arrays.py::test_an_export_that_copies_is_a_read_a_later_write_waits_for",),
    ),
    # -- the defects fixed with them
    Mutation(
        "N10",
        "an await that finds every stream busy at the bound queues behind the least loaded",
        "_core/_run.py",
        "        if not can_wait:\n",
        "        if True:\n",
        ("tests/core/test_policy.py::test_a_burst_beyond_the_pool_never_queues_a_run_behind_long_work",),
    ),
    Mutation(
        "N11",
        "cancel_at_every_point passes a pipeline that swallows the cancellation",
        "_testing/_cancel_at_every_point.py",
        "    if attempt.landed and not scope.cancelled_caught:\n",
        "    if False:\n",
        ("tests/testing/test_cancel_points.py::test_a_pipeline_that_swallows_the_cancellation_fails_naming_the_point",),
    ),
    Mutation(
        "N12",
        "stream.synchronize() blocks a running event loop",
        "_core/_stream.py",
        "        refuse_blocking(\n"
        "            \"stream.synchronize()\", \"in async code, `await gf.wait_stream(stream)`\"\n"
        "        )\n",
        "",
        ("tests/core/test_running.py::test_every_blocking_call_is_refused_in_the_loop_naming_its_own_alternative",),
    ),
    Mutation(
        "N13",
        "a stream lease left by Ctrl-C holds the interrupt until its GPU work ends",
        "_scopes/_scope.py",
        "            if not interrupted(exc):\n"
        "                await self._tracked.drain()\n",
        "            await self._tracked.drain()\n",
        ("tests/core/test_interrupts.py",),
    ),
    Mutation(
        "N14",
        "a second Ctrl-C during the exit's wait prints a traceback",
        "_core/_runtime.py",
        "    except KeyboardInterrupt:\n"
        "        pass\n",
        "    except ZeroDivisionError:\n"
        "        pass\n",
        ("tests/core/test_interrupts.py",),
    ),
    Mutation(
        "N15",
        "a waiter for an idle stream takes its turn while the one woken before it has not looked",
        "_core/_handoff.py",
        "        return not self._handed and bool(self._queue) and self._queue[0] is ticket\n",
        "        return bool(self._queue) and self._queue[0] is ticket\n",
        ("tests/core/test_policy.py::test_an_await_woken_for_a_stream_keeps_its_turn_until_it_"
         "has_looked",),
    ),
    # -- the common await's straight line (_run.await_run)
    Mutation(
        "R1",
        "the common await's straight line is taken while a scope (or a trace, a watcher) is on",
        "_core/_run.py",
        "    if UNUSUAL.n or policy is not None or not op.ordinary or _finalizers.queue:\n",
        "    if policy is not None or not op.ordinary or _finalizers.queue:\n",
        ("tests/scopes/test_scopes.py", "tests/testing/test_cancel_points.py"),
    ),
    Mutation(
        "R2",
        "the common await's straight line is taken though a policy was given",
        "_core/_run.py",
        "    if UNUSUAL.n or policy is not None or not op.ordinary or _finalizers.queue:\n",
        "    if UNUSUAL.n or not op.ordinary or _finalizers.queue:\n",
        ("tests/core/test_policy.py", "tests/core/test_running.py"),
    ),
    Mutation(
        "R3",
        "the common await's straight line is taken by a collective (not ordinary: it "
        "asks for its rank's previous stream first)",
        "_core/_run.py",
        "    if UNUSUAL.n or policy is not None or not op.ordinary or _finalizers.queue:\n",
        "    if UNUSUAL.n or policy is not None or _finalizers.queue:\n",
        ("tests/comm/test_comm.py",),
    ),
    Mutation(
        "R4",
        "a run is completed before the GPU reached its mark",
        "_core/_completion.py",
        "                while runs and runs[0].number <= reached:\n",
        "                while runs:\n",
        ("tests/core/test_completion.py::test_a_run_queued_behind_another_on_its_stream_"
         "completes_at_its_own_mark", "tests/core/test_lifetimes.py", "tests/core/test_hazards.py"),
    ),
    Mutation(
        "R5",
        "a stream whose runs seen completed stop one short of its last mark counts as idle",
        "_core/_stream.py",
        "                and (lane.completed >= lane.issued or lane.read() >= lane.issued)\n",
        "                and (lane.completed + 1 >= lane.issued or lane.read() >= lane.issued)\n",
        ("tests/core/test_policy.py",),
    ),
]


def _loop_of(nodeid: str) -> str | None:
    """The event loop a test id ran under (``test_x[sim-trio-settrace]``:
    trio), or None for a test that runs under none."""
    params = nodeid.partition("[")[2].rstrip("]").split("-")
    return next((p for p in params if p in ("asyncio", "uvloop", "trio")), None)


def _pytest(src: Path, tests: tuple[str, ...], timeout: float) -> tuple[bool, str]:
    """Run ``tests`` on sim against ``src``; (passed, what failed under which loop)."""
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1")
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "sim", *tests,
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s (a hang counts as caught)"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    failed = sorted({ln.split(" ")[1] for ln in lines if ln.startswith(("FAILED ", "ERROR "))})
    if not failed:
        return proc.returncode == 0, lines[-1] if lines else proc.stderr.strip()[-200:]
    # which event loops saw it: every async test runs under each
    ran_under = [_loop_of(f) for f in failed]
    loops = {loop: ran_under.count(loop) for loop in ("asyncio", "uvloop", "trio")}
    plain = ran_under.count(None)
    seen = ", ".join(f"{loop} {n}" for loop, n in loops.items() if n)
    names = sorted({f.split("::")[-1].split("[")[0] for f in failed})
    return False, (
        f"{len(failed)} failed ({seen or 'no loop'}" + (f", no loop {plain}" if plain and seen
        else "") + "): " + ", ".join(names[:3]) + (f" +{len(names) - 3} more" if len(names) > 3
        else "")
    )


def _copy_src(dest: Path) -> Path:
    src = dest / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # the copy, not the installed checkout, must be what the tests import
    probe = subprocess.run(
        [sys.executable, "-c", "import gpuflow; print(gpuflow.__file__)"],
        env=dict(os.environ, PYTHONPATH=str(src)), capture_output=True, text=True, check=True,
    )  # fmt: skip
    if not probe.stdout.strip().startswith(str(src)):
        raise SystemExit(f"the tests would import {probe.stdout.strip()}, not the copy in {src}")
    return src


def _apply(src: Path, m: Mutation) -> None:
    path = src / "gpuflow" / m.path
    text = path.read_text()
    n = text.count(m.old)
    if n != 1:
        raise LookupError(f"{m.name}: the code to mutate occurs {n} times in {m.path}, not once")
    path.write_text(text.replace(m.old, m.new))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name:5} {m.path:18} {m.what}")
        return 0 if chosen else 2
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="gpuflow-mutate-") as tmp:
        controls = sorted({t for m in chosen for t in m.tests})
        src = _copy_src(Path(tmp) / "control")
        ok, summary = _pytest(src, tuple(controls), args.timeout)
        print(f"control (no mutation): {summary}", flush=True)
        if not ok:
            print("the tests fail without a mutation: fix that first", file=sys.stderr)
            return 2
        for m in chosen:
            src = _copy_src(Path(tmp) / m.name)
            try:
                _apply(src, m)
            except LookupError as exc:
                rows.append((m.name, m.what, "NOT APPLIED", str(exc)))
                print(f"{m.name}: {exc}", flush=True)
                continue
            t0 = time.monotonic()
            passed, summary = _pytest(src, m.tests, args.timeout)
            verdict = "SURVIVED" if passed else "caught"
            rows.append((m.name, m.what, verdict, f"{summary} ({time.monotonic() - t0:.0f} s)"))
            print(f"{m.name}: {verdict}: {summary}", flush=True)
    print()
    print("| mutation | bug planted | result | tests (sim) |")
    print("|---|---|---|---|")
    for name, what, verdict, summary in rows:
        print(f"| {name} | {what} | {verdict} | {summary} |")
    return 0 if all(r[2] == "caught" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
