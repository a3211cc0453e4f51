"""Front-end overhead with a backend that does nothing: signals complete at once.

Run: python benchmarks/profile_frontend.py [profile]
"""

import cProfile
import pstats
import sys
import threading
import time

import anyio

import gpuflow as gf
import gpuflow._runtime as R
from gpuflow._backends import _base


class NullStream:
    def __init__(s, d):
        s.device = d
        s.signals = 0


class NullBackend(_base.Backend):
    name = "null"

    def __init__(s):
        s._sem = threading.Semaphore(0)
        s.lock = threading.Lock()

    device_count = property(lambda s: 1)

    def device_name(s, d):
        return "null"

    def create_stream(s, d):
        return NullStream(d)

    def destroy_stream(s, x):
        pass

    def stream_handle(s, x):
        return 0

    def synchronize(s, x):
        pass

    def query(s, x):
        return True

    def record_event(s, x):
        return None

    def wait_event(s, x, e):
        pass

    def alloc(s, d, n, st):
        class B:
            pass

        b = B()
        b.device = d
        b.nbytes = n
        b.ptr = 0
        return b

    def free(s, b, st):
        pass

    def copy_from_host(s, *a):
        pass

    def copy_to_host(s, *a):
        pass

    def copy_device(s, *a):
        pass

    def fill(s, *a):
        pass

    def arange(s, *a):
        pass

    def load_kernel(s, d, m, n):
        return n

    def launch(s, *a):
        pass

    def enqueue_signal(s, st):
        with s.lock:
            st.signals += 1
        s._sem.release()

    def wait_signals(s, t):
        s._sem.acquire(timeout=t if t else -1)

    def take_signals(s, st):
        with s.lock:
            n = st.signals
            st.signals = 0
            return n

    def wake(s):
        s._sem.release()

    def begin_capture(s, x):
        pass

    def end_capture(s, x):
        return None

    def launch_graph(s, *a):
        pass

    def device_fault(s, d):
        return None

    def reset_device(s, d):
        pass


be = NullBackend()
R._runtime = R.Runtime(be, 0, [0], 4)
mod = gf.compile('extern "C" __global__ void empty() {}', references={"empty": lambda: None})
op = mod.empty(gf.LaunchConfig(1, 1))
k = op
chain = k
for _ in range(131):
    chain = chain.then(lambda _o: k)
pol = gf.SingleStream(0)
for lib in ("asyncio", "trio"):

    async def main():
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

    per_await, per_step = anyio.run(main, backend=lib)
    print(f"{lib} await us/op {per_await:.2f}, chain us/step {per_step:.2f}")
# the chain's own Python: execute() alone, no run set-up, no await
from gpuflow._bridge import Submission  # noqa: E402
from gpuflow._context import ExecutionContext  # noqa: E402

ctx = ExecutionContext(R._runtime, gf.new_stream(0), pol, Submission(0))
t0 = time.perf_counter()
for _ in range(300):
    chain.execute(ctx)
print("chain execute() us/step %.3f" % ((time.perf_counter() - t0) / 300 / 132 * 1e6))
# sync path enqueue only
s = gf.new_stream(0)
t0 = time.perf_counter()
for _ in range(20000):
    op.enqueue_on(s)
print("enqueue_on us/op %.2f" % ((time.perf_counter() - t0) / 20000 * 1e6))
if len(sys.argv) > 1:

    async def main():
        for _ in range(5000):
            await op

    cProfile.run("anyio.run(main)", "/tmp/prof/p.out")
    pstats.Stats("/tmp/prof/p.out").sort_stats("tottime").print_stats(18)
