"""Planted bugs where features meet: a latency class and a pool, a reset
and another library's stream, awaits at the pool's bound and a run that
cannot wait, a graph launch refused, and what the newcomer's defects
were (the run, the runtime and the handoff, in ``src/gpuflow/_core/``).

Each is a :class:`Mutation` (``mutation.py``); ``mutate.py`` plants and runs them.
"""

from __future__ import annotations

from mutation import Mutation

MUTATIONS = [
    Mutation(
        "V3",
        "a run right after the last one its stream reached is missing from gf.in_flight()",
        "_core/_facts.py",
        "            if run._number <= reached or not isinstance(run, Run) or run.done:\n",
        "            if run._number <= reached + 1 or not isinstance(run, Run) or run.done:\n",
        ("tests/core/test_in_flight.py",),
    ),
    Mutation(
        "V4",
        "a latency class's streams are made at its first use again (on CUDA, under load, a wait)",
        "_core/_runtime.py",
        "            if backend.setup_waits_for_idle:\n"
        "                # every latency class's pool, now:",
        "            if False:\n"
        "                # every latency class's pool, now:",
        ("tests/backends/test_cuda_stand_in.py::"
         "test_the_cuda_backend_runs_a_program_against_a_stand_in_driver",),
    ),
    Mutation(
        "V7",
        "a new runtime replaces one with runs in flight",
        "_core/_runtime.py",
        "    _refuse_with_runs_in_flight()\n",
        "",
        ("tests/core/test_devices.py::test_a_new_runtime_is_refused_while_runs_are_in_flight",),
    ),
    Mutation(
        "T1",
        "a class of reserved SMs at the default priority takes the default pool",
        "_core/_run.py",
        "        if cls is not None and (cls.priority or cls.sms is not None):\n",
        "        if cls is not None and cls.priority:\n",
        ("tests/together/test_features_together.py::test_a_class_of_reserved_sms_keeps_a_pool_of_its_own_however_it_grows",),
    ),
    Mutation(
        "T1b",
        "a class's pool of reserved SMs at the default priority grows into the default pool",
        "_core/_runtime.py",
        "            if priority or sms is not None:\n"
        "                streams = self._levels.get((device, priority, sms))\n",
        "            if priority:\n"
        "                streams = self._levels.get((device, priority, sms))\n",
        ("tests/together/test_features_together.py::test_a_class_of_reserved_sms_keeps_a_pool_of_its_own_however_it_grows",),
    ),
    Mutation(
        "T2",
        "a runtime replaced leaves its latency classes' streams alive",
        "_core/_runtime.py",
        "            made += [s.raw for streams in self._levels.values() for s in streams]\n",
        "",
        ("tests/together/test_features_together.py::test_a_runtime_replaced_on_its_backend_leaves_no_stream_of_any_level",),
    ),
    Mutation(
        "T4",
        "a runtime replaced while its backend goes on leaves its green contexts",
        "_core/_runtime.py",
        "        else:  # (the backend goes on: its partitions no stream uses go now)\n"
        "            self.release_partitions()\n",
        "",
        ("tests/backends/test_cuda_stand_in.py::"
         "test_the_cuda_backend_runs_a_program_against_a_stand_in_driver",),
    ),
    Mutation(
        "T7",
        "a run that cannot wait prefers a leased stream to a stalled one",
        "_core/_policy.py",
        "key=lambda s: (s.leased, s.stalled(stalled_before), s.load())",
        "key=lambda s: (s.stalled(stalled_before), s.leased, s.load())",
        ("tests/together/test_features_together.py::test_a_run_that_cannot_wait_takes_an_unleased_stream_even_when_all_are_stalled",),
    ),
    Mutation(
        "T14",
        "a stream retired with nothing pending keeps its completion lane",
        "_core/_completion.py",
        "                if not lane.runs:\n"
        "                    del self._lanes[raw]\n",
        "                pass\n",
        ("tests/together/test_features_together.py::test_a_stream_dropped_with_nothing_pending_goes_with_its_lane_at_once",),
    ),
    Mutation(
        "T8",
        "an await woken for a stream a blocking run took goes to the back of the queue",
        "_core/_handoff.py",
        "        ticket.handed = False\n"
        "        ticket.event = anyio.Event()\n"
        "        return False\n",
        "        ticket.handed = False\n"
        "        ticket.event = anyio.Event()\n"
        "        self._queue.remove(ticket)\n"
        "        self._queue.append(ticket)\n"
        "        return False\n",
        ("tests/together/test_features_together.py::test_awaits_at_the_bound_keep_their_order_past_a_blocking_run_and_a_newcomer",),
    ),
    Mutation(
        "T8c",
        "awaits woken together take their streams in the order their loop resumes them",
        "_core/_handoff.py",
        "        if self._queue and self._queue[0] is ticket:\n",
        "        if ticket.handed or (self._queue and self._queue[0] is ticket):\n",
        ("tests/together/test_features_together.py::test_awaits_woken_together_take_their_streams_in_the_order_they_came",),
    ),
    Mutation(
        "T8d",
        "a new await does not count the awaits woken and on their way",
        "_core/_completion.py",
        "        return 0 if waiters is None else len(waiters)\n",
        "        return 0 if waiters is None else waiters.waiting()\n",
        ("tests/together/test_features_together.py::test_a_new_await_waits_behind_the_one_woken_for_an_idle_stream",),
    ),
    Mutation(
        "T8b",
        "a new await takes an idle stream before the awaits already waiting",
        "_core/_run.py",
        "        if ensure_runtime().completer.stream_waiters(device):\n"
        "            return None, policy  # (behind the awaits that came first)\n",
        "",
        ("tests/together/test_features_together.py::test_awaits_at_the_bound_keep_their_order_past_a_blocking_run_and_a_newcomer",),
    ),
    Mutation(
        "T9",
        "under Trio, a lease two nurseries below Ctrl-C holds the interrupt until its GPU is done",
        "_core/_loops.py",
        "            nursery = nursery.parent_task.parent_nursery\n",
        "            nursery = None\n",
        ("tests/core/test_interrupts.py::test_ctrl_c_reaches_the_program_at_once_and_a_second_ends_the_exit_wait",),
    ),
    Mutation(
        "T11",
        "a write on the stream that wrote an array last skips the wait for another library's use",
        "_core/_hazards.py",
        "            if self.writer is stream and not self.readers"
        " and self.foreign is _NO_FOREIGN:\n",
        "            if self.writer is stream and not self.readers:\n",
        ("tests/together/test_features_together.py::test_a_write_on_the_last_writers_stream_waits_for_another_librarys_use_since",),
    ),
    Mutation(
        "T13",
        "a graph launch refused takes the pending updates with it",
        "_core/_operation.py",
        "        _capture.check_launch(g.recording, ctx)\n"
        "        with g._lock:\n"
        "            updates, g._updates = g._updates, []\n",
        "        with g._lock:\n"
        "            updates, g._updates = g._updates, []\n"
        "        _capture.check_launch(g.recording, ctx)\n",
        ("tests/together/test_features_together.py::test_a_refused_graph_launch_keeps_the_updates_for_the_next_launch",),
    ),
    Mutation(
        "U1",
        "a reset keeps the stream other libraries' arrays arrive on, never destroyed",
        "_core/_runtime.py",
        "            for made in [k for k in self._interop if k[0] == device]:\n"
        "                old.append(self._interop.pop(made))  # (made anew at its next use)\n",
        "",
        ("tests/together/test_features_together.py::test_a_reset_retires_the_stream_other_libraries_arrays_arrive_on",),
    ),
    Mutation(
        "T8e",
        "awaits behind the first waiting for an idle stream look again every stall_s",
        "_core/_run.py",
        "                await wait_event(ticket.event)\n                continue\n",
        "                await wait_event(ticket.event, policy.stall_s)\n"
        "                continue\n",
        ("tests/core/test_policy.py::test_only_the_first_await_in_line_looks_again_for_an_idle_"
         "stream",),
    ),
]
