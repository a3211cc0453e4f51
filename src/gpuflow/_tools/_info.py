"""``python -m gpuflow info``: the facts a bug report needs, in one paste.

As ``cupy.show_config()`` and ``python -m torch.utils.collect_env`` do:
gpuflow's and Python's versions, the packages gpuflow runs with and the
optional ones (event loops, MPI, NCCL; "not installed" where absent), the CUDA
driver and devices (or why there are none), the backend gpuflow would pick
and its devices (name, compute capability, memory, SMs), the SMs each
device would reserve (``--reserve-sms NAME=COUNT``, as
``init_device_contexts(reserve_sms=...)`` would), and whether PyTorch and
CuPy can be imported here, with the CUDA they were built for.  Nothing
fails: a part that cannot be learnt says why.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import sys
from types import ModuleType
from typing import Any

from ..lowlevel import cuda_probe, load_backend

#: the environment variable that names the backend ``"auto"`` picks
BACKEND_ENV = "GPUFLOW_BACKEND"

_PACKAGES = ("numpy", "anyio", "cuda-bindings", "nvidia-cuda-nvrtc")
#: What extras install: event loops, the bootstrap under mpiexec, NCCL, and
#: the tests' DLPack reader
_OPTIONAL = ("trio", "uvloop", "mpi4py", "nccl4py", "nvidia-nccl-cu13", "cuda-core")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _reserved_lines(be: Any, device: int, reserve: dict[str, int]) -> list[str]:
    try:
        *parts, rest = be.partition_sms(device, list(reserve.values()))
    except Exception as exc:
        return [f"     reserved SMs: none: {exc}"]
    lines = [
        f"     reserved SMs {name!r}: {be.partition_size(part)} ({count} asked)"
        for (name, count), part in zip(reserve.items(), parts, strict=True)
    ]
    return [*lines, f"     the other streams' SMs: {be.partition_size(rest)}"]


def _backend_lines(reserve: dict[str, int] | None = None) -> list[str]:
    try:
        be = load_backend("auto", None)
    except Exception as exc:
        return [f"backend: none could be started ({type(exc).__name__}: {exc})"]
    try:
        chosen = os.environ.get(BACKEND_ENV)
        why = f"; {BACKEND_ENV}={chosen!r}" if chosen else ""
        lines = [f"backend: {be.name} (what init_device_contexts() picks here{why})"]
        n = be.device_count
        if be.simulated:
            how = (
                "the simulation makes as many as asked for: "
                "gf.init_device_contexts(num_devices=N); `python -m gpuflow demo` asks for 2, "
                "`python -m gpuflow bench --devices N` and pytest's --gpuflow-devices N "
                "choose; 1 unless asked"
            )
        else:
            how = (
                "every device by default; gf.init_device_contexts(num_devices=N) takes "
                "the first N"
            )
        lines.append(f"devices: {n} ({how})")
        for d in range(be.device_count):
            desc = be.describe_device(d)
            cc = "simulated" if desc.compute_capability is None else (
                f"compute capability {desc.compute_capability}"
            )
            sms: int | str | None
            try:
                sms = be.sm_count(d)
            except Exception as exc:
                sms = f"? ({exc})"
            lines.append(
                f"  {d}: {desc.name}, {cc}, {_gib(desc.total_memory)}"
                + ("" if sms is None else f", {sms} SMs")
            )
            if reserve:
                lines += _reserved_lines(be, d, reserve)
        if not reserve:
            lines.append(
                "reserved SMs: none asked (--reserve-sms NAME=COUNT shows what each device "
                "gives, as init_device_contexts(reserve_sms={NAME: COUNT}) would)"
            )
        return lines
    finally:
        be.close()


def _library(name: str, describe: Any) -> str:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        return "not installed"
    except Exception as exc:  # installed but broken: that is worth reporting
        return f"installed, but import fails: {type(exc).__name__}: {exc}"
    try:
        return str(describe(module))
    except Exception as exc:
        return f"{getattr(module, '__version__', '?')} (could not ask more: {exc})"


def _torch(torch: ModuleType) -> str:
    cuda = torch.version.cuda or "no CUDA"
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"{torch.__version__} (built for CUDA {cuda}; {devices} CUDA device(s) usable)"


def _cupy(cupy: ModuleType) -> str:
    try:
        runtime = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as exc:
        return f"{cupy.__version__} (its CUDA runtime cannot start: {type(exc).__name__})"
    return f"{cupy.__version__} (CUDA runtime {runtime // 1000}.{runtime % 1000 // 10})"


def report(reserve: dict[str, int] | None = None) -> str:
    """The report ``python -m gpuflow info`` prints (``reserve``: the SMs to
    try to reserve on each device, by name)."""
    from_pkg = _version("gpuflow")
    lines = [
        f"gpuflow {sys.modules['gpuflow'].__version__} (installed: {from_pkg})",
        f"python {platform.python_version()} ({platform.python_implementation()}, "
        f"{platform.system()} {platform.machine()})",
        "packages: " + ", ".join(f"{p} {_version(p)}" for p in _PACKAGES),
        "optional: " + ", ".join(f"{p} {_version(p)}" for p in _OPTIONAL),
    ]
    count, driver, problem = cuda_probe()
    lines.append(f"CUDA driver: {driver if driver else 'none'}")
    lines.append(f"CUDA devices: {count}" if count else f"CUDA devices: no CUDA device: {problem}")
    lines += _backend_lines(reserve)
    lines.append(f"PyTorch: {_library('torch', _torch)}")
    lines.append(f"CuPy: {_library('cupy', _cupy)}")
    return "\n".join(lines)


def _reservation(text: str) -> tuple[str, int]:
    name, sep, count = text.partition("=")
    if not sep or not name or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=COUNT (a name and a number of SMs, e.g. interactive=16)"
        )
    return name, int(count)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuflow info",
        description="Print what a bug report needs: gpuflow's, Python's and the packages' "
        "versions (optional ones too), the CUDA driver and devices, the backend gpuflow "
        "picks here, and whether PyTorch and CuPy import.",
    )
    parser.add_argument(
        "--reserve-sms", metavar="NAME=COUNT", type=_reservation, action="append",
        help="reserve COUNT SMs named NAME on each device, as "
        "init_device_contexts(reserve_sms=...) would, and list what each device gives "
        "(or why it cannot); may be repeated",
    )  # fmt: skip
    args = parser.parse_args(argv)
    print(report(dict(args.reserve_sms) if args.reserve_sms else None))
    return 0
