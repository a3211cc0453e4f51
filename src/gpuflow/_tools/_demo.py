"""The main job: a transformer-like token loop run three ways, then fanned out.

A model of 22 layers, each six small kernels on real data (a matrix-vector
product, bias, tanh, scale, residual add, soft-sign), processes a stream of
tokens.  The same tokens go through it

1. with a synchronisation after every kernel (132 sync gaps a token),
2. as one ``then`` chain awaited once a token,
3. as a captured graph replayed (and awaited) once a token,

and each mode must produce the same numbers.  Then a second pipeline (the
same model, a copy on each device) is fanned out over every device in a
device group, and every copy must give the same numbers.  It runs on ``sim``
where there is no GPU, on ``cuda`` where there is one.

Every ratio it prints is of tokens per second (above 1x is faster), as the
README's table gives them: each mode against the first, the device group
against one device.  On ``sim`` the clock measures the simulation, not a
GPU: the demo says so first, and prints no fan-out throughput or scaling.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

import gpuflow as gf

LAYERS = 22
KERNELS_PER_LAYER = 6

#: What the demo says first on ``sim``: its clock measures the simulation.
SIM_NOTE = (
    "note: sim timings mean nothing. Backend 'sim' simulates the GPU on this CPU "
    "(each kernel\nruns as its NumPy reference on a thread), so tokens/s below say "
    "nothing about a GPU;\non sim the demo checks that every mode, and every device, "
    "gives the same numbers."
)

SOURCE = r"""
extern "C" __global__ void matvec(const float* w, const float* x, float* y, int n) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < n) {
        float acc = 0.0f;
        for (int k = 0; k < n; ++k) acc += w[row * n + k] * x[k];
        y[row] = acc;
    }
}
extern "C" __global__ void add_bias(float* y, const float* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += b[i];
}
extern "C" __global__ void tanh_inplace(float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = tanhf(y[i]);
}
extern "C" __global__ void scale(float* y, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= s;
}
extern "C" __global__ void residual(float* x, const float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}
extern "C" __global__ void softsign(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] / (1.0f + fabsf(x[i]));
}
"""


def _matvec(w: Any, x: Any, y: Any, n: int) -> None:
    y[:n] = w[: n * n].reshape(n, n) @ x[:n]


def _add_bias(y: Any, b: Any, n: int) -> None:
    y[:n] += b[:n]


def _tanh(y: Any, n: int) -> None:
    np.tanh(y[:n], out=y[:n])


def _scale(y: Any, s: float, n: int) -> None:
    y[:n] *= np.float32(s)


def _residual(x: Any, y: Any, n: int) -> None:
    x[:n] += y[:n]


def _softsign(x: Any, n: int) -> None:
    x[:n] = x[:n] / (np.float32(1) + np.abs(x[:n]))


REFERENCES: dict[str, Callable[..., None]] = {
    "matvec": _matvec,
    "add_bias": _add_bias,
    "tanh_inplace": _tanh,
    "scale": _scale,
    "residual": _residual,
    "softsign": _softsign,
}


def _const(op: gf.DeviceOperation[object]) -> Callable[[Any], gf.DeviceOperation[object]]:
    return lambda _out: op


class Model:
    """Weights of every layer on one device, and the token's working arrays."""

    def __init__(self, mod: gf.Module, hidden: int, seed: int, device: int) -> None:
        rng = np.random.default_rng(seed)
        self.mod = mod
        self.n = hidden
        self.cfg = gf.LaunchConfig.for_num_elems(hidden, block=128)
        ops = []
        for _ in range(LAYERS):
            w = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
            b = (rng.standard_normal(hidden) * 0.1).astype(np.float32)
            ops += [gf.from_host(w), gf.from_host(b)]
        ops += [gf.zeros(hidden, np.float32), gf.zeros(hidden, np.float32)]
        arrays = gf.zip(*ops).sync(gf.SingleStream(device))
        self.weights = [(arrays[2 * i], arrays[2 * i + 1]) for i in range(LAYERS)]
        self.x, self.y = arrays[-2], arrays[-1]

    def kernels(self) -> list[gf.DeviceOperation[object]]:
        """The 132 launches of one token, in order."""
        m, n, cfg, x, y = self.mod, self.n, self.cfg, self.x, self.y
        out: list[gf.DeviceOperation[object]] = []
        for w, b in self.weights:
            out += [
                m.matvec(cfg, w, x, y, n),
                m.add_bias(cfg, y, b, n),
                m.tanh_inplace(cfg, y, n),
                m.scale(cfg, y, 0.5, n),
                m.residual(cfg, x, y, n),
                m.softsign(cfg, x, n),
            ]
        return out

    def token(self) -> gf.DeviceOperation[object]:
        """One token as a single ``then`` chain."""
        ks = self.kernels()
        op = ks[0]
        for k in ks[1:]:
            op = op.then(_const(k))
        return op


def _reset(model: Model, embedding: npt.NDArray[np.generic]) -> None:
    gf.copy(gf.from_host(embedding), out=model.x).sync()


async def _per_token(op: gf.DeviceOperation[object], tokens: int) -> float:
    """Seconds per token when ``op`` (one token) is awaited ``tokens`` times."""
    t0 = time.perf_counter()
    for _ in range(tokens):
        await op
    return (time.perf_counter() - t0) / tokens


def run_modes(tokens: int, hidden: int) -> tuple[list[tuple[str, float]], bool]:
    mod = gf.compile(SOURCE, references=REFERENCES)
    model = Model(mod, hidden, seed=1, device=gf.current_device())
    emb = np.random.default_rng(2).standard_normal(hidden).astype(np.float32)
    results: list[tuple[str, float]] = []
    finals: list[npt.NDArray[np.generic]] = []

    # 1. a sync after every kernel
    _reset(model, emb)
    kernels = model.kernels()
    one_stream = gf.SingleStream(gf.current_device())
    t0 = time.perf_counter()
    for _ in range(tokens):
        for k in kernels:
            k.sync(one_stream)
    results.append(("sync after every kernel", (time.perf_counter() - t0) / tokens))
    finals.append(gf.to_host(model.x).sync())

    # 2. one chain awaited per token
    _reset(model, emb)
    chain = model.token()

    results.append(("then chain, awaited per token", anyio.run(_per_token, chain, tokens)))
    finals.append(gf.to_host(model.x).sync())

    # 3. graph replay awaited per token
    _reset(model, emb)
    graph = chain.capture()
    launch = graph.launch()

    results.append(("graph replay, awaited per token", anyio.run(_per_token, launch, tokens)))
    finals.append(gf.to_host(model.x).sync())
    same = all(np.allclose(f, finals[0], rtol=1e-5, atol=1e-6) for f in finals[1:])
    return results, same


def fan_out_models(hidden: int, devices: list[int]) -> dict[int, Model]:
    """A copy of one model on each device (the same weights everywhere)."""
    mod = gf.compile(SOURCE, references=REFERENCES)
    models = {}
    for d in devices:
        with gf.use_device(d):
            models[d] = Model(mod, hidden, seed=3, device=d)
    return models


def fan_out(launches: dict[int, gf.DeviceOperation[object]], tokens: int) -> float:
    """Tokens per second of the whole group: each device replays its own
    model's graph ``tokens`` times, all devices at once in a device group."""
    devices = list(launches)

    async def worker(d: int) -> None:
        for _ in range(tokens):
            await launches[d]

    async def group() -> float:
        t0 = time.perf_counter()
        async with gf.open_device_group(devices) as g:
            for d in devices:
                g.start_soon(worker, d, device=d)
        return tokens * len(devices) / (time.perf_counter() - t0)

    return anyio.run(group)


def run_fan_out(tokens: int, hidden: int, devices: list[int], timed: bool) -> bool:
    """Fan the graph replay out over ``devices``, print what it shows, and
    say whether every device gave the same numbers.

    ``timed`` (a GPU): the group's tokens/s against one device's, each the
    median of three runs taken in turns, so that one slow run does not make
    the ratio.  Untimed (``sim``), no throughput is printed: simulated
    devices are threads sharing this machine's cores, and their ratio swings
    from run to run with whatever else the machine does.
    """
    models = fan_out_models(hidden, devices)
    launches = {}
    for d, model in models.items():
        with gf.use_device(d):
            launches[d] = model.token().capture().launch()
    print()
    print(f"device-group fan-out (graph replay) over {len(devices)} device(s):")
    if timed:
        ones, groups = [], []
        for _ in range(3):
            ones.append(fan_out({devices[0]: launches[devices[0]]}, tokens))
            groups.append(fan_out(launches, tokens))
        one, group = statistics.median(ones), statistics.median(groups)
        if len(devices) > 1:
            print(f"  one device {one:.1f} tokens/s; the group {group:.1f} tokens/s = "
                  f"{group / one:.2f}x one device's tokens/s (median of 3 runs each)")
        else:
            print(f"  {one:.1f} tokens/s (one device: nothing to compare with)")
    # the numbers: every device starts from the same state and runs the same tokens
    emb = np.zeros(hidden, np.float32)
    for d, model in models.items():
        with gf.use_device(d):
            _reset(model, emb)
    fan_out(launches, tokens)
    finals = []
    for d, model in models.items():
        with gf.use_device(d):
            finals.append(gf.to_host(model.x).sync())
    same = all(np.allclose(f, finals[0], rtol=1e-5, atol=1e-6) for f in finals[1:])
    print(f"  same numbers on every device: {'yes' if same else 'NO'}")
    if not timed:
        print("  (no throughput or scaling figure on sim: see the note above)")
    return same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpuflow demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "sim"])
    p.add_argument("--tokens", type=int, default=None, help="tokens per mode")
    p.add_argument("--hidden", type=int, default=256, help="model width")
    args = p.parse_args(argv)
    backend = gf.init_device_contexts(
        backend=args.backend, num_devices=2 if args.backend == "sim" else None
    )
    if backend == "sim" and args.backend == "auto":
        # no GPU here: simulate two devices so that the fan-out has somewhere to go
        gf.init_device_contexts(backend="sim", num_devices=2)
    devices = list(range(gf.device_count()))
    backend_object = gf.lowlevel.current_backend_object()
    timed = backend != "sim"
    tokens = args.tokens or (200 if timed else 5)
    names = ", ".join(backend_object.device_name(d) for d in devices)
    print(f"gpuflow demo on backend {backend!r}: {len(devices)} device(s) ({names})")
    if not timed:
        print(SIM_NOTE)
    print(
        f"model: {LAYERS} layers x {KERNELS_PER_LAYER} kernels = "
        f"{LAYERS * KERNELS_PER_LAYER} launches a token, width {args.hidden}, "
        f"{tokens} tokens a mode"
    )
    results, same = run_modes(tokens, args.hidden)
    base = 1 / results[0][1]
    print()
    print(f"{'mode':<34}{'tokens/s':>12}{'us/token':>12}{'tokens/s vs sync':>18}")
    for name, per in results:
        print(f"{name:<34}{1 / per:>12.1f}{per * 1e6:>12.1f}{1 / per / base:>17.2f}x")
    print("(the last column is each mode's tokens/s over the first's: above 1x is faster)")
    print(f"same numbers in every mode: {'yes' if same else 'NO'}")
    same_everywhere = run_fan_out(tokens, args.hidden, devices, timed)
    return 0 if same and same_everywhere else 1
