"""Module loads, as the driver does them: a load waits for the device's
running kernels.

On a GPU, ``cuModuleLoadData`` returns only once the kernels running on the
device have finished (seen on an H100: 69.7 ms behind a kernel with 70 ms
left), and a module is loaded once into each context that runs it: the
device's own, and each green context of reserved SMs, where a stream's first
launch of a kernel loads it.  The simulation does the same, so that a load
on the way to a launch stalls its thread here as it would there, and tests
without a GPU see it: a module is loaded once into each context (the
device's, each partition's) for each life of the device's context, and that
load waits until every kernel running on the device when it began is done.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager


class Loads:
    """What the simulated driver has loaded, and the kernels a load waits for."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: per device: the kernels running now (a token each)
        self._running: dict[int, dict[int, None]] = {}
        self._tokens = itertools.count()
        #: (device, its context's generation, the context, the module)
        self._loaded: set[tuple[int, int, Hashable, Hashable]] = set()
        #: loads done, and those that waited for running kernels (what a test counts)
        self.count = 0
        self.waited = 0

    @contextmanager
    def kernel_running(self, device: int) -> Iterator[None]:
        """A kernel of ``device`` runs inside the block (loads wait for it)."""
        token = next(self._tokens)
        with self._cond:
            self._running.setdefault(device, {})[token] = None
        try:
            yield
        finally:
            with self._cond:
                del self._running[device][token]
                self._cond.notify_all()

    def load(
        self,
        device: int,
        generation: int,
        context: Hashable,
        module: Hashable,
        abandoned: Callable[[], bool],
    ) -> None:
        """Load ``module`` into ``context`` of ``device`` (None: the device's
        own), once a generation: the first load waits until the kernels of
        the device running when it began are done (or ``abandoned()``: the
        device faulted or was reset)."""
        key = (device, generation, context, module)
        with self._cond:
            if key in self._loaded:
                return
            running = self._running.get(device, {})
            before = set(running)
            if before:
                self.waited += 1
            while not before.isdisjoint(running) and not abandoned():
                self._cond.wait(0.01)
            self._loaded.add(key)
            self.count += 1

    def loaded(self, module: Hashable) -> set[tuple[int, Hashable]]:
        """Where ``module`` is loaded: ``(device, context)`` pairs (context
        None: the device's own)."""
        with self._cond:
            return {(d, c) for d, _g, c, m in self._loaded if m == module}
