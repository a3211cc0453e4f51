"""Modules: loaded once a device, whole, and ahead of the launches that run them.

A load (``cuModuleLoadData``) waits for the kernels running on the device
(seen on an H100: 69.7 ms behind a kernel with 70 ms left), and under CUDA's
lazy loading a kernel's first launch loads it, waiting likewise (an empty
kernel's first launch on an idle stream was seen to wait for a kernel
spinning on another stream: docs/performance.md, "Measurements behind the
code").  So a module is loaded whole (every function, ``cuFuncLoad``) when
gpuflow loads it, once a device, and gpuflow loads it when it is compiled or
a runtime starts, into the device's context and each green context
(:mod:`._green`), never on the way to a launch.

Loaded modules stay loaded while the backend lives: ``cuModuleUnload``
waits until the device is idle, and a finalizer calling it would stall
whatever thread collects the garbage (an event loop's, the completer's)
until every kernel in flight is done.  They are unloaded when the backend
closes, a point the program chose.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .._nvrtc import compile_source
from .._records import ModuleSource
from . import _green
from ._driver import check
from ._handles import CudaKernel, CudaModule, Dev
from ._kernels import BUILTIN_NAMES, BUILTIN_SOURCE

if TYPE_CHECKING:
    from ._backend import CudaBackend

#: The backend's checked driver call: ``(dev, name, fn, *args)`` -> results.
Call = Callable[..., Any]


class Modules:
    """The modules one backend loaded, by device and image."""

    def __init__(self, backend: CudaBackend, cu: ModuleType, call: Call) -> None:
        self._backend = backend
        self._cu = cu
        self._call = call
        self._modules: dict[tuple[int, bytes], CudaModule] = {}
        self._lock = threading.Lock()

    def kernel(self, dev: Dev, module: ModuleSource, name: str) -> CudaKernel:
        """Kernel ``name`` of ``module`` on ``dev`` (the module loaded, once)."""
        if dev.fault is not None:
            raise dev.fault
        cubin = module.binary_for(dev.arch)
        key = (dev.index, cubin)
        with self._lock:
            mod = self._modules.get(key)
            if mod is not None and mod.token is not dev.token:
                mod = None
            if mod is None:
                (h,) = self._call(dev, "cuModuleLoadData", self._cu.cuModuleLoadData, cubin)
                mod = CudaModule(self._backend, dev, int(h))
                self._modules[key] = mod
                self.load_functions(dev, h)
        self._backend.make_current(dev)
        (f,) = check(
            self._cu.cuModuleGetFunction(mod.handle, name.encode()),
            "cuModuleGetFunction",
            dev,
            message=f'kernel {name!r} not found in its module (is it declared extern "C"?)',
        )
        return CudaKernel(dev, name, f, mod, cubin)

    def builtin(self, dev: Dev, name: str) -> Any:
        """Built-in kernel ``name`` (fills, arange) on ``dev`` (loaded once)."""
        fns = dev.builtins
        if fns is None:
            cubin = compile_source(BUILTIN_SOURCE, dev.arch, ())
            (mod,) = self._call(dev, "cuModuleLoadData", self._cu.cuModuleLoadData, cubin)
            self.load_functions(dev, mod)
            fns = {}
            for fname in BUILTIN_NAMES:
                (f,) = self._call(
                    dev, "cuModuleGetFunction", self._cu.cuModuleGetFunction, mod, fname.encode()
                )
                fns[fname] = f
            dev.builtins = fns
        return fns[name]

    def ahead(self, dev: Dev, module: ModuleSource | None, partitions: Sequence[Any]) -> None:
        """``module`` (None: the built-in kernels) loaded now into ``dev``'s
        context and each green context of ``partitions``."""
        if dev.fault is not None:
            raise dev.fault
        if module is None:
            self.builtin(dev, BUILTIN_NAMES[0])
            image = compile_source(BUILTIN_SOURCE, dev.arch, ())
            names: Sequence[str] = BUILTIN_NAMES
        else:
            names = list(module.kernels)
            if not names:
                return
            self.kernel(dev, module, names[0])
            image = module.binary_for(dev.arch)
        for part in partitions:
            _green.load(self._cu, part, image, names)

    def load_functions(self, dev: Dev, module: Any) -> None:
        """Every kernel of a module loaded now, not at its first launch."""
        cu = self._cu
        (count,) = self._call(dev, "cuModuleGetFunctionCount", cu.cuModuleGetFunctionCount, module)
        (funcs,) = self._call(
            dev, "cuModuleEnumerateFunctions", cu.cuModuleEnumerateFunctions, count, module
        )
        for f in funcs:
            self._call(dev, "cuFuncLoad", cu.cuFuncLoad, f)

    def drop(self) -> list[CudaModule]:
        """Forget every module: the caller unloads them (the backend closing)."""
        with self._lock:
            modules, self._modules = list(self._modules.values()), {}
        return modules
