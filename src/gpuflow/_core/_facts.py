"""What a program can learn of its devices and of the runtime without
changing either: a device's facts (:func:`device_info`), the runs in flight
and what each waits for (:func:`in_flight`), and the readers
:mod:`gpuflow.lowlevel` offers (the backend, a device's pool streams, a
graph's handle, how runs were seen complete).  Any thread."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple

from .._backends import Backend, LaunchLimits
from ._completion import Lane
from ._finalizers import run_finalized
from ._loops import task_name
from ._run import Run
from ._runtime import Runtime, current_device, current_runtime, ensure_runtime
from ._statistics import CompletionStatistics
from ._stream import Stream, live_streams, made_streams

if TYPE_CHECKING:
    from ._operation import Graph


class DeviceInfo(NamedTuple):
    """The facts of one device that :func:`device_info` gives."""

    #: the device's ordinal
    device: int
    #: its name (``"NVIDIA H100 80GB HBM3"``; on ``sim``, ``"gpuflow sim device 0"``)
    name: str
    #: ``"9.0"`` style, or None where the device has none (``sim``)
    compute_capability: str | None
    #: its SMs, or None where the backend cannot say
    sms: int | None
    #: its memory in bytes
    total_memory: int
    #: the most urgent stream priority level (levels run from 0, the
    #: default, to this one; 0 where the device has no priorities)
    max_priority: int
    #: the SMs reserved at :func:`gpuflow.init_device_contexts`, by name
    #: (as many as the driver gave: it rounds up)
    reserved_sms: dict[str, int]
    #: the SMs gpuflow's other streams run on (None where none are reserved:
    #: every SM)
    other_sms: int | None
    #: what one launch may ask of it (grid and block dimensions, threads and
    #: shared memory a block)
    launch_limits: LaunchLimits
    #: the backend serving it (``"cuda"``, ``"sim"``)
    backend: str


def device_info(device: int | None = None) -> DeviceInfo:
    """The facts of ``device`` (default: the current device): its name,
    compute capability, SMs, memory, stream priority range, the SMs
    reserved on it by name, its launch limits, and the backend.

    Any thread; asks the backend, never the device's queue (cheap, but not
    for every run).

    Parameters
    ----------
    device
        The device's ordinal (None: the current device).

    Returns
    -------
    DeviceInfo

    Raises
    ------
    gpuflow.UsageError
        ``device`` is not one of the runtime's devices.
    """
    rt = ensure_runtime()
    dev = rt.check_device(current_device() if device is None else device)
    be = rt.backend
    desc = be.describe_device(dev)
    parts = rt.partitions.get(dev, {})
    rest = rt.rest_partition(dev)
    return DeviceInfo(
        device=dev,
        name=desc.name,
        compute_capability=desc.compute_capability,
        sms=be.sm_count(dev),
        total_memory=desc.total_memory,
        max_priority=be.stream_priorities(dev),
        reserved_sms={name: be.partition_size(p) for name, p in parts.items()},
        other_sms=None if rest is None else be.partition_size(rest),
        launch_limits=be.launch_limits(dev),
        backend=be.name,
    )


class RunInFlight(NamedTuple):
    """One run :func:`in_flight` found on the GPU: what it runs, where, who
    waits for it, since when, and what its stream waits for first."""

    #: the operation (its repr), or what gpuflow runs for itself
    operation: str
    #: its device's ordinal
    device: int
    #: its stream (its repr)
    stream: str
    #: its stream's priority level (0: the default)
    priority: int
    #: the name of the reserved SMs its stream runs on, or None
    sms: str | None
    #: the name of the task that awaits it, or None: no task awaits it (a
    #: run started and not awaited yet, ``enqueue_on``), or none has had to
    #: wait for it yet
    task: str | None
    #: seconds since the run started
    pending_s: float
    #: what the run waits for before its own work can end: the run ahead of
    #: it on its stream, another stream's work it was ordered after, its
    #: collective's peers, or its own work on the device
    waits_for: str

    def __str__(self) -> str:
        level = f", priority {self.priority}" if self.priority else ""
        level += f", SMs {self.sms!r}" if self.sms is not None else ""
        who = "no task awaits it" if self.task is None else f"awaited by task {self.task!r}"
        return (
            f"{self.operation} on device {self.device}, {self.stream}{level}: {who}, "
            f"pending {self.pending_s:.3f} s, waits for {self.waits_for}"
        )


def _named(run: Run) -> str:
    what = run._what
    if what is None:
        return "a run of gpuflow's own"
    op = what()
    return "an operation no longer referenced" if op is None else repr(op)


def _stream_named(rt: Runtime, lane: Lane) -> str:
    stream = rt.stream_of(lane.raw)
    return repr(lane.raw) if stream is None else repr(stream)


def _waits_for(rt: Runtime, run: Run, ahead: Run | None, now: float) -> str:
    """What ``run``'s stream waits for first, as far as gpuflow knows."""
    found = []
    if ahead is not None:
        found.append(
            f"the run ahead of it on its stream ({_named(ahead)}, pending "
            f"{now - ahead._since:.3f} s)"
        )
    for lane, point in run._waits or ():
        if lane is None:
            continue
        if isinstance(point, Run):
            if not point.reached():
                found.append(f"{_named(point)} on another stream ({_stream_named(rt, lane)})")
        elif not lane.idle():
            found.append(
                f"work on another stream ({_stream_named(rt, lane)}) it was ordered after"
            )
    for comm in run._comms or ():
        found.append(f"its collective's peers ({comm!r})")
    if not found:
        return "its own work on the device (running, or queued behind other streams' work)"
    return "; ".join(found)


def in_flight() -> list[RunInFlight]:
    """The runs on the GPU now, oldest first on each stream: for each its
    operation, device, stream and its priority, the task that awaits it,
    how long it has been pending and what its stream waits for (the run
    ahead of it, another stream's work it was ordered after, a collective's
    peers).  What an await that seems stuck is waiting for:
    ``for run in gf.in_flight(): print(run)``.

    A snapshot, read without stopping anything (the completion words; no
    driver call): a run may end while it is taken.  Runs whose work the
    GPU has reached but no loop has seen yet are left out, and so are
    blocking runs (``sync()``, which no loop awaits) and awaits still
    waiting for an idle stream.  Any thread, also from a signal handler's
    task (see docs/concepts.md, "Debugging a stuck await").

    Returns
    -------
    list[RunInFlight]
        Empty where nothing is in flight (or no runtime was made yet).
    """
    rt = current_runtime()
    if rt is None:
        return []
    now = time.monotonic()
    found = []
    for lane, runs in rt.completer.pending_by_lane():
        reached = lane.reached()
        stream = rt.stream_of(lane.raw)
        named = repr(lane.raw) if stream is None else repr(stream)
        ahead: Run | None = None
        for run in runs:
            if run._number <= reached or not isinstance(run, Run) or run.done:
                continue
            task: Any = run._task
            found.append(RunInFlight(
                operation=_named(run),
                device=run.device,
                stream=named,
                priority=0 if stream is None else stream.priority,
                sms=None if stream is None else stream.sms,
                task=None if task is None else task_name(task),
                pending_s=now - run._since,
                waits_for=_waits_for(rt, run, ahead, now),
            ))  # fmt: skip
            ahead = run
    return found


def resource_leaks() -> list[str]:
    """What the current runtime's backend holds that nothing of gpuflow's
    accounts for, each kind named with its count: backend streams no
    :class:`Stream` holds (a replaced runtime's, a retired one's), streams
    a replaced runtime kept and did not destroy, streams the runtime keeps
    of a device context reset since, completion lanes of streams gone with
    no run pending, partitions of reserved SMs
    (green contexts) no runtime or stream uses, pinned staging buffers
    still busy, and events the backend made that are neither pooled nor held
    (on ``cuda``).  Empty at rest.  Any thread (for the quiescence check)."""
    rt = current_runtime()
    if rt is None:
        return []
    be = rt.backend
    held = live_streams()
    mine = [s for s in held if s._runtime.backend is be]
    raws = {id(s.raw) for s in mine} | {id(raw) for raw in rt.spares()}
    live = be.live_objects()
    found = []
    streams = [raw for raw in made_streams(be) if id(raw) not in raws]
    if streams:
        found.append(f"{len(streams)} backend stream(s) no stream of gpuflow's holds: "
                     + ", ".join(map(repr, streams[:3])))
    replaced = {id(s._runtime): s._runtime for s in mine if not s._runtime.live}
    alive = [s for old in replaced.values() for s in old.kept() if not be.stream_destroyed(s.raw)]
    if alive:  # (the Streams a program still holds keep them in sight)
        found.append(f"{len(alive)} stream(s) of a runtime replaced, not destroyed with it: "
                     + ", ".join(map(repr, alive[:3])))
    stale = rt.kept_stale()
    if stale:
        found.append(f"{len(stale)} stream(s) of a device reset since, kept by the runtime: "
                     + ", ".join(map(repr, stale[:3])))
    lanes = [lane for lane in rt.completer.lanes() if not lane.runs and id(lane.raw) not in raws]
    if lanes:
        found.append(f"{len(lanes)} completion lane(s) of streams gone: "
                     + ", ".join(repr(lane.raw) for lane in lanes[:3]))
    used = {id(p) for d in rt.devices for p in rt.partitions_of(d)}
    for s in mine:
        if not be.stream_destroyed(s.raw) and not s._runtime.is_foreign(s):
            used.add(id(s._runtime.partition_of(s)))
    parts = [p for p in live.get("partitions", []) if id(p) not in used]
    if parts:
        found.append(f"{len(parts)} partition(s) of reserved SMs no runtime or stream uses: "
                     + ", ".join(map(repr, parts[:3])))
    staging = live.get("staging", [])
    if staging:
        found.append(f"{len(staging)} pinned staging buffer(s) still busy")
    events = live.get("events", [])
    if events:
        found.append(f"{len(events)} event(s) neither pooled nor held by anything")
    return found


class MemoryStats(NamedTuple):
    """Device memory of one device, as :func:`memory_stats` reports it."""

    device: int
    #: bytes of the arrays gpuflow allocated that are still alive (as
    #: ``torch.cuda.memory_allocated`` or CuPy's ``MemoryPool.used_bytes``)
    in_use_bytes: int
    #: bytes the backend holds for the device: on ``cuda`` the memory pool's
    #: reserved memory (freed memory stays in the pool for reuse, as
    #: ``torch.cuda.memory_reserved``); on ``sim`` what is not yet freed in
    #: stream order; None where a backend cannot tell
    reserved_bytes: int | None
    #: how many of gpuflow's allocations are alive
    live_allocations: int


def memory_stats(device: int | None = None) -> MemoryStats:
    """How much memory of ``device`` (default: the current device) gpuflow uses.

    ``in_use_bytes`` and ``live_allocations`` count the arrays gpuflow
    allocated and a program (or GPU work still running) still holds; an
    array stops counting as soon as its last reference goes, although its
    memory is freed only after the work enqueued before that (in stream
    order), which ``reserved_bytes`` shows.  Another library's memory taken
    with :func:`gpuflow.from_dlpack` is not counted.  On ``cuda`` the
    reserved bytes are the device's default memory pool's, which other
    libraries allocating from that pool share.  The counts are of the
    current runtime (:func:`init_device_contexts` starts new ones).  Any
    thread; cheap enough to poll.

    Parameters
    ----------
    device
        The device's ordinal (None: the current device).

    Returns
    -------
    MemoryStats

    Raises
    ------
    gpuflow.UsageError
        ``device`` is not one of the runtime's devices.
    """
    rt = ensure_runtime()
    dev = rt.check_device(current_device() if device is None else device)
    run_finalized()  # (so that reserved_bytes sees the frees of arrays dropped so far)
    nbytes, count = rt.memory.totals(dev)
    return MemoryStats(dev, nbytes, rt.backend.memory_reserved(dev), count)


def current_backend_object() -> Backend:
    """The backend instance serving this process (raw handles, for interop and benchmarks).

    Any thread.

    Returns
    -------
    Backend
        The current runtime's (made with the defaults where there is none yet).
    """
    return ensure_runtime().backend


def pool_streams(device: int | None = None) -> list[Stream]:
    """The pool streams of ``device`` (default: the current one) now: the
    ``streams_per_device`` made at initialisation, then those the default
    policy (:class:`gpuflow.StreamPoolLeastLoaded`) added under load.

    Any thread.

    Parameters
    ----------
    device
        The device's ordinal (None: the current device).

    Returns
    -------
    list[Stream]

    Raises
    ------
    gpuflow.UsageError
        ``device`` is not one of the runtime's devices.
    """
    rt = ensure_runtime()
    return list(rt.streams(rt.check_device(current_device() if device is None else device)))


def graph_exec_handle(graph: Graph[object]) -> int:
    """The ``CUgraphExec`` address of a graph captured on the ``cuda`` backend.

    Any thread.

    Parameters
    ----------
    graph
        A graph made by :meth:`gpuflow.DeviceOperation.capture`.

    Returns
    -------
    int

    Raises
    ------
    gpuflow.UsageError
        The graph is not the ``cuda`` backend's.
    """
    return ensure_runtime().backend.graph_handle(graph.recording.raw)


def current_completion_statistics() -> CompletionStatistics:
    """How the runs of this runtime were seen complete so far: by the
    awaiting task's inline read, by a loop's poller, or by the completer
    thread, and how many sleeping wake-ups were armed.  Take it before and
    after a piece of work to see what its busy-poll budget bought
    (``busy_poll_us``, :func:`gpuflow.init_device_contexts`).  Any thread.

    Returns
    -------
    CompletionStatistics
        The counts so far (a snapshot).
    """
    return ensure_runtime().completer.statistics()
