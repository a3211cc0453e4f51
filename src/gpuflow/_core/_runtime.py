"""The process-wide runtime: one backend, its devices, their stream pools.

:func:`init_device_contexts` makes it; the first use of gpuflow without it
makes one with the defaults (``backend="auto"``), as CuPy and PyTorch
initialise lazily.  The current device is a context variable, so each task
(and each thread) sees its own, and a device group's children see theirs.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from .._backends import Backend, RawEvent, RawPartition, RawStream, load_backend
from .._errors import DeviceFaultError, UsageError, UsageTypeError
from ._completion import Completer
from ._finalizers import finalize_later, run_finalized, start_reaper
from ._hazards import MemoryLedger
from ._latency import (
    DEFAULT_BUSY_POLL_US,
    ENCLOSING,
    busy_poll_s,
    class_here,
)
from ._stream import Stream, gone, live_streams, made, made_streams

#: The device current in this task or thread (None: the runtime's default):
#: :func:`current_device` and :func:`use_device` read and set it.
current_device_var: ContextVar[int | None] = ContextVar("gpuflow_current_device", default=None)

#: The most streams a device's pool grows to under the default policy: as
#: many as CUDA's hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``, which
#: gpuflow sets to 32), so that no two pool streams share one.
MAX_POOL_STREAMS = 32
#: Other libraries' streams a runtime keeps a :class:`Stream` of at most
#: (past it, they are made again on their next use).
MAX_FOREIGN_STREAMS = 1024
#: streams known by handle before the first sweep of dead ones
_SWEEP_HANDLES_AT = 256
#: Device context generations, each taken once in the process: a stream or
#: an allocation of a replaced runtime never matches a current one's.
_GENERATIONS = itertools.count(1)


class Runtime:
    """Backend, devices and stream pools.  Internal: reach it through the API."""

    def __init__(
        self,
        backend: Backend,
        default_device: int,
        devices: list[int],
        streams_per_device: int,
        busy_poll_s: float = DEFAULT_BUSY_POLL_US / 1e6,
        reserve_sms: dict[str, int] | None = None,
    ) -> None:
        start_reaper()  # (its arrays' and streams' finalizers leave work for it)
        self.backend = backend
        self.default_device = default_device
        self.devices = devices
        self.streams_per_device = streams_per_device
        self.live = True
        self._lock = threading.Lock()
        #: per device: its context's generation, a number no other runtime or
        #: context of the process has had (a reset takes a new one), which a
        #: stream keeps: one comparison says that what was loaded for one
        #: stream serves another
        self._generations = {d: next(_GENERATIONS) for d in devices}
        #: per device: the backend's state of it, whose ``fault`` every run
        #: checks (the same object for the backend's life)
        self._states = {d: backend.device_state(d) for d in devices}
        self._pools: dict[int, list[Stream]] = {}
        #: per device: the pool, then the streams grow() added (append only):
        #: what :meth:`streams` gives, read directly where a run starts
        self.device_streams: dict[int, list[Stream]] = {}
        #: per (device, priority level, reserved SMs' name) other than the
        #: default (0, None): that level's streams, made at its first use (the
        #: first ``streams_per_device`` of them its leases' pool), then those
        #: the default policy grew (append only)
        self._levels: dict[tuple[int, int, str | None], list[Stream]] = {}
        #: stream-lease bookkeeping per (device, generation, priority, SMs'
        #: name), owned by _scope
        self.lease_pools: dict[tuple[int, int, int, str | None], Any] = {}
        #: per device: the partitions of its SMs reserve_sms made, by name,
        #: and the one of the SMs left, where gpuflow's other streams are made
        self.partitions: dict[int, dict[str, Any]] = {}
        self._rest: dict[int, Any] = {}
        #: the ids of the partitions released once the runtime was retired
        #: (None: they went with the backend)
        self._released: set[int] | None = set()
        for d in devices:
            if reserve_sms:
                names = list(reserve_sms)
                *parts, rest = backend.partition_sms(d, [reserve_sms[n] for n in names])
                self.partitions[d] = dict(zip(names, parts, strict=True))
                self._rest[d] = rest
        #: every live stream of this runtime, by its handle (__cuda_stream__):
        #: a weak reference each, not a WeakValueDictionary, whose lookup of
        #: a handle it lacks (every other library's stream, at each wait for
        #: it) raises and catches a KeyError; dead ones go as it grows
        self._handles_lock = threading.Lock()  # (reset_device holds _lock when it adopts)
        self._by_handle: dict[int, weakref.ref[Stream]] = {}
        self._by_handle_sweep_at = _SWEEP_HANDLES_AT
        #: the Stream of each backend stream of another library used so far
        #: (a Stream is equal only to itself: one backend stream has one)
        self._foreign: dict[Any, Stream] = {}
        #: the private stream of each device for other libraries' arrays
        self._interop: dict[tuple[int, int], Stream] = {}
        #: per device: backend streams made ahead (see _make_pool)
        self._spares: dict[int, list[RawStream]] = {}
        #: the bytes and number of the allocations made through this runtime
        self.memory = MemoryLedger()
        self.completer = Completer(backend, busy_poll_s)
        for d in devices:
            self._make_pool(d)
            if backend.setup_waits_for_idle:
                # every latency class's pool, now: made at a class's first
                # use, under load, a stream could wait for the device to be
                # idle, and the class's first request with it
                self._make_levels(d)
            if backend.loads_wait_for_kernels:
                # the built-in kernels in every context that runs them, now:
                # a first fill there would load them, waiting for running kernels
                try:
                    backend.load_ahead(d, None, self.partitions_of(d))
                except Exception as exc:  # (tried again at the first fill, which raises)
                    warnings.warn(f"gpuflow: loading the built-in kernels failed: {exc!r}",
                                  stacklevel=2)

    def _make_pool(self, device: int) -> None:
        be = self.backend
        if be.setup_waits_for_idle:
            # creating a stream can block the calling thread until the device is
            # idle (CUDA, when the driver grows its own pool of streams: seen
            # behind a kernel of another stream, docs/performance.md,
            # "Measurements behind the code"): every stream the pool may grow
            # into, and the interop stream, are made now, before any work runs
            count = max(self.streams_per_device, MAX_POOL_STREAMS) + 1
            self._spares[device] = [self._create(device, 0, None) for _ in range(count)]
        pool = [
            self.adopt(device, self.new_raw_stream(device)) for _ in range(self.streams_per_device)
        ]
        self._pools[device] = pool
        self.device_streams[device] = list(pool)

    def new_raw_stream(self, device: int, priority: int = 0, sms: str | None = None) -> Any:
        """A backend stream of ``device``: one made ahead, while there is one
        (of the default priority and SMs).  ``sms``: made in that partition
        of reserved SMs; else in the SMs the partitions left, where any are
        reserved."""
        if priority or sms is not None:
            return self._create(device, priority, sms)
        spares = self._spares.get(device)
        if spares:
            try:
                return spares.pop()
            except IndexError:  # taken by another thread meanwhile
                pass
        return self._create(device, 0, None)

    def _create(self, device: int, priority: int, sms: str | None) -> Any:
        """A backend stream of that level (a backend is given no more
        arguments than the level needs)."""
        be = self.backend
        part = self._rest.get(device) if sms is None else self.partitions[device][sms]
        if part is not None:
            raw = be.create_stream(device, priority, part)
        elif priority:
            raw = be.create_stream(device, priority)
        else:
            raw = be.create_stream(device)
        made(be, raw)
        return raw

    def _destroy(self, raw: RawStream) -> None:
        """Destroy a backend stream this runtime made (its lane retired first)."""
        self.completer.retire_stream(raw)
        self.backend.destroy_stream(raw)
        gone([raw])

    def adopt(
        self, device: int, raw: RawStream, priority: int = 0, sms: str | None = None
    ) -> Stream:
        """The :class:`Stream` of a backend stream just made, known by its handle."""
        s = Stream(self, device, raw, self.generation(device), priority, sms)
        s._lane = self.completer.lane(raw, device)
        try:
            handle = self.backend.stream_handle(raw)
        except Exception:  # a backend without handles: no other library can name it
            return s
        with self._handles_lock:
            by_handle = self._by_handle
            if len(by_handle) >= self._by_handle_sweep_at:
                for h in [h for h, ref in by_handle.items() if ref() is None]:
                    del by_handle[h]
                self._by_handle_sweep_at = max(_SWEEP_HANDLES_AT, 2 * len(by_handle))
            by_handle[handle] = weakref.ref(s)
        return s

    def foreign_stream(self, raw: RawStream, device: int) -> Stream:
        """The :class:`Stream` of another library's backend stream ``raw``."""
        s = self._foreign.get(raw)
        if s is not None and s._generation == self._generations.get(device):
            return s
        with self._handles_lock:
            if len(self._foreign) >= MAX_FOREIGN_STREAMS:
                for old in self._foreign:  # (made again on their next use)
                    self.completer.retire_stream(old)
                self._foreign.clear()
            s = self._foreign[raw] = Stream(self, device, raw, self.generation(device))
            s._lane = self.completer.lane(raw, device)
        return s

    def own_streams(self) -> list[Stream]:
        """gpuflow's own live streams (every one made where the backend has handles)."""
        with self._handles_lock:
            refs = list(self._by_handle.values())
        return [s for s in (ref() for ref in refs) if s is not None]

    def stream_of(self, raw: RawStream) -> Stream | None:
        """The :class:`Stream` of backend stream ``raw`` (gpuflow's own, or
        another library's used so far), if one is known."""
        s = self._foreign.get(raw)
        if s is not None:
            return s
        try:
            return self.stream_by_handle(self.backend.stream_handle(raw))
        except Exception:  # (a backend without handles, a destroyed stream)
            return None

    def stream_by_handle(self, handle: int) -> Stream | None:
        """gpuflow's own live stream with ``handle`` (``__cuda_stream__``), if any."""
        ref = self._by_handle.get(handle)
        return None if ref is None else ref()

    def current(self, stream: Stream) -> bool:
        """Whether ``stream`` belongs to this runtime, live, and to its
        device's context as it is now (not one a reset replaced)."""
        return self.live and stream._generation == self._generations.get(stream.device)

    def is_interop(self, stream: Stream) -> bool:
        """Whether ``stream`` is a device's interop stream (never makes one)."""
        return self._interop.get((stream.device, stream._generation)) is stream

    def interop_stream(self, device: int) -> Stream:
        """The private stream of ``device`` on which other libraries' arrays arrive.

        What is enqueued on it is waits for other libraries' pending work
        (and host copies of DLPack exports to the host): gpuflow never makes
        it the last writer of memory it frees, so waiting for it waits for
        arrivals only.  One a device (and context generation), made on first use.
        """
        key = (device, self.generation(device))
        s = self._interop.get(key)
        if s is not None:
            return s
        self.check_device(device)
        made = self.adopt(device, self.new_raw_stream(device))
        with self._handles_lock:
            s = self._interop.get(key)
            if s is None:
                s = self._interop[key] = made
                return s
        self._destroy(made.raw)  # another thread made it first
        return s

    def rest_partition(self, device: int) -> Any:
        """The partition of ``device``'s SMs that reserve_sms left to the
        other streams, or None where none are reserved."""
        return self._rest.get(device)

    def generation(self, device: int) -> int:
        """``device``'s context's generation now: a number no other context
        of the process has had (0 for a device the runtime does not know)."""
        return self._generations.get(device, 0)

    def check_device(self, device: int) -> int:
        known = isinstance(device, int) and not isinstance(device, bool)
        if not known or device not in self._generations:
            raise UsageError(
                f"device {device} is not initialised (devices: {self.devices}); "
                "see gf.init_device_contexts(num_devices=...)"
            )
        return device

    def check_priority(self, device: int, priority: int) -> int:
        """``priority`` for a stream of ``device``: an int from 0 (the
        default) to the device's most urgent level, never clamped."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise UsageTypeError(f"priority must be an int, got {type(priority).__name__}")
        if priority:
            top = self.backend.stream_priorities(device)
            if not 0 <= priority <= top:
                raise UsageError(
                    f"priority {priority} is out of device {device}'s range: 0 (the default) "
                    f"to {top} (the most urgent; higher is more urgent)"
                    if top else
                    f"priority {priority}: device {device} ({self.backend.name}) has no stream "
                    "priorities, only the default 0"
                )  # fmt: skip
        return priority

    def check_sms(self, device: int, sms: str | None) -> str | None:
        """``sms``: None, or the name of a partition of ``device``'s SMs
        that :func:`init_device_contexts` reserved."""
        if sms is None:
            return None
        if not isinstance(sms, str):
            raise UsageTypeError(
                f"sms must be the name of reserved SMs (a str), got {type(sms).__name__}"
            )
        reserved = self.partitions.get(device, {})
        if sms not in reserved:
            raise UsageError(
                f"no SMs named {sms!r} are reserved on device {device} "
                + (f"(reserved: {', '.join(map(repr, reserved))})" if reserved else
                   "(none are: see gf.init_device_contexts(reserve_sms={name: count}))")
            )  # fmt: skip
        return sms

    def pool(self, device: int, priority: int = 0, sms: str | None = None) -> list[Stream]:
        """The ``streams_per_device`` streams made with the device's context
        (of a priority level above 0 or reserved SMs: made at the level's
        first use): what round robin deals and stream leases take."""
        if priority or sms is not None:
            return self.streams(device, priority, sms)[: self.streams_per_device]
        try:
            return self._pools[device]
        except KeyError:
            self.check_device(device)
            raise

    def streams(self, device: int, priority: int = 0, sms: str | None = None) -> list[Stream]:
        """The pool followed by the streams :meth:`grow` added; the list only
        grows (in place), until a reset of the device replaces it."""
        try:
            if not priority and sms is None:
                return self.device_streams[device]
            return self._levels[device, priority, sms]
        except KeyError:
            self.check_device(device)
            if not priority and sms is None:
                raise
        return self._make_level(device, priority, sms)

    def partitions_of(self, device: int) -> list[RawPartition]:
        """The partitions of ``device``'s SMs (the reserved ones, and the one
        left to the other streams); none where no SMs are reserved."""
        rest = self._rest.get(device)
        return [] if rest is None else [*self.partitions[device].values(), rest]

    def _make_levels(self, device: int) -> None:
        """Every level's pool of ``device`` (each priority, on each partition's
        SMs and on the others) but the default one's, which exists."""
        top = self.backend.stream_priorities(device)
        for sms in [None, *self.partitions.get(device, {})]:
            for priority in range(top + 1):
                if priority or sms is not None:
                    self._make_level(device, priority, sms)

    def _make_level(self, device: int, priority: int, sms: str | None) -> list[Stream]:
        """A level's pool on ``device``: at its first use, or, where making a
        stream can wait until the device is idle (CUDA), when the runtime
        starts (:meth:`_make_levels`)."""
        with self._lock:
            streams = self._levels.get((device, priority, sms))
            if streams is None:
                streams = self._levels[device, priority, sms] = [
                    self.adopt(device, self.new_raw_stream(device, priority, sms), priority, sms)
                    for _ in range(self.streams_per_device)
                ]
            return streams

    def grow(
        self, device: int, limit: int, priority: int = 0, sms: str | None = None
    ) -> Stream | None:
        """Add a stream to ``device``'s streams (of that level) unless it
        has ``limit`` already; the new stream, or None.  Added streams live
        as long as the pool."""
        with self._lock:
            if priority or sms is not None:
                streams = self._levels.get((device, priority, sms))
            else:
                streams = self.device_streams.get(device)
            if streams is None or len(streams) >= limit or not self.live:
                return None
            s = self.adopt(device, self.new_raw_stream(device, priority, sms), priority, sms)
            streams.append(s)
            return s

    def startable(self, stream: Stream) -> bool:
        """Whether a run may start on ``stream`` (:meth:`check_startable`
        says why not)."""
        state = self._states.get(stream.device)
        return (
            state is not None
            and state.fault is None
            and self.live
            and stream._generation == self._generations[stream.device]
        )

    def check_startable(self, stream: Stream) -> None:
        """A run may start on ``stream``: it is :meth:`current`, and its
        device has no sticky fault (else the error that says which)."""
        device = stream.device
        state = self._states.get(device)
        if (
            state is not None
            and state.fault is None
            and self.live
            and stream._generation == self._generations[device]
        ):
            return
        if not self.current(stream):
            raise UsageError(
                f"{stream!r} belongs to a runtime or device context that was replaced or reset"
            )
        self.check_fault(device)

    def check_fault(self, device: int) -> None:
        state = self._states.get(device)
        fault = state.fault if state is not None else self.backend.device_fault(device)
        if fault is not None:
            raise DeviceFaultError(
                f"device {device} has a sticky fault; call gf.reset_device({device}) "
                f"to recover: {fault}",
                code=fault.code,
                name=fault.name,
                device=device,
            ) from fault

    def reset_device(self, device: int) -> None:
        self.check_device(device)
        with self._lock:
            self.completer.fail_device(
                device,
                DeviceFaultError(f"device {device} was reset with work pending", device=device),
            )
            # raises (and changes nothing of ours) where the driver refuses
            self.backend.reset_device(device)
            gone(self._spares.pop(device, []))  # gone with the context
            self._pools.pop(device, None)
            old = self.device_streams.pop(device, [])
            for key in [key for key in self._levels if key[0] == device]:
                old += self._levels.pop(key)  # (made anew at the level's next use)
            self._generations[device] = next(_GENERATIONS)
            self._make_pool(device)
        if self.backend.setup_waits_for_idle:  # (after the lock: each level takes it)
            self._make_levels(device)
        with self._handles_lock:  # other libraries' streams there: named anew from now
            for raw in [raw for raw, s in self._foreign.items() if s.device == device]:
                self.completer.retire_stream(raw)
                del self._foreign[raw]
            for made in [k for k in self._interop if k[0] == device]:
                old.append(self._interop.pop(made))  # (made anew at its next use)
        for s in old:
            self._destroy(s.raw)

    def close(self, backend: bool = True) -> None:
        """Retire this runtime (its arrays and streams become invalid); close
        its backend too unless the runtime replacing it goes on with it."""
        run_finalized()  # (frees of its arrays, in stream order, while it is live)
        self.live = False
        self.completer.close()
        # the streams it made go with it (work still on them completes first;
        # a stream given out by new_stream goes with its last reference)
        be = self.backend
        with self._lock:
            made = [raw for spares in self._spares.values() for raw in spares]
            made += [s.raw for streams in self.device_streams.values() for s in streams]
            made += [s.raw for streams in self._levels.values() for s in streams]
            made += [s.raw for s in self._interop.values()]
            self._spares.clear()
        for raw in made:
            self._destroy(raw)
        if backend:
            be.close()
            gone(made_streams(be))  # (whatever is left went with it)
            self._released = None
        else:  # (the backend goes on: its partitions no stream uses go now)
            self.release_partitions()

    def release_partitions(self) -> None:
        """Once the runtime is retired and its backend goes on: release its
        partitions of reserved SMs that no stream uses any more (those a
        stream still uses go with their last one: ``_retire_stream``)."""
        released = self._released
        if self.live or released is None:
            return
        used = self.partitions_in_use()
        with self._lock:
            free = [
                p for d in self.devices for p in self.partitions_of(d)
                if id(p) not in used and id(p) not in released
            ]  # fmt: skip
            released.update(map(id, free))
        if free:
            self.backend.release_partitions(free)

    def spares(self) -> list[RawStream]:
        """The backend streams made ahead for the pools to grow into, not yet taken."""
        with self._lock:
            return [raw for spares in self._spares.values() for raw in spares]

    def kept(self) -> list[Stream]:
        """The streams this runtime keeps: its pools, levels and interop streams."""
        with self._lock:
            kept = [s for streams in self.device_streams.values() for s in streams]
            kept += [s for streams in self._levels.values() for s in streams]
        with self._handles_lock:
            kept += list(self._interop.values())
        return kept

    def kept_stale(self) -> list[Stream]:
        """The streams this runtime keeps of a device context reset since:
        none, where every reset retired what it made."""
        return [s for s in self.kept() if not self.current(s)]

    def partition_of(self, stream: Stream) -> Any:
        """The partition of SMs ``stream`` was made in (None: none reserved)."""
        if stream.sms is not None:
            return self.partitions[stream.device][stream.sms]
        return self._rest.get(stream.device)

    def partitions_in_use(self) -> set[int]:
        """The ids of this runtime's partitions a stream not yet destroyed
        was made in (a ``new_stream()`` the program still holds, say)."""
        be = self.backend
        return {
            id(part)
            for s in live_streams()
            if s._runtime is self
            and not self.is_foreign(s)
            and not be.stream_destroyed(s.raw)
            and (part := self.partition_of(s)) is not None
        }

    def is_foreign(self, stream: Stream) -> bool:
        """Whether ``stream`` is another library's (gpuflow made no backend stream for it)."""
        return self._foreign.get(stream.raw) is stream


class _Current:
    """The runtime in use: an attribute every run reads where it starts (no
    call); :func:`ensure_runtime` makes one where there is none yet."""

    __slots__ = ("runtime",)

    def __init__(self) -> None:
        self.runtime: Runtime | None = None


CURRENT = _Current()
_runtime_lock = threading.Lock()

#: Called with each new runtime, before it is used (``gpuflow._kernel`` loads
#: the modules compiled so far where loading can wait for an idle device).
runtime_started: list[Callable[[Runtime], None]] = []


def init_device_contexts(
    default_device: int = 0,
    num_devices: int | None = None,
    streams_per_device: int = 4,
    backend: str | Backend = "auto",
    *,
    busy_poll_us: float | None = None,
    reserve_sms: Mapping[str, int] | None = None,
) -> str:
    """Initialise gpuflow: choose the backend, the devices and their stream pools.

    The first use of gpuflow without this call makes the runtime with the
    defaults.  Calling it again replaces the runtime: arrays and streams
    made before belong to the old one, and are refused from then on.  It
    replaces a runtime at rest only: while runs of the current one are in
    flight on the GPU (an await in progress, a run started and not yet
    done, work a cancelled await left running), it raises a
    :class:`UsageError` and changes nothing, since the streams and memory
    they use would go with it.  Not to be raced with runs started in other
    threads meanwhile.

    Parameters
    ----------
    default_device
        The device runs go to where no ``gf.use_device`` says otherwise.
    num_devices
        How many devices to use, from device 0 (None: every device).
    streams_per_device
        The streams each device's pool starts with (the default policy grows
        a pool under load, up to ``CUDA_DEVICE_MAX_CONNECTIONS`` streams).
    backend
        ``"auto"``, ``"cuda"``, ``"sim"``, a name given to
        :func:`gpuflow.lowlevel.register_backend`, or a
        :class:`gpuflow.lowlevel.Backend` instance.  ``"auto"`` is the backend
        the ``GPUFLOW_BACKEND`` environment variable names where it is set
        (``GPUFLOW_BACKEND=sim`` runs a program written for a GPU on the
        simulation), else ``cuda`` where the CUDA driver reports a device,
        else ``sim``.
    busy_poll_us
        How long an event loop that awaits GPU work keeps reading the GPU's
        completion words, once per loop turn, before it arms a wake-up and
        sleeps in its selector (None: the ``GPUFLOW_BUSY_POLL_US``
        environment variable, else 200; 0 turns polling off).  Polling
        completes a short run within a few microseconds of the GPU finishing
        it; the wake-up costs tens of microseconds more but no CPU.  A loop
        busy with other tasks reads the words once per turn either way.
        A latency class may set its own (:func:`latency_class`).
    reserve_sms
        SMs to reserve on each device, by name: ``{"interactive": 16}``
        makes a partition of at least 16 SMs (the driver rounds up, to 8 a
        partition on current GPUs) whose streams run on those SMs alone, and
        makes gpuflow's other streams in the SMs left, so that work on
        them never holds the reserved ones.  Runs use them through
        ``latency_class(sms="interactive")``, ``open_stream_lease(sms=...)``
        and ``new_stream(sms=...)``.  On cuda these are green contexts
        (CUDA 12.4 or later); another library's streams still run on every
        SM.  ``python -m gpuflow info --reserve-sms interactive=16`` lists
        what a device gives.

    Returns
    -------
    str
        The name of the backend chosen (also logged on the ``gpuflow`` logger).

    Raises
    ------
    gpuflow.UsageError
        An argument out of range (each names the one), a backend name
        (given, or in ``GPUFLOW_BACKEND``) that is no backend's, or SMs to
        reserve that the device does not have, or on a backend or driver
        that cannot reserve them (never a set-up that reserves nothing);
        runs of the current runtime in flight (the message counts them).
    gpuflow.DeviceError
        The backend could not be started.

    Warns
    -----
    RuntimeWarning
        ``"auto"`` fell back to ``sim`` on a machine whose CUDA driver is
        installed but unusable (``cuInit`` fails, or GPU device files exist
        but the driver sees no device), with the driver's error code and
        name: the program would otherwise run every kernel as its NumPy
        reference without a word.  With no driver at all the choice is only
        logged.
    """
    _refuse_with_runs_in_flight()
    poll_s = busy_poll_s(busy_poll_us)
    if not isinstance(streams_per_device, int) or streams_per_device < 1:
        raise UsageError(f"streams_per_device must be a positive int, not {streams_per_device!r}")
    if num_devices is not None and (not isinstance(num_devices, int) or num_devices < 1):
        raise UsageError(f"num_devices must be a positive int or None, not {num_devices!r}")
    reserve = _check_reserve(reserve_sms)
    be = load_backend(backend, num_devices)
    given = be is backend  # the caller's instance: closed by its runtime, not on an error here
    count = be.device_count
    if num_devices is not None and num_devices > count:
        if not given:
            be.close()
        raise UsageError(f"num_devices={num_devices}, but backend {be.name!r} has {count}")
    n = count if num_devices is None else num_devices
    if not 0 <= default_device < n:
        if not given:
            be.close()
        raise UsageError(f"default_device={default_device} is not one of the {n} devices")
    try:
        rt = Runtime(be, default_device, list(range(n)), streams_per_device, poll_s, reserve)
    except BaseException:
        if not given:
            be.close()
        raise
    for started in runtime_started:
        started(rt)
    with _runtime_lock:
        old, CURRENT.runtime = CURRENT.runtime, rt
    if old is not None:
        old.close(backend=old.backend is not be)
    return be.name


def discard_runtime(keep: Backend | str | None = None) -> None:
    """Close the runtime in use, whatever is in flight on it (its runs are
    abandoned), and leave none: what the pytest plugin does before each
    test, after one that may have failed to end at rest.  Its backend is
    closed too, unless it is ``keep`` (a backend the next runtime takes)."""
    with _runtime_lock:
        old, CURRENT.runtime = CURRENT.runtime, None
    if old is not None:
        old.close(backend=old.backend is not keep)


def _refuse_with_runs_in_flight() -> None:
    """A runtime is replaced only at rest: its streams and memory go with it,
    and a run still in flight on them would be abandoned (its await never
    told, what it keeps released under running work)."""
    old = CURRENT.runtime
    if old is None or not old.live:
        return
    run_finalized()  # (frees of dropped arrays: runs of their own, done soon)
    pending = old.completer.unreached()
    if pending:
        raise UsageError(
            f"init_device_contexts() with {pending} run(s) of the current runtime still "
            "in flight: its streams and memory go with it. Await them, or leave the scopes "
            "that started them, first (gf.testing.pending_runs() counts them)"
        )


def _check_reserve(reserve_sms: Mapping[str, int] | None) -> dict[str, int] | None:
    """``reserve_sms``, checked before any backend starts."""
    if reserve_sms is None:
        return None
    if not isinstance(reserve_sms, Mapping):
        raise UsageTypeError(
            "reserve_sms must map names to numbers of SMs ({'interactive': 16}), "
            f"got {type(reserve_sms).__name__}"
        )
    for name, count in reserve_sms.items():
        if not isinstance(name, str) or not name:
            raise UsageError(f"reserve_sms: a name of reserved SMs must be a str, got {name!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise UsageError(
                f"reserve_sms[{name!r}] must be a number of SMs (an int of 1 or more), "
                f"not {count!r}"
            )
    return dict(reserve_sms) or None


#: How long a process that exits waits for the GPU work still pending.
EXIT_DRAIN_S = 5.0
#: How long it waits before it says so (most work pending at exit is short).
EXIT_QUIET_S = 0.1


@atexit.register
def _drain_at_exit() -> None:
    # What pending runs keep (another library's memory, whose DLPack deleter
    # may need a live interpreter) is released by the completer thread when
    # the GPU is done: let it finish before the interpreter goes away, rather
    # than from a daemon thread during finalization (on the H200, PyTorch's
    # deleter called then aborted the process at exit).  A wait that is not
    # over at once says so, and a Ctrl-C ends it: the process then exits
    # with that memory still held, which the driver reclaims with the
    # process (a leak, never a free under running work).
    rt = CURRENT.runtime
    if rt is None:
        return
    try:
        run_finalized()
        completer = rt.completer
        if completer.drain(EXIT_QUIET_S):
            return
        print(
            f"gpuflow: waiting up to {EXIT_DRAIN_S:g} s for {completer.pending} run(s) still "
            "on the GPU, so that what they use is released in order; press Ctrl-C "
            "to exit now (the driver then reclaims that memory with the process)",
            file=sys.stderr,
            flush=True,
        )
        completer.drain(EXIT_DRAIN_S)
    except KeyboardInterrupt:
        pass


def ensure_runtime() -> Runtime:
    """The runtime in use, made with :func:`init_device_contexts`'s defaults
    at the first use (:func:`current_runtime` reads it and never makes one)."""
    rt = CURRENT.runtime
    if rt is None:
        with _runtime_lock:
            rt = CURRENT.runtime
        if rt is None:
            init_device_contexts()
            rt = CURRENT.runtime
            assert rt is not None
    return rt


def current_runtime() -> Runtime | None:
    """The runtime in use, or None before the first use (never makes one)."""
    return CURRENT.runtime


def current_device() -> int:
    """The device that operations started from this task or thread run on.

    Returns
    -------
    int
        The device :func:`use_device` set in this task or thread, else the
        runtime's ``default_device``.  Makes the runtime with the defaults
        where there is none yet.
    """
    d = current_device_var.get()
    return ensure_runtime().default_device if d is None else d


def device_count_option(text: str) -> int:
    """The number of devices a command line asks for (``--devices N``,
    ``--gpuflow-devices N``): a positive int, else argparse's error, which
    says what was given."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a positive number of devices, not {text!r}")
    return n


def device_count() -> int:
    """How many devices gpuflow runs on.

    Any thread.

    Returns
    -------
    int
        The devices :func:`init_device_contexts` took (ordinals from 0).
        Makes the runtime with the defaults where there is none yet.
    """
    return len(ensure_runtime().devices)


@contextmanager
def use_device(device: int) -> Iterator[int]:
    """Make ``device`` current for operations started inside the ``with`` block.

    The current device is a context variable: it applies to this task or
    thread (and to tasks started from it), never to others, and is restored
    on exit however the block is left.

    Parameters
    ----------
    device
        The device's ordinal.

    Yields
    ------
    int
        ``device``.

    Raises
    ------
    gpuflow.UsageError
        ``device`` is not one of the runtime's devices (on entry).
    """
    ensure_runtime().check_device(device)
    token = current_device_var.set(device)
    try:
        yield device
    finally:
        current_device_var.reset(token)


def new_stream(
    device: int | None = None, *, priority: int = ENCLOSING, sms: str | None = ENCLOSING
) -> Stream:
    """A new stream of its own on ``device`` (default: the current device).

    The stream is destroyed when the last reference to it goes; work already
    enqueued on it still completes.  ``priority`` reads the right way round:
    0 is the default and each level above it is more urgent (when SMs free
    up, the GPU schedules the blocks of a more urgent stream's kernels
    first; running blocks are not preempted, and copies are not affected).
    The device's range is asked of the driver (0 to 5 on current GPUs,
    CUDA's 0 to -5); a level out of it is refused, never clamped.

    Any thread.

    Parameters
    ----------
    device
        The device's ordinal (None: the current device).
    priority
        The stream's priority level, from 0 (the default) to the device's
        most urgent.
    sms
        The name of SMs reserved at :func:`init_device_contexts`
        (``reserve_sms``): the stream runs its kernels on those alone.
        None: on the SMs no partition reserved (every SM where none is).

    Returns
    -------
    Stream

    Raises
    ------
    gpuflow.UsageError
        ``device`` is not one of the runtime's devices, ``priority`` is
        out of the device's range (the message says the range), or no SMs
        of that name are reserved (the message lists those that are).
    gpuflow.UsageTypeError
        ``priority`` is not an int, or ``sms`` not a str.
    """
    rt = ensure_runtime()
    dev = rt.check_device(current_device() if device is None else device)
    cls = class_here(priority, sms)
    priority = rt.check_priority(dev, cls.priority)
    sms = rt.check_sms(dev, cls.sms)
    raw = rt.new_raw_stream(dev, priority, sms)
    s = rt.adopt(dev, raw, priority, sms)
    weakref.finalize(s, finalize_later, _retire_stream, rt, raw, s._final)
    return s


def _retire_stream(rt: Runtime, raw: RawStream, final: list[RawEvent]) -> None:
    """A dropped stream's lane, then the stream (its finalizer's work, done
    later: :mod:`._finalizers`).  ``final`` gets an event recorded after all
    its work: a collection that finds the stream unreachable together with
    an array it used retires the stream first, and the array's free, still
    ordered after that use, waits for this event."""
    try:
        rt.completer.retire_stream(raw)
    except Exception as exc:  # never from a finalizer
        warnings.warn(f"gpuflow: signalling a stream being destroyed failed: {exc!r}",
                      stacklevel=1)
    try:
        final.append(rt.backend.record_event(raw))
    except Exception:  # a faulted device: what still waits for it leaks
        pass
    rt.backend.destroy_stream(raw)
    gone([raw])
    try:  # (the last stream of a retired runtime's partition: the partition goes too)
        rt.release_partitions()
    except Exception as exc:  # never from a finalizer
        warnings.warn(f"gpuflow: releasing reserved SMs failed: {exc!r}", stacklevel=1)


def current_backend() -> str:
    """The name of the backend in use.

    Any thread.

    Returns
    -------
    str
        ``"cuda"``, ``"sim"``, or the name of a backend of
        :func:`gpuflow.lowlevel.register_backend`.  Makes the runtime with
        the defaults where there is none yet.
    """
    return ensure_runtime().backend.name


def reset_device(device: int | None = None) -> None:
    """Recover ``device`` (default: the current one) from a sticky fault.

    Pending operations on it fail with :class:`DeviceFaultError`; its pool
    streams are replaced; arrays and kernels made on it before are invalid
    (as after CUDA's primary context reset).

    Any thread; the awaits of runs pending on the device raise the fault.

    Parameters
    ----------
    device
        The device's ordinal (None: the current device).

    Raises
    ------
    gpuflow.UsageError
        ``device`` is not one of the runtime's devices.
    gpuflow.DeviceFaultError
        The driver refused the reset (on ``cuda``, after an illegal address
        the process must end): the device stays faulted.
    """
    rt = ensure_runtime()
    rt.reset_device(current_device() if device is None else device)
