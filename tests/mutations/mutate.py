"""Plant known lifetime and ordering bugs in a copy of ``src/`` and check
that the test suite catches every one.

Each mutation (``planted_core.py`` for ``src/gpuflow/_core/``,
``planted_layers.py`` for the layers above it and the backends,
``planted_together.py`` for where features meet) is a bug
that once slipped past a green suite, or one worth guarding in the same
places: the run, completion, hazard, scope, policy and simulator code.
For each, this script copies ``src/`` to a temporary directory, applies
the mutation (an exact, unique text replacement: if the code moved, the
script says so rather than testing nothing), runs the tests that should
catch it on ``sim`` against the copy, and reports whether they failed.  A
control run first checks that the same tests pass unmutated.

Run it before changing the run, completion, hazard or scope code, and after:

    python tests/mutations/mutate.py              # every mutation
    python tests/mutations/mutate.py M3 M5        # some of them
    python tests/mutations/mutate.py --list
    python tests/mutations/mutate.py --tests tests/together/test_stateful.py T1 T8

It needs nothing but the standard library and pytest; every mutation
takes about an hour and a half on two cores, a few of them a few minutes
(it is not part of the default test run).  Exit status 0 means
every mutation was caught.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# the catalogues beside this script, however it is loaded (run, or read by
# tests/project/test_architecture.py)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutation import Mutation  # noqa: E402
from planted_core import MUTATIONS as CORE  # noqa: E402
from planted_layers import MUTATIONS as LAYERS  # noqa: E402
from planted_together import MUTATIONS as TOGETHER  # noqa: E402

MUTATIONS: list[Mutation] = [*CORE, *LAYERS, *TOGETHER]


def _loop_of(nodeid: str) -> str | None:
    """The event loop a test id ran under (``test_x[sim-trio-settrace]``:
    trio), or None for a test that runs under none."""
    params = nodeid.partition("[")[2].rstrip("]").split("-")
    return next((p for p in params if p in ("asyncio", "uvloop", "trio")), None)


def _pytest(src: Path, tests: tuple[str, ...], timeout: float) -> tuple[bool, str]:
    """Run ``tests`` on sim against ``src``; (passed, what failed under which loop)."""
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1")
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "sim", *tests,
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s (a hang counts as caught)"
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    failed = sorted({ln.split(" ")[1] for ln in lines if ln.startswith(("FAILED ", "ERROR "))})
    if not failed:
        return proc.returncode == 0, lines[-1] if lines else proc.stderr.strip()[-200:]
    # which event loops saw it: every async test runs under each
    ran_under = [_loop_of(f) for f in failed]
    loops = {loop: ran_under.count(loop) for loop in ("asyncio", "uvloop", "trio")}
    plain = ran_under.count(None)
    seen = ", ".join(f"{loop} {n}" for loop, n in loops.items() if n)
    names = sorted({f.split("::")[-1].split("[")[0] for f in failed})
    return False, (
        f"{len(failed)} failed ({seen or 'no loop'}" + (f", no loop {plain}" if plain and seen
        else "") + "): " + ", ".join(names[:3]) + (f" +{len(names) - 3} more" if len(names) > 3
        else "")
    )


def _copy_src(dest: Path) -> Path:
    src = dest / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # the copy, not the installed checkout, must be what the tests import
    probe = subprocess.run(
        [sys.executable, "-c", "import gpuflow; print(gpuflow.__file__)"],
        env=dict(os.environ, PYTHONPATH=str(src)), capture_output=True, text=True, check=True,
    )  # fmt: skip
    if not probe.stdout.strip().startswith(str(src)):
        raise SystemExit(f"the tests would import {probe.stdout.strip()}, not the copy in {src}")
    return src


def _apply(src: Path, m: Mutation) -> None:
    path = src / "gpuflow" / m.path
    text = path.read_text()
    n = text.count(m.old)
    if n != 1:
        raise LookupError(f"{m.name}: the code to mutate occurs {n} times in {m.path}, not once")
    path.write_text(text.replace(m.old, m.new))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    p.add_argument(
        "--tests", action="append", metavar="ARG",
        help="pytest arguments to run against every mutation instead of its own tests "
        "(repeatable): which mutations another test finds",
    )  # fmt: skip
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    if args.tests:
        chosen = [dataclasses.replace(m, tests=tuple(args.tests)) for m in chosen]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name:5} {m.path:18} {m.what}")
        return 0 if chosen else 2
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="gpuflow-mutate-") as tmp:
        controls = sorted({t for m in chosen for t in m.tests})
        src = _copy_src(Path(tmp) / "control")
        ok, summary = _pytest(src, tuple(controls), args.timeout)
        print(f"control (no mutation): {summary}", flush=True)
        if not ok:
            print("the tests fail without a mutation: fix that first", file=sys.stderr)
            return 2
        for m in chosen:
            src = _copy_src(Path(tmp) / m.name)
            try:
                _apply(src, m)
            except LookupError as exc:
                rows.append((m.name, m.what, "NOT APPLIED", str(exc)))
                print(f"{m.name}: {exc}", flush=True)
                continue
            t0 = time.monotonic()
            passed, summary = _pytest(src, m.tests, args.timeout)
            verdict = "SURVIVED" if passed else "caught"
            rows.append((m.name, m.what, verdict, f"{summary} ({time.monotonic() - t0:.0f} s)"))
            print(f"{m.name}: {verdict}: {summary}", flush=True)
    print()
    print("| mutation | bug planted | result | tests (sim) |")
    print("|---|---|---|---|")
    for name, what, verdict, summary in rows:
        print(f"| {name} | {what} | {verdict} | {summary} |")
    return 0 if all(r[2] == "caught" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
