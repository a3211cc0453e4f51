"""libcuda and libc through :mod:`ctypes`: per-operation driver calls, and semaphores.

libcuda is called directly for the small calls made once or more per
operation (event record and wait, stream and event query, host functions,
stream-ordered alloc/free, graph launch), and necessarily for
``cuLaunchHostFunc``: the bindings' wrapper takes the GIL when the host
function fires (measured: 5 ms stream stalls).  Here the host function is
libc's own ``close`` (of a pipe an event loop watches) or ``sem_post`` (of
the semaphore the dispatcher sleeps on in ``sem_timedwait``; ctypes releases
the GIL), called by the driver's thread with no Python involved.  A
semaphore's memory lives as long as the process: a host function may post
it after its stream and backend are gone.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..._errors import DeviceError


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Native:
    """The ctypes entry points (libcuda's and libc's semaphores)."""

    def __init__(self) -> None:
        vp, ui, ci = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        lib = ctypes.CDLL("libcuda.so.1")

        def cu(name: str, argtypes: list[Any]) -> Any:
            f = getattr(lib, name)
            f.argtypes = argtypes
            f.restype = ci
            return f

        self.ctx_set_current = cu("cuCtxSetCurrent", [vp])
        self.ctx_get_current = cu("cuCtxGetCurrent", [ctypes.POINTER(vp)])
        self.ctx_synchronize = cu("cuCtxSynchronize", [])
        self.launch_host_func = cu("cuLaunchHostFunc", [vp, vp, vp])
        self.event_record = cu("cuEventRecord", [vp, vp])
        self.event_query = cu("cuEventQuery", [vp])
        self.stream_wait_event = cu("cuStreamWaitEvent", [vp, vp, ui])
        self.stream_query = cu("cuStreamQuery", [vp])
        self.stream_synchronize = cu("cuStreamSynchronize", [vp])
        self.graph_launch = cu("cuGraphLaunch", [vp, vp])
        self.mem_alloc_async = cu(
            "cuMemAllocAsync", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, vp]
        )
        self.mem_free_async = cu("cuMemFreeAsync", [ctypes.c_uint64, vp])

        libc = ctypes.CDLL(None, use_errno=True)
        self.sem_post_addr: int = ctypes.cast(libc.sem_post, vp).value or 0
        # a host function of one pointer-sized argument: the fd travels as the pointer
        self.close_addr: int = ctypes.cast(libc.close, vp).value or 0
        self.sem_init = libc.sem_init
        self.sem_init.argtypes = [vp, ci, ui]
        self.sem_init.restype = ci
        self.sem_post = libc.sem_post
        self.sem_post.argtypes = [vp]
        self.sem_post.restype = ci
        self.sem_wait = libc.sem_wait
        self.sem_wait.argtypes = [vp]
        self.sem_wait.restype = ci
        self.sem_trywait = libc.sem_trywait
        self.sem_trywait.argtypes = [vp]
        self.sem_trywait.restype = ci
        self.sem_timedwait = libc.sem_timedwait
        self.sem_timedwait.argtypes = [vp, ctypes.POINTER(Timespec)]
        self.sem_timedwait.restype = ci
        # glibc >= 2.30: a monotonic deadline, immune to wall-clock jumps
        self.sem_clockwait: Any = getattr(libc, "sem_clockwait", None)
        if self.sem_clockwait is not None:
            self.sem_clockwait.argtypes = [vp, ci, ctypes.POINTER(Timespec)]
            self.sem_clockwait.restype = ci

    def new_sem(self) -> tuple[Any, int]:
        buf = ctypes.create_string_buffer(64)  # sizeof(sem_t) is 32 on x86-64 and aarch64
        if self.sem_init(buf, 0, 0) != 0:
            raise DeviceError(f"sem_init failed (errno {ctypes.get_errno()})")
        # a host function may still post it after its stream and backend are
        # gone (a backend replaced by init_device_contexts, say): the memory
        # must never be reused for anything else, so it lives with the process
        _SEMAPHORES.append(buf)
        return buf, ctypes.addressof(buf)


#: Every semaphore a host function may post: 64 bytes a stream, never freed.
_SEMAPHORES: list[Any] = []
