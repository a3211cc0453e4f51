"""Which devices gpuflow runs on, and which one is current where."""

from __future__ import annotations

import logging
import re
import threading
import warnings
from typing import Any

import anyio
import numpy as np
import pytest
from helpers import simulated

import gpuflow as gf


def test_device_count_is_what_init_took(device_backend: str) -> None:
    n = gf.device_count()
    assert n >= 1
    if simulated():
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
    from gpuflow._backends._sim._backend import SimBackend  # the instance under test

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

    from gpuflow._backends._sim._backend import SimBackend  # a backend to register

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


# -- backend="auto": which backend, and saying so ------------------------------------------------


class _Driver:
    """``cuda.bindings.driver`` as a machine shows it: a driver library that
    loads or not, and what ``cuInit`` and ``cuDeviceGetCount`` answer."""

    def __init__(self, *, loads: bool = True, init: int = 0, devices: int = 0) -> None:
        from cuda.bindings import driver  # importing it needs no driver library

        self.CUresult = driver.CUresult
        self.loads, self.init, self.devices = loads, init, devices
        self.calls: list[str] = []

    def cuDriverGetVersion(self) -> tuple[object, int]:
        self.calls.append("cuDriverGetVersion")
        if not self.loads:
            raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found ...')
        return self.CUresult(0), 13000

    def cuInit(self, flags: int) -> tuple[object]:
        self.calls.append("cuInit")
        return (self.CUresult(self.init),)

    def cuDeviceGetCount(self) -> tuple[object, int]:
        self.calls.append("cuDeviceGetCount")
        return self.CUresult(0), self.devices


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``machine(driver, nodes)``: what backend="auto" will find (the driver
    module and the GPU device files), with no GPUFLOW_BACKEND set."""
    from gpuflow._backends._cuda import _driver

    monkeypatch.delenv("GPUFLOW_BACKEND", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def set_up(driver: _Driver, nodes: list[str]) -> _Driver:
        monkeypatch.setattr(_driver, "_cu_module", driver)
        monkeypatch.setattr(_driver, "_device_nodes", lambda: list(nodes))
        return driver

    return set_up


_MISMATCH = 803  # CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: a driver library newer than its module


@pytest.mark.sim_only  # replaces the driver module for one test
@pytest.mark.parametrize(
    ("driver", "nodes", "reason"),
    [
        (_Driver(init=_MISMATCH), [], r"cuInit failed \[CUDA_ERROR_SYSTEM_DRIVER_MISMATCH \(803\)"),
        (_Driver(init=999), ["/dev/nvidia0"], r"\[CUDA_ERROR_UNKNOWN \(999\)\]"),
        (_Driver(init=100), ["/dev/nvidia0"], r"\[CUDA_ERROR_NO_DEVICE \(100\)\]"),
        (_Driver(devices=0), ["/dev/nvidia0"], "the driver reports no device, but /dev/nvidia0"),
    ],
    ids=["driver-mismatch", "unknown-error", "no-device-but-device-files", "zero-devices"],
)
def test_auto_warns_when_it_falls_back_to_sim_beside_a_driver(
    machine: Any, driver: _Driver, nodes: list[str], reason: str
) -> None:
    machine(driver, nodes)
    with pytest.warns(RuntimeWarning, match=reason) as caught:
        assert gf.init_device_contexts() == "sim"
    (warning,) = caught
    text = str(warning.message)
    assert "a CUDA driver is installed but gpuflow cannot use it" in text
    assert "NumPy reference" in text and "GPUFLOW_BACKEND=sim" in text
    assert warning.filename == __file__  # it points at the call that chose
    assert gf.lowlevel.current_backend_object().name == "sim"


@pytest.mark.sim_only
def test_the_warning_names_cuda_visible_devices_where_it_is_set(
    machine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    machine(_Driver(init=100), ["/dev/nvidia0", "/dev/nvidia1"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.warns(RuntimeWarning, match=r"\(CUDA_VISIBLE_DEVICES='7'\)"):
        gf.init_device_contexts()


@pytest.mark.sim_only
@pytest.mark.parametrize(
    ("driver", "nodes"),
    [(_Driver(loads=False), []), (_Driver(init=100), [])],
    ids=["no-driver-library", "driver-library-but-no-gpu"],
)
def test_auto_is_silent_on_a_machine_without_a_gpu(
    machine: Any, driver: _Driver, nodes: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    machine(driver, nodes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.INFO, logger="gpuflow"):
            assert gf.init_device_contexts() == "sim"
    assert "no CUDA driver or device present; backend 'sim'" in caplog.text


@pytest.mark.sim_only
def test_gpuflow_backend_chooses_what_auto_stands_for(
    machine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = machine(_Driver(init=_MISMATCH), ["/dev/nvidia0"])
    monkeypatch.setenv("GPUFLOW_BACKEND", "sim")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sim was chosen: nothing to warn about
        assert gf.init_device_contexts(num_devices=2) == "sim"
    assert gf.device_count() == 2 and driver.calls == []  # the driver was not even asked
    from gpuflow._tools._info import _backend_lines  # what a bug report says of it

    assert _backend_lines()[0] == (
        "backend: sim (what init_device_contexts() picks here; GPUFLOW_BACKEND='sim')"
    )

    monkeypatch.setenv("GPUFLOW_BACKEND", "cuda")
    with pytest.raises(gf.DeviceError, match="CUDA_ERROR_SYSTEM_DRIVER_MISMATCH") as failed:
        gf.init_device_contexts()
    assert "(the backend was chosen by GPUFLOW_BACKEND=cuda)" in failed.value.__notes__

    monkeypatch.setenv("GPUFLOW_BACKEND", "gpu")
    with pytest.raises(gf.UsageError, match=r"GPUFLOW_BACKEND='gpu' names no backend: .*'sim'"):
        gf.init_device_contexts()
    # a backend named in the call is the program's choice: the variable is not read
    assert gf.init_device_contexts(backend="sim", num_devices=2) == "sim"


@pytest.mark.anyio
async def test_a_new_runtime_is_refused_while_runs_are_in_flight(device_backend: str) -> None:
    from helpers import kernels as K

    x = await gf.zeros(64, np.float32)
    before = gf.lowlevel.current_backend_object()
    async with gf.open_stream_lease() as lease:
        started = lease.start_run(K.slow_fill(x, 1.0, 0.2))
        with pytest.raises(gf.UsageError, match=re.escape(
            "init_device_contexts() with 1 run(s) of the current runtime still in flight: "
            "its streams and memory go with it. Await them, or leave the scopes that "
            "started them, first"
        )):
            gf.init_device_contexts(backend=device_backend)
        await started
    # nothing was replaced: the array and its runtime serve on
    assert gf.lowlevel.current_backend_object() is before
    np.testing.assert_array_equal(await gf.to_host(x), np.ones(64, np.float32))
    # at rest, a new runtime is made
    gf.init_device_contexts(backend=before, num_devices=gf.device_count())


def test_device_info_gives_a_devices_facts(device_backend: str) -> None:
    be = gf.lowlevel.current_backend_object()
    info = gf.device_info()
    assert info.device == gf.current_device() and info.backend == device_backend
    desc = be.describe_device(info.device)
    assert (info.name, info.compute_capability, info.total_memory) == (
        desc.name, desc.compute_capability, desc.total_memory)
    assert info.sms == be.sm_count(info.device) and info.sms is not None and info.sms > 0
    assert info.max_priority == be.stream_priorities(info.device)
    assert info.reserved_sms == {} and info.other_sms is None
    assert info.launch_limits.max_threads_per_block >= 1024
    if simulated():  # as an H100 (or H200) reports
        assert info.compute_capability is None and info.sms == 132 and info.max_priority == 5
        assert info.launch_limits.max_grid == (2**31 - 1, 65535, 65535)
    with pytest.raises(gf.UsageError, match="device 99 is not initialised"):
        gf.device_info(99)


@pytest.mark.sim_only  # (reserves SMs on a simulated device)
def test_device_info_says_the_sms_each_name_reserved() -> None:
    gf.init_device_contexts(
        backend="sim", num_devices=2, reserve_sms={"interactive": 12, "bulk": 8}
    )
    info = gf.device_info(1)
    assert info.device == 1
    # rounded up as the driver rounds (8 SMs a granule on sm_90), the rest left to others
    assert info.reserved_sms == {"interactive": 16, "bulk": 8}
    assert info.other_sms == 132 - 16 - 8
