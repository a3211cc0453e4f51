"""NVRTC: CUDA C++ to device code, on any machine (no GPU is needed to compile).

Compiled binaries are cached by (source, architecture, options): a test suite
or a demo that compiles the same module many times pays NVRTC once.
"""

from __future__ import annotations

import functools
import os
import threading

from .._errors import CompileError

#: Architecture used to check a source where no device says which: PTX for
#: Hopper, so that syntax and type errors surface on every machine.
CHECK_ARCH = "compute_90"

_lock = threading.Lock()


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """The CUDA toolkit's header folders NVRTC is pointed at (as CuPy does), so
    that ``#include <cuda_fp16.h>`` works: ``$CUDA_HOME``, ``$CUDA_PATH``, then
    ``/usr/local/cuda``, those that exist.  NVRTC's own wheel has no headers."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    found: list[str] = []
    for root in roots:
        if root:
            inc = os.path.join(root, "include")
            if os.path.isfile(os.path.join(inc, "cuda_fp16.h")) and inc not in found:
                found.append(inc)
    return tuple(found)


@functools.lru_cache(maxsize=256)
def compile_source(source: str, arch: str, options: tuple[str, ...]) -> bytes:
    """CUBIN for ``sm_XY``, PTX for ``compute_XY``; CompileError with NVRTC's log."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise CompileError(
            f"NVRTC is not available ({exc}): install nvidia-cuda-nvrtc", ""
        ) from exc

    def check(res: tuple[object, ...], what: str) -> object:
        err = res[0]
        if int(err) != 0:  # type: ignore[call-overload]
            raise CompileError(f"NVRTC {what} failed: {err}", "")
        return res[1] if len(res) > 1 else None

    with _lock:  # NVRTC programs are not shared, but keep compile order deterministic
        prog = check(nvrtc.nvrtcCreateProgram(source.encode(), b"gpuflow.cu", 0, [], []), "create")
        try:
            opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
            opts += [o.encode() for o in options]  # the caller's -I come first
            opts += [f"-I{d}".encode() for d in include_dirs()]
            (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
            size = check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
            # NVRTC writes into the buffers it is given: they must be fresh,
            # mutable memory.  (``b" " * 1`` is the interpreter's own cached
            # ``b" "``: writing a log's NUL into it turned every ``" ".encode()``
            # of the process into ``b"\\x00"``, which broke ``import torch``.)
            log = bytearray(int(size))  # type: ignore[call-overload]
            nvrtc.nvrtcGetProgramLog(prog, log)
            text = log.rstrip(b"\x00 ").decode(errors="replace").strip()
            if int(err) != 0:
                raise CompileError(f"NVRTC could not compile the source for {arch}", text)
            if arch.startswith("sm_"):
                n = check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
                out = bytearray(int(n))  # type: ignore[call-overload]
                check(nvrtc.nvrtcGetCUBIN(prog, out), "cubin")
            else:
                n = check(nvrtc.nvrtcGetPTXSize(prog), "ptx size")
                out = bytearray(int(n))  # type: ignore[call-overload]
                check(nvrtc.nvrtcGetPTX(prog, out), "ptx")
            return bytes(out)
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
