"""Front-end overhead with a backend that does nothing: marks are reached at once.

No device is used.  Run: python benchmarks/profile_frontend.py [profile]
(``profile``: also cProfile 5,000 awaits and print the top functions,
count the function calls a run of the 64-task row makes, under asyncio and
Trio, and the objects the garbage collector tracks that an awaited run
holds while in flight, with 1,000 in flight: measures of the run path that
no machine's speed moves).

``--driver-share`` (on a GPU) runs the 64-task throughput on the cuda
backend with the backend's ``launch`` and ``mark`` timed: the two driver
calls every run makes on the loop's thread; and the CPU time of the loop's
thread and of the process over the run's wall time (a loop thread near 1.0
is busy throughout, waiting neither for the GIL nor in the driver).

``--pieces`` (on a GPU, or with ``--stand-in``) times the steps of three
kinds of await, each step with a timer around it: an empty kernel, ``gf.wait_stream``
of another library's stream, and (where NCCL's bindings are installed) a
4-byte all-reduce of one rank.  Each kind prints its median await with no
timers, then each step's calls an await and microseconds a call (the
timers' own cost included, so a step reads a little high, and a step's time
includes the steps it calls).  On a GPU with PyTorch, a fourth kind is the
bench's PyTorch request: ``gf.wait_stream`` of one of 8 torch streams right
after an MLP forward on it (its median includes the forward; its steps are
the wait's alone, which run after the forward's Python, as in a service).

``--stand-in LIB`` runs the ``cuda`` backend against a stand-in libcuda,
which does each item at once and kernels not at all
(``tests/stand_in/libcuda.c``; build it with ``cc -shared -fPIC -O2
-Wl,-soname,libcuda.so.1 -o LIB tests/stand_in/libcuda.c``): the cuda
backend's Python and cuda-bindings' calls without the driver's own cost.
It prints the run path's rows, each beside its baseline measured in the
same process, in turns (``--quick``: fewer turns, for CI, which checks that
the rows print, never a figure): the 64-task throughput under asyncio,
uvloop and Trio beside the plain loop of ``plain_loop.py`` (asyncio,
uvloop), and the function calls a run of each makes; the 132-kernel chain
beside the raw launch loop of the bench's chain row; an await of
``gf.wait_stream`` on another library's stream beside an await of an empty
kernel; ``enqueue_on`` of an empty kernel; and the default policy's
``next_stream`` beside round robin's.  Beside the bench on the same host,
the difference is what the driver and the GPU add.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import ctypes
import gc
import importlib
import itertools
import os
import pstats
import statistics
import tempfile
import threading
import time
import timeit
from collections.abc import Callable, Sequence
from importlib.util import find_spec
from typing import Any

import anyio
import numpy as np

import gpuflow as gf

# a null backend (below) and the default policy measure the front end alone
from gpuflow._backends import _base
from gpuflow._core._policy import DEFAULT_POLICY
from gpuflow._tools._bench_poll import mlp_forward
from gpuflow._tools._bench_rows import Completions, row, summary


class NullStream:
    def __init__(self, device: int) -> None:
        self.device = device
        self.word = 0


class NullBuffer:
    def __init__(self, device: int, nbytes: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self.ptr = 0


class NullBackend(_base.Backend):
    """Every call returns at once; a mark is reached as it is enqueued."""

    name = "null"

    def __init__(self) -> None:
        self.lock = threading.Lock()

    @property
    def device_count(self) -> int:
        return 1

    class _State:
        fault = None

    _devices = (_State(),)

    def device_name(self, device: int) -> str:
        return "null"

    # (its handles are its own classes, given back to it only: Any to the interface)
    def create_stream(self, device: int, priority: int = 0, partition: Any = None) -> Any:
        return NullStream(device)

    def destroy_stream(self, stream: Any) -> None:
        pass

    def stream_destroyed(self, stream: Any) -> bool:
        return False

    def stream_handle(self, stream: Any) -> int:
        return 0

    def synchronize(self, stream: Any) -> None:
        pass

    def query(self, stream: Any) -> bool:
        return True

    def record_event(self, stream: Any) -> Any:
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def alloc(self, device: int, nbytes: int, stream: Any) -> NullBuffer:
        return NullBuffer(device, nbytes)

    def free(self, buffer: Any, stream: Any) -> None:
        pass

    def copy_from_host(self, dst: Any, src: np.ndarray[Any, Any], stream: Any) -> None:
        pass

    def copy_to_host(self, dst: np.ndarray[Any, Any], src: Any, stream: Any) -> None:
        pass

    def copy_device(self, dst: Any, src: Any, nbytes: int, stream: Any) -> None:
        pass

    def fill(self, dst: Any, value: np.generic, count: int, stream: Any) -> None:
        pass

    def arange(
        self, dst: Any, start: np.generic, step: np.generic, count: int, stream: Any
    ) -> None:
        pass

    def load_kernel(self, device: int, module: Any, name: str) -> Any:
        return name

    def launch(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shmem: int,
        args: Sequence[Any],
        stream: Any,
    ) -> None:
        pass

    def mark(self, stream: Any, polled: bool = True) -> int:
        with self.lock:
            stream.word += 1
            return int(stream.word)

    def completion_reader(self, stream: Any) -> Any:
        return lambda: stream.word

    def wait_mark(self, stream: Any, other: Any, number: int) -> None:
        pass

    def begin_capture(self, stream: Any) -> None:
        pass

    def end_capture(self, stream: Any) -> Any:
        return None

    def launch_graph(self, graph: Any, stream: Any) -> None:
        pass

    def device_state(self, device: int) -> Any:
        return self._lookup(self._devices, device)

    def device_arch(self, device: int) -> str:
        return "sm_90"

    def reset_device(self, device: int) -> None:
        pass

    def graph_node_count(self, graph: Any) -> int:
        return 0


class ModelStream(NullStream):
    def __init__(self, device: int) -> None:
        super().__init__(device)
        self.ready: list[float] = []  # when the GPU reaches mark i + 1


class ModelBackend(NullBackend):
    """A GPU with no driver cost: a stream reaches each mark ``exec_s`` after
    the previous one or after its enqueue, whichever is later.  What the
    front end costs under many tasks, with the driver's calls left out: set
    beside the bench's ``throughput`` row on the same host, the difference
    is the driver's (and the GPU's) share."""

    name = "model"

    def __init__(self, exec_s: float) -> None:
        super().__init__()
        self.exec_s = exec_s

    def create_stream(
        self, device: int, priority: int = 0, partition: Any = None
    ) -> Any:
        return ModelStream(device)

    def mark(self, stream: Any, polled: bool = True) -> int:
        now = time.perf_counter()
        with self.lock:
            ready = stream.ready
            ready.append(max(ready[-1] if ready else 0.0, now) + self.exec_s)
            stream.word = len(ready)
            return int(stream.word)

    def completion_reader(self, stream: Any) -> Any:
        ready = stream.ready
        reached = [0]

        def read() -> int:
            n, now = reached[0], time.perf_counter()
            while n < len(ready) and ready[n] <= now:
                n += 1
            reached[0] = n
            return n

        return read

    def enqueue_close(self, stream: Any, fd: int) -> bool:
        # (a sleeping loop's wake-up: a timer thread stands in for the driver's)
        ready = stream.ready
        delay = (ready[-1] if ready else 0.0) - time.perf_counter()
        threading.Timer(max(0.0, delay), os.close, [fd]).start()
        return True


class HeldBackend(NullBackend):
    """A GPU that reaches no mark while ``held``, then every mark at once."""

    def __init__(self) -> None:
        super().__init__()
        self.held = False

    def completion_reader(self, stream: Any) -> Any:
        seen = [0]

        def read() -> int:
            if not self.held:
                seen[0] = stream.word
            return seen[0]

        return read


def throughput(
    lib: str,
    op: gf.DeviceOperation[Any],
    tasks: int,
    per: int,
    cpu: dict[str, float] | None = None,
) -> float:
    """Awaited ops per second: ``tasks`` tasks each awaiting ``op`` ``per``
    times (the bench's ``throughput`` row, without its naive baseline).
    ``cpu``, if given, receives the CPU time of the loop's thread and of the
    whole process over the timed part, as fractions of its wall time."""

    async def worker() -> None:
        for _ in range(per):
            await op

    async def timed() -> float:
        async with anyio.create_task_group() as tg:  # warm-up
            for _ in range(4):
                tg.start_soon(worker)
        c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(tasks):
                tg.start_soon(worker)
        wall = time.perf_counter() - t0
        if cpu is not None:
            cpu["loop thread"] = (time.thread_time() - c0) / wall
            cpu["process"] = (time.process_time() - p0) / wall
        return tasks * per / wall

    if lib == "uvloop":
        import uvloop

        return anyio.run(timed, backend="asyncio",
                         backend_options={"loop_factory": uvloop.new_event_loop})
    return anyio.run(timed, backend=lib)


async def awaits_and_chain(
    op: gf.DeviceOperation[Any], chain: gf.DeviceOperation[Any], pol: gf.SchedulingPolicy
) -> tuple[float, float]:
    for _ in range(200):
        await op
    n = 5000
    t0 = time.perf_counter()
    for _ in range(n):
        await op
    t1 = time.perf_counter()
    for _ in range(50):
        await chain.run(pol)
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t1) / 50 / 132 * 1e6


async def awaits(op: gf.DeviceOperation[Any], n: int) -> None:
    for _ in range(n):
        await op


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile", nargs="?", choices=["profile"],
                   help="also run cProfile, and count the calls a run of the 64-task row makes")
    p.add_argument("--model-throughput", action="store_true",
                   help="instead: 64 tasks x 100 awaits against ModelBackend (marks reached "
                        "5, 10 and 30 us apart), medians of 5 runs per loop")
    p.add_argument("--stand-in", metavar="LIB",
                   help="the cuda backend against this stand-in libcuda.so.1: the run path's "
                        "rows beside their baselines (see above)")
    p.add_argument("--quick", action="store_true",
                   help="with --stand-in: fewer turns (CI checks that the rows print)")
    p.add_argument("--pieces", action="store_true",
                   help="instead, on a GPU (or with --stand-in): the steps of an await of an "
                        "empty kernel, of gf.wait_stream and of an all-reduce, each timed")
    p.add_argument("--driver-share", action="store_true",
                   help="instead, on a GPU: the 64-task throughput with the backend's launch "
                        "and mark timed, each loop (what the driver's calls take of the "
                        "loop thread)")
    args = p.parse_args(argv)

    if args.model_throughput:
        return model_throughput()
    if args.driver_share:
        return driver_share()
    if args.stand_in:
        # NVRTC asks the driver for tables of its own when it first compiles,
        # which the stand-in does not have: compile once before loading it
        from gpuflow._backends import _nvrtc

        _nvrtc.compile_source('extern "C" __global__ void warm() {}', "sm_90", ())
        ctypes.CDLL(args.stand_in, mode=ctypes.RTLD_GLOBAL)  # found by its soname
        gf.init_device_contexts(backend="cuda")
        name = gf.lowlevel.current_backend_object().device_name(0)
        if name != "Fake GPU":
            # a driver of the machine answered cuda-bindings (and the stand-in
            # perhaps ctypes): the figures would mix the two
            p.error(f"--stand-in: the device is {name!r}, not the stand-in's: run it where "
                    "no CUDA driver is installed")
        mod = gf.compile('extern "C" __global__ void empty() {}')
    elif args.pieces:
        gf.init_device_contexts(backend="cuda")
        mod = gf.compile('extern "C" __global__ void empty() {}')
    else:
        gf.init_device_contexts(backend=NullBackend())
        mod = gf.compile('extern "C" __global__ void empty() {}',
                         references={"empty": lambda: None})
    op = mod.empty(gf.LaunchConfig(1, 1))
    if args.pieces:
        return pieces(op, with_torch=not args.stand_in)
    if args.stand_in:
        return stand_in_rows(op, args.quick)
    k = op
    chain = k
    for _ in range(131):
        chain = chain.then(lambda _o: k)
    pol = gf.SingleStream(0)
    for lib in ("asyncio", "trio"):
        per_await, per_step = anyio.run(awaits_and_chain, op, chain, pol, backend=lib)
        print(f"{lib} await us/op {per_await:.2f}, chain us/step {per_step:.2f}")
    # the chain's own Python: execute() alone, no run set-up, no await, in a
    # context kept from a run (valid here: the null backend enqueues nothing)
    kept: list[gf.ExecutionContext] = []
    gf.with_context(lambda ctx: kept.append(ctx) or gf.value(None)).sync(pol)
    (ctx,) = kept
    t0 = time.perf_counter()
    for _ in range(300):
        chain.execute(ctx)
    print(f"chain execute() us/step {(time.perf_counter() - t0) / 300 / 132 * 1e6:.3f}")

    # the default policy's choice alone, with every stream idle (a run's
    # common case): the best of five batches, so that other load barely shows
    policies = {"default policy": DEFAULT_POLICY, "round robin": gf.StreamPoolRoundRobin()}
    for name, chooser in policies.items():
        batches = timeit.repeat(lambda c=chooser: c.next_stream(0), number=20000, repeat=5)
        print(f"{name} next_stream us/call {min(batches) / 20000 * 1e6:.3f} ({chooser!r})")

    # sync path enqueue only
    s = gf.new_stream(0)
    t0 = time.perf_counter()
    for _ in range(20000):
        op.enqueue_on(s)
    print(f"enqueue_on us/op {(time.perf_counter() - t0) / 20000 * 1e6:.2f}")
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "frontend.prof")
            cProfile.runctx("anyio.run(awaits, op, 5000)", globals(), {"op": op}, out)
            pstats.Stats(out).sort_stats("tottime").print_stats(18)
        for lib in ("asyncio", "trio"):
            print(f"64 tasks x 100 awaits, {lib}: {calls_per_run(lib, op):.1f} calls a run "
                  "(Python functions and builtins, the loop's and AnyIO's included)")
        for lib in ("asyncio", "trio"):
            print(f"1,000 awaits in flight, {lib}: {objects_in_flight(lib):.1f} objects "
                  "tracked by the garbage collector a run, beyond its parked task's own")
    return 0


def stand_in_rows(op: gf.DeviceOperation[Any], quick: bool) -> int:
    """The run path's rows against the stand-in driver, each beside its
    baseline measured in this process, in turns (``--stand-in``)."""
    from plain_loop import STREAMS, PlainLoop

    from gpuflow._tools._bench import Raw

    turns, tasks, per = (2, 64, 20) if quick else (5, 64, 100)
    loops = ["asyncio"] + [m for m in ("uvloop", "trio") if find_spec(m)]
    plain = PlainLoop([Raw(gf.new_stream()) for _ in range(STREAMS)])

    def plain_row(lib: str) -> float:
        if lib == "uvloop":
            import uvloop

            return uvloop.run(plain.row(tasks, per))
        return asyncio.run(plain.row(tasks, per))

    print(f"the run path on the stand-in driver ({'quick: ' if quick else ''}{turns} turns; "
          "each row beside its baseline, measured in this process in turns)")
    print(f"  {'measured':<46}{'gpuflow':>10} {'':<6} {'baseline (same run)':<44}"
          f" {'ratio':>8}  target")
    ours: dict[str, list[float]] = {lib: [] for lib in loops}
    theirs: dict[str, list[float]] = {lib: [] for lib in loops if lib != "trio"}
    for lib in loops:  # warm: streams, lanes, pollers
        throughput(lib, op, tasks, per)
        if lib in theirs:
            plain_row(lib)
    for _ in range(turns):
        for lib in loops:
            ours[lib].append(throughput(lib, op, tasks, per))
            if lib in theirs:
                theirs[lib].append(plain_row(lib))
    rate = {lib: statistics.median(r) for lib, r in ours.items()}
    for lib in loops:
        if lib == "trio":
            row(f"{tasks} tasks x {per} awaits (trio)", rate[lib], "op/s",
                "gpuflow's own, asyncio", rate["asyncio"], ">= 0.8x")
        else:
            row(f"{tasks} tasks x {per} awaits ({lib})", rate[lib], "op/s",
                f"plain loop {lib}", statistics.median(theirs[lib]), ">= 0.6x")
    calls_ours = calls_per_run("asyncio", op, tasks, per)
    calls_plain = _calls(lambda: plain_row("asyncio")) / (tasks * per)
    row("calls a run, 64-task row (asyncio)", calls_ours, "calls", "plain loop asyncio",
        calls_plain, "<= 35 calls")

    # the 132-kernel chain, one step, against the raw launch loop, in turns
    k = op
    chain = k
    for _ in range(131):
        chain = chain.then(lambda _o: k)
    pol = gf.SingleStream(0)
    n_chain = 20 if quick else 100

    async def chain_steps() -> float:
        t0 = time.perf_counter()
        for _ in range(n_chain):
            await chain.run(pol)
        return (time.perf_counter() - t0) / n_chain / 132 * 1e6

    raw_steps = raw_launch_loop(op, pol)
    chained, raw = [], []
    for _ in range(turns):
        chained.append(anyio.run(chain_steps))
        raw.append(raw_steps(n_chain))
    row("132-kernel chain, a step", statistics.median(chained), "us",
        "raw cuLaunchKernel x132 + sync", statistics.median(raw), "<= 1.4x")

    # an await of gf.wait_stream on another library's stream, against an
    # await of an empty kernel, in turns
    n_await = 500 if quick else 2000

    async def kernel_awaits() -> float:
        t0 = time.perf_counter()
        for _ in range(n_await):
            await op
        return (time.perf_counter() - t0) / n_await * 1e6

    foreign, kernel = [], []
    for _ in range(turns):
        foreign.append(anyio.run(foreign_waits, n_await))
        kernel.append(anyio.run(kernel_awaits))
    row("await gf.wait_stream(another library's stream)", statistics.median(foreign), "us",
        "await of an empty kernel", statistics.median(kernel), "<= 1.05x")

    # enqueue_on of an empty kernel (the Python of a run no loop awaits)
    s = gf.new_stream(0)
    n_enqueue = 2000 if quick else 20000
    spent = []
    for _ in range(turns):
        t0 = time.perf_counter()
        for _ in range(n_enqueue):
            op.enqueue_on(s)
        spent.append((time.perf_counter() - t0) / n_enqueue * 1e6)
    row("enqueue_on of an empty kernel", statistics.median(spent), "us", target="<= 4 us")
    gf.testing.assert_quiescent(timeout=5.0)  # (the enqueued runs, completed first)

    # the default policy's choice with every stream idle, against round robin's
    rr = gf.StreamPoolRoundRobin()
    chooses = {"default": [], "rr": []}
    for _ in range(turns):
        for name, chooser in (("default", DEFAULT_POLICY), ("rr", rr)):
            best = min(timeit.repeat(lambda c=chooser: c.next_stream(0), number=5000, repeat=3))
            chooses[name].append(best / 5000 * 1e6)
    row("default policy next_stream", statistics.median(chooses["default"]), "us",
        "round robin", statistics.median(chooses["rr"]), "<= 2x")
    print(summary())
    return 0


def _calls(fn: Callable[[], object]) -> float:
    """The function calls (Python and built-in, as cProfile counts them) ``fn()`` makes."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats: Any = pstats.Stats(prof)
    return float(sum(v[1] for v in stats.stats.values()))


def objects_in_flight(lib: str, tasks: int = 1000) -> float:
    """Objects tracked by the garbage collector that an awaited run holds
    while it is in flight, beyond those of a task parked on an AnyIO event:
    what each collection goes through while many awaits are pending.  On a
    GPU that reaches no mark until every task is parked (it replaces the
    runtime)."""
    backend = HeldBackend()
    gf.init_device_contexts(backend=backend)
    mod = gf.compile('extern "C" __global__ void empty() {}',
                     references={"empty": lambda: None})
    op = mod.empty(gf.LaunchConfig(1, 1))

    async def run_once() -> None:
        await op

    async def main() -> float:
        await op  # (a stream and its lane made)
        counts = []
        for work in (anyio.Event().wait, run_once):
            backend.held = True
            async with anyio.create_task_group() as tg:
                for _ in range(tasks):
                    tg.start_soon(work)
                await anyio.sleep(0.05)  # every task parked
                gc.collect()
                counts.append(len(gc.get_objects()))
                backend.held = False
                tg.cancel_scope.cancel()  # (a cancelled await's run still completes)
        return (counts[1] - counts[0]) / tasks

    return anyio.run(main, backend=lib)


def calls_per_run(
    lib: str, op: gf.DeviceOperation[Any], tasks: int = 64, per: int = 100
) -> float:
    """Function calls (Python and built-in, as cProfile counts them) per
    awaited run of the 64-task row: what the run path costs, in a unit
    that no machine's speed moves."""
    throughput(lib, op, tasks, per)  # (warm: every stream and lane made)
    runs = (tasks + 4) * per  # (the row's warm-up tasks included)
    return _calls(lambda: throughput(lib, op, tasks, per)) / runs


def _torch_like_stream() -> Any:
    """A stream gpuflow did not make, named as PyTorch names one
    (``cuda_stream``, ``device_index``, ``device``)."""
    from cuda.bindings import driver as cu

    class TorchDeviceLike:
        index = 0

    class TorchLike:
        cuda_stream = int(cu.cuStreamCreate(1)[1])
        device_index = 0
        device = TorchDeviceLike()

    return TorchLike()


async def foreign_waits(n: int = 2000) -> float:
    """``await gf.wait_stream(s)`` of a stream gpuflow did not make, as a
    PyTorch stream is named (``cuda_stream``, ``device_index``, ``device``):
    the median of five batches, µs per await."""
    theirs = _torch_like_stream()
    batches = []
    for i in range(6):
        t0 = time.perf_counter()
        for _ in range(n):
            await gf.wait_stream(theirs)
        if i:  # (the first warms)
            batches.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(batches)


def raw_launch_loop(
    op: gf.DeviceOperation[Any], pol: gf.SingleStream
) -> Callable[[int], float]:
    """The bench's chain row's baseline: 132 cuLaunchKernel calls of
    cuda-bindings and a synchronize, on the stream the chain ran on; the
    function that times ``n`` of those loops (median µs a launch)."""
    from cuda.bindings import driver as cu

    op.sync(pol)
    raw = op._cache[1]  # type: ignore[attr-defined]  # (the loaded kernel)
    stream: Any = pol.stream.raw  # (the cuda backend's own)

    def steps(n: int) -> float:
        loops = []
        for _ in range(n):
            t0 = time.perf_counter()
            for _ in range(132):
                cu.cuLaunchKernel(raw.obj, 1, 1, 1, 1, 1, 1, 0, stream.obj, 0, 0)
            cu.cuStreamSynchronize(stream.obj)
            loops.append(time.perf_counter() - t0)
        return statistics.median(loops) / 132 * 1e6

    return steps


def _timer(real: Callable[..., Any], tally: list[float]) -> Callable[..., Any]:
    """``real`` with a timer around it: each call adds its seconds and one
    call to ``tally``."""
    clock = time.perf_counter

    def timed(*args: Any, **kw: Any) -> Any:
        t0 = clock()
        try:
            return real(*args, **kw)
        finally:
            tally[0] += clock() - t0
            tally[1] += 1

    return timed


def driver_share() -> int:
    """The bench's throughput row on the cuda backend, with the time spent in
    the backend's ``launch`` and ``mark`` (the two driver calls of each run)
    added up: on the loop's thread, they bound the rate by themselves."""
    gf.init_device_contexts(backend="cuda")
    backend = gf.lowlevel.current_backend_object()
    spent: dict[str, list[float]] = {}

    def timing(name: str, real: Any) -> Any:
        spent[name] = [0.0, 0.0]
        return _timer(real, spent[name])

    # (instance attributes: this process only) a launch of an op whose
    # arguments are final goes through the step the backend prepared for it
    made = backend.prepare_launch
    setattr(backend, "prepare_launch", lambda *args: timing("launch", made(*args)))  # noqa: B010
    setattr(backend, "mark", timing("mark", backend.mark))  # noqa: B010
    op = gf.compile('extern "C" __global__ void empty() {}').empty(gf.LaunchConfig(1, 1))
    loops = ["asyncio"] + [m for m in ("uvloop", "trio") if find_spec(m)]
    for lib in loops:
        for tally in spent.values():
            tally[:] = [0.0, 0]
        cpu: dict[str, float] = {}
        rate = throughput(lib, op, 64, 100, cpu)
        # (a launch a run: a call's time times its calls a run times the rate
        # is its share of the thread; runs on a busy stream share a mark)
        runs = spent["launch"][1]
        parts = ", ".join(
            f"{name} {s / n * 1e6:.2f} us a call, {n / runs:.2f} a run "
            f"({s / runs * rate * 100:.0f}% of the loop thread)"
            for name, (s, n) in spent.items() if n
        )
        busy = ", ".join(f"{name} {share:.2f}" for name, share in cpu.items())
        print(f"64 tasks x 100 awaits, {lib:<7} {rate:>9,.0f} op/s; {parts}; "
              f"CPU time over wall time: {busy}")
    return 0


#: The steps of an await that ``--pieces`` times (``module:attribute``):
#: a run's start (its stream, its checks: ``_start``/``_begin`` where the
#: await is unusual, the policy and ``startable`` where not) and its mark
#: (``Lane.submit``), the kernel's launch, the await's inline read and the
#: run's completion; for ``gf.wait_stream``, resolving the other library's
#: stream, its mark there and reading its event; for a collective, its
#: checks, its ordering and NCCL's call.
PIECES = (
    "gpuflow._core._run:_start",
    "gpuflow._core._run:_begin",
    "gpuflow._core._run:_submit_foreign",
    "gpuflow._core._policy:StreamPoolLeastLoaded.idle_stream",
    "gpuflow._core._runtime:Runtime.startable",
    "gpuflow._core._completion:Completer.submit",
    "gpuflow._core._completion:Lane.submit",
    "gpuflow._kernels._kernel:_Launch.execute",
    "gpuflow._backends._cuda._backend:CudaBackend.mark",
    "gpuflow._core._run:_spin_inline",
    "gpuflow._core._completion:Completer.advance",
    "gpuflow._core._completion:Completer.complete_reached",
    "gpuflow._core._completion:Completer.complete",
    "gpuflow._core._run:_foreign_home",
    "gpuflow._backends._cuda._backend:CudaBackend.foreign_stream",
    "gpuflow._backends._cuda._words:EventMarks.reached",
    "gpuflow._comm._communicator:_Collective._prepare",
    "gpuflow._comm._communicator:_issue",
    "gpuflow._comm._communicator:Communicator._started",
    "gpuflow._backends._cuda._backend:CudaBackend.comm_group",
    "gpuflow._backends._cuda._nccl:NcclComms.group",
)


def _timed_pieces() -> tuple[dict[str, list[float]], Callable[[], None]]:
    """Put a timer around every step of :data:`PIECES`: the tallies (seconds,
    calls) by step, and the function that takes the timers off again."""
    tallies: dict[str, list[float]] = {}
    undo: list[tuple[Any, str, Any]] = []
    for piece in PIECES:
        module, _, path = piece.partition(":")
        owner: Any = importlib.import_module(module)
        *outer, name = path.split(".")
        for attr in outer:
            owner = getattr(owner, attr)
        own = name in vars(owner)  # (else inherited: the timer shadows it)
        real = vars(owner)[name] if own else getattr(owner, name)
        tallies[path] = [0.0, 0.0]
        setattr(owner, name, _timer(real, tallies[path]))
        undo.append((owner, name, real if own else None))

    def restore() -> None:
        for owner, name, real in undo:
            if real is None:
                delattr(owner, name)
            else:
                setattr(owner, name, real)

    return tallies, restore


def pieces(op: gf.DeviceOperation[Any], n: int = 1000, with_torch: bool = False) -> int:
    """The steps of three kinds of await (four with PyTorch), timed (``--pieces``)."""
    kinds: dict[str, Callable[[], Any]] = {"an empty kernel": lambda: op}
    # (a stream of its own for the timed awaits: the reader of a stream's
    # event is bound when gpuflow first meets the stream)
    theirs = [_torch_like_stream()]
    kinds["gf.wait_stream(another library's stream)"] = lambda: gf.wait_stream(theirs[0])
    if with_torch and find_spec("torch") is not None:
        kinds["gf.wait_stream(a torch stream) after an MLP forward"] = _torch_request()
    if find_spec("nccl") is None:
        print("(a 4-byte all-reduce: needs NCCL's bindings, pip install 'gpuflow[nccl]')")
    loops = ["asyncio"] + [m for m in ("uvloop", "trio") if find_spec(m)]
    for lib in loops:
        backend, options = ("asyncio", {"use_uvloop": True}) if lib == "uvloop" else (lib, {})

        async def measure(lib: str) -> None:
            comm = None
            if find_spec("nccl") is not None:
                comm = await gf.open_communicator([0]).__aenter__()
                x, y = await gf.ones(1, np.float32), await gf.zeros(1, np.float32)
                reduce = comm.all_reduce([x], "max", out=[y])
                kinds["a 4-byte all-reduce"] = lambda: reduce
            try:
                for kind, make in kinds.items():
                    for _ in range(200):
                        await make()
                    batches = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        for _ in range(n):
                            await make()
                        batches.append((time.perf_counter() - t0) / n * 1e6)
                    tallies, restore = _timed_pieces()
                    theirs[0] = _torch_like_stream()
                    try:
                        t0 = time.perf_counter()
                        for _ in range(n):
                            await make()
                        timed = (time.perf_counter() - t0) / n * 1e6
                    finally:
                        restore()
                    print(f"await of {kind} ({lib}): {statistics.median(batches):.1f} us; "
                          f"with the timers on, {timed:.1f} us")
                    for step, (spent, calls) in sorted(tallies.items(), key=lambda t: -t[1][0]):
                        if calls:
                            print(f"    {step:<36} {calls / n:5.2f} an await x "
                                  f"{spent / calls * 1e6:6.2f} us")
            finally:
                if comm is not None:
                    await comm.__aexit__(None, None, None)

        anyio.run(measure, lib, backend=backend, backend_options=options)
    return 0


def _torch_request() -> Callable[[], Any]:
    """The bench's PyTorch request (``python -m gpuflow bench --only torch``):
    a 4-layer bf16 MLP forward on the next of 8 torch streams, then the
    wait for that stream, made after the forward."""
    import torch

    forward = mlp_forward()
    new_stream: Any = torch.cuda.Stream
    streams = [new_stream() for _ in range(8)]
    turn = itertools.count()

    def request() -> gf.DeviceOperation[None]:
        s = streams[next(turn) % len(streams)]
        with torch.cuda.stream(s):
            forward()
        return gf.wait_stream(s)

    return request


def model_throughput() -> int:
    loops = ["asyncio"] + [m for m in ("uvloop", "trio") if find_spec(m)]
    for exec_us in (5, 10, 30):
        gf.init_device_contexts(backend=ModelBackend(exec_us * 1e-6))
        mod = gf.compile('extern "C" __global__ void empty() {}',
                         references={"empty": lambda: None})
        op = mod.empty(gf.LaunchConfig(1, 1))
        for lib in loops:
            seen = Completions()
            rate = statistics.median(throughput(lib, op, 64, 100) for _ in range(5))
            streams = len(gf.lowlevel.pool_streams(0))
            print(f"model {exec_us:>2} us a mark, {lib:<7} {rate:>9,.0f} op/s "
                  f"({streams} pool streams)")
            seen.show()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
