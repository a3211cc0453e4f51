"""What the ranks of the multi-process communicator tests run, each in its own process.

Started by ``gf.spawn_ranks`` (the functions below get their RankInfo), or by
``mpiexec -n N python tests/helpers/ranks.py SCENARIO LOOP``, which prints each
rank's result as one JSON line ``{"rank": r, "result": ...}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import anyio
import numpy as np

import gpuflow as gf


async def _host(a: gf.DeviceArray) -> list[Any]:
    return (await gf.to_host(a)).tolist()  # type: ignore[no-any-return]


async def _every_collective(info: gf.RankInfo) -> dict[str, Any]:
    r, n = info.rank, info.nranks
    out: dict[str, Any] = {}
    async with gf.open_communicator(info) as comm:
        x = await gf.from_host(np.array([r + 1, 2 * r + 1, 3], np.float32))
        for op in ("sum", "prod", "max", "min", "avg"):
            out[op] = await _host(await comm.all_reduce(x, op))
        ints = await gf.from_host(np.array([r, 10 + r], np.int64))
        await comm.all_reduce(ints, out=ints)  # in place
        out["in_place"] = await _host(ints)
        out["broadcast"] = await _host(await comm.broadcast(x, root=n - 1))
        out["all_gather"] = await _host(await comm.all_gather(x))
        rows = await gf.from_host(np.arange(n * 2, dtype=np.int32).reshape(n, 2) * (r + 1))
        out["reduce_scatter"] = await _host(await comm.reduce_scatter(rows))
        # a ring: each rank sends to the next and receives from the one before
        _, got = await comm.group(
            comm.send(x, (r + 1) % n), comm.recv((r - 1) % n, shape=(3,), dtype=np.float32)
        )
        out["ring"] = await _host(got)
    return out


def every_collective(info: gf.RankInfo, loop: str) -> dict[str, Any]:
    return anyio.run(_every_collective, info, backend=loop)


async def _killed(info: gf.RankInfo) -> dict[str, Any]:
    result: dict[str, Any] = {}
    try:
        async with gf.open_communicator(info) as comm:
            x = await gf.from_host(np.ones(4, np.float32))
            await comm.all_reduce(x)  # every rank gets this far
            if info.rank == info.nranks - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # the last rank dies, mid-job
            try:
                with anyio.fail_after(30):
                    await comm.all_reduce(x)
            except gf.CommunicatorError as exc:
                result.update(error=exc.name, message=str(exc))
            else:
                raise AssertionError("the all-reduce with a dead peer completed")
    except gf.CommunicatorError as exc:
        # leaving the scope reports the error that aborted its communicator
        result["scope"] = exc.name
    return result


def killed(info: gf.RankInfo, loop: str) -> dict[str, Any]:
    return anyio.run(_killed, info, backend=loop)


def fails_on_the_last(info: gf.RankInfo, loop: str) -> str:
    if info.rank == info.nranks - 1:
        raise ValueError(f"rank {info.rank} was told to fail")
    return f"rank {info.rank} ok on {loop}"


def prints_in_pieces(info: gf.RankInfo, lines: int) -> str:
    """Lines written a piece at a time, the ranks' pieces interleaved in
    time, and a last line with no newline; an error line on stderr."""
    import time

    for i in range(lines):
        for piece in (f"line {i} ", "of ", f"rank {info.rank}", "\n"):
            sys.stdout.write(piece)
            sys.stdout.flush()
            time.sleep(0.002)
    print(f"warning from rank {info.rank}", file=sys.stderr)
    sys.stdout.write("unfinished")
    return "printed"


def sleeps(info: gf.RankInfo, seconds: float) -> None:
    import time

    time.sleep(seconds)


SCENARIOS = {"every_collective": every_collective, "killed": killed}

if __name__ == "__main__":  # under mpiexec
    scenario, loop = sys.argv[1], sys.argv[2]
    gf.init_device_contexts(backend="sim")
    me = gf.bootstrap_mpi()
    result = SCENARIOS[scenario](me, loop)
    print(json.dumps({"rank": me.rank, "result": result}), flush=True)
