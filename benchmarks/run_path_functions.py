"""The run path's shape: which of gpuflow's functions one warm ``await`` enters.

No device is used.  Run: ``python benchmarks/run_path_functions.py``

On ``sim`` under asyncio, an ``await`` of a compiled kernel's launch (two
arrays and a scalar: ``scale(cfg, x, 2.0, n)`` and a ``saxpy``), warmed by
a hundred awaits of it first, is watched with ``sys.setprofile`` on the
loop's thread: every function of ``gpuflow`` it enters, once each
(a generator's resumptions included, as they are calls to the profiler),
grouped by module; twenty such awaits, each counted alone (one parks
where the simulated kernel outlasts the inline read, another does not).
What it counts depends on the code's shape, not on the machine's speed: a
measure of how many steps a run takes, and how many modules a reader must
follow to see one (issue 57's target: at most 30 functions in at most 9
modules).  ``--list`` prints them.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from types import FrameType
from typing import Any

import anyio
import numpy as np

import gpuflow as gf

SOURCE = r"""
extern "C" __global__ void scale(float* x, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


def _scale(x: np.ndarray, s: float, n: int) -> None:
    x[:n] *= np.float32(s)


def _saxpy(a: float, x: np.ndarray, y: np.ndarray, n: int) -> None:
    y[:n] = np.float32(a) * x[:n] + y[:n]


def watched(op: gf.DeviceOperation[Any], samples: int) -> list[dict[str, set[str]]]:
    """The gpuflow functions each of ``samples`` warm awaits of ``op``
    enters, by module (one await parks where the simulated kernel takes
    longer than its inline read, another does not: they differ)."""
    package = gf.__file__.rsplit("/", 1)[0] + "/"
    found: list[dict[str, set[str]]] = []

    async def main() -> None:
        for _ in range(100):  # warm: loaded, prepared, the pool's streams made
            await op
        for _ in range(samples):
            seen: dict[str, set[str]] = defaultdict(set)

            def profile(
                frame: FrameType, event: str, arg: Any, seen: dict[str, set[str]] = seen
            ) -> None:
                if event != "call":
                    return
                code = frame.f_code
                if code.co_filename.startswith(package):
                    module = frame.f_globals.get("__name__", code.co_filename)
                    seen[module].add(code.co_qualname)

            sys.setprofile(profile)
            try:
                await op
            finally:
                sys.setprofile(None)
            found.append(seen)

    anyio.run(main, backend="asyncio")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print each function, by module")
    p.add_argument("--samples", type=int, default=20, help="awaits watched (default 20)")
    args = p.parse_args(argv)
    gf.init_device_contexts(backend="sim", num_devices=1)
    mod = gf.compile(SOURCE, references={"scale": _scale, "saxpy": _saxpy})
    n = 4096
    x = gf.from_host(np.ones(n, np.float32)).sync()
    y = gf.from_host(np.ones(n, np.float32)).sync()
    cfg = gf.LaunchConfig.for_num_elems(n)
    for name, op in [
        ("scale(x, 1.0, n): one array written", mod.scale(cfg, x, 1.0, n)),
        ("saxpy(1.0, x, y, n): one read, one written", mod.saxpy(cfg, 1.0, x, y, n)),
    ]:
        found = watched(op, args.samples)
        functions = sorted(sum(len(f) for f in seen.values()) for seen in found)
        modules = sorted(len(seen) for seen in found)
        print(
            f"await of a launch, {name}: {functions[0]}-{functions[-1]} gpuflow functions "
            f"(median {functions[len(functions) // 2]}) in {modules[0]}-{modules[-1]} modules, "
            f"{len(found)} awaits"
        )
        if args.list:  # (every function any of them entered)
            union: dict[str, set[str]] = defaultdict(set)
            for seen in found:
                for module, names in seen.items():
                    union[module] |= names
            for module in sorted(union):
                print(f"  {module}: {', '.join(sorted(union[module]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
