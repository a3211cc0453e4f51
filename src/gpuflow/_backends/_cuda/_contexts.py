"""The devices of the ``cuda`` backend: one primary context per device.

:class:`CudaContexts` is the part of :class:`._backend.CudaBackend` that
owns the contexts, and finds other libraries' streams and memory in them
(PyTorch and CuPy work in the same primary contexts); the work enqueued in
them is the subclass's.

Contexts: one primary context per device, made current on whichever thread
calls, cached per thread (a token per context generation, so a reset makes
every thread set the new one).  Peer access is enabled between every pair of
capable devices, for contexts and memory pools.  How completion marks are
made is chosen once, here: a ``cuStreamWriteValue64`` into the stream's
completion word where the driver takes stream memory operations, else an
event (:mod:`._words`).

Setting up can wait for the device: seen on the H200 (driver 580), making a
stream (when the driver grows its own pool of them), loading a module and
freeing page-locked or ``cuMemAlloc`` memory each waited for a kernel
running on another stream.  gpuflow makes its streams when the runtime
starts (``setup_waits_for_idle``), loads modules when they are compiled or
the runtime starts, frees no page-locked memory, and allocates
stream-ordered.

Sticky faults: ``query`` (and every call that meets the fault) records a
:class:`DeviceFaultError`; later calls raise it.  ``reset_device`` resets the
primary context and retains it again; with driver 580 (CUDA 13) on an H200
the driver refused every retain after an illegal address (measured), as
CUDA's documentation warns ("the process must be terminated and
relaunched"): the reset then raises :class:`DeviceFaultError` with the
driver's code and the device stays faulted.
"""

from __future__ import annotations

import ctypes
import time
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar, cast

from ..._errors import DeviceError, DeviceFaultError, UsageError
from .._base import Backend
from .._codes import CONTEXT_ERRORS, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, CUDA_SUCCESS
from .._records import DeviceDescription, LaunchLimits, RawPartition, RawStream
from . import _green
from ._driver import check, driver, err_name, error_for
from ._green import CudaPartition
from ._handles import CudaBuffer, CudaStream, Dev, Token
from ._kernels import ThreadState
from ._native import Native
from ._staging import Staging
from ._words import SLAB_BYTES, WORDS, EventMarks, WordMarks

STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2
_HOST_REGISTER_PORTABLE_DEVICEMAP = 1 | 2
_CUDA_ERROR_NOT_SUPPORTED = 801
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


def _launch_limits(cu: ModuleType, cudev: Any) -> LaunchLimits:
    """A device's launch limits, as its driver reports them."""
    attr = cu.CUdevice_attribute

    def get(name: str) -> int:
        (v,) = check(cu.cuDeviceGetAttribute(getattr(attr, name), cudev), "cuDeviceGetAttribute")
        return int(v)

    return LaunchLimits(
        (get("CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X"), get("CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y"),
         get("CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z")),
        (get("CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X"), get("CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y"),
         get("CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z")),
        get("CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK"),
        get("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
    )  # fmt: skip


#: CUDA's default-stream handles: the NULL stream, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
DEFAULT_STREAM_HANDLES = (0, 1, 2)
#: Other libraries' streams the backend keeps a stream object of at most.
_MAX_FOREIGN_STREAMS = 1024

T = TypeVar("T")

class CudaContexts(Backend):
    """CUDA devices through the driver API, as far as their primary contexts
    go: set-up, the current context of each thread, peers, completion marks,
    other libraries' streams and memory, and reset.
    :class:`._backend.CudaBackend` enqueues work on them."""

    name = "cuda"
    setup_waits_for_idle = True
    loads_wait_for_kernels = True
    cuda_native = True

    def __init__(self, num_devices: int | None = None, *, marks: str = "auto") -> None:
        """The first ``num_devices`` devices (all by default); ``marks`` as
        for :class:`._backend.CudaBackend`."""
        if marks not in ("auto", "word", "event"):
            raise UsageError(f"marks must be 'auto', 'word' or 'event', not {marks!r}")
        cu = driver()
        self._cu = cu
        self.last_reset_trace: list[str] = []  # driver calls of the last reset_device
        #: the green contexts partition_sms made (destroyed by close())
        self._partitions: list[Any] = []
        #: (handle, device) -> the stream object of another library's stream
        self._foreign_streams: dict[tuple[int, int], CudaStream] = {}
        check(cu.cuInit(0), "cuInit")
        (available,) = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        available = int(available)
        n = available if num_devices is None else num_devices
        if n < 1 or n > available:
            raise UsageError(
                f"num_devices={num_devices} but {available} CUDA device(s) are present"
            )
        self._n = Native()
        self.thread_state = ThreadState()
        self._devices: list[Dev] = []
        #: each device's launch limits, read once
        self._limits: list[LaunchLimits] = []
        self._staging = Staging(self._devices, self._n, self.make_current, self._call)
        for i in range(n):
            (cudev,) = check(cu.cuDeviceGet(i), "cuDeviceGet")
            (raw,) = check(cu.cuDeviceGetName(256, cudev), "cuDeviceGetName")
            name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace").strip()
            attr = cu.CUdevice_attribute
            (major,) = check(
                cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, cudev),
                "cuDeviceGetAttribute",
            )
            (minor,) = check(
                cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, cudev),
                "cuDeviceGetAttribute",
            )
            dev = Dev(i, cudev, name, f"sm_{int(major)}{int(minor)}")
            self._limits.append(_launch_limits(cu, cudev))
            (ctx,) = check(cu.cuDevicePrimaryCtxRetain(cudev), "cuDevicePrimaryCtxRetain")
            dev.ctx = int(ctx)
            self._devices.append(dev)
            self._setup_context(dev)
        for dev in self._devices:
            for other in self._devices:
                if other is not dev:
                    (ok,) = check(
                        cu.cuDeviceCanAccessPeer(dev.cudev, other.cudev), "cuDeviceCanAccessPeer"
                    )
                    if int(ok):
                        dev.peers.append(other.index)
        for dev in self._devices:
            self._enable_peers(dev)
        #: another library's stream is marked with events whatever the driver
        #: takes: a word written there would be a write into memory of ours
        #: enqueued where we cannot see when the stream goes, and an event is
        #: queried without its stream (which may be gone by then)
        self._foreign_marks = EventMarks(
            self._record, self._n.event_query, self._n.stream_wait_event, self.make_current
        )
        self._marks: WordMarks | EventMarks = self._choose_marks(marks)

    def _choose_marks(self, marks: str) -> WordMarks | EventMarks:
        n = self._n
        events = self._foreign_marks
        if marks == "event":
            return events
        # the bindings' call is the shorter path (docs/performance.md,
        # "Measurements behind the code"); its first use also tells whether the
        # driver takes stream memory operations at all
        bind = self._cu.cuStreamWriteValue64

        def write(stream: CudaStream, addr: int, value: int, flags: int) -> int:
            return int(bind(stream.obj, addr, value, flags)[0])

        def write_ctypes(stream: CudaStream, addr: int, value: int, flags: int) -> int:
            return int(n.write_value64(stream.handle, addr, value, flags))

        def wait(stream: CudaStream, addr: int, value: int, flags: int) -> int:
            return int(n.wait_value64(stream.handle, addr, value, flags))

        dev = self._devices[0]
        probe = CudaStream(dev, self._cu.CUstream(dev.side), WORDS.take(self._register_host))
        self.make_current(dev)
        try:
            rc = write(probe, probe.word.addr, probe.issued, 0)  # type: ignore[union-attr]
        except Exception:  # bindings that take these arguments otherwise
            write, rc = write_ctypes, write_ctypes(probe, probe.word.addr, probe.issued, 0)  # type: ignore[union-attr]
        if rc == CUDA_SUCCESS:
            rc = self._n.stream_synchronize(dev.side)
        if rc == CUDA_SUCCESS:
            return WordMarks(write, wait, events, bind if write is not write_ctypes else None)
        if rc != _CUDA_ERROR_NOT_SUPPORTED or marks == "word":
            raise error_for(rc, "cuStreamWriteValue64", dev)
        return events

    def _new_event(self, dev: Dev) -> int:
        (ev,) = self._call(dev, "cuEventCreate", self._cu.cuEventCreate, _EVENT_DISABLE_TIMING)
        dev.made_events.append(int(ev))
        return int(ev)

    def _record(self, dev: Dev, stream_handle: int) -> int:
        """Record a pooled event on a stream (context already current)."""
        try:
            ev = dev.events.pop()
        except IndexError:
            ev = self._new_event(dev)
        rc = self._n.event_record(ev, stream_handle)
        if rc:
            raise error_for(rc, "cuEventRecord", dev)
        return ev

    def _register_host(self, addr: int) -> tuple[int, int]:
        """Make the slab of host memory at ``addr`` writable by every device
        (page-locked, mapped): ``(host address, device address)`` of it, or of
        memory the driver allocated where it refuses to register ours."""
        dev = self._devices[0]
        self.make_current(dev)
        cu = self._cu
        (err,) = cu.cuMemHostRegister(addr, SLAB_BYTES, _HOST_REGISTER_PORTABLE_DEVICEMAP)
        if int(err) not in (CUDA_SUCCESS, _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED):
            flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
            (addr,) = check(cu.cuMemHostAlloc(SLAB_BYTES, flags), "cuMemHostAlloc", dev)
            addr = int(addr)
            ctypes.memset(addr, 0, SLAB_BYTES)
        (dptr,) = check(cu.cuMemHostGetDevicePointer(addr, 0), "cuMemHostGetDevicePointer", dev)
        return addr, int(dptr)

    def make_current(self, dev: Dev) -> ThreadState:
        """Make ``dev``'s primary context current on this thread (cached per thread)."""
        ts = self.thread_state
        if ts.token is not dev.token:
            rc = self._n.ctx_set_current(dev.ctx)
            if rc:
                raise error_for(rc, "cuCtxSetCurrent", dev)
            ts.token = dev.token
        return ts

    def force_current(self, dev: Dev) -> None:
        """Someone else changed this thread's context behind the cache: set it again."""
        self.thread_state.token = None
        self.make_current(dev)

    def learn_current(self) -> None:
        """Another library's calls (NCCL's) may have made another context
        current on this thread: ask the driver which, rather than set ours
        again at the next call (one query, no change)."""
        err, ctx = self._cu.cuCtxGetCurrent()
        dev = None if err else self._dev_of_ctx(int(ctx))
        self.thread_state.token = None if dev is None else dev.token

    def _dev_of_ctx(self, ctx: int | None) -> Dev | None:
        """The device whose context (gpuflow's: its primary one) ``ctx`` is."""
        for dev in self._devices:
            if dev.ctx == (ctx or 0):
                return dev
        return None

    def _call(self, dev: Dev, what: str, fn: Any, *args: Any) -> tuple[Any, ...]:
        """A cuda.bindings call with ``dev``'s context current; one retry on a context error."""
        if self.thread_state.token is not dev.token:
            self.make_current(dev)
        res = fn(*args)
        if not res[0]:  # (CUDA_SUCCESS: every call but a failed one)
            return tuple(res[1:])
        if int(res[0]) in CONTEXT_ERRORS:
            self.force_current(dev)
            res = fn(*args)
        return check(res, what, dev)

    def priority_range(self, dev: Dev) -> tuple[int, int]:
        """CUDA's (lowest, highest) stream priority on ``dev``: (0, -5) on
        current GPUs, a lower number more urgent."""
        least, greatest = self._call(
            dev, "cuCtxGetStreamPriorityRange", self._cu.cuCtxGetStreamPriorityRange
        )
        return int(least), int(greatest)

    def stream_priorities(self, device: int) -> int:
        least, greatest = self.priority_range(self._dev(device))
        return least - greatest

    # -- reserved SMs: green contexts (._green) ------------------------------------
    def sm_count(self, device: int) -> int:
        return _green.sm_count(self._cu, self._dev(device))

    def release_partitions(self, partitions: Sequence[Any]) -> None:
        gone = [p for p in self._partitions if p in partitions]
        self._partitions = [p for p in self._partitions if p not in partitions]
        _green.destroy(self._cu, gone)

    def partition_sms(self, device: int, sizes: Sequence[int]) -> list[Any]:
        parts = _green.partition_sms(self._cu, self._call, self._dev(device), sizes)
        self._partitions += parts
        return parts

    def partition_size(self, partition: RawPartition) -> int:
        return int(cast(CudaPartition, partition).sms)

    def _setup_context(self, dev: Dev) -> None:
        """What each life of a primary context needs: pool settings, a private stream."""
        cu = self._cu
        (pool,) = self._call(
            dev, "cuDeviceGetDefaultMemPool", cu.cuDeviceGetDefaultMemPool, dev.cudev
        )
        dev.pool = pool
        # keep freed memory in the pool: returning it to the OS at each sync costs
        threshold = cu.cuuint64_t(0xFFFFFFFFFFFFFFFF)
        self._call(
            dev,
            "cuMemPoolSetAttribute",
            cu.cuMemPoolSetAttribute,
            pool,
            cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            threshold,
        )
        # never reuse memory freed on another stream by making the allocating
        # stream wait for that stream's work: an allocation on an idle stream
        # would queue behind long (or abandoned) work elsewhere.  Reuse that
        # needs no new dependency (the free is done, or already ordered) stays.
        self._call(
            dev,
            "cuMemPoolSetAttribute",
            cu.cuMemPoolSetAttribute,
            pool,
            cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            0,
        )
        (side,) = self._call(dev, "cuStreamCreate", cu.cuStreamCreate, STREAM_NON_BLOCKING)
        dev.side = int(side)

    def _enable_peers(self, dev: Dev) -> None:
        """Peer access from ``dev`` to every capable device, both for contexts and pools."""
        cu = self._cu
        for j in dev.peers:
            other = self._devices[j]
            try:
                self.make_current(dev)
                res = cu.cuCtxEnablePeerAccess(other.ctx, 0)
                if int(res[0]) != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:  # (before a reset)
                    check(res, "cuCtxEnablePeerAccess", dev)
                desc = cu.CUmemAccessDesc()
                desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = dev.index
                desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                self._call(
                    other, "cuMemPoolSetAccess", cu.cuMemPoolSetAccess, other.pool, [desc], 1
                )
            except DeviceError as exc:
                warnings.warn(
                    f"gpuflow: peer access {dev.index} -> {j} not enabled: {exc}", stacklevel=2
                )

    def _dev(self, device: int) -> Dev:
        return self._lookup(self._devices, device)

    device_state = _dev

    def live_device(self, stream: CudaStream) -> Dev:
        """The stream's device, after the fault and stale-handle checks of an enqueue."""
        dev = stream.dev
        if dev.fault is not None:
            raise dev.fault
        if stream.token is not dev.token:
            raise UsageError(f"{stream!r} was created before its device was reset")
        if stream.destroyed:
            raise UsageError(f"{stream!r} was destroyed")
        return dev

    # -- other libraries' streams and memory, in the primary contexts -----------------
    def foreign_stream(
        self, handle: int, device: int, named: bool = False
    ) -> tuple[RawStream, int]:
        if named:
            # the library says the stream is on ``device``, and the driver said
            # so of ``handle`` before, in the context ``device`` still has
            # (a handle reused by another stream of it names the same thing)
            stream = self._foreign_streams.get((handle, device))
            if stream is not None and stream.token is stream.dev.token:
                if stream.dev.fault is not None:
                    raise stream.dev.fault
                return RawStream(stream), device
        if handle in DEFAULT_STREAM_HANDLES:
            dev = self._dev(device)
        else:
            err, ctx = self._cu.cuStreamGetCtx(handle)
            if err:
                raise UsageError(
                    f"0x{handle:x} is not a CUDA stream the driver knows ({err_name(int(err))})"
                )
            found = self._dev_of_ctx(int(ctx))
            if found is None:
                raise UsageError(
                    f"stream 0x{handle:x} belongs to a CUDA context that is not the primary "
                    "context of one of gpuflow's devices (gpuflow, PyTorch and CuPy all work "
                    "in primary contexts)"
                )
            dev = found
        if dev.fault is not None:
            raise dev.fault
        # one backend stream for a handle in a context life (the driver said
        # which context the handle is in just now, so a handle reused by
        # another context's stream is another key)
        key = (handle, dev.index)
        stream = self._foreign_streams.get(key)
        if stream is None or stream.token is not dev.token:
            stream = CudaStream(dev, self._cu.CUstream(handle), None)
            stream.foreign = True
            if len(self._foreign_streams) >= _MAX_FOREIGN_STREAMS:
                self._foreign_streams.clear()
            self._foreign_streams[key] = stream
        return RawStream(stream), dev.index

    def _foreign_call(self, dev: Dev, fn: Callable[[], T]) -> T:
        """``fn()`` with ``dev``'s context current, and then the calling thread's own
        context current again: a call on another library's stream may run inside
        that library's code (a DLPack deleter), which must find its thread as it
        left it."""
        err, current = self._cu.cuCtxGetCurrent()
        if err:
            raise error_for(int(err), "cuCtxGetCurrent", dev)
        prev = int(current)
        if prev == dev.ctx:
            self.thread_state.token = dev.token  # current already (the common case): no call
        else:
            self.force_current(dev)
        try:
            return fn()
        finally:
            if prev != dev.ctx:
                self._n.ctx_set_current(prev or None)
                self.thread_state.token = None  # our cache no longer says what is current

    def foreign_buffer(self, ptr: int, nbytes: int, device: int | None) -> CudaBuffer:
        if nbytes == 0:
            # nothing is ever read or written: any address will do (CAI gives 0)
            return CudaBuffer(self._dev(0 if device is None else device), 0, ptr, foreign=True)
        cu = self._cu
        attr = cu.CUpointer_attribute
        self.make_current(self._devices[0] if device is None else self._dev(device))

        def get(which: object) -> tuple[int, int]:
            res = cu.cuPointerGetAttribute(which, ptr)
            return int(res[0]), (int(res[1]) if int(res[0]) == CUDA_SUCCESS else 0)

        rc, mtype = get(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE)
        if rc:
            raise UsageError(
                f"0x{ptr:x} is not memory the CUDA driver knows ({err_name(rc)}): host memory "
                "from malloc or NumPy? (gf.from_host copies it to the device)"
            )
        if mtype == int(cu.CUmemorytype.CU_MEMORYTYPE_HOST):
            raise UsageError(
                f"0x{ptr:x} is host memory (pinned or registered), not device memory "
                "(gf.from_host copies it to the device)"
            )
        rc, ordinal = get(attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
        if rc or ordinal < 0:  # managed memory may name no device: take the producer's
            ordinal = -1 if device is None else device
        if device is not None and ordinal != device:
            raise UsageError(
                f"0x{ptr:x} is memory of CUDA device {ordinal}, not of device {device} as "
                "its producer says"
            )
        if not 0 <= ordinal < len(self._devices):
            raise UsageError(
                f"0x{ptr:x} is memory of CUDA device {ordinal}, which gpuflow does not use "
                f"(its devices: 0..{len(self._devices) - 1})"
            )
        rc, start = get(attr.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR)
        rc2, size = get(attr.CU_POINTER_ATTRIBUTE_RANGE_SIZE)
        if not rc and not rc2 and ptr + nbytes > start + size:
            raise UsageError(
                f"0x{ptr:x} + {nbytes} bytes runs past the end of its allocation "
                f"(0x{start:x}, {size} bytes)"
            )
        return CudaBuffer(self._devices[ordinal], int(nbytes), ptr, foreign=True)

    # -- devices ------------------------------------------------------------------
    @property
    def device_count(self) -> int:
        return len(self._devices)

    def device_name(self, device: int) -> str:
        return self._dev(device).name

    def device_arch(self, device: int) -> str:
        """``sm_XY`` of ``device`` (what :meth:`load_kernel` asks the module for)."""
        return self._dev(device).arch

    def launch_limits(self, device: int) -> LaunchLimits:
        return self._limits[self._dev(device).index]

    def describe_device(self, device: int) -> DeviceDescription:
        dev = self._dev(device)
        digits = dev.arch.removeprefix("sm_")
        (total,) = check(self._cu.cuDeviceTotalMem(dev.cudev), "cuDeviceTotalMem", dev)
        return DeviceDescription(dev.name, f"{digits[:-1]}.{digits[-1:]}", int(total))

    def memory_reserved(self, device: int) -> int:
        """The device's memory pool's reserved bytes: what gpuflow's arrays
        use and what freed ones left in the pool for reuse (the pool keeps
        it: its release threshold is set to the maximum)."""
        dev = self._dev(device)
        cu = self._cu
        (value,) = self._call(
            dev,
            "cuMemPoolGetAttribute",
            cu.cuMemPoolGetAttribute,
            dev.pool,
            cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        )
        return int(value)

    def driver_version(self) -> str | None:
        (v,) = check(self._cu.cuDriverGetVersion(), "cuDriverGetVersion")
        return f"{int(v) // 1000}.{int(v) % 1000 // 10}"

    # -- faults ---------------------------------------------------------------------------
    def reset_device(self, device: int) -> None:
        dev = self._dev(device)
        cu = self._cu
        trace: list[str] = []
        last = 0

        def step(what: str, res: Any) -> tuple[Any, ...]:
            nonlocal last
            last = int(res[0])
            trace.append(f"{what}: {err_name(last) if last else 'ok'}")
            return tuple(res[1:])

        # each driver result is traced rather than checked: the reset succeeds or
        # fails as a whole (a DeviceFaultError with the last code, below)
        with dev.lock, self._staging.lock:
            # no thread of ours keeps the old context current: this one lets go now,
            # the others set the new one at their next call (the token changes below)
            self._n.ctx_set_current(None)
            self.thread_state.token = None
            ctx: Any = None
            for attempt in range(3):
                if attempt == 2:
                    # last resort: drop the reference taken at start-up, so that the
                    # driver destroys the context, and retain a new one
                    step("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(dev.cudev))
                else:
                    step("cuDevicePrimaryCtxReset", cu.cuDevicePrimaryCtxReset(dev.cudev))
                # a reset does not release our reference; retaining again makes the
                # context live (that extra reference is kept)
                out = step("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev.cudev))
                if last == CUDA_SUCCESS:
                    self._n.ctx_set_current(int(out[0]))
                    last = self._n.ctx_synchronize()
                    trace.append(f"cuCtxSynchronize: {err_name(last) if last else 'ok'}")
                    self._n.ctx_set_current(None)
                    if last == CUDA_SUCCESS:
                        ctx = out[0]
                        break
                    step("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease(dev.cudev))
                time.sleep(0.05)
            self.last_reset_trace = trace
            if ctx is None:
                raise DeviceFaultError(
                    f"CUDA device {dev.index} could not be reset ({'; '.join(trace)}); "
                    "the driver keeps the fault: restart the process",
                    code=last or None,
                    name=err_name(last) if last else None,
                    device=dev.index,
                )
            dev.ctx = int(ctx)
            dev.token = Token()  # every thread sets the new context; old handles are stale
            dev.fault = None
            dev.events = []
            dev.made_events = []
            dev.builtins = None
            self._staging.drop(dev)  # pinned staging memory went with the context
            self._setup_context(dev)
            if self._marks.name == "word":
                WORDS.register_all(self._register_host)  # (registered through the old one)
        self._enable_peers(dev)
        for other in self._devices:
            if dev.index in other.peers:
                self._enable_peers(other)
