"""``python -m gpuflow bench`` ships with the package: it runs wherever
gpuflow is installed, not only from a checkout of the repository."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest
from helpers.child import run_child

import gpuflow as gf
from gpuflow.__main__ import main as gpuflow_main
from gpuflow._tools import _bench, _bench_rows
from gpuflow._tools._bench import main as bench_main
from gpuflow._tools._demo import main as demo_main
from gpuflow._tools._demo import run_fan_out


def test_bench_runs_from_an_installed_copy_of_the_package(
    device_backend: str, tmp_path: Path
) -> None:
    # a copy of the package alone, away from the repository: what an install leaves
    site = tmp_path / "site"
    shutil.copytree(
        Path(gf.__file__).parent, site / "gpuflow", ignore=shutil.ignore_patterns("__pycache__")
    )
    work = tmp_path / "work"
    work.mkdir()
    # the copy first; what else is on the path (its dependencies) stays
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("OUT", None)  # (the rows go where --json says, never where $OUT points)
    where = subprocess.run(
        [sys.executable, "-c", "import gpuflow; print(gpuflow.__file__)"],
        cwd=work, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).parent == site / "gpuflow"

    cmd = ["-m", "gpuflow", "bench", "--backend", device_backend, "--quick", "--only", "throughput",
           "--trace", "run.json", "--json", "rows.json"]
    proc = run_child([sys.executable, *cmd], cwd=work, env=env, timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"gpuflow bench on backend {device_backend!r}" in proc.stdout
    report = json.loads((work / "rows.json").read_text())
    assert sorted(p.name for p in work.iterdir()) == ["rows.json", "run.json"]
    assert report["backend"] == device_backend
    names = [r["name"] for r in report["rows"]]
    loops = ["asyncio"] + [m for m in ("uvloop", "trio") if find_spec(m)]
    assert names == [
        name
        for loop in loops
        for name in (
            f"awaited ops per second ({loop})", f"awaited ops per second, 1,000 tasks ({loop})"
        )
    ]
    assert all(r["unit"] == "op/s" and r["value"] > 0 for r in report["rows"])
    # --trace: a timeline of every run; each loop awaited at least 64 x 20 kernels
    events = json.loads((work / "run.json").read_text())["traceEvents"]
    runs = [e for e in events if e.get("cat") == "gpuflow.run"]
    assert len(runs) >= len(loops) * 64 * 20
    assert {e["name"] for e in runs} == {"kernel empty"}


# -- the command line's help ---------------------------------------------------------------------


@pytest.mark.sim_only  # no backend involved
def test_the_command_line_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpuflow_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m gpuflow COMMAND [options]")
    for command in ("demo", "bench", "info"):
        assert f"\n  {command}  " in out, command
    for markup in ("``", ":class:", ":func:"):  # reStructuredText a terminal shows raw
        assert markup not in out
    assert gpuflow_main([]) == 2 and "usage:" in capsys.readouterr().err
    assert gpuflow_main(["nope"]) == 2 and "expected one of demo" in capsys.readouterr().err


@pytest.mark.sim_only  # no backend involved
def test_bench_help_describes_it_and_every_name_only_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        bench_main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "gpuflow's benchmarks. Each row:" in out
    names = out[out.index("names for --only"):]
    for name in ("launch", "throughput", "chain", "hold", "lease", "deadlines", "fanout",
                 "torch", "nccl", "fault"):
        assert f"\n  {name:<11} " in names, name
    with pytest.raises(SystemExit) as done:  # a misspelt name runs nothing, and says so
        bench_main(["--only", "lanch"])
    assert done.value.code == 2
    assert "invalid choice: 'lanch' (choose from 'launch'" in capsys.readouterr().err


@pytest.mark.sim_only  # no backend involved
def test_info_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        gpuflow_main(["info", "--help"])
    assert done.value.code == 0
    assert "what a bug report needs" in capsys.readouterr().out


# -- rows: no negative times, targets on their own loop's rows -----------------------------------


@pytest.fixture
def fresh_rows() -> Iterator[None]:
    """The bench's rows (one list, shared by every bench module) empty for one test."""
    saved = list(_bench_rows.ROWS)
    _bench_rows.ROWS.clear()
    yield
    _bench_rows.ROWS[:] = saved


@pytest.mark.usefixtures("fresh_rows")
def test_bench_lease_exit_is_never_negative_and_rows_keep_their_loops(
    device_backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench_main(["--backend", device_backend, "--quick", "--only", "launch",
                       "--only", "lease", "--json", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    loops = ["asyncio"] + [m for m in ("uvloop", "trio") if find_spec(m)]
    lease = [r for r in rows if r["name"].startswith("lease exit beyond the GPU work's end")]
    assert [r["loop"] for r in lease] == loops
    for r in lease:
        # the lease waits for the work, which cannot end before its enqueue + 20 ms
        assert r["unit"] == "ms" and r["value"] >= 0, r
        # left of the 20 ms at the cancel: about 15 ms (the cancel comes 5 ms
        # after the lease started, and the enqueue a moment after that)
        assert 10 < r["base"] < 20, r
    assert "-0." not in capsys.readouterr().out  # nor printed as such
    for r in rows:
        assert r["loop"] in loops and r["name"].count(f"({r['loop']})") == 1, r
        others = [lib for lib in ("asyncio", "uvloop", "trio") if lib != r["loop"]]
        assert not any(lib in r["target"] for lib in others), r


def test_the_class_and_overlap_rows_stand_beside_their_own_baselines(
    device_backend: str, tmp_path: Path
) -> None:
    """Each class row is measured against the no-class row of the same run
    (and that one against an idle device), p50 and p99, the reserved-SM
    rows too (sim and a driver of CUDA 12.4 or later reserve SMs); the
    overlap row runs on every loop.  What the rows measure is the bench's to say, not asserted
    here."""
    assert bench_main(["--backend", device_backend, "--quick", "--only", "classes",
                       "--only", "overlap", "--json", str(tmp_path / "rows.json")]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    top = gf.lowlevel.current_backend_object().stream_priorities(0)
    for q in ("p50", "p99"):
        plain = rows[f"short {q}, no class, every SM busy"]
        assert plain["base_name"] == f"short {q}, idle device" and plain["base"] > 0
        classes = [f"short {q}, priority {top}", f"short {q}, 8 reserved SMs"]
        for name in classes:
            assert rows[name]["base"] == plain["value"], rows[name]
            assert rows[name]["base_name"] == f"short {q}, no class" and rows[name]["value"] > 0
    loops = ["asyncio"] + [m for m in ("uvloop", "trio") if find_spec(m)]
    overlap = [r for r in rows.values() if r["name"].startswith("run started first")]
    assert [r["loop"] for r in overlap] == loops
    assert all(r["base_name"] == "awaited, then host work" for r in overlap)


@pytest.mark.sim_only  # no backend involved
@pytest.mark.usefixtures("fresh_rows")
def test_a_row_refuses_a_target_set_for_another_loop(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"target '>= 70,000 \(asyncio\)' is set for asyncio, "
                       r"not for the loop it was measured under \(uvloop\)"):
        _bench_rows.row("awaited ops per second (uvloop)", 1.0, "op/s",
                        target=">= 70,000 (asyncio)")
    with pytest.raises(ValueError, match=r"\(none named\)"):
        _bench_rows.row("poller turn", 1.0, "us", target="<= 1 us (trio)")
    _bench_rows.row("awaited ops per second (asyncio)", 1.0, "op/s",
                    target=">= 70,000 (asyncio)")
    _bench_rows.row("awaited ops per second (uvloop)", 1.0, "op/s", "naive bridge", 0.5,
                    target=">= 2.5x")
    assert [(r["loop"], r["target"]) for r in _bench_rows.ROWS] == [
        ("asyncio", ">= 70,000 (asyncio)"), ("uvloop", ">= 2.5x")]
    capsys.readouterr()


@pytest.mark.sim_only  # no backend involved
@pytest.mark.usefixtures("fresh_rows")
def test_a_row_with_an_aim_says_whether_it_met_it(capsys: pytest.CaptureFixture[str]) -> None:
    row = _bench_rows.row
    row("lease exit beyond the GPU work's end (asyncio)", 6.4, "ms", "work left", 15.0,
        "<= 1 ms beyond")
    row("awaited ops per second, 1,000 tasks (trio)", 79.0, "op/s", "64 tasks trio", 100.0,
        ">= 0.8x")
    row("awaited ops per second (asyncio)", 80_000.0, "op/s", "naive bridge", 30_000.0,
        ">= 2.5x, >= 70,000 (asyncio)")
    row("fault -> DeviceFaultError", 25.0, "ms", "driver's first report", 10.0,
        "<= driver's first report + 20 ms")
    row("device group speed-up (2 devices)", 1.95, "x", target=">= 1.9x")
    row("graph replay awaited", 5.0, "us", "sync after every kernel", 100.0,
        "<= 0.1x (10x faster)")
    row("deadline misses, round robin", 50.0, "%", target="(120 fast requests)")
    row("gpuflow await (asyncio)", 20.0, "us", target="(sim: no target)")
    out = capsys.readouterr().out.splitlines()
    assert [line.rsplit(": ", 1)[-1] if line.endswith(("met", "missed")) else None
            for line in out] == ["missed", "missed", "met", "met", "met", "met", None, None]
    assert [r["verdict"] for r in _bench_rows.ROWS] == [
        "missed", "missed", "met", "met", "met", "met", None, None]
    assert _bench_rows.summary() == (
        "6 row(s) with an aim: 4 met, 2 missed: lease exit beyond the GPU work's end "
        "(asyncio); awaited ops per second, 1,000 tasks (trio)"
    )
    # an aim the row's figures cannot decide is the bench's own bug
    with pytest.raises(ValueError, match="a ratio needs a baseline"):
        row("poller turn", 1.0, "us", target="<= 2x")
    with pytest.raises(ValueError, match="in ms, the row in us"):
        row("poller turn", 1.0, "us", target="<= 2 ms")


@pytest.mark.sim_only  # no backend involved
@pytest.mark.usefixtures("fresh_rows")
def test_a_gpus_aim_is_not_judged_on_sim(capsys: pytest.CaptureFixture[str]) -> None:
    row = _bench_rows.row
    try:
        _bench_rows.measured_on("sim")
        row("device group speed-up (2 devices)", 1.1, "x", target=">= 1.9x", gpu_aim=True)
        # no baseline on sim: the aim is read, and not judged
        row("fault -> DeviceFaultError", 1.0, "ms", target="<= driver's first report + 20 ms",
            gpu_aim=True)
        row("graph replay awaited", 5.0, "us", "sync after every kernel", 100.0, "<= 0.1x")
        # a target that cannot be read is the bench's bug wherever it runs
        with pytest.raises(ValueError, match="cannot read the aim 'well inside"):
            row("latency, 99th percentile", 1.0, "ms", "a deadline", 200.0,
                "well inside (<= 0.5x)", gpu_aim=True)
        assert [r["verdict"] for r in _bench_rows.ROWS] == ["not judged", "not judged", "met"]
        out = capsys.readouterr().out.splitlines()
        assert out[0].endswith(">= 1.9x: not judged on sim (a GPU's aim)")
        assert _bench_rows.summary() == (
            "3 row(s) with an aim: 1 met, 0 missed, 2 not judged on sim (a GPU's aim)"
        )
        _bench_rows.measured_on("cuda")  # the same rows on a GPU are judged
        row("device group speed-up (2 devices)", 1.1, "x", target=">= 1.9x", gpu_aim=True)
        assert _bench_rows.ROWS[-1]["verdict"] == "missed"
    finally:
        _bench_rows.measured_on("cuda")


def test_every_name_only_takes_runs_a_bench() -> None:
    assert list(_bench._RUNS) == list(_bench.BENCHES)


@pytest.mark.sim_only  # each row as the plain command runs it on sim
@pytest.mark.usefixtures("fresh_rows")
@pytest.mark.parametrize("name", list(_bench.BENCHES))
def test_every_row_runs_on_sim(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``python -m gpuflow bench`` runs with no ``--only``, row by row
    (two simulated devices, so that the two-device row runs too): each
    finishes, each row with an aim says met, missed or not judged, and no
    row whose aim is a GPU's says it missed on sim."""
    path = tmp_path / "rows.json"
    assert bench_main(["--backend", "sim", "--quick", "--devices", "2", "--only", name,
                       "--json", str(path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())["rows"]
    if name in ("hold", "torch", "nccl"):  # the GPU's rows alone: it says why none ran
        assert rows == [] and "needs a CUDA device" in out, out
    else:
        assert rows, out
    for r in rows:
        assert r["verdict"] in (None, "met", "missed", "not judged"), r
        assert not (r["gpu_aim"] and r["verdict"] == "missed"), r
    assert out.splitlines()[-1].startswith(f"{len(rows) - sum(r['verdict'] is None for r in rows)} "
                                           "row(s) with an aim: ")


@pytest.mark.sim_only  # the simulation's devices, as many as asked for
@pytest.mark.usefixtures("fresh_rows")
def test_devices_lets_the_two_device_row_run_on_sim(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rows.json"
    assert bench_main(["--backend", "sim", "--quick", "--only", "fanout", "--devices", "2",
                       "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sim device 0, sim device 1" in out.splitlines()[0] or ", " in out.splitlines()[0]
    rows = json.loads(path.read_text())["rows"]
    assert [r["name"] for r in rows] == ["device group speed-up (2 devices)"]
    assert rows[0]["verdict"] == "not judged"  # (a GPU's aim: sim's devices share its cores)
    assert out.splitlines()[-1] == (
        "1 row(s) with an aim: 0 met, 0 missed, 1 not judged on sim (a GPU's aim)")
    with pytest.raises(SystemExit):
        bench_main(["--devices", "0"])
    assert "a positive number of devices, not '0'" in capsys.readouterr().err


# -- the demo ------------------------------------------------------------------------------------


def _demo_modes(out: str) -> list[tuple[str, float, float, float]]:
    """The demo's table: (mode, tokens/s, us/token, ratio) a line."""
    table = out[out.index("\nmode "):].splitlines()[2:5]
    rows = []
    for line in table:
        m = re.fullmatch(r"(.+?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x", line)
        assert m, line
        rows.append((m[1], float(m[2]), float(m[3]), float(m[4])))
    return rows


def test_the_demo_says_what_its_numbers_mean(
    device_backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo_main(["--backend", device_backend, "--tokens", "2", "--hidden", "32"]) == 0
    out = capsys.readouterr().out
    header = out[out.index("\nmode "):].splitlines()[1]
    assert header.split() == ["mode", "tokens/s", "us/token", "tokens/s", "vs", "sync"]
    modes = _demo_modes(out)
    assert [m[0] for m in modes] == [
        "sync after every kernel", "then chain, awaited per token",
        "graph replay, awaited per token"]
    for _name, rate, us, ratio in modes:
        # tokens/s over the first mode's (a throughput ratio), not a ratio of times
        assert ratio == pytest.approx(modes[0][2] / us, rel=1e-3, abs=0.006)
        assert rate == pytest.approx(1e6 / us, rel=1e-3, abs=0.051)  # (printed to 0.1)
    assert "same numbers in every mode: yes" in out
    assert "same numbers on every device: yes" in out
    sim_note = "note: sim timings mean nothing."
    if device_backend == "sim":
        assert out.index(sim_note) < out.index("\nmode ")  # said before any number
        # no fan-out throughput, hence no scaling claim, from the simulation's clock
        assert out[out.index("device-group fan-out"):].splitlines() == [
            "device-group fan-out (graph replay) over 2 device(s):",
            "  same numbers on every device: yes",
            "  (no throughput or scaling figure on sim: see the note above)",
        ]
    else:
        assert sim_note not in out


@pytest.mark.sim_only  # the timed fan-out, as on a GPU, with the simulation's clock
def test_the_demo_fan_out_compares_tokens_per_second_with_one_device(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_fan_out(2, 32, [0, 1], timed=True)
    line = capsys.readouterr().out.splitlines()[2]
    m = re.fullmatch(
        r"  one device ([\d.]+) tokens/s; the group ([\d.]+) tokens/s = ([\d.]+)x one "
        r"device's tokens/s \(median of 3 runs each\)", line)
    assert m, line
    assert float(m[3]) == pytest.approx(float(m[2]) / float(m[1]), rel=0.01)


def test_the_bench_takes_its_paths_in_turns_and_each_where_it_may_run() -> None:
    # a ratio of two medians compares like with like only if both paths were
    # timed across the same stretch of the run: in turns of `block` calls,
    # coroutine functions inside an event loop, plain ones outside any
    from gpuflow._core._loops import running_loop_name

    calls: list[tuple[str, str | None]] = []

    async def awaited() -> None:
        calls.append(("awaited", running_loop_name()))

    def plain() -> None:
        calls.append(("plain", running_loop_name()))

    got = _bench_rows.interleaved({"awaited": awaited, "plain": plain}, 40, 10)
    assert {k: len(v) for k, v in got.items()} == {"awaited": 40, "plain": 40}
    assert all(t >= 0 for v in got.values() for t in v)
    # 4 untimed calls of each, then turns of 10
    names = [name for name, _ in calls]
    assert names == ["awaited"] * 4 + ["plain"] * 4 + (["awaited"] * 10 + ["plain"] * 10) * 4
    assert {where for name, where in calls if name == "awaited"} == {"asyncio"}
    assert {where for name, where in calls if name == "plain"} == {None}
    # coroutine functions alone: one loop, in turns all the same
    calls.clear()
    got = _bench_rows.interleaved({"a": awaited, "b": awaited}, 20, 5, "trio")
    assert {k: len(v) for k, v in got.items()} == {"a": 20, "b": 20}
    assert len(calls) == 2 * (2 + 20) and {where for _, where in calls} == {"trio"}
