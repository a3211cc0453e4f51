"""libcuda and libc through :mod:`ctypes`: per-operation driver calls, and the host function.

libcuda is called directly for the small calls made once or more per
operation (event record and wait, stream and event query, completion-word
writes and waits, host functions, stream-ordered alloc/free, graph launch),
and necessarily for ``cuLaunchHostFunc``: the bindings' wrapper takes the
GIL when the host function fires (measured: 5 ms stream stalls).  Here the
host function is libc's own ``close`` of a pipe an event loop watches,
called by the driver's thread with no Python involved.

Calls that answer through an out-parameter (``cuCtxGetCurrent``,
``cuStreamIsCapturing``, ``cuStreamGetCtx``) go through cuda-bindings instead,
whose calls return the answer without a ctypes object to fill, in half the
time or less; those with no out-parameter cost the same either way
(docs/performance.md, "Measurements behind the code").
"""

from __future__ import annotations

import ctypes
from typing import Any


class Native:
    """The ctypes entry points (libcuda's, and libc's ``close``)."""

    def __init__(self) -> None:
        vp, ui, ci, u64 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_uint64
        lib = ctypes.CDLL("libcuda.so.1")

        def cu(name: str, argtypes: list[Any]) -> Any:
            f = getattr(lib, name)
            f.argtypes = argtypes
            f.restype = ci
            return f

        self.ctx_set_current = cu("cuCtxSetCurrent", [vp])
        self.ctx_synchronize = cu("cuCtxSynchronize", [])
        self.launch_host_func = cu("cuLaunchHostFunc", [vp, vp, vp])
        self.event_record = cu("cuEventRecord", [vp, vp])
        self.event_query = cu("cuEventQuery", [vp])
        self.stream_wait_event = cu("cuStreamWaitEvent", [vp, vp, ui])
        self.stream_query = cu("cuStreamQuery", [vp])
        self.stream_synchronize = cu("cuStreamSynchronize", [vp])
        # stream memory operations: the v2 entry points (always available
        # since CUDA 12, whatever CAN_USE_STREAM_MEM_OPS_V1 says)
        self.write_value64 = cu("cuStreamWriteValue64_v2", [vp, u64, u64, ui])
        self.wait_value64 = cu("cuStreamWaitValue64_v2", [vp, u64, u64, ui])
        self.graph_launch = cu("cuGraphLaunch", [vp, vp])
        self.mem_alloc_async = cu(
            "cuMemAllocAsync", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, vp]
        )
        self.mem_free_async = cu("cuMemFreeAsync", [ctypes.c_uint64, vp])

        libc = ctypes.CDLL(None, use_errno=True)
        # a host function of one pointer-sized argument: the fd travels as the pointer
        self.close_addr: int = ctypes.cast(libc.close, vp).value or 0
