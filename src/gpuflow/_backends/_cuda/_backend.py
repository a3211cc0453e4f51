"""The ``cuda`` backend itself: :class:`CudaBackend`, the interface of
:mod:`.._base` on the CUDA driver (streams, events, memory, copies, kernels,
the native half of the completion bridge, communicators and graphs) in the
contexts of :class:`._contexts.CudaContexts` (primary, and green: :mod:`._green`).

Completion bridge, native half: each stream owns a completion word in mapped
host memory (:mod:`._words`); a mark is a ``cuStreamWriteValue64`` of its
number (a mark no loop reads, an event), a wait for it ``cuStreamWaitValue64``,
and a sleeping loop's wake-up a host function that is libc's ``close``
(:mod:`._native`), with no Python and no GIL in the driver's thread.  Where
the driver refuses stream memory operations, marks are events
(``CudaBackend(marks="event")``).
"""

from __future__ import annotations

import ctypes
import gc
import struct
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

import numpy as np

from ..._errors import CommunicatorError, UsageError
from .._codes import (
    CONTEXT_ERRORS,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_SUCCESS,
)
from .._nvrtc import compile_source
from .._records import (
    Activity,
    CollectiveCall,
    HostArray,
    KernelArg,
    ModuleSource,
    PointerArg,
    RawBuffer,
    RawComm,
    RawEvent,
    RawGraph,
    RawKernel,
    RawPartition,
    RawStream,
    Step,
)
from . import _green
from ._contexts import DEFAULT_STREAM_HANDLES, STREAM_NON_BLOCKING, CudaContexts, T
from ._driver import check, error_for, warn_unless_fault
from ._green import CudaPartition
from ._handles import (
    Capture,
    CudaBuffer,
    CudaEvent,
    CudaGraph,
    CudaKernel,
    CudaStream,
    Dev,
    Token,
)
from ._kernels import (
    ARANGE_F32_STRUCT,
    ARANGE_F64_STRUCT,
    BUILTIN_SOURCE,
    BUILTIN_STRUCT,
    FILL_MAX_BLOCKS,
    FILL_STRUCT,
    FILL_THREADS,
    UINT_OF_SIZE,
    VALUES_OFFSET,
    arange_kernel,
    packed,
    plan,
)
from ._modules import Modules
from ._nccl import NcclComm, NcclComms
from ._staging import STAGE_H2D_MIN, STAGE_MAX, Pending
from ._timing import Timer
from ._words import WORDS, WordMarks


class CudaBackend(CudaContexts):
    """CUDA devices through the driver API: one primary context per device."""

    def __init__(self, num_devices: int | None = None, *, marks: str = "auto") -> None:
        """``marks``: how a completion mark is made.  ``"word"``: the stream
        writes the mark's number into its completion word (stream memory
        operations); ``"event"``: an event is recorded and queried;
        ``"auto"`` (the default): words where the driver takes stream memory
        operations, else events."""
        super().__init__(num_devices, marks=marks)
        self._launch = self._cu.cuLaunchKernel
        self._timer = Timer(self._cu, self._n, self.make_current)  # the activity record
        self._nccl = NcclComms(self)
        self._plans: dict[tuple[type, ...], struct.Struct] = {}
        self._loaded = Modules(self, self._cu, self._call)
        self._stream_lock = threading.Lock()

    # -- streams ------------------------------------------------------------------
    def create_stream(
        self, device: int, priority: int = 0, partition: RawPartition | None = None
    ) -> RawStream:
        part = cast(CudaPartition | None, partition)
        dev = self._dev(device)
        if dev.fault is not None:
            raise dev.fault
        least = self.priority_range(dev)[0] if priority or part is not None else 0
        if part is not None:
            h = _green.create_stream(self._cu, self._call, part, least - priority)
        elif priority:
            (h,) = self._call(
                dev, "cuStreamCreateWithPriority", self._cu.cuStreamCreateWithPriority,
                STREAM_NON_BLOCKING, least - priority,
            )  # fmt: skip
        else:
            (h,) = self._call(dev, "cuStreamCreate", self._cu.cuStreamCreate, STREAM_NON_BLOCKING)
        word = WORDS.take(self._register_host) if self._marks.name == "word" else None
        return RawStream(CudaStream(dev, h, word, part))

    def destroy_stream(self, stream: RawStream) -> None:
        s = cast(CudaStream, stream)
        if s.foreign:
            return  # another library's: never ours to destroy
        try:
            dev = s.dev
            # a stream is dropped (its finalizer, on any thread) while the
            # completer may be querying it: a query must never use a handle
            # destroyed under it
            with self._stream_lock:
                if s.destroyed:
                    return
                s.destroyed = True
                live = s.token is dev.token and dev.fault is None
                if live:
                    self.make_current(dev)
                marks = self._marks
                if s.word is not None and (
                    not live or not isinstance(marks, WordMarks) or marks.seal(dev, s)
                ):
                    WORDS.give_back(s.word, s.issued)
                if not live:
                    return  # gone with the context, or a faulted one: leak
                (err,) = self._cu.cuStreamDestroy(s.handle)
                # its events (its marks', the one before its last capture): the
                # pool's again, free to record elsewhere
                with s.mark_lock:
                    while s.mark_events:
                        dev.events.append(s.mark_events.popleft()[1])
                if s.pre_capture:
                    dev.events.append(s.pre_capture)
                    s.pre_capture = 0
            if int(err):
                warn_unless_fault(int(err), "cuStreamDestroy", dev, f"destroying {stream!r}")
        except Exception as exc:
            warnings.warn(f"gpuflow: destroying {stream!r} failed: {exc!r}", stacklevel=2)

    def live_objects(self) -> dict[str, list[Any]]:
        self._staging.sweep_all()  # (copies done are delivered: their buffers free)
        with self._staging.lock:
            staging = [p.buf for dev in self._devices for p in dev.pending]
            copying = {p.event for dev in self._devices for p in dev.pending}
        return {
            "partitions": list(self._partitions),
            "staging": staging,
            "events": _events_unheld(self._devices, copying),
        }

    def stream_destroyed(self, stream: RawStream) -> bool:
        return bool(cast(CudaStream, stream).destroyed)

    def stream_handle(self, stream: RawStream) -> int:
        return int(cast(CudaStream, stream).handle)

    def synchronize(self, stream: RawStream) -> None:
        s = cast(CudaStream, stream)
        dev = s.dev
        if dev.fault is not None:
            raise dev.fault
        if s.capture is not None:
            raise UsageError("cannot synchronize a stream while it is being captured")
        if s.token is not dev.token or s.destroyed:
            return  # its work went with the context (or the stream is gone)
        self.make_current(dev)
        rc = self._n.stream_synchronize(s.handle)
        if rc:
            raise error_for(rc, "cuStreamSynchronize", dev)
        if self._staging.d2h_pending:
            self._staging.sweep_all()

    def query(self, stream: RawStream) -> bool:
        s = cast(CudaStream, stream)
        dev = s.dev
        if dev.fault is not None:
            raise dev.fault
        if s.foreign:
            # another library's stream may be gone by now: ask the events of
            # our marks on it instead (a fault's sticky code is recorded)
            reached = self._foreign_marks.reached(s)
            if dev.fault is not None:
                raise dev.fault
            return bool(reached >= s.issued)
        with self._stream_lock:  # not destroyed while we ask
            if s.token is not dev.token or s.destroyed:
                return True
            self.make_current(dev)
            if s.capture is not None:
                # querying a capturing stream would invalidate the capture: ask about
                # the work enqueued before it began instead
                rc = self._n.event_query(s.pre_capture) if s.pre_capture else CUDA_SUCCESS
            else:
                rc = self._n.stream_query(s.handle)
        if rc == CUDA_SUCCESS:
            if self._staging.d2h_pending:
                self._staging.sweep_all()
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        raise error_for(rc, "cuStreamQuery", dev)

    # -- events -------------------------------------------------------------------
    def record_event(self, stream: RawStream) -> RawEvent:
        s = cast(CudaStream, stream)
        dev = self.live_device(s)
        if s.foreign:
            return self._foreign_call(
                dev, lambda: RawEvent(CudaEvent(dev, self._record(dev, s.handle), None))
            )
        self.make_current(dev)
        return RawEvent(CudaEvent(dev, self._record(dev, s.handle), s.capture))

    def _worth_waiting(self, dev: Dev, other: Dev, token: Token) -> bool:
        """Whether work of ``other``'s context life ``token`` is left to wait
        for (a reset context took its work with it); another device's fault
        is raised."""
        if token is not other.token:
            return False
        if other.fault is not None and other is not dev:
            raise other.fault
        return True

    def wait_event(self, stream: RawStream, event: RawEvent) -> None:
        s = cast(CudaStream, stream)
        ev = cast(CudaEvent, event)
        dev = self.live_device(s)
        if not self._worth_waiting(dev, ev.dev, ev.token):
            return
        if s.foreign:
            if ev.capture is not None:
                raise UsageError(
                    "another library's stream cannot wait on work being captured into a graph"
                )
            rc = self._foreign_call(
                dev, lambda: self._n.stream_wait_event(s.handle, ev.handle, 0)
            )
            if rc:
                raise error_for(rc, "cuStreamWaitEvent", dev)
            return
        self.make_current(dev)
        if ev.capture is not None and s.capture is None:
            # CUDA's fork: waiting on an event recorded in a capture joins it.  What
            # the stream had before is marked for query (which must not touch it now).
            pre = self._record(dev, s.handle)
            if s.pre_capture:
                dev.events.append(s.pre_capture)
            s.pre_capture = pre
            s.capture = ev.capture
            ev.capture.streams.append(s)
        rc = self._n.stream_wait_event(s.handle, ev.handle, 0)
        if rc:
            raise error_for(rc, "cuStreamWaitEvent", dev)

    # -- memory -------------------------------------------------------------------
    def alloc(self, device: int, nbytes: int, stream: RawStream) -> CudaBuffer:
        s = cast(CudaStream, stream)
        dev = self._dev(device)
        self.live_device(s)
        if dev.fault is not None:
            raise dev.fault
        self.make_current(dev)
        # During a capture (or for another device than the stream's) the memory is
        # taken outside the graph, on a private stream, and made usable at once:
        # the graph then sees fixed addresses, as the sim backend does.
        side = s.capture is not None or s.dev is not dev
        h = dev.side if side else s.handle
        size = max(int(nbytes), 1)
        out = ctypes.c_uint64()
        rc = self._n.mem_alloc_async(ctypes.byref(out), size, h)
        if rc == CUDA_ERROR_OUT_OF_MEMORY:
            # memory freed to the pool but cached there: give it back and retry once
            # (the trim's own result does not matter: the retry's does)
            self._cu.cuMemPoolTrimTo(dev.pool, 0)
            rc = self._n.mem_alloc_async(ctypes.byref(out), size, h)
        if rc:
            oom = f"out of memory on CUDA device {dev.index}: {nbytes} bytes requested"
            raise error_for(
                rc, "cuMemAllocAsync", dev, message=oom if rc == CUDA_ERROR_OUT_OF_MEMORY else None
            )
        if side:
            rc = self._n.stream_synchronize(dev.side)
            if rc:
                raise error_for(rc, "cuStreamSynchronize", dev)
        return CudaBuffer(dev, int(nbytes), int(out.value))

    def free(self, buffer: RawBuffer, stream: RawStream) -> None:
        b = cast(CudaBuffer, buffer)
        s = cast(CudaStream, stream)
        try:
            if b.freed or b.foreign:
                return  # (another library's memory is never ours to free)
            dev = b.dev
            if dev.fault is not None or b.token is not dev.token:
                b.freed = True  # the context is gone with its memory, or faulted: leak
                return
            sdev = s.dev
            if s.token is not sdev.token or sdev.fault is not None:
                b.freed = True  # its stream's work may never finish: leak
                return
            if s.destroyed:
                warnings.warn(
                    f"gpuflow: {buffer!r} freed on a destroyed stream: leaked", stacklevel=2
                )
                b.freed = True
                return
            if s.capture is not None:
                # a free in a capture would be a graph node, legal only for graph memory:
                # free it on the stream when the capture ends instead
                s.capture.deferred_frees.append((b, s))
                return
            self.make_current(sdev)
            rc = self._n.mem_free_async(b.ptr, s.handle)
            if rc in CONTEXT_ERRORS:
                self.force_current(sdev)
                rc = self._n.mem_free_async(b.ptr, s.handle)
            b.freed = True
            if rc:
                warn_unless_fault(rc, "cuMemFreeAsync", sdev, f"freeing {buffer!r}")
        except Exception as exc:  # a finalizer must not raise
            warnings.warn(f"gpuflow: freeing {buffer!r} failed: {exc!r}", stacklevel=2)

    # -- copies (through pinned staging buffers: ._staging) -----------------------
    def copy_from_host(self, dst: RawBuffer, src: HostArray, stream: RawStream) -> None:
        d = cast(CudaBuffer, dst)
        s = cast(CudaStream, stream)
        dev = self.live_device(s)
        n = int(src.nbytes)
        if n == 0:
            return
        if not src.flags.c_contiguous:
            raise UsageError("copy_from_host needs a C-contiguous array")
        if n > d.nbytes:
            raise UsageError(f"copy of {n} bytes into {dst!r}")
        buf = None
        if s.capture is None and STAGE_H2D_MIN <= n <= STAGE_MAX:
            buf = self._staging.get(dev, n)
        self.make_current(dev)
        cu = self._cu
        timed = None
        if self._timer.records:
            timed = self._timer.start(dev, s, f"copy to {dst!r}")
        if buf is None:
            self._call(
                dev, "cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync,
                d.ptr, src.ctypes.data, n, s.handle,
            )  # fmt: skip
            self._timer.end(timed)
            return
        buf.array[:n] = src.reshape(-1).view(np.uint8)
        # (on an error below the staging buffer is dropped, never reused)
        self._call(
            dev, "cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync, d.ptr, buf.ptr, n, s.handle
        )
        self._timer.end(timed)
        ev = self._record(dev, s.handle)
        self._staging.done(dev, Pending(ev, buf, None, n))

    def copy_to_host(self, dst: HostArray, src: RawBuffer, stream: RawStream) -> None:
        sb = cast(CudaBuffer, src)
        s = cast(CudaStream, stream)
        dev = self.live_device(s)
        n = int(dst.nbytes)
        if n == 0:
            return
        if not dst.flags.c_contiguous:
            raise UsageError("copy_to_host needs a C-contiguous array")
        if n > sb.nbytes:
            raise UsageError(f"copy of {n} bytes from {src!r}")
        buf = None
        if s.capture is None and n <= STAGE_MAX:
            buf = self._staging.get(dev, n)
        self.make_current(dev)
        cu = self._cu
        timed = None
        if self._timer.records:
            timed = self._timer.start(dev, s, f"copy from {src!r}")
        if buf is None:
            # pageable destination: the driver returns only once the copy is done
            self._call(
                dev, "cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync,
                dst.ctypes.data, sb.ptr, n, s.handle,
            )  # fmt: skip
            self._timer.end(timed)
            return
        flat = dst.reshape(-1).view(np.uint8)
        self._call(
            dev, "cuMemcpyDtoHAsync", cu.cuMemcpyDtoHAsync, buf.ptr, sb.ptr, n, s.handle
        )
        self._timer.end(timed)
        ev = self._record(dev, s.handle)
        self._staging.done(dev, Pending(ev, buf, flat, n))

    def copy_device(self, dst: RawBuffer, src: RawBuffer, nbytes: int, stream: RawStream) -> None:
        d = cast(CudaBuffer, dst)
        sb = cast(CudaBuffer, src)
        s = cast(CudaStream, stream)
        dev = self.live_device(s)
        if nbytes <= 0:
            return
        cu = self._cu
        timed = None
        if self._timer.records:
            self.make_current(dev)
            timed = self._timer.start(dev, s, f"copy {src!r} -> {dst!r}")
        # (the bindings take the stream object faster than its handle)
        if d.dev is not sb.dev:
            self._call(
                dev, "cuMemcpyPeerAsync", cu.cuMemcpyPeerAsync,
                d.ptr, d.dev.ctx, sb.ptr, sb.dev.ctx, nbytes, s.obj,
            )  # fmt: skip
        else:
            self._call(
                dev, "cuMemcpyDtoDAsync", cu.cuMemcpyDtoDAsync,
                d.ptr, sb.ptr, nbytes, s.obj,
            )  # fmt: skip
        if timed is not None:
            self._timer.end(timed)

    # -- fills (memset, or a built-in kernel: ._kernels) ------------------------------
    def load_ahead(
        self, device: int, module: ModuleSource | None, partitions: Sequence[Any]
    ) -> None:
        self._loaded.ahead(self._dev(device), module, partitions)

    def _launch_builtin(
        self, dev: Dev, stream: CudaStream, fname: str, st: struct.Struct, values: tuple[Any, ...]
    ) -> None:
        green = stream.green  # (a green context loads a copy of its own)
        func = self._loaded.builtin(dev, fname) if green is None else _green.function(
            self._cu, green, compile_source(BUILTIN_SOURCE, dev.arch, ()), fname)  # fmt: skip
        count = int(values[-1])
        blocks = min((count + FILL_THREADS - 1) // FILL_THREADS, FILL_MAX_BLOCKS)
        ts = self.make_current(dev)
        st.pack_into(ts.params, VALUES_OFFSET, *values)
        (err,) = self._cu.cuLaunchKernel(
            func, blocks, 1, 1, FILL_THREADS, 1, 1, 0, stream.obj, ts.params_addr, 0
        )
        if err:
            raise error_for(int(err), f"built-in kernel {fname}", dev, launch=True)

    def fill(self, dst: RawBuffer, value: np.generic, count: int, stream: RawStream) -> None:
        d = cast(CudaBuffer, dst)
        s = cast(CudaStream, stream)
        dev = self.live_device(s)
        if count <= 0:
            return
        timed = None
        if self._timer.records:
            self.make_current(dev)
            timed = self._timer.start(dev, s, f"fill of {dst!r}")
        self._fill(dev, d, value, count, s)
        self._timer.end(timed)

    def _fill(
        self, dev: Dev, dst: CudaBuffer, value: np.generic, count: int, stream: CudaStream
    ) -> None:
        size = value.dtype.itemsize
        bits = value.tobytes()
        cu = self._cu
        h = stream.handle
        if size == 1:
            self._call(dev, "cuMemsetD8Async", cu.cuMemsetD8Async, dst.ptr, bits[0], count, h)
        elif size == 2:
            v = int.from_bytes(bits, "little")
            self._call(dev, "cuMemsetD16Async", cu.cuMemsetD16Async, dst.ptr, v, count, h)
        elif size == 4:
            v = int.from_bytes(bits, "little")
            self._call(dev, "cuMemsetD32Async", cu.cuMemsetD32Async, dst.ptr, v, count, h)
        elif size == 8 and bits[:4] == bits[4:]:
            v = int.from_bytes(bits[:4], "little")
            self._call(dev, "cuMemsetD32Async", cu.cuMemsetD32Async, dst.ptr, v, 2 * count, h)
        elif size == 8:
            v = int.from_bytes(bits, "little")
            self._launch_builtin(dev, stream, "gf_fill_u64", FILL_STRUCT, (dst.ptr, v, count))
        else:
            raise UsageError(f"fill does not support dtype {value.dtype} on the cuda backend")

    def arange(
        self, dst: RawBuffer, start: np.generic, step: np.generic, count: int, stream: RawStream
    ) -> None:
        d = cast(CudaBuffer, dst)
        s = cast(CudaStream, stream)
        dev = self.live_device(s)
        if count <= 0:
            return
        dtype = start.dtype
        fname = arange_kernel(dtype)
        step_: Any = np.asarray(step).astype(dtype)[()]
        step = step_
        if dtype.kind == "f" and dtype.itemsize != 2:
            a: Any = float(start)
            b: Any = float(step)
            st = ARANGE_F32_STRUCT if dtype.itemsize == 4 else ARANGE_F64_STRUCT
        else:
            u = UINT_OF_SIZE[dtype.itemsize]
            a = int(np.asarray(start).view(u)[()])
            b = int(np.asarray(step).view(u)[()])
            if dtype.kind == "b":
                a, b = int(bool(a)), int(bool(b))
            st = BUILTIN_STRUCT
        timed = None
        if self._timer.records:
            self.make_current(dev)
            timed = self._timer.start(dev, s, f"arange into {dst!r}")
        self._launch_builtin(dev, s, fname, st, (d.ptr, a, b, count))
        self._timer.end(timed)

    # -- kernels --------------------------------------------------------------------
    def load_kernel(self, device: int, module: ModuleSource, name: str) -> RawKernel:
        return RawKernel(self._loaded.kernel(self._dev(device), module, name))

    def launch(
        self,
        kernel: RawKernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shmem: int,
        args: Sequence[KernelArg],
        stream: RawStream,
    ) -> None:
        k = cast(CudaKernel, kernel)
        s = cast(CudaStream, stream)
        dev = s.dev
        if dev.fault is not None:
            raise dev.fault
        if k.token is not dev.token or s.token is not dev.token or s.destroyed:
            self._stale_launch(k, s)
        ts = self.thread_state
        if ts.token is not dev.token:
            self.make_current(dev)
        if args:
            key = tuple(map(type, args))
            st = self._plans.get(key)
            if st is None:
                st = self._plans[key] = plan(key)
            st.pack_into(
                ts.params,
                VALUES_OFFSET,
                *[a.buffer.ptr if type(a) is PointerArg else a for a in args],
            )
            params = ts.params_addr
        else:
            params = 0
        gx, gy, gz = grid
        bx, by, bz = block
        timer = self._timer
        timed = timer.start(dev, s, f"kernel {k.name!r}") if timer.records else None
        func = k.obj
        if s.green is not None:  # (its own copy of the kernel, in its green ctx)
            func = _green.function(self._cu, s.green, k.image, k.name)
        # cuda.bindings' cuLaunchKernel (Cython, GIL released) with the parameter array's
        # address: measured faster than libcuda through ctypes, whose 11 converted
        # arguments cost more than the bindings' whole call
        (err,) = self._launch(func, gx, gy, gz, bx, by, bz, shmem, s.obj, params, 0)
        if err:
            try:
                self._launch_failed(int(err), k, grid, block, shmem, params, s)
            except BaseException:
                timer.drop(timed)
                raise
        if timed is not None:
            timer.end(timed)

    def prepare_launch(
        self,
        kernel: RawKernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shmem: int,
        args: Sequence[KernelArg],
    ) -> Step:
        k = cast(CudaKernel, kernel)
        # the arguments are packed once, into an array of the step's own
        # (the driver copies them at each launch; an array's address is its
        # allocation's for good, and whoever prepares the step keeps the
        # allocation); a launch where anything is not as usual (a fault, a
        # reset, another thread's context, the activity record) goes through
        # launch(), which checks and times it
        values = tuple(a.buffer.ptr if type(a) is PointerArg else a for a in args)
        keep, params = packed(tuple(map(type, args)), values) if args else (None, 0)
        launch, launch_failed, f = self.launch, self._launch_failed, self._launch
        obj, tls, timer = k.obj, self.thread_state, self._timer
        gx, gy, gz = grid
        bx, by, bz = block

        def step(stream: CudaStream, _keep: object = keep) -> None:
            dev = stream.dev
            if (
                dev.fault is not None
                or k.token is not dev.token
                or stream.token is not dev.token
                or stream.destroyed
                or tls.token is not dev.token
                or timer.records
                or stream.green is not None
            ):
                launch(kernel, grid, block, shmem, args, RawStream(stream))
                return
            (err,) = f(obj, gx, gy, gz, bx, by, bz, shmem, stream.obj, params, 0)
            if err:
                launch_failed(int(err), k, grid, block, shmem, params, stream)

        # (typed with its own stream class: it is only ever given this backend's)
        return cast(Step, step)

    def _stale_launch(self, kernel: CudaKernel, stream: CudaStream) -> NoReturn:
        if kernel.token is not kernel.dev.token:
            raise UsageError(f"kernel {kernel.name!r} was loaded before its device was reset")
        self.live_device(stream)
        raise UsageError(f"kernel {kernel.name!r} belongs to another device than {stream!r}")

    def _launch_failed(
        self,
        rc: int,
        kernel: CudaKernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shmem: int,
        params: int,
        stream: CudaStream,
    ) -> None:
        dev = stream.dev
        retry = False
        if rc in CONTEXT_ERRORS:
            self.force_current(dev)
            retry = True
        elif rc == CUDA_ERROR_INVALID_VALUE and shmem > kernel.shmem_max:
            # more than 48 KiB of dynamic shared memory must be opted into
            cu = self._cu
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            (err,) = cu.cuFuncSetAttribute(kernel.obj, attr, shmem)
            if int(err) == CUDA_SUCCESS:  # else the launch's own error is the one to report
                kernel.shmem_max = shmem
                retry = True
        if retry:
            (err,) = self._launch(kernel.obj, *grid, *block, shmem, stream.obj, params, 0)
            rc = int(err)
            if rc == CUDA_SUCCESS:
                return
        raise error_for(
            rc,
            f"launch of kernel {kernel.name!r} with grid={tuple(grid)} block={tuple(block)} "
            f"shmem={shmem}",
            dev,
            launch=True,
        )

    # -- the native half of the completion bridge -------------------------------------
    def mark(self, stream: RawStream, polled: bool = True) -> int:
        s = cast(CudaStream, stream)
        dev = s.dev
        if (
            dev.fault is None
            and s.token is dev.token
            and not s.destroyed
            and s.capture is None
            and self.thread_state.token is dev.token
        ):
            # every run's mark: what the checks below let through, without
            # their calls (another library's stream named by its handle
            # needs no context of ours: a default stream's is asked below)
            if not s.foreign:
                return self._marks.mark(dev, s, polled)
            if s.handle not in DEFAULT_STREAM_HANDLES:
                return self._foreign_mark(dev, s)
        dev = self.live_device(s)
        if s.capture is not None:
            raise UsageError("a completion mark cannot be captured into a graph")
        if s.foreign:
            return self._ours_on_foreign(dev, s, lambda: self._foreign_mark(dev, s))
        if self.thread_state.token is not dev.token:
            self.make_current(dev)
        return self._marks.mark(dev, s, polled)

    def marker(self, stream: RawStream) -> Callable[[bool], int]:
        s = cast(CudaStream, stream)
        marks = self._marks
        if s.foreign or not isinstance(marks, WordMarks) or marks.bound is None:
            return super().marker(stream)
        return marks.marker(s, self.thread_state, self.mark)

    def _foreign_mark(self, dev: Dev, stream: CudaStream) -> int:
        if self._capturing(dev, stream):
            raise UsageError(
                f"{stream!r} is being captured into a graph: a completion mark cannot be "
                "enqueued there"
            )
        return self._foreign_marks.mark(dev, stream)

    def completion_reader(self, stream: RawStream) -> Callable[[], int]:
        s = cast(CudaStream, stream)
        return (self._foreign_marks if s.foreign else self._marks).reader(s)

    def wait_mark(self, stream: RawStream, other: RawStream, number: int) -> None:
        s = cast(CudaStream, stream)
        o = cast(CudaStream, other)
        dev = self.live_device(s)
        if not self._worth_waiting(dev, o.dev, o.token):
            return
        marks = self._foreign_marks if o.foreign else self._marks
        if s.foreign:
            rc = self._foreign_call(dev, lambda: marks.wait(dev, s, o, number))
        else:
            if self.thread_state.token is not dev.token:
                self.make_current(dev)
            rc = marks.wait(dev, s, o, number)
        if rc:
            raise error_for(rc, "cuStreamWaitValue64", dev)

    def enqueue_close(self, stream: RawStream, fd: int) -> bool:
        s = cast(CudaStream, stream)
        dev = self.live_device(s)
        if s.capture is not None:
            return False  # a host node would close the fd again at every replay
        if s.foreign:
            return self._ours_on_foreign(dev, s, lambda: self._close_after(dev, s, fd))
        if self.thread_state.token is not dev.token:
            self.make_current(dev)
        return self._close_after(dev, s, fd)

    def _close_after(self, dev: Dev, stream: CudaStream, fd: int) -> bool:
        if stream.foreign and self._capturing(dev, stream):
            return False  # (another library's capture: as one of ours)
        rc = self._n.launch_host_func(stream.handle, self._n.close_addr, fd)
        if rc:
            raise error_for(rc, "cuLaunchHostFunc", dev)
        return True

    def stream_capturing(self, stream: RawStream) -> bool:
        s = cast(CudaStream, stream)
        if not s.foreign:
            return s.capture is not None
        dev = self.live_device(s)
        return self._ours_on_foreign(dev, s, lambda: self._capturing(dev, s))

    def _ours_on_foreign(self, dev: Dev, stream: CudaStream, fn: Callable[[], T]) -> T:
        """``fn()`` on another library's stream, called by gpuflow's own code
        (never from inside that library's, which _foreign_call leaves its
        thread to as it found it).  A default stream's handle names the
        stream of whatever context is current: that must really be
        ``dev``'s, whichever another library made current since gpuflow
        last did, so it is asked; any other handle names its own context."""
        if stream.handle in DEFAULT_STREAM_HANDLES:
            return self._foreign_call(dev, fn)
        if self.thread_state.token is not dev.token:
            self.make_current(dev)
        return fn()

    def _capturing(self, dev: Dev, stream: CudaStream) -> bool:
        """Whether another library captures ``stream`` (its context current)."""
        err, status = self._cu.cuStreamIsCapturing(stream.obj)
        if err:
            raise error_for(int(err), "cuStreamIsCapturing", dev)
        return int(status) != 0

    def complete_transfers(self, stream: RawStream) -> None:
        if self._staging.d2h_pending:
            self._staging.sweep_all()

    # -- communicators: NCCL (._nccl) ---------------------------------------------------
    def comm_unique_id(self) -> bytes:
        return self._nccl.unique_id()

    def comm_init(
        self, devices: Sequence[int], ranks: Sequence[int], nranks: int, unique_id: bytes | None
    ) -> list[RawComm]:
        comms = self._nccl.init([self._dev(d) for d in devices], ranks, nranks, unique_id)
        return [RawComm(c) for c in comms]

    def comm_group(self, calls: Sequence[tuple[RawComm, CollectiveCall, RawStream]]) -> None:
        own = [(cast(NcclComm, c), call, cast(CudaStream, s)) for c, call, s in calls]
        for _comm, _call, stream in own:
            self.live_device(stream)
        self._nccl.group(own)

    def prepare_collective(self, comm: RawComm, call: CollectiveCall) -> Step:
        # (typed with its own stream class: it is only ever given this backend's)
        return cast(Step, self._nccl.prepare(cast(NcclComm, comm), call))

    def comm_async_error(self, comm: RawComm) -> CommunicatorError | None:
        return self._nccl.async_error(cast(NcclComm, comm))

    def comm_abort(self, comm: RawComm) -> None:
        self._nccl.abort(cast(NcclComm, comm))

    def comm_destroy(self, comm: RawComm) -> None:
        self._nccl.destroy(cast(NcclComm, comm))

    # -- graphs -------------------------------------------------------------------------
    def begin_capture(self, stream: RawStream) -> None:
        # Relaxed mode: other threads (the completer's queries, finalizers' frees on
        # other streams, other tasks' work) stay legal during a capture; fork/join
        # through record_event/wait_event works in every mode.
        s = cast(CudaStream, stream)
        dev = self.live_device(s)
        if s.capture is not None:
            raise UsageError("the stream is already being captured")
        self.make_current(dev)
        pre = self._record(dev, s.handle)
        cu = self._cu
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        try:
            self._call(dev, "cuStreamBeginCapture", cu.cuStreamBeginCapture, s.handle, mode)
        except BaseException:
            dev.events.append(pre)
            raise
        if s.pre_capture:
            dev.events.append(s.pre_capture)
        s.pre_capture = pre
        s.capture = Capture(s)

    def end_capture(self, stream: RawStream) -> RawGraph:
        s_ = cast(CudaStream, stream)
        cap = s_.capture
        if cap is None:
            raise UsageError("the stream is not being captured")
        dev = s_.dev
        cu = self._cu
        self.make_current(dev)
        res = cu.cuStreamEndCapture(s_.handle)
        for s in cap.streams:
            s.capture = None
        for buffer, s in cap.deferred_frees:
            self.free(buffer, RawStream(s))
        (graph,) = check(res, "cuStreamEndCapture", dev)
        try:
            # with no array to fill, the driver only counts the nodes
            _, nodes = self._call(dev, "cuGraphGetNodes", cu.cuGraphGetNodes, graph, 0)
            (exec_,) = self._call(dev, "cuGraphInstantiate", cu.cuGraphInstantiate, graph, 0)
        except BaseException:
            cu.cuGraphDestroy(graph)  # unchecked: the instantiation's error is the one to raise
            raise
        return RawGraph(CudaGraph(self, dev, int(graph), int(exec_), int(nodes)))

    def graph_node_count(self, graph: RawGraph) -> int:
        return int(cast(CudaGraph, graph).nodes)

    def graph_handle(self, graph: RawGraph) -> int:
        return int(cast(CudaGraph, graph).exec)

    def launch_graph(self, graph: RawGraph, stream: RawStream) -> None:
        g = cast(CudaGraph, graph)
        s = cast(CudaStream, stream)
        dev = self.live_device(s)
        if g.token is not g.dev.token:
            raise UsageError("the graph was captured before its device was reset")
        self.make_current(dev)
        timed = (
            self._timer.start(dev, s, f"graph of {g.nodes} nodes")
            if self._timer.records
            else None
        )
        rc = self._n.graph_launch(g.exec, s.handle)
        if rc:
            self._timer.drop(timed)
            raise error_for(rc, "cuGraphLaunch", dev)
        self._timer.end(timed)

    # -- the activity record (._timing) -----------------------------------------------------
    def start_activity_record(self) -> list[Activity]:
        """Start a record of the kernels, copies, fills and graph replays gpuflow
        enqueues on its own streams, timed by CUDA events; the list fills when
        :meth:`update_activity_records` is called, with the items done by then."""
        return self._timer.open()

    def stop_activity_record(self, record: list[Activity]) -> None:
        self._timer.close(record)

    def update_activity_records(self) -> None:
        self._timer.update()

    def activity_stream_id(self, stream: RawStream) -> int:
        return int(cast(CudaStream, stream).handle)

    def close(self) -> None:
        """Unload the modules (this waits until the device is idle); other
        handles go with the process."""
        for mod in self._loaded.drop():
            mod.unload()
        parts, self._partitions = self._partitions, []
        _green.destroy(self._cu, parts)


def _events_unheld(devices: Sequence[Dev], copying: set[int]) -> list[int]:
    """The CUevents made in the current life of a device's context that are
    neither in its pool nor held by what records or waits with them: an
    event object (:class:`CudaEvent`), a stream's marks or capture, a
    staging copy (``copying``).  Every event made is one of those, at any
    time: one that is not was lost (a leak, until the context goes).  The
    holders are looked for among every object only where the pool and the
    copies do not account for all (a test's end, mostly)."""
    out: set[int] = set()
    for dev in devices:
        out |= set(dev.made_events) - set(dev.events)
    out -= copying
    if not out:
        return []
    ours = {id(dev) for dev in devices}
    for obj in gc.get_objects():
        kind = type(obj)
        if kind is CudaEvent and id(obj.dev) in ours:
            out.discard(obj.handle)
        elif kind is CudaStream and id(obj.dev) in ours:
            out.discard(obj.pre_capture)
            for _number, event in list(obj.mark_events):
                out.discard(event)
    return sorted(out)
