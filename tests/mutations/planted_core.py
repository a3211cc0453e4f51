"""Planted bugs in the core: runs, their completion, streams and their policy,
hazards, the loop adapters and the runtime (``src/gpuflow/_core/``).

Each is a :class:`Mutation` (``mutation.py``); ``mutate.py`` plants and runs them.
"""

from __future__ import annotations

from mutation import Mutation

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
        '        run._complete(None, None, {})\n'
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
        '            completer.complete([run])\n',
        '    except BaseException:\n'
        '        completer.complete([run])\n',
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
        "M7",
        'a read on another stream does not wait for the last write (read after write)',
        '_core/_hazards.py',
        '                order_after(be, stream, self.writer, self.wrote, run)\n'
        '                self.synced.add(stream)\n',
        '                self.synced.add(stream)\n',
        ('tests/core/test_hazards.py', 'tests/memory/test_arrays.py'),
    ),
    Mutation(
        "M8",
        'a write on another stream does not wait for earlier reads (write after read)',
        '_core/_hazards.py',
        '    for s, point in uses.readers.items():\n'
        '        order_after(backend, stream, s, point, waiter)\n',
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
        "M13",
        "a completed run keeps what it kept (a leak)",
        '_core/_run.py',
        '        self.error = error\n'
        '        self._keep = self._what = self._waits = self._task = None\n',
        '        self.error = error\n'
        '        self._what = self._waits = self._task = None\n',
        ("tests/core/test_lifetimes.py",),
    ),
    Mutation(
        "B1",
        'a reached mark completes every run of its stream, not only those up to it',
        '_core/_completion.py',
        '                while runs and runs[0]._number <= reached:\n',
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
        '            for comm in run._comms:\n'
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
        '    uses = [(alloc, stream, writes) for alloc, writes in rec.hazards]\n',
        '    uses = [(alloc, stream, writes) for alloc, writes in rec.hazards if writes]\n',
        ('tests/core/test_graph.py',),
    ),
    Mutation(
        "I10",
        "a read after another library's use does not wait for it",
        '_core/_hazards.py',
        '                for ev in self.foreign.values():\n'
        '                    be.wait_event(stream.raw, ev)\n'
        '                order_after(be, stream, self.writer, self.wrote, run)\n',
        '                order_after(be, stream, self.writer, self.wrote, run)\n',
        ('tests/interop/test_interop_arrays.py', 'tests/interop/test_interop_work.py',),
    ),
    Mutation(
        "I11",
        "a free does not wait for another library's use",
        '_core/_hazards.py',
        '        for ev in uses.foreign.values():\n'
        '            backend.wait_event(stream.raw, ev)\n'
        '        order_after(backend, stream, uses.writer, uses.wrote, waiter)\n',
        '        order_after(backend, stream, uses.writer, uses.wrote, waiter)\n',
        ('tests/interop/test_interop_arrays.py', 'tests/interop/test_interop_work.py',),
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
        '    if point is None or not point._order(backend, stream.raw, on.raw):\n',
        '    if True:\n',
        ('tests/core/test_hazards.py',),
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
        'prefer in prefer._runtime.streams(device):\n',
        ('tests/comm/test_comm.py::test_a_collective_of_a_replaced_runtime_names_its_array',),
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
        "an await whose cancellation points are watched is marked only after the in-flight one",
        '_core/_run.py',
        '            lane.submit(run)\n            mark_on = None\n',
        '            pass\n',
        ('tests/testing/test_cancel_points.py',),
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
        "E4",
        "a run no task awaits takes a mark the loops read (a word written between kernels)",
        '_core/_run.py',
        'rt.completer.submit(stream.raw, run, polled=False)  # (no task awaits it)',
        'rt.completer.submit(stream.raw, run)  # (no task awaits it)',
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
        "        order_after(backend, stream, s, point, waiter)\n",
        "    for s, point in uses.readers.items():\n"
        "        if s is not uses.writer:\n"
        "            order_after(backend, stream, s, point, waiter)\n",
        ("tests/core/test_hazards.py::test_a_write_waits_for_a_read_on_the_arrays_own_last_writer_stream",),
    ),
    Mutation(
        "N8",
        "a Trio await cancelled in flight is rescheduled when its run completes",
        "_core/_loops.py",
        "        self.state = _WOKEN  # cancelled: a later wake-up must not reschedule\n",
        "        pass\n",
        ("tests/core/test_cancellation.py::test_an_await_cancelled_in_flight_is_not_woken_when_its_run_completes",),
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
        "        if self._queue and self._queue[0] is ticket:\n",
        "        if self._queue and ticket in (\n"
        "            self._queue[0], next(t for t in self._queue if not t.handed)\n"
        "        ):\n",
        ("tests/core/test_policy.py::test_an_await_woken_for_a_stream_keeps_its_turn_until_it_"
         "has_looked",),
    ),
    # -- the await's shortest form (_run.await_run)
    Mutation(
        "R1",
        "the await takes its shortest form while a scope (or a trace, a watcher) is on",
        "_core/_run.py",
        "    unusual = UNUSUAL.n or policy is not None or not plan.ordinary\n",
        "    unusual = policy is not None or not plan.ordinary\n",
        ("tests/scopes/test_scopes.py", "tests/testing/test_cancel_points.py"),
    ),
    Mutation(
        "R2",
        "the await takes its shortest form though a policy was given",
        "_core/_run.py",
        "    unusual = UNUSUAL.n or policy is not None or not plan.ordinary\n",
        "    unusual = UNUSUAL.n or not plan.ordinary\n",
        ("tests/core/test_policy.py", "tests/core/test_running.py"),
    ),
    Mutation(
        "R3",
        "the await takes its shortest form for a collective (not ordinary: it "
        "asks for its rank's previous stream first)",
        "_core/_run.py",
        "    unusual = UNUSUAL.n or policy is not None or not plan.ordinary\n",
        "    unusual = UNUSUAL.n or policy is not None\n",
        ("tests/comm/test_comm.py",),
    ),
    Mutation(
        "R4",
        "a run is completed before the GPU reached its mark",
        "_core/_completion.py",
        "                while runs and runs[0]._number <= reached:\n",
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
    Mutation(
        "L4",
        "a stream priority out of the device's range is taken (clamped by the driver)",
        "_core/_runtime.py",
        "            if not 0 <= priority <= top:\n",
        "            if False:\n",
        ("tests/core/test_priorities.py",),
    ),
    Mutation(
        "L7",
        "a run started in a latency class takes a stream of the default level",
        "_core/_run.py",
        "        if cls is not None and (cls.priority or cls.sms is not None):\n",
        "        if False:\n",
        ("tests/core/test_priorities.py",),
    ),
    Mutation(
        "L8",
        "a level's pool grows into the default level's streams",
        "_core/_runtime.py",
        "            s = self.adopt(device, self.new_raw_stream(device, priority, sms), "
        "priority, sms)\n",
        "            s = self.adopt(device, self.new_raw_stream(device), 0)\n",
        ("tests/core/test_priorities.py",),
    ),
    Mutation(
        "L9",
        "the SMs left by the reserved ones are not where gpuflow's other streams are made",
        "_core/_runtime.py",
        "        part = self._rest.get(device) if sms is None else self.partitions[device][sms]\n",
        "        part = None if sms is None else self.partitions[device][sms]\n",
        ("tests/core/test_latency_classes.py::test_reserved_sms_serve_their_class_alone",),
    ),
    Mutation(
        "L10",
        "a latency class's busy poll is not the runs' it starts",
        "_core/_run.py",
        "    run._poll_s = current_poll_var.get()\n",
        "",
        ("tests/core/test_latency_classes.py::test_a_class_sets_its_own_busy_poll",),
    ),
    Mutation(
        "L11",
        "an inner latency class forgets what the outer one set",
        "_core/_latency.py",
        "    outer = current_class_var.get() or LatencyClass()\n",
        "    outer = LatencyClass()\n",
        ("tests/core/test_latency_classes.py::test_a_class_takes_its_own_level_and_nests",),
    ),
    Mutation(
        "L12",
        "a name of reserved SMs that no partition has is taken (and fails later, in a pool)",
        "_core/_runtime.py",
        "        if sms not in reserved:\n",
        "        if False:\n",
        ("tests/core/test_latency_classes.py",),
    ),
    Mutation(
        "L19",
        "a run's part on another device (a copy, a collective's rank) leaves its latency class",
        "_core/_policy.py",
        "    cls = current_class_var.get()\n    if cls is None:\n        return DEFAULT_POLICY",
        "    cls = current_class_var.get()\n    if True:\n        return DEFAULT_POLICY",
        ("tests/core/test_latency_classes.py::test_a_runs_part_on_another_device_keeps_its_class",),
    ),
    Mutation(
        "L20",
        "a Trio park woken before its task yields reschedules the task while it runs",
        "_core/_loops.py",
        "            if state is _WAITING:\n",
        "            if True:\n",
        ("tests/core/test_completion_lifetimes.py::test_a_park_woken_before_its_task_yields_leaves_the_loop_sound",),
    ),
    Mutation(
        "L21",
        "reserving a second partition of SMs splits the first split's output (the driver refuses)",
        "_backends/_cuda/_green.py",
        "            if i:\n",
        "            if False:\n",
        ("tests/backends/test_cuda_stand_in.py",),
    ),
    Mutation(
        "L22",
        "green contexts made before one the driver cannot make are left behind",
        "_backends/_cuda/_green.py",
        "        _destroy(cu, dev, greens)  # (nothing made is left behind)\n",
        "        pass\n",
        ("tests/backends/test_cuda_stand_in.py",),
    ),
    # -- the run path's plan, its one enqueue, its one ordering, its hooks
    Mutation(
        "X1",
        "a plan's prepared launch is called on a stream of a device context reset since",
        "_core/_run.py",
        "    if plan.generation == stream._generation and plan.step is not None:\n",
        "    if plan.step is not None:\n",
        ("tests/core/test_run_path.py", "tests/core/test_faults.py"),
    ),
    Mutation(
        "X2",
        "a launch of arrays prepared for one device context runs again after a reset",
        "_kernels/_kernel.py",
        "        if plan.generation == stream._generation and plan.step is not None:\n"
        "            if plan.uses is None:  # (scalars only)\n",
        "        if plan.step is not None:\n"
        "            if plan.uses is None:  # (scalars only)\n",
        ("tests/core/test_run_path.py",),
    ),
    Mutation(
        "X3",
        "the one ordering of a run's work skips its reads (a kind of use left unordered)",
        "_core/_hazards.py",
        "            else:\n"
        "                alloc.before_read(stream, run)\n"
        "        return enqueue(*args)\n",
        "        return enqueue(*args)\n",
        ("tests/core/test_hazards.py",),
    ),
    Mutation(
        "X4",
        "a capture leaves its hook on: every await after it takes the long path",
        "_core/_capture.py",
        "    capture_log.reset(token)\n"
        "    UNUSUAL.end()\n"
        "    raw = be.end_capture(cap_stream.raw)\n",
        "    capture_log.reset(token)\n    raw = be.end_capture(cap_stream.raw)\n",
        ("tests/core/test_run_path.py",),
    ),
    Mutation(
        "X5",
        "a collective's plan prefers no stream: its await takes the shortest form",
        "_comm/_communicator.py",
        "        self._plan = comm._collectives_plan\n",
        "        self._plan = Plan()\n",
        ("tests/comm/test_comm.py",),
    ),
    Mutation(
        "X6",
        "a plan's step is enqueued without ordering the memory it uses (a launch of final arrays)",
        "_core/_plan.py",
        "    enqueue_ordered(run, [(a, stream, w) for a, w in plan.uses], plan.step, stream.raw)\n",
        "    plan.step(stream.raw)\n",
        ("tests/core/test_hazards.py", "tests/core/test_run_path.py"),
    ),
    Mutation(
        "X7",
        "frees that finalizers left send the next await down the policy's path",
        "_core/_run.py",
        "    if _finalizers.queue:  # frees of arrays dropped since the last run\n"
        "        _finalizers.run_finalized()\n"
        "    plan = op._plan\n"
        "    unusual = UNUSUAL.n or policy is not None or not plan.ordinary\n",
        "    plan = op._plan\n"
        "    unusual = UNUSUAL.n or policy is not None or not plan.ordinary or _finalizers.queue\n",
        ("tests/core/test_run_path.py",),
    ),
]
