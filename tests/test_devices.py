"""Which devices gpuflow runs on, and which one is current where."""

from __future__ import annotations

import re
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


@pytest.mark.sim_only  # builds a sim backend of its own
def test_init_takes_a_backend_instance() -> None:
    from gpuflow._backends._sim import SimBackend  # the instance under test

    be = SimBackend(3)
    assert gf.init_device_contexts(backend=be) == "sim"
    assert gf.lowlevel.current_backend_object() is be
    assert gf.device_count() == 3
    assert gf.full(4, 2.0).sync(gf.SingleStream(device=2)).device == 2
    # a runtime that goes on with the same instance does not close it
    gf.init_device_contexts(backend=be, num_devices=2)
    assert gf.device_count() == 2
    np.testing.assert_array_equal(gf.to_host(gf.full(3, 5)).sync(), np.full(3, 5))
    with pytest.raises(gf.UsageError, match="num_devices=4, but backend 'sim' has 3"):
        gf.init_device_contexts(backend=be, num_devices=4)


@pytest.mark.sim_only
def test_backends_are_found_by_name_in_a_registry() -> None:
    import uuid

    from gpuflow._backends._sim import SimBackend

    made: list[int | None] = []

    def factory(num_devices: int | None) -> gf.lowlevel.Backend:
        made.append(num_devices)
        return SimBackend(num_devices)

    name = f"test-{uuid.uuid4().hex[:8]}"
    gf.lowlevel.register_backend(name, factory)
    assert gf.init_device_contexts(backend=name, num_devices=2) == "sim"
    assert made == [2] and gf.device_count() == 2
    with pytest.raises(gf.UsageError, match=f"{name!r} is registered already"):
        gf.lowlevel.register_backend(name, factory)
    with pytest.raises(gf.UsageError, match="other than 'auto'"):
        gf.lowlevel.register_backend("auto", factory)
    with pytest.raises(gf.UsageError, match=r"one of 'auto', 'cuda', 'sim'.*not 'nope'"):
        gf.init_device_contexts(backend="nope")


def test_every_device_reports_its_architecture_and_no_fault() -> None:
    be = gf.lowlevel.current_backend_object()
    for d in range(gf.device_count()):
        assert re.fullmatch(r"sm_\d+", be.device_arch(d))
        assert be.device_fault(d) is None
    with pytest.raises(gf.UsageError, match=f"device {gf.device_count()} does not exist"):
        be.device_arch(gf.device_count())
