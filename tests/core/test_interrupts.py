"""Ctrl-C: the interrupt reaches the program at once, and the exit says what it waits for.

A program pressed Ctrl-C while it awaits a long kernel gets
:class:`KeyboardInterrupt` at once, whether or not a stream lease (or a
device group) encloses the await, however many nurseries down (a
lease in a device group's grandchild), and under every loop: the scopes it
leaves do not wait for the GPU, and what the GPU still uses stays alive,
as for a cancelled await.  At exit gpuflow waits for that work so that it
is released in order, and says so in one line; a second Ctrl-C ends the
wait, with no traceback.  Each case runs a child process (a signal to
this one would interrupt the suite), on the backend the test runs on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpuflow as gf

SRC = Path(gf.__file__).resolve().parents[1]

PROGRAM = r'''
import signal, sys, time, anyio, numpy as np, gpuflow as gf

# a program started from a terminal gets Python's Ctrl-C handler; one started
# with SIGINT ignored (the suite run in the background of a shell script: its
# children inherit the ignore) gets none, and would never see the interrupt
signal.signal(signal.SIGINT, signal.default_int_handler)
backend, loop, shape, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
gf.init_device_contexts(backend=backend)
mod = gf.compile(r"""
extern "C" __global__ void spin(float* x, long long ns) {
    unsigned long long s, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(s));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - s < (unsigned long long)ns);
    x[0] = 1.0f;
}""", references={"spin": lambda x, ns: (time.sleep(ns / 1e9), x.__setitem__(0, 1.0))})


async def work(x):
    await mod.spin(gf.LaunchConfig(1, 1), x, int(seconds * 1e9))


async def main():
    x = await gf.zeros(1, dtype=np.float32)
    print("started", flush=True)
    if shape == "bare":
        await work(x)
    elif shape == "lease":
        async with gf.open_stream_lease():
            await work(x)
    elif shape == "group":  # a lease in a child task of a device group
        async def child():
            async with gf.open_stream_lease():
                await work(x)

        async with gf.open_device_group() as group:
            group.start_soon(child)
    else:  # two nurseries down: a lease in a grandchild, through a task group
        async def grandchild():
            async with gf.open_stream_lease():
                await work(x)

        async def child():
            async with anyio.create_task_group() as tg:
                tg.start_soon(grandchild)

        async with gf.open_device_group() as group:
            group.start_soon(child)


t0 = time.monotonic()
try:
    if loop == "uvloop":
        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    else:
        anyio.run(main, backend=loop)
except BaseException as exc:
    if not isinstance(exc, KeyboardInterrupt) and not (
        isinstance(exc, BaseExceptionGroup) and exc.split(KeyboardInterrupt)[0] is not None
    ):
        raise
    print(f"interrupted after {time.monotonic() - t0:.3f} s", flush=True)
'''

LOOPS = ["asyncio", "uvloop", "trio"]


def _start(
    tmp_path: Path, backend: str, loop: str, shape: str, seconds: float
) -> subprocess.Popen[str]:
    program = tmp_path / "interrupted.py"
    program.write_text(PROGRAM)
    # (the gpuflow this process imported: a mutated copy, under the mutation check)
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.Popen(
        [sys.executable, str(program), backend, loop, shape, str(seconds)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line != "started\n":
        proc.kill()
        pytest.fail(f"the program did not start: {line}{proc.communicate()}")
    time.sleep(0.3)  # awaiting the kernel
    return proc


def _end(proc: subprocess.Popen[str], within: float) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=within + 20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the program did not end: {out}{err}")
    return out, err, time.monotonic() - t0


@pytest.mark.alone  # (bounds the time it takes)
@pytest.mark.parametrize("shape", ["bare", "lease", "group", "two-down"])
@pytest.mark.parametrize("loop", LOOPS)
def test_ctrl_c_reaches_the_program_at_once_and_a_second_ends_the_exit_wait(
    tmp_path: Path, device_backend: str, loop: str, shape: str
) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    proc = _start(tmp_path, device_backend, loop, shape, seconds=20.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # (the program's own line, before its exit)
    reached = time.monotonic() - t0
    assert line.startswith("interrupted after"), line
    assert reached < 2.0, f"the interrupt reached the program {reached:.2f} s after Ctrl-C"
    assert proc.stderr is not None
    said = proc.stderr.readline()  # what a user sees before pressing Ctrl-C again
    assert said.startswith("gpuflow: waiting up to 5 s for 1 run(s) still on the GPU"), said
    assert "press Ctrl-C to exit now" in said
    proc.send_signal(signal.SIGINT)  # the exit's wait for the kernel: skipped
    _out, err, took = _end(proc, within=2.0)
    assert took < 2.0, f"the second Ctrl-C ended the process {took:.2f} s later: {err}"
    assert proc.returncode == 0 and err == "", err  # no traceback, nothing ignored


@pytest.mark.alone  # (bounds the time it takes)
@pytest.mark.parametrize("loop", LOOPS)
def test_without_a_second_ctrl_c_the_exit_waits_for_the_gpu(
    tmp_path: Path, device_backend: str, loop: str
) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    proc = _start(tmp_path, device_backend, loop, "lease", seconds=1.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err, _took = _end(proc, within=5.0)
    ended = time.monotonic() - t0
    assert "interrupted after" in out
    # the kernel had about 1.2 s left: the process lived until it was done
    assert ended > 1.0, f"the process ended {ended:.2f} s after Ctrl-C, before its kernel"
    assert proc.returncode == 0, err
    assert "gpuflow: waiting up to 5 s" in err and "Traceback" not in err, err
