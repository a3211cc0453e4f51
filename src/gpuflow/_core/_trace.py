"""The timeline: every run recorded, written as Chrome trace-event JSON.

``with gf.trace("run.json"):`` records the runs started inside the block,
and ``GPUFLOW_TRACE=run.json`` records a whole program (written when the
interpreter exits).  The file opens in https://ui.perfetto.dev and
``chrome://tracing``.  While a trace records, gpuflow's operations are also
NVTX ranges (domain ``gpuflow``, around each run's enqueue) when the
``nvtx`` package is installed, so that Nsight Systems shows them beside the
kernels they launched.

When no trace records, a run pays one global check (:data:`active` is an
empty tuple) and nothing else.

What a trace holds:

* one process per device, one track in it per stream (``stream 1``,
  ``stream 2``... in the order the trace first saw them); on it one complete
  event (``"ph": "X"``, category ``gpuflow.run``) per run, named after the
  operation.  Where the backend times what its streams run (its activity
  record, :meth:`Backend.start_activity_record`: ``sim`` times every item,
  ``cuda`` its kernels, copies, fills and graph replays with CUDA events),
  the slice is the device's own: from when the stream started the run's
  first item to when it finished its last one (on ``sim``, reached the
  run's completion mark), and inside
  it one slice (category ``gpuflow.item``) per kernel, copy, fill, graph
  replay or collective the run enqueued there, with the device's times
  (``args``: ``run``, its number, and ``what``, the backend's name for the
  item).  Work a run enqueued on other streams (``zip`` arms) is a slice of
  the run's name on that stream's track (category ``gpuflow.arm``) with its
  items inside.  Elsewhere the slice runs from when the stream could start
  the run (it was enqueued, or the stream finished its previous run,
  whichever is later) to when gpuflow saw the GPU finish it.  A stream's
  slices never overlap: one that would is cut where the next one starts.
  ``args``: ``op`` (its repr), ``device``, ``stream``, ``priority`` (its
  stream's level: 0 the default, higher more urgent), ``sms`` (the name of
  the reserved SMs its stream runs on, or null), ``how`` it ran
  (``await``, ``sync``, ``enqueue_on``, ``start_run``), ``outcome`` (``ok``,
  ``cancelled``, ``fault``, ``error``; ``unfinished`` if the trace was
  written first), ``gpu`` (how the GPU side ended: ``ok``, ``fault``,
  ``unfinished``), ``device_timed`` (whether the slice's ends are the
  device's), ``run`` (its number) and its times in microseconds since the
  trace began: ``enqueued_us`` (the run began enqueueing),
  ``enqueue_end_us``, ``gpu_done_us`` (gpuflow saw the GPU done),
  ``resumed_us`` (the awaiting task ran again, or was cancelled);
* a ``host`` process, one track per thread that started runs: the host side
  of each enqueue (an ``X`` event, ``gpuflow.enqueue``); for each awaited
  run, the wake-up from the GPU being done to the task running again (an
  async slice, ``gpuflow.wake``), or an instant marker (``cancelled ...``)
  where the task stopped waiting first.

Recording is thread-safe: runs start on any thread, completions arrive on
the awaiting loop's thread or the completer's.  A run tags the items it
enqueues (:data:`._backends._base.activity_tag`, set from its start to its
end in the context that runs it), which is how the device's record of an
item names the run it belongs to.
"""

from __future__ import annotations

import atexit
import importlib
import itertools
import json
import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import Token
from dataclasses import dataclass, field
from typing import Any

from .._backends import Activity, Backend, activity_tag
from .._errors import DeviceFaultError, UsageError, UsageTypeError
from ._unusual import UNUSUAL

#: The environment variable that records a whole program into the file it names.
ENV = "GPUFLOW_TRACE"

#: The traces recording now: empty when none is (the one check a run pays).
active: tuple[Recorder, ...] = ()

_lock = threading.Lock()
_ids = itertools.count(1)
#: the nvtx module once a trace has started: None before, False if not importable
_nvtx: Any = None
#: trace-event process ids: the program's threads, then one per device
_HOST_PID = 1
_DEVICE_PID = 100

#: A stream's track: (device, id of its backend, the backend's id of the stream)
Key = tuple[int, int, int]

#: The key a slice of a stream's track carries until the file is written:
#: where the last item inside it ended (the slice must not end before)
_INNER = "_inner_end_us"

#: The items a run enqueues only to order its work (its completion mark, the
#: waits for what it depends on): part of its time on a stream, not shown
_ORDERING = frozenset({"event record", "event wait", "mark wait", "completion mark"})


def _shown(what: str) -> str | None:
    """The slice name of an item a run enqueued (an activity record's
    ``what``), or None for one that is no work of its own (ordering, frees,
    host signals)."""
    if what.startswith("kernel "):
        return "kernel " + what.removeprefix("kernel ").strip("'")
    if what.startswith("copy to "):
        return "copy to device"
    if what.startswith("copy from "):
        return "copy to host"
    if what.startswith("copy "):
        return "copy device to device"
    if what.startswith(("fill of ", "arange into ")):
        return what.split(" ", 1)[0]
    if what.startswith(("graph of ", "nccl ")):
        return what
    return None


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)  # perf_counter and perf_counter_ns share a clock


@dataclass
class _Slot:
    """Where a run's slice lies on its stream's track, as one trace saw it
    finish, and what the device ran for it there and elsewhere."""

    start: int
    end: int
    device_timed: bool
    #: (track, slice name, the backend's name, start, end), in the order run
    items: list[tuple[Key, str, str, int, int]] = field(default_factory=list)
    #: (track, start, end) of the run's work on each other stream
    arms: list[tuple[Key, int, int]] = field(default_factory=list)


def _outcome(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    if isinstance(exc, DeviceFaultError):
        return "fault"
    if isinstance(exc, Exception):
        return "error"
    return "cancelled"  # the loop's cancellation (or an interrupt) is a BaseException


class TracedRun:
    """One run as the traces recording it see it; :mod:`._run` reports to it.

    Its events are written once both its ends are known: the GPU's (the
    submission finished, on whatever thread finished it) and its caller's
    (the awaiting task resumed or was cancelled, ``sync`` or ``enqueue_on``
    returned or raised).
    """

    __slots__ = (
        "backend", "device", "done", "ends", "enq", "enq_end", "gpu", "how", "id", "name",
        "op", "outcome", "priority", "recorders", "resumed", "slots", "sms", "stream",
        "stream_key", "tag", "thread",
    )  # fmt: skip

    def __init__(
        self, recorders: tuple[Recorder, ...], name: str, op: str, how: str, stream: Any
    ) -> None:
        self.recorders = recorders
        self.id = next(_ids)
        self.name = name
        self.op = op
        self.how = how
        self.device: int = stream.device
        self.stream = repr(stream)
        self.priority: int = stream.priority
        self.sms: str | None = stream.sms
        backend: Backend = stream._runtime.backend
        self.backend = backend
        self.stream_key: Key = (
            stream.device, id(backend), backend.activity_stream_id(stream.raw)
        )
        self.thread = threading.get_native_id()
        self.enq = time.perf_counter_ns()
        self.enq_end: int | None = None
        self.done: int | None = None
        self.slots: dict[int, _Slot] = {}  # per recorder: where its slice lies
        self.tag: Token[int | None] | None = None
        self.resumed: int | None = None
        self.gpu = "unfinished"  # how the GPU side ended
        self.outcome = "ok"
        self.ends = 2
        nvtx = _nvtx
        if nvtx:
            nvtx.push_range(message=name, domain="gpuflow")

    def enqueued(self) -> None:
        """The operation has enqueued its work (or failed to): on the run's thread."""
        self.enq_end = time.perf_counter_ns()
        nvtx = _nvtx
        if nvtx:
            nvtx.pop_range(domain="gpuflow")

    def gpu_done(self, error: BaseException | None) -> None:
        """The run's submission finished (a completion callback, any thread)."""
        with _lock:
            # read under the lock: a stream's runs finish in the order taken
            now = self.done = time.perf_counter_ns()
            self.gpu = _outcome(error)
            for r in self.recorders:
                self.slots[id(r)] = r._slot(self, now)
            self._end()

    def ended(self, exc: BaseException | None) -> None:
        """The caller is done with the run: it returned or raised ``exc``, or
        (for an await) the task resumed or was cancelled."""
        now = time.perf_counter_ns()
        if self.enq_end is None:  # execute itself raised
            self.enqueued()
        if self.tag is not None:
            try:
                activity_tag.reset(self.tag)
            except ValueError:
                # ended in another context than it began in (a coroutine that
                # another task resumed): the tag stays where it was set, and
                # items enqueued there later are ignored, as the run is over
                pass
            self.tag = None
        with _lock:
            if self.how == "await":
                self.resumed = now
            self.outcome = _outcome(exc)
            self._end()

    def _end(self) -> None:  # under _lock
        self.ends -= 1
        if self.ends == 0:
            for r in self.recorders:
                r._write_run(self)


class Recorder:
    """The events of one trace, kept in memory until :meth:`write`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(path)
        self._t0 = time.perf_counter_ns()
        self._closed = False
        self._events: list[dict[str, Any]] = []
        self._open: dict[int, TracedRun] = {}  # runs started, not yet written
        self._tracks: dict[Key, int] = {}  # a stream -> its tid
        self._track_end: dict[Key, int] = {}
        self._threads: dict[int, str] = {}
        # each backend the runs used: its activity record (None: it keeps none)
        self._records: dict[int, tuple[Backend, list[Activity] | None]] = {}
        self._owned: dict[int, list[Activity]] = {}  # the items of open runs, by run

    def _us(self, ns: int) -> float:
        return (ns - self._t0) / 1e3

    def _opened(self, run: TracedRun) -> None:
        with _lock:
            self._open[run.id] = run
            if run.thread not in self._threads:
                self._threads[run.thread] = threading.current_thread().name
            backend = run.backend
            if id(backend) not in self._records:
                # from the first run on a backend: every item it enqueues is timed
                try:
                    record: list[Activity] | None = backend.start_activity_record()
                except UsageError:
                    record = None
                self._records[id(backend)] = (backend, record)

    def _track(self, key: Key) -> int:
        tid = self._tracks.get(key)
        if tid is None:
            tid = self._tracks[key] = 1 + sum(k[0] == key[0] for k in self._tracks)
        return tid

    def _stream_slot(self, key: Key, enq: int, done: int) -> int:
        """When a run that stream ``key`` finished at ``done`` could start:
        when it was enqueued, or when the stream finished its previous run
        (under _lock, as it finishes: a stream finishes its runs in order)."""
        end = self._track_end.get(key, enq)
        self._track_end[key] = max(done, end)
        return min(max(enq, end), done)

    def _items(self, run: TracedRun) -> list[Activity]:
        """What the device ran for ``run``, as far as its backend has told
        (under _lock): the backend's record is read up to now, each item
        kept for the open run that enqueued it."""
        backend, record = self._records.get(id(run.backend), (None, None))
        if backend is not None and record is not None:
            backend.update_activity_records()
            n = len(record)  # the streams append at the end meanwhile
            owned, open_ = self._owned, self._open
            for a in record[:n]:
                if a.tag in open_:
                    owned.setdefault(a.tag, []).append(a)
            del record[:n]
        return self._owned.pop(run.id, [])

    def _slot(self, run: TracedRun, done: int) -> _Slot:
        """Where ``run``, which the GPU finished by ``done``, lies on its
        stream's track, with what it ran (under _lock, as it finishes)."""
        key = run.stream_key
        backend_id = key[1]
        extent: dict[Key, list[int]] = {}  # track -> [start, end] of the run's work there
        slot = _Slot(0, 0, False)
        for a in self._items(run):
            name = _shown(a.what)
            if name is None and a.what not in _ORDERING:
                continue  # a free or a host signal: no work of the run's
            where: Key = (a.device, backend_id, a.stream)
            start, end = _ns(a.start), _ns(a.end)
            span = extent.setdefault(where, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
            if name is not None:
                slot.items.append((where, name, a.what, start, end))
        own = extent.pop(key, None)
        if own is not None:  # the device's times
            slot.start, slot.end, slot.device_timed = own[0], own[1], True
            self._track_end[key] = max(self._track_end.get(key, own[1]), own[1])
        else:
            slot.start, slot.end = self._stream_slot(key, run.enq, done), done
        slot.arms = [(where, span[0], span[1]) for where, span in extent.items()]
        return slot

    def _write_run(self, run: TracedRun, now: int | None = None) -> None:
        """Append the events of ``run``; ``now`` when it is still unfinished
        (under _lock)."""
        if self._closed:
            return
        self._open.pop(run.id, None)
        self._owned.pop(run.id, None)  # what its stream ran after it was seen done
        us = self._us
        key = run.stream_key
        slot = run.slots.get(id(self))
        if slot is None:  # still running: from when its stream could start it up to now
            assert now is not None
            slot = _Slot(min(max(run.enq, self._track_end.get(key, run.enq)), now), now, False)
        gpu = run.gpu
        outcome = run.outcome if run.outcome != "ok" else gpu
        args: dict[str, Any] = {
            "op": run.op,
            "device": run.device,
            "stream": run.stream,
            "priority": run.priority,
            "sms": run.sms,
            "how": run.how,
            "outcome": outcome,
            "run": run.id,
            "device_timed": slot.device_timed,
            "enqueued_us": us(run.enq),
        }
        if run.enq_end is not None:
            args["enqueue_end_us"] = us(run.enq_end)
        args["gpu"] = gpu
        if run.done is not None:
            args["gpu_done_us"] = us(run.done)
        if run.resumed is not None:
            args["resumed_us"] = us(run.resumed)
        events = self._events
        inner: dict[Key, int] = {}  # the end of the last item inside each slice
        for where, _name, _what, _start, end in slot.items:
            inner[where] = max(inner.get(where, end), end)
        events.append({
            "name": run.name, "cat": "gpuflow.run", "ph": "X",
            "ts": us(slot.start), "dur": (slot.end - slot.start) / 1e3,
            "pid": _DEVICE_PID + run.device, "tid": self._track(key), "args": args,
            _INNER: us(inner.get(key, slot.start)),
        })  # fmt: skip
        for where, start, end in slot.arms:
            events.append({
                "name": run.name, "cat": "gpuflow.arm", "ph": "X",
                "ts": us(start), "dur": (end - start) / 1e3,
                "pid": _DEVICE_PID + where[0], "tid": self._track(where),
                "args": {"run": run.id, "op": run.op, "part": "its work on another stream"},
                _INNER: us(inner.get(where, start)),
            })  # fmt: skip
        for where, name, what, start, end in slot.items:
            events.append({
                "name": name, "cat": "gpuflow.item", "ph": "X",
                "ts": us(start), "dur": (end - start) / 1e3,
                "pid": _DEVICE_PID + where[0], "tid": self._track(where),
                "args": {"run": run.id, "what": what},
            })  # fmt: skip
        host = {"pid": _HOST_PID, "tid": run.thread}
        if run.enq_end is not None:
            events.append({
                "name": f"enqueue {run.name}", "cat": "gpuflow.enqueue", "ph": "X",
                "ts": us(run.enq), "dur": (run.enq_end - run.enq) / 1e3,
                "args": {"run": run.id}, **host,
            })  # fmt: skip
        if run.resumed is None:
            return
        if run.done is not None and run.done <= run.resumed:
            wake = {"name": f"wake {run.name}", "cat": "gpuflow.wake", "id": run.id, **host}
            events.append({**wake, "ph": "b", "ts": us(run.done), "args": {"outcome": outcome}})
            events.append({**wake, "ph": "e", "ts": us(run.resumed)})
        else:  # the task stopped waiting before the GPU was done
            events.append({
                "name": f"{run.outcome} {run.name}", "cat": "gpuflow.await", "ph": "i",
                "s": "t", "ts": us(run.resumed), "args": {"run": run.id}, **host,
            })  # fmt: skip

    def write(self) -> None:
        """Write the trace file (once): every run written so far, and those
        not finished as ``unfinished`` slices up to now."""
        now = time.perf_counter_ns()
        with _lock:
            for run in list(self._open.values()):
                self._write_run(run, now)
            self._closed = True
            for backend, record in self._records.values():
                if record is not None:
                    backend.stop_activity_record(record)
            self._records.clear()
            self._no_overlaps()
            doc = {
                "traceEvents": self._metadata() + self._events,
                "displayTimeUnit": "ms",
                "otherData": {"producer": "gpuflow"},
            }
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)

    def _no_overlaps(self) -> None:
        """Cut each slice of a stream's track where the next one starts, if
        it ends later, but never before the last item inside it ended (under
        _lock): a run gpuflow saw done after its stream had started the next
        run's work, where the device's times are not known."""
        tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for e in self._events:
            if _INNER in e:
                tracks.setdefault((e["pid"], e["tid"]), []).append(e)
        for slices in tracks.values():
            slices.sort(key=lambda e: e["ts"])
            for a, b in itertools.pairwise(slices):
                cut = max(b["ts"], a[_INNER])
                if cut < a["ts"] + a["dur"]:
                    a["dur"] = cut - a["ts"]
        for slices in tracks.values():
            for e in slices:
                del e[_INNER]

    def _metadata(self) -> list[dict[str, Any]]:
        def meta(what: str, pid: int, tid: int | None, **args: object) -> dict[str, Any]:
            event = {"name": what, "ph": "M", "pid": pid, "args": args}
            if tid is not None:
                event["tid"] = tid
            return event

        out = [meta("process_name", _HOST_PID, None, name="host"),
               meta("process_sort_index", _HOST_PID, None, sort_index=0)]
        for d in sorted({key[0] for key in self._tracks}):
            out.append(meta("process_name", _DEVICE_PID + d, None, name=f"gpuflow device {d}"))
            out.append(meta("process_sort_index", _DEVICE_PID + d, None, sort_index=1 + d))
        for (d, _backend, _stream), tid in self._tracks.items():
            out.append(meta("thread_name", _DEVICE_PID + d, tid, name=f"stream {tid}"))
            out.append(meta("thread_sort_index", _DEVICE_PID + d, tid, sort_index=tid))
        for tid, name in self._threads.items():
            out.append(meta("thread_name", _HOST_PID, tid, name=name))
        return out


def begin(op: Any, how: str, stream: Any) -> TracedRun:
    """Record a run of ``op`` on ``stream`` that starts now (``how``: "await",
    "sync", "enqueue_on"); call only while :data:`active` is not empty."""
    recorders = active
    run = TracedRun(recorders, op.label(), repr(op), how, stream)
    for r in recorders:
        r._opened(run)
    # what this run enqueues, from here to its end, is the run's
    run.tag = activity_tag.set(run.id)
    return run


def _load_nvtx() -> None:
    global _nvtx
    if _nvtx is None:
        try:
            _nvtx = importlib.import_module("nvtx")
        except ImportError:
            _nvtx = False


def start(path: str | os.PathLike[str]) -> Recorder:
    """Start recording into a new trace that :func:`stop` writes to ``path``."""
    global active
    rec = Recorder(path)
    with _lock:
        _load_nvtx()
        active = (*active, rec)
    UNUSUAL.begin()  # (runs take the long path, which reports to the trace)
    return rec


def stop(rec: Recorder) -> None:
    """Stop recording into ``rec`` and write its file."""
    global active
    with _lock:
        stopped = rec in active
        active = tuple(r for r in active if r is not rec)
    if stopped:
        UNUSUAL.end()
    rec.write()


@contextmanager
def trace(path: str | os.PathLike[str]) -> Iterator[None]:
    """Record every run started inside the block into a timeline at ``path``.

    The file (Chrome trace-event JSON) is written when the block is left,
    however it is left; open it in https://ui.perfetto.dev or
    ``chrome://tracing``.  Runs still on the device then are written as
    ``unfinished``.  Traces may nest or overlap (each gets every run started
    while it records).  ``GPUFLOW_TRACE=path.json`` records a whole program.
    While a trace records, gpuflow's operations are also NVTX ranges (domain
    ``gpuflow``) when the ``nvtx`` package is installed.

    Any thread: it records the runs every thread starts while the block is
    open.

    Parameters
    ----------
    path
        Where the timeline is written (a ``str`` or path-like).

    Raises
    ------
    gpuflow.UsageTypeError
        ``path`` is not a file path.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise UsageTypeError(f"gf.trace(path) needs a file path, not {type(path).__name__}")
    rec = start(path)
    try:
        yield
    finally:
        stop(rec)


def _write_at_exit(rec: Recorder) -> None:
    try:
        stop(rec)
    except Exception as exc:  # at exit: say why, never raise
        warnings.warn(f"gpuflow: could not write the trace {rec.path!r}: {exc!r}", stacklevel=1)


def _from_environment() -> None:
    path = os.environ.get(ENV)
    if path:
        atexit.register(_write_at_exit, start(path))


_from_environment()
