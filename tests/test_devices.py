"""Which devices gpuflow runs on, and which one is current where."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

import gpuflow as gf


def test_device_count_is_what_init_took(device_backend: str) -> None:
    n = gf.device_count()
    assert n >= 1
    if device_backend == "sim":
        assert n == 2  # the suite's sim runtime has two devices
    for d in range(n):
        assert gf.new_stream(d).device == d
    with pytest.raises(gf.UsageError, match=f"device {n} is not initialised"):
        gf.new_stream(n)


def test_use_device_makes_a_device_current_and_restores_it() -> None:
    last = gf.device_count() - 1
    before = gf.current_device()
    with gf.use_device(last) as d:
        assert d == last and gf.current_device() == last
        assert gf.new_stream().device == last
        # a run started here goes to that device
        out = gf.zeros(4, np.float32).sync()
        assert out.device == last
    assert gf.current_device() == before
    with pytest.raises(RuntimeError, match="boom"):
        with gf.use_device(last):
            raise RuntimeError("boom")
    assert gf.current_device() == before


def test_use_device_refuses_a_device_that_is_not_there() -> None:
    for bad in (gf.device_count(), -1, True, "0"):
        with pytest.raises(gf.UsageError, match="is not initialised"):
            with gf.use_device(bad):  # type: ignore[arg-type]
                pass  # pragma: no cover


def test_use_device_applies_to_its_thread_only() -> None:
    last = gf.device_count() - 1
    seen: list[int] = []
    with gf.use_device(last):
        t = threading.Thread(target=lambda: seen.append(gf.current_device()))
        t.start()
        t.join()
    assert seen == [0]


@pytest.mark.anyio
async def test_use_device_applies_to_its_task_only() -> None:
    last = gf.device_count() - 1
    seen: dict[str, int] = {}
    entered = anyio.Event()
    leave = anyio.Event()

    async def inside() -> None:
        with gf.use_device(last):
            entered.set()
            await leave.wait()
            seen["inside"] = (await gf.zeros(2, np.float32)).device

    async def outside() -> None:
        await entered.wait()
        seen["outside"] = gf.current_device()
        leave.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(inside)
        tg.start_soon(outside)
    assert seen == {"inside": last, "outside": 0}
