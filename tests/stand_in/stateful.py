"""Runtimes replaced on one cuda backend, against the stand-in libcuda (argv[1]).

Run by tests/backends/test_cuda_stand_in.py in a process of its own (the
stand-in must be the process's libcuda), as ``program.py`` is.  A Hypothesis
state machine (the stateful test of the cuda backend, where
``tests/together/test_stateful.py`` is sim's) replaces the runtime on the
backend that goes on, reserving SMs or not, makes streams in its partitions
and holds them, and drops them; after every step the green contexts the
stand-in counts are exactly those a runtime or a held stream still uses:
the current runtime's partitions (its reservations and the rest), and of a
runtime replaced, the partitions of the streams the program still holds.
The sequence behind ``test_features_together``'s item 4 runs first.
"""

from __future__ import annotations

import ctypes
import gc
import sys

from gpuflow._backends import _nvrtc

# (as program.py: NVRTC compiles once before the stand-in is loaded)
_nvrtc.compile_source('extern "C" __global__ void warm() {}', "sm_90", ())
standin = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import gpuflow as gf  # noqa: E402

green = ctypes.c_int.in_dll(standin, "standin_green_contexts")
RESERVES: list[dict[str, int]] = [{}, {"a": 12}, {"a": 12, "b": 8}]

gf.init_device_contexts(backend="cuda")
backend = gf.lowlevel.current_backend_object()


class RuntimesOnOneBackend(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.runtime = 0
        self.reserve: dict[str, int] = {}
        self.reserved: dict[int, bool] = {}
        #: the streams the program holds: (their runtime, their partition's name, the stream)
        self.held: list[tuple[int, str | None, gf.Stream]] = []
        self.replace(0)

    @rule(which=st.integers(0, len(RESERVES) - 1))
    def replace(self, which: int) -> None:
        self.reserve = RESERVES[which]
        gf.init_device_contexts(backend=backend, reserve_sms=self.reserve or None)
        self.runtime += 1
        self.reserved[self.runtime] = bool(self.reserve)
        self._settle()

    @rule(name=st.sampled_from([None, "a", "b"]), priority=st.integers(0, 2))
    def hold(self, name: str | None, priority: int) -> None:
        if name is not None and name not in self.reserve:
            name = None
        self.held.append((self.runtime, name, gf.new_stream(sms=name, priority=priority)))

    @precondition(lambda self: bool(self.held))
    @rule(pick=st.integers(0, 100))
    def drop(self, pick: int) -> None:
        del self.held[pick % len(self.held)]
        self._settle()

    @staticmethod
    def _settle() -> None:
        gc.collect()
        gf.memory_stats()  # (a safe point: dropped streams' finalizers' work is done)

    @invariant()
    def green_contexts_are_those_in_use(self) -> None:
        current = len(self.reserve) + 1 if self.reserve else 0
        older = {
            (runtime, name)
            for runtime, name, _s in self.held
            if runtime != self.runtime and self.reserved[runtime]
        }
        want = current + len(older)
        assert green.value == want, (
            f"{green.value} green contexts, {want} in use: the current runtime's "
            f"{current}, and {sorted(older, key=str)} of runtimes replaced, held"
        )

    def teardown(self) -> None:
        self.held.clear()
        gf.init_device_contexts(backend=backend)
        self._settle()
        assert green.value == 0, green.value


# the sequence behind item 4: a stream held across a replacement keeps its own
machine = RuntimesOnOneBackend()
machine.replace(2)
machine.green_contexts_are_those_in_use()
machine.hold("b", 1)
machine.hold(None, 0)
machine.replace(0)
machine.green_contexts_are_those_in_use()
machine.drop(0)
machine.green_contexts_are_those_in_use()
machine.teardown()

run_state_machine_as_test(
    RuntimesOnOneBackend,
    settings=settings(
        max_examples=int(sys.argv[2]) if len(sys.argv) > 2 else 10,
        stateful_step_count=12,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    ),
)
print("ok")
