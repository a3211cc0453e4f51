"""Reserved SMs on CUDA: green contexts.

A green context (CUDA 12.4+) is made from a partition of a device's SMs:
the streams made in it run their kernels on those SMs alone.  gpuflow
splits each device's SMs once, at set-up (``reserve_sms``), into one
partition per name and one of the SMs left, where its other streams are
made: so that gpuflow's own work outside a class never holds the reserved
SMs (another library's streams, in the primary context, may use any SM).

What is made here lives as long as the backend: streams made in a green
context are destroyed as any stream is, the green contexts when the backend
closes.  Kernels are loaded into each green context they run in (a
function belongs to the context its module was loaded in); memory, events
and the completion words are the device's and serve every context.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from ..._errors import UsageError
from ._driver import check
from ._handles import Dev

#: the backend's call of a driver function with a device's context current
#: (``CudaContexts._call``): (device, name, function, *arguments) -> results
Call = Callable[..., tuple[Any, ...]]

#: The first driver with green contexts (cuDriverGetVersion's number)
GREEN_DRIVER = 12040
#: CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
_SM_COUNT = 16
_STREAM_NON_BLOCKING = 1


def granule(dev: Dev, resource: Any) -> tuple[int, int]:
    """The smallest partition of ``dev``'s SMs and the multiple a size is
    rounded up to: what the driver reports (CUDA 13), else its documented
    guideline by architecture (9.0 and later: 8 and 8)."""
    sm = resource.sm
    least = int(getattr(sm, "minSmPartitionSize", 0) or 0)
    align = int(getattr(sm, "smCoscheduledAlignment", 0) or 0)
    if least and align:
        return least, align
    major = int(dev.arch.removeprefix("sm_")[:-1] or 0)
    return {6: (1, 1), 7: (2, 2), 8: (4, 2)}.get(major, (8, 8))


class CudaPartition:
    """A green context of some of a device's SMs, and the kernels loaded in it."""

    __slots__ = ("asked", "ctx", "dev", "functions", "green", "lock", "modules", "sms")

    def __init__(self, dev: Dev, green: object, ctx: object, sms: int, asked: int) -> None:
        self.dev = dev
        self.green = green  # the CUgreenCtx
        self.ctx = ctx  # its CUcontext (cuCtxFromGreenCtx), to load modules in
        self.sms = sms
        self.asked = asked
        #: module image -> the CUmodule loaded in this context (once an image)
        self.modules: dict[bytes, Any] = {}
        #: (module image, kernel name) -> the CUfunction loaded in this context
        self.functions: dict[tuple[bytes, str], Any] = {}
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<cuda green context of {self.sms} SMs on device {self.dev.index}>"


def sm_count(cu: ModuleType, dev: Dev) -> int:
    attr = cu.CUdevice_attribute(_SM_COUNT)
    (n,) = check(cu.cuDeviceGetAttribute(attr, dev.cudev), "cuDeviceGetAttribute", dev)
    return int(n)


def partition_sms(
    cu: ModuleType, call: Call, dev: Dev, sizes: Sequence[int]
) -> list[CudaPartition]:
    """The partitions of :meth:`Backend.partition_sms`: checked against the
    device before the driver is asked, then split one by one off what is
    left, each made a green context."""
    where = f"cannot reserve SMs on cuda device {dev.index} ({dev.name})"
    (version,) = check(cu.cuDriverGetVersion(), "cuDriverGetVersion", dev)
    if int(version) < GREEN_DRIVER or not hasattr(cu, "cuGreenCtxCreate"):
        raise UsageError(
            f"{where}: reserved SMs are CUDA's green contexts, which need a driver of CUDA "
            f"12.4 or later and cuda-bindings that has them (driver: CUDA "
            f"{int(version) // 1000}.{int(version) % 1000 // 10})"
        )
    sm_type = cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
    (whole,) = call(dev, "cuDeviceGetDevResource", cu.cuDeviceGetDevResource,
                             dev.cudev, sm_type)  # fmt: skip
    total = int(whole.sm.smCount)
    least, align = granule(dev, whole)
    rounded = [max(least, -(-n // align) * align) for n in sizes]
    if sum(rounded) + least > total:
        raise UsageError(
            f"{where}: {' + '.join(map(str, rounded))} SMs (rounded up to multiples of "
            f"{align}, at least {least} a partition) and at least {least} left for the rest "
            f"do not fit in the device's {total}"
        )
    # the driver splits no split's output: what is left after a split is
    # split again from a green context made of it, destroyed once every
    # partition has its own
    splitters: list[Any] = []  # green contexts made only to split what is left
    greens: list[Any] = []  # the partitions'
    try:
        resources = []
        source = left = whole
        for i, n in enumerate(rounded):
            if i:
                green = _green_context(cu, call, dev, left, splitters)
                (source,) = call(dev, "cuGreenCtxGetDevResource", cu.cuGreenCtxGetDevResource,
                                 green, sm_type)  # fmt: skip
            got, _count, left = call(dev, "cuDevSmResourceSplitByCount",
                                     cu.cuDevSmResourceSplitByCount, 1, source, 0, n)  # fmt: skip
            resources.append(got[0])
        resources.append(left)
        parts = []
        for resource, asked in zip(resources, [*sizes, 0], strict=True):
            green = _green_context(cu, call, dev, resource, greens)
            (ctx,) = call(dev, "cuCtxFromGreenCtx", cu.cuCtxFromGreenCtx, green)
            parts.append(CudaPartition(dev, green, ctx, int(resource.sm.smCount), asked))
    except BaseException:
        _destroy(cu, dev, greens)  # (nothing made is left behind)
        raise
    finally:
        _destroy(cu, dev, splitters)
    return parts


def _green_context(cu: ModuleType, call: Call, dev: Dev, resource: Any, made: list[Any]) -> Any:
    """A green context of ``resource``'s SMs, kept in ``made``."""
    (desc,) = call(dev, "cuDevResourceGenerateDesc", cu.cuDevResourceGenerateDesc, [resource], 1)
    (green,) = call(
        dev, "cuGreenCtxCreate", cu.cuGreenCtxCreate, desc, dev.cudev,
        cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM,
    )  # fmt: skip
    made.append(green)
    return green


def create_stream(cu: ModuleType, call: Call, part: CudaPartition, cuda_priority: int) -> Any:
    """A non-blocking stream (the only kind a green context makes) of
    ``part``'s green context, of CUDA's priority number."""
    (h,) = call(
        part.dev, "cuGreenCtxStreamCreate", cu.cuGreenCtxStreamCreate,
        part.green, _STREAM_NON_BLOCKING, cuda_priority,
    )  # fmt: skip
    return h


def function(cu: ModuleType, part: CudaPartition, image: bytes, name: str) -> Any:
    """Kernel ``name`` of module ``image`` loaded in ``part``'s context (the
    module once an image: a load waits for the device's running kernels, so
    gpuflow loads ahead, :func:`load`)."""
    key = (image, name)
    f = part.functions.get(key)
    if f is not None:
        return f
    dev = part.dev
    with part.lock:
        f = part.functions.get(key)
        if f is None:
            check(cu.cuCtxPushCurrent(part.ctx), "cuCtxPushCurrent", dev)
            try:
                mod = _module(cu, part, image)
                (f,) = check(
                    cu.cuModuleGetFunction(mod, name.encode()), "cuModuleGetFunction", dev
                )
            finally:
                check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent", dev)
            part.functions[key] = f
    return f


def load(cu: ModuleType, part: CudaPartition, image: bytes, names: Sequence[str]) -> None:
    """Module ``image`` loaded in ``part``'s context now, with its kernels
    ``names``: what their first launches there would load."""
    for name in names:
        function(cu, part, image, name)


def _module(cu: ModuleType, part: CudaPartition, image: bytes) -> Any:
    """``image`` loaded in ``part``'s context, current now (under its lock)."""
    mod = part.modules.get(image)
    if mod is None:
        dev = part.dev
        (mod,) = check(cu.cuModuleLoadData(image), "cuModuleLoadData", dev)
        # whole, as in the device's context (._modules): a lazy first launch would load too
        (count,) = check(cu.cuModuleGetFunctionCount(mod), "cuModuleGetFunctionCount", dev)
        (funcs,) = check(
            cu.cuModuleEnumerateFunctions(count, mod), "cuModuleEnumerateFunctions", dev
        )
        for f in funcs:
            check(cu.cuFuncLoad(f), "cuFuncLoad", dev)
        part.modules[image] = mod
    return mod


def destroy(cu: ModuleType, parts: Sequence[CudaPartition]) -> None:
    """Destroy the green contexts (their streams are gone already); a
    failure is a warning, as any release's."""
    for part in parts:
        _destroy(cu, part.dev, [part.green])


def _destroy(cu: ModuleType, dev: Dev, greens: Sequence[Any]) -> None:
    for green in greens:
        try:
            check(cu.cuGreenCtxDestroy(green), "cuGreenCtxDestroy", dev)
        except Exception as exc:
            warnings.warn(
                f"gpuflow: destroying a green context on cuda device {dev.index} failed: "
                f"{exc!r}", stacklevel=3,
            )  # fmt: skip
