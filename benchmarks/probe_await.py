"""Where one ``await op`` spends its time, on the backend in use.

Timestamps from both threads on one clock (``perf_counter``):
front end and launch | signal enqueue | GPU + host function + dispatcher wake
| dispatcher Python up to the post | loop wake-up and task resume.
Then cProfile of the loop thread over awaits and over a 132-step then-chain.

Run: python benchmarks/probe_await.py [cuda|sim]
"""

import cProfile
import io
import pstats
import statistics
import sys
import time

import anyio

import gpuflow as gf
from gpuflow import _bridge
from gpuflow._runtime import get_runtime

backend = gf.init_device_contexts(backend=sys.argv[1] if len(sys.argv) > 1 else "auto")
rt = get_runtime()
be = rt.backend
pc = time.perf_counter
marks: dict[str, float] = {}

orig_wait = be.wait_signals


def wait_signals(t):  # type: ignore[no-untyped-def]
    orig_wait(t)
    marks.setdefault("wake", pc())


be.wait_signals = wait_signals
orig_post = _bridge.post


def post(*a):  # type: ignore[no-untyped-def]
    marks.setdefault("post", pc())
    orig_post(*a)


_bridge.post = post
disp = rt.dispatcher
orig_submit = disp.submit


def submit(raw, sub, *rest):  # type: ignore[no-untyped-def]
    marks["submit0"] = pc()
    orig_submit(raw, sub, *rest)
    marks["submit1"] = pc()


disp.submit = submit
mod = gf.compile('extern "C" __global__ void empty() {}', references={"empty": lambda: None})
op = mod.empty(gf.LaunchConfig(1, 1))
chain = op
for _ in range(131):
    chain = chain.then(lambda _o: op)
one = gf.SingleStream()
N = 2000

for lib in ("asyncio", "trio"):
    async def main() -> dict[str, list[float]]:
        names = ("front", "signal", "gpu+wake", "dispatch", "resume", "total")
        seg: dict[str, list[float]] = {k: [] for k in names}
        for _ in range(200):
            await op
        for _ in range(N):
            marks.clear()
            t0 = pc()
            await op
            t1 = pc()
            m = dict(marks)
            if not ("wake" in m and "post" in m and m["submit1"] <= m["wake"] <= m["post"]):
                continue
            seg["front"].append(m["submit0"] - t0)
            seg["signal"].append(m["submit1"] - m["submit0"])
            seg["gpu+wake"].append(m["wake"] - m["submit1"])
            seg["dispatch"].append(m["post"] - m["wake"])
            seg["resume"].append(t1 - m["post"])
            seg["total"].append(t1 - t0)
        return seg

    seg = anyio.run(main, backend=lib)
    print(f"{backend} {lib}: " + ", ".join(
        f"{k} {statistics.median(v) * 1e6:.1f} us" for k, v in seg.items()
    ) + f"  ({len(seg['total'])} of {N} samples)")

for what, coro in (("await", lambda: op), ("chain", lambda: chain.run(one))):
    async def prof_main() -> None:
        for _ in range(3000 if what == "await" else 60):
            await coro()

    pr = cProfile.Profile()
    pr.enable()
    anyio.run(prof_main)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(f"== cProfile, loop thread, {what}\n" + "\n".join(s.getvalue().splitlines()[4:40]))
