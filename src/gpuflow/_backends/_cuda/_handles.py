"""Handles: a device's state and the driver objects gpuflow hands out.

Handles are plain integers (the cuda.bindings objects are kept only where
the launch path wants them); cuda.core is not used, because its objects
destroy their handles in finalizers of their own, which would run after a
primary-context reset or a sticky fault, where gpuflow must leak instead.
Every handle keeps the :class:`Token` of the context life it was made in:
one made before a reset is stale, and neither used nor destroyed.  The
finalizers here leak rather than destroy anything in a context that is
gone or faulted, and never raise.
"""

from __future__ import annotations

import collections
import threading
import warnings
from typing import TYPE_CHECKING, Any

from ..._errors import DeviceFaultError
from ._driver import driver, warn_unless_fault

if TYPE_CHECKING:
    from ._backend import CudaBackend
    from ._staging import HostBuf, Pending
    from ._words import Word

DEFAULT_SHMEM = 48 * 1024  # dynamic shared memory a kernel may use without opting in


class Token:
    """Identity of one life of a device's primary context (a reset makes a new one)."""

    __slots__ = ()


class Dev:
    """One device and the current life of its primary context: the context, its
    fault, its pools (events, pinned staging buffers) and private stream."""

    __slots__ = (
        "arch",
        "builtins",
        "ctx",
        "cudev",
        "events",
        "fault",
        "free_host",
        "host_bytes",
        "index",
        "lock",
        "made_events",
        "name",
        "peers",
        "pending",
        "pool",
        "side",
        "token",
    )  # fmt: skip

    def __init__(self, index: int, cudev: object, name: str, arch: str) -> None:
        self.index = index
        self.cudev = cudev
        self.ctx = 0
        self.token = Token()
        self.fault: DeviceFaultError | None = None
        self.name = name
        self.arch = arch
        self.pool: Any = None
        self.lock = threading.RLock()
        self.events: list[int] = []  # recycled CUevents (disable-timing)
        #: every CUevent made in this life of the context (for the leak count)
        self.made_events: list[int] = []
        self.side = 0  # a private stream for allocations made during a capture
        self.builtins: dict[str, Any] | None = None
        self.free_host: dict[int, list[HostBuf]] = {}
        self.pending: list[Pending] = []
        self.host_bytes = 0
        self.peers: list[int] = []


class Capture:
    """A stream capture: the streams it joined, and frees deferred to its end."""

    __slots__ = ("deferred_frees", "streams")

    def __init__(self, origin: CudaStream) -> None:
        self.streams: list[CudaStream] = [origin]
        self.deferred_frees: list[tuple[CudaBuffer, CudaStream]] = []


class CudaStream:
    """A non-blocking stream and its completion word (:mod:`._words`).

    ``issued`` is the number of its last mark and ``worded`` that of its
    last mark written into its word; with event marks (and silent ones),
    ``mark_events`` holds the events of the marks not yet seen reached and
    ``reached`` the last one that was.  A *foreign* stream is another
    library's (``foreign_stream``): it has no word, its marks are events,
    gpuflow records events on it and makes it wait, and never destroys it.
    """

    __slots__ = (
        "__weakref__", "capture", "destroyed", "dev", "foreign", "green", "handle", "issued",
        "mark_events", "mark_lock", "obj", "pre_capture", "reached", "token", "word", "worded",
    )  # fmt: skip

    def __init__(self, dev: Dev, handle: Any, word: Word | None, green: Any = None) -> None:
        self.dev = dev
        self.obj = handle  # the cuda.bindings CUstream, for the launch path
        self.handle = int(handle)
        self.word = word
        self.issued = self.reached = self.worded = word.read() if word is not None else 0
        self.mark_events: collections.deque[tuple[int, int]] = collections.deque()
        self.mark_lock = threading.Lock()
        self.token = dev.token
        self.capture: Capture | None = None
        self.pre_capture = 0  # an event recorded just before the capture began
        self.destroyed = False
        self.foreign = False
        #: the partition of reserved SMs (a green context, ._green) it was made in, or None
        self.green = green

    def __repr__(self) -> str:
        kind = "foreign cuda stream" if self.foreign else "cuda stream"
        return f"<{kind} 0x{self.handle:x} on device {self.dev.index}>"


class CudaEvent:
    """A recorded event; its CUevent goes back to the device's pool when dropped."""

    __slots__ = ("capture", "dev", "handle", "token")

    def __init__(self, dev: Dev, handle: int, capture: Capture | None) -> None:
        self.dev = dev
        self.handle = handle
        self.token = dev.token
        self.capture = capture

    def __del__(self) -> None:
        dev = self.dev
        if self.token is dev.token and dev.fault is None:
            dev.events.append(self.handle)


class CudaBuffer:
    """Device memory from the device's stream-ordered pool, or (``foreign``)
    another library's memory, which gpuflow never frees."""

    __slots__ = ("dev", "device", "foreign", "freed", "nbytes", "ptr", "token")

    def __init__(self, dev: Dev, nbytes: int, ptr: int, foreign: bool = False) -> None:
        self.dev = dev
        self.device = dev.index
        self.nbytes = nbytes
        self.ptr = ptr
        self.token = dev.token
        self.freed = False
        self.foreign = foreign

    def __repr__(self) -> str:
        kind = "foreign cuda memory" if self.foreign else "cuda buffer"
        return f"<{kind} 0x{self.ptr:x} ({self.nbytes} bytes) on device {self.device}>"


class CudaModule:
    """A loaded CUmodule, cached by its backend and unloaded when the backend
    closes (never by a finalizer: an unload waits until the device is idle)."""

    __slots__ = ("__weakref__", "backend", "dev", "handle", "token")

    def __init__(self, backend: CudaBackend, dev: Dev, handle: int) -> None:
        self.backend = backend
        self.dev = dev
        self.handle = handle
        self.token: Token | None = dev.token

    def unload(self) -> None:
        """Unload the module (once); a failure is a warning."""
        dev = self.dev
        token, self.token = self.token, None
        if token is not dev.token or dev.fault is not None:
            return  # gone with the context, or a faulted context: leak
        try:
            self.backend.make_current(dev)
            (err,) = driver().cuModuleUnload(self.handle)
            if int(err):
                warn_unless_fault(int(err), "cuModuleUnload", dev, f"unloading {self!r}")
        except Exception as exc:  # closing goes on with the other modules
            warnings.warn(f"gpuflow: unloading {self!r} failed: {exc!r}", stacklevel=2)

    def __repr__(self) -> str:
        return f"<cuda module 0x{self.handle:x} on device {self.dev.index}>"


class CudaKernel:
    """A launchable CUfunction; keeps its module loaded."""

    __slots__ = ("dev", "func", "image", "module", "name", "obj", "shmem_max", "token")

    def __init__(self, dev: Dev, name: str, func: Any, module: CudaModule, image: bytes) -> None:
        self.dev = dev
        self.image = image  # its module's cubin (loaded again in a green context that runs it)
        self.name = name
        self.obj = func  # the cuda.bindings CUfunction, for the launch path
        self.func = int(func)
        self.module = module
        self.token = dev.token
        self.shmem_max = DEFAULT_SHMEM

    def __repr__(self) -> str:
        return f"<cuda kernel {self.name!r} on device {self.dev.index}>"


class CudaGraph:
    """An instantiated graph (CUgraphExec) and the CUgraph it came from."""

    __slots__ = ("backend", "dev", "exec", "graph", "nodes", "token")

    def __init__(self, backend: CudaBackend, dev: Dev, graph: int, exec_: int, nodes: int) -> None:
        self.backend = backend
        self.dev = dev
        self.graph = graph
        self.exec = exec_
        self.nodes = nodes
        self.token = dev.token

    def __del__(self) -> None:
        dev = self.dev
        if self.token is not dev.token or dev.fault is not None:
            return
        try:
            self.backend.make_current(dev)
            cu = driver()
            (err,) = cu.cuGraphExecDestroy(self.exec)
            if int(err):
                warn_unless_fault(int(err), "cuGraphExecDestroy", dev, f"destroying {self!r}")
            (err,) = cu.cuGraphDestroy(self.graph)
            if int(err):
                warn_unless_fault(int(err), "cuGraphDestroy", dev, f"destroying {self!r}")
        except Exception as exc:  # a finalizer must not raise
            warnings.warn(f"gpuflow: destroying {self!r} failed: {exc!r}", stacklevel=2)

    def __repr__(self) -> str:
        return f"<cuda graph 0x{self.exec:x} on device {self.dev.index}>"
