"""Planted bugs in the layers above the core: scopes, memory and export,
communicators, the testing toolkit and the backends.

Each is a :class:`Mutation` (``mutation.py``); ``mutate.py`` plants and runs them.
"""

from __future__ import annotations

from mutation import Mutation

MUTATIONS = [
    Mutation(
        "M6",
        "sim no longer poisons freed memory",
        "_backends/_sim/_backend.py",
        "            b.data.fill(_POISON)\n",
        "            pass\n",
        ("tests/memory/test_arrays.py", "tests/core/test_running.py", "tests/core/test_faults.py"),
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
        "C7",
        "a communicator is never handed to the watchdog (nobody asks it for its errors)",
        '_comm/_communicator.py',
        '        self._rt.completer.watch_communicator(self)\n',
        '        pass\n',
        ('tests/comm/test_comm.py',),
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
        "        uses = [(a._allocation, stream, True) for a in arrays]\n",
        "        uses = []\n",
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
        "I15",
        "an import's first use waits for the interop stream's later imports too",
        '_interop/_libraries.py',
        '        if stream._runtime.is_interop(stream):\n',
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
        '        if not be.loads_wait_for_kernels or not rt.live:\n',
        '        if True:\n',
        ('tests/kernels/test_kernels.py', 'tests/core/test_latency_classes.py'),
    ),
    Mutation(
        "K2",
        "a launch operation keeps the kernel it loaded past a reset of its device",
        '_kernels/_kernel.py',
        '        if c is None or c[0] != generation:\n',
        '        if c is None:\n',
        ('tests/core/test_faults.py',),
    ),
    Mutation(
        "K3",
        "a launch with scalar arguments only keeps its kernel past a reset of its device",
        '_kernels/_kernel.py',
        '        if c is None or c[0] != generation:\n',
        '        if c is None:\n',
        ('tests/core/test_faults.py',),
    ),
    Mutation(
        "C11",
        "a collective is not ordered after the rank's previous collective on another stream",
        '_comm/_communicator.py',
        '                order_after(be, s, tail[0], tail[1])\n',
        '                pass\n',
        ('tests/comm/test_comm.py::test_a_collective_run_again_runs_after_the_ranks_previous_one',),
    ),
    Mutation(
        "C12",
        "a collective reads before a write on another stream ends",
        '_comm/_communicator.py',
        '    uses = [(arr._allocation, s, False) for p in prepared for arr, s in p.reads]\n',
        '    uses = []\n',
        ('tests/comm/test_comm.py::test_a_collective_run_again_orders_its_uses_as_a_first_run',),
    ),
    Mutation(
        "C13",
        "a collective writes before a write on another stream ends",
        '_comm/_communicator.py',
        '    uses += [(arr._allocation, s, True) for p in prepared for arr, s in p.writes]\n',
        '',
        ('tests/comm/test_comm.py::test_a_collective_run_again_orders_its_uses_as_a_first_run',),
    ),
    Mutation(
        "W1",
        "a lone await of another library's stream waits for it on a stream of gpuflow's",
        '_interop/_libraries.py',
        '        self._plan = Plan(foreign=(handle, device))\n',
        '        self._plan = Plan()\n',
        ('tests/interop/test_interop_work.py::test_a_lone_wait_stream_holds_up_no_stream_of_gpuflow',),
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
        "C5",
        "a collective run again keeps the arrays of its first run, though its lists changed",
        '_comm/_communicator.py',
        '    return len(v) == len(kept) and all(map(operator.is_, v, kept))\n',
        '    return True\n',
        ('tests/comm/test_comm.py::test_a_collective_run_again_takes_its_arrays_as_they_are_then',),
    ),
    Mutation(
        "C8",
        "a collective run again makes the calls a run checked from other arrays made",
        '_comm/_communicator.py',
        '        if memo is not None and memo[0] is checked:\n',
        '        if memo is not None:\n',
        ('tests/comm/test_comm.py::test_a_collective_run_again_enqueues_on_that_runs_stream',),
    ),
    Mutation(
        "C9",
        "a collective run again enqueues on the stream of its earlier run",
        '_comm/_communicator.py',
        'known = memo[1].get(ctx.stream)',
        'known = next(iter(memo[1].values()), None)',
        ('tests/comm/test_comm.py::test_a_collective_run_again_enqueues_on_that_runs_stream',),
    ),
    Mutation(
        "C6",
        "a collective run again takes arrays of a device reset since",
        '_comm/_communicator.py',
        '            if x is not None:\n'
        '                x._check_usable(ctx, what)\n'
        '                if read:\n'
        '                    reads.append((x, stream))\n'
        '            if o is not None:\n'
        '                if o is not x:\n'
        '                    o._check_usable(ctx, what)\n',
        '            if x is not None:\n'
        '                if read:\n'
        '                    reads.append((x, stream))\n'
        '            if o is not None:\n'
        '                if o is not x:\n'
        '                    pass\n',
        ('tests/comm/test_comm.py::test_a_collective_run_again_refuses_arrays_of_a_reset_device',),
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
        "N9",
        "an export that copies (DLPack copy=True) is not a read of the array",
        "_memory/_export.py",
        "            alloc.before_read(s)\n"
        "            be.copy_device(copy.buffer",
        "            be.copy_device(copy.buffer",
        ("tests/interop/test_interop_arrays.py::test_an_export_that_copies_is_a_read_a_later_write_waits_for",),
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
        "N13",
        "a stream lease left by Ctrl-C holds the interrupt until its GPU work ends",
        "_scopes/_scope.py",
        "            if not interrupted(exc):\n"
        "                await self._tracked.drain()\n",
        "            await self._tracked.drain()\n",
        ("tests/core/test_interrupts.py",),
    ),
    Mutation(
        "L1",
        "a run started from a task outside its scope is not the scope's: its exit does not wait",
        "_scopes/_scope.py",
        "        self.track(run)\n",
        "        pass\n",
        ("tests/scopes/test_started_runs.py::"
         "test_a_run_started_from_a_task_outside_the_scope_is_still_the_scopes",),
    ),
    Mutation(
        "L2",
        "a started run that failed and was never awaited is forgotten at its scope's exit",
        "_scopes/_scope.py",
        "        if not errors:\n",
        "        if True:\n",
        ("tests/scopes/test_started_runs.py",),
    ),
    Mutation(
        "L3",
        "a started run's failure is raised at the exit too though a task's await raised it",
        "_scopes/_scope.py",
        "            self._awaited = self._awaited or exc is self._run.error\n",
        "            pass\n",
        ("tests/scopes/test_started_runs.py::"
         "test_a_failed_run_awaited_is_raised_by_the_await_not_again_at_the_exit",),
    ),
    Mutation(
        "L6",
        "a started run whose await was cancelled counts as awaited: its later failure is lost",
        "_scopes/_scope.py",
        "            self._awaited = self._awaited or exc is self._run.error\n",
        "            self._awaited = True\n",
        ("tests/scopes/test_started_runs.py::"
         "test_a_failure_after_a_cancelled_await_is_raised_at_the_scope_exit",),
    ),
    Mutation(
        "L5",
        "gpuflow's priority level is passed to CUDA as it is: higher is then less urgent",
        "_backends/_cuda/_backend.py",
        "                STREAM_NON_BLOCKING, least - priority,\n",
        "                STREAM_NON_BLOCKING, least + priority,\n",
        ("tests/backends/test_cuda_stand_in.py",),
    ),
    Mutation(
        "L13",
        "sim's free SMs go to the earliest launch whatever its stream's priority",
        "_backends/_sim/_sms.py",
        "        return (-self.priority, self.seq)\n",
        "        return (0, self.seq)\n",
        ("tests/core/test_latency_classes.py::test_an_urgent_kernel_behind_a_saturating_one_starts_within_one_block",),
    ),
    Mutation(
        "L14",
        "a stream made in reserved SMs runs its blocks on any SM of sim's device",
        "_backends/_sim/_sms.py",
        "        allowed = None if partition is None else partition.sms\n",
        "        allowed = None\n",
        ("tests/core/test_latency_classes.py::test_reserved_sms_serve_their_class_alone",),
    ),
    Mutation(
        "L15",
        "a block on sim holds no SM for its time (every grid runs at once)",
        "_backends/_sim/_sms.py",
        "                busy[sm] = (launch, start + launch.block_s)\n",
        "                busy[sm] = (launch, start)\n",
        ("tests/core/test_latency_classes.py::test_the_sim_runs_a_grid_in_waves_of_its_sms",),
    ),
    Mutation(
        "L16",
        "a cuda launch on a green context's stream uses the primary context's function",
        "_backends/_cuda/_backend.py",
        "        if s.green is not None:  # (its own copy of the kernel, in its green ctx)\n",
        "        if False:\n",
        ("tests/backends/test_cuda_stand_in.py::test_the_cuda_backend_runs_a_program_against_a_stand_in_driver",),
    ),
    Mutation(
        "L17",
        "reserving more SMs than a cuda device has goes to the driver unchecked",
        "_backends/_cuda/_green.py",
        "    if sum(rounded) + least > total:\n",
        "    if False:\n",
        ("tests/backends/test_cuda_stand_in.py::test_the_cuda_backend_runs_a_program_against_a_stand_in_driver",),
    ),
    Mutation(
        "L18",
        "a kernel waiting for sim's SMs goes on waiting after its device's context is reset",
        "_backends/_sim/_sms.py",
        "                    if abandoned():\n",
        "                    if False:\n",
        ("tests/core/test_latency_classes.py::test_a_kernel_waiting_for_sms_ends_with_its_devices_context",),
    ),
    Mutation(
        "V1",
        "a launch one past a device's limit is built (off by one)",
        "_kernels/_kernel.py",
        "                if n > top:\n",
        "                if n > top + 1:\n",
        ("tests/kernels/test_kernels.py::"
         "test_a_launch_past_the_devices_limits_is_refused_when_built",),
    ),
    Mutation(
        "V2",
        "a stream lease made inside a latency class does not take it",
        "_scopes/_scope.py",
        "    cls = class_here(priority, sms, busy_poll_us)\n"
        "    return StreamLease(",
        "    cls = class_here(priority if priority is not ENCLOSING else 0, None, busy_poll_us)\n"
        "    return StreamLease(",
        ("tests/core/test_latency_classes.py",),
    ),
    Mutation(
        "V5",
        "a module is loaded into the reserved SMs' context at a first launch, not ahead",
        "_kernels/_kernel.py",
        "                be.load_ahead(device, self, rt.partitions_of(device))\n",
        "                be.load_ahead(device, self, [])\n",
        ("tests/core/test_latency_classes.py",),
    ),
    Mutation(
        "V6",
        "sim loads a module at once, whatever runs on the device",
        "_backends/_sim/_loads.py",
        "            while not before.isdisjoint(running) and not abandoned():\n",
        "            while False:\n",
        ("tests/kernels/test_kernels.py::"
         "test_a_compile_in_the_loop_stalls_it_behind_running_kernels_and_compile_async_does_not",),
    ),
    Mutation(
        "V8",
        "a stream lease entered again is taken",
        "_scopes/_scope.py",
        "        if self._where is not None or self._ended:\n",
        "        if False:\n",
        ("tests/scopes/test_scopes.py::test_a_lease_is_entered_once",),
    ),
    Mutation(
        "V9",
        "a GPU's aim is judged on sim",
        "_tools/_bench_rows.py",
        'judged=not gpu_aim or _backend == "cuda"',
        "judged=True",
        ("tests/tools/test_bench.py",),
    ),
    Mutation(
        "T3",
        "sim's SMs left to other work begin where the asked, not the rounded, reservation ends",
        "_backends/_sim/_sms.py",
        "            start += n\n",
        "            start += asked or n\n",
        ("tests/together/test_features_together.py::test_a_reservation_rounded_up_leaves_the_rest_its_own_sms",),
    ),
    Mutation(
        "T5",
        "a scope's prune drops the started runs that failed, unawaited",
        "_scopes/_scope.py",
        "                s for s in started"
        " if not s._awaited and not (s.done() and s.failed() is None)\n",
        "                s for s in started if not s.done()\n",
        ("tests/together/test_features_together.py::test_a_group_that_started_many_runs_still_raises_the_failure_nobody_awaited",),
    ),
    Mutation(
        "T6",
        "a group left by a child's error raises its unawaited failure alone",
        "_scopes/_scope.py",
        "                self._tracked.raise_unawaited(raised)\n",
        "                self._tracked.raise_unawaited(None)\n",
        ("tests/together/test_features_together.py::test_a_group_left_by_a_childs_error_also_raises_the_failure_nobody_awaited",),
    ),
    Mutation(
        "T10",
        "cancel_at_every_point counts a lease its caller holds as the pipeline's",
        "_testing/_cancel_at_every_point.py",
        "    leases = Baseline.now().leases\n",
        "    leases: frozenset[object] = frozenset()\n",
        ("tests/together/test_features_together.py::test_cancel_at_every_point_inside_a_callers_own_lease_passes_a_correct_pipeline",),
    ),
    Mutation(
        "T12",
        "an export to a stream of gpuflow's is no write there: later uses skip the consumer's",
        "_memory/_export.py",
        "        if own and not arrival:\n"
        "            alloc.before_write(consumer)\n",
        "        if False:\n"
        "            alloc.before_write(consumer)\n",
        ("tests/together/test_features_together.py::test_an_export_to_a_gpuflow_stream_orders_later_uses_after_the_consumers_writes",),
    ),
    Mutation(
        "E10",
        "a stream destroyed after a capture loses the event recorded before it",
        "_backends/_cuda/_backend.py",
        "                if s.pre_capture:\n"
        "                    dev.events.append(s.pre_capture)\n"
        "                    s.pre_capture = 0\n",
        "",
        ("tests/backends/test_cuda_stand_in.py::test_the_cuda_backend_runs_a_program_against_a_stand_in_driver",),
    ),
    Mutation(
        "E11",
        "an event dropped never goes back to its device's pool",
        "_backends/_cuda/_handles.py",
        "            dev.events.append(self.handle)\n",
        "            pass\n",
        ("tests/backends/test_cuda_stand_in.py::test_the_cuda_backend_runs_a_program_against_a_stand_in_driver",),
    ),
]
