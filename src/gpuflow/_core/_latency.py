"""Latency classes, and the busy-poll budget they set.

A class of runs (interactive requests beside batch work) takes streams of
its level (a priority, reserved SMs) and polls with a budget of its own.
The class in effect is a context variable: set by ``gf.latency_class``, and
by a stream lease or device group for the work inside it; read where a run
starts and where a lease or stream takes its level.  Below the runtime,
which checks a level against its devices (:class:`LevelChecks`).
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from typing import Any, NamedTuple, Protocol

from .._errors import UsageError
from ._unusual import UNUSUAL

#: How long an event loop with runs pending polls the GPU's completion words
#: before it arms a wake-up and sleeps (see ``init_device_contexts``).
DEFAULT_BUSY_POLL_US = 200.0
BUSY_POLL_ENV = "GPUFLOW_BUSY_POLL_US"


def busy_poll_s(busy_poll_us: float | None) -> float:
    """The busy-poll budget in seconds: the argument, else the environment's, else the default."""
    where = "busy_poll_us"
    if busy_poll_us is None:
        env = os.environ.get(BUSY_POLL_ENV)
        if env is None or not env.strip():
            return DEFAULT_BUSY_POLL_US / 1e6
        where = BUSY_POLL_ENV
        try:
            busy_poll_us = float(env)
        except ValueError:
            raise UsageError(
                f"{BUSY_POLL_ENV}={env!r} is not a number of microseconds"
            ) from None
    if isinstance(busy_poll_us, bool) or not isinstance(busy_poll_us, int | float):
        raise UsageError(f"{where} must be a number of microseconds, not {busy_poll_us!r}")
    if not 0 <= busy_poll_us < float("inf"):
        raise UsageError(f"{where} must be 0 (no polling) or more microseconds, not {busy_poll_us}")
    return float(busy_poll_us) / 1e6


class LevelChecks(Protocol):
    """What checks a class's level against a device (the runtime)."""

    def check_priority(self, device: int, priority: int) -> int: ...

    def check_sms(self, device: int, sms: str | None) -> str | None: ...


class LatencyClass(NamedTuple):
    """What :func:`gpuflow.latency_class` sets for the runs a task starts."""

    #: stream priority: 0 the default, higher more urgent
    priority: int = 0
    #: the name of the reserved SMs its runs use (None: the SMs none reserved)
    sms: str | None = None
    #: its busy-poll budget in microseconds (None: the runtime's)
    busy_poll_us: float | None = None


#: The class of the runs the current task starts (None: the default class,
#: which the runs of an await where nothing is unusual are).
current_class_var: ContextVar[LatencyClass | None] = ContextVar(
    "gpuflow_latency_class", default=None
)

#: The busy-poll budget in seconds of that class (None: the runtime's), as
#: each run started takes it
current_poll_var: ContextVar[float | None] = ContextVar("gpuflow_poll_s", default=None)


class _Enclosing:
    """What a class's argument left out is: the enclosing class's."""

    def __repr__(self) -> str:
        return "<the enclosing class's>"


#: The default of every argument that names a part of a latency class
#: (``priority``, ``sms``, ``busy_poll_us``): the class in effect where the
#: call is made.
ENCLOSING: Any = _Enclosing()


def class_here(
    priority: int = ENCLOSING, sms: str | None = ENCLOSING, busy_poll_us: float | None = ENCLOSING
) -> LatencyClass:
    """The class the arguments name, each one left out (:data:`ENCLOSING`)
    the class's in effect here (outside any, the default class's)."""
    outer = current_class_var.get() or LatencyClass()
    return LatencyClass(
        outer.priority if priority is ENCLOSING else priority,
        outer.sms if sms is ENCLOSING else sms,
        outer.busy_poll_us if busy_poll_us is ENCLOSING else busy_poll_us,
    )


def enter_class(
    cls: LatencyClass, rt: LevelChecks, devices: list[int]
) -> tuple[Any, Any] | None:
    """Make ``cls`` the class of the runs this task (and the tasks it starts)
    starts from now, once ``rt`` checked it on each of ``devices``; what
    :func:`leave_class` takes (None where it is the class in effect already)."""
    for device in devices:
        rt.check_priority(device, cls.priority)
        rt.check_sms(device, cls.sms)
    poll_s = None if cls.busy_poll_us is None else busy_poll_s(cls.busy_poll_us)
    if cls == (current_class_var.get() or LatencyClass()):
        return None
    tokens = current_class_var.set(cls), current_poll_var.set(poll_s)
    UNUSUAL.begin()  # (runs take the long path, which asks the class)
    return tokens


def leave_class(entered: tuple[Any, Any] | None) -> None:
    """Take back what :func:`enter_class` set.  A scope closed from another
    task (an async generator's, say), whose context never had it, has
    nothing to take back."""
    if entered is None:
        return
    UNUSUAL.end()
    class_token, poll_token = entered
    try:
        current_poll_var.reset(poll_token)
        current_class_var.reset(class_token)
    except ValueError:
        pass
