"""Bad input is a :class:`gf.UsageError`, raised before anything is enqueued,
and also the built-in error Python's convention names: a wrong type is a
:class:`TypeError`, a wrong value a :class:`ValueError`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import kernels as K

import gpuflow as gf


def test_the_usage_errors_are_the_builtin_ones_too() -> None:
    assert issubclass(gf.UsageError, gf.GpuflowError)
    assert issubclass(gf.UsageError, ValueError)
    assert issubclass(gf.UsageTypeError, gf.UsageError)
    assert issubclass(gf.UsageTypeError, TypeError)
    assert not issubclass(gf.UsageError, TypeError)


WRONG_TYPES: list[tuple[str, Callable[[], Any], str]] = [
    ("then() of a non-callable", lambda: gf.value(1).then(3), "callable"),  # type: ignore[arg-type]
    ("map() of a non-callable", lambda: gf.value(1).map(None), "callable"),  # type: ignore[arg-type]
    ("zip() of a plain value", lambda: gf.zip(gf.value(1), 2), r"DeviceOperation.*int"),  # type: ignore[call-overload]
    ("compile() of bytes", lambda: gf.compile(b"x"), "source text"),  # type: ignore[arg-type]
    ("a kernel given a host array", lambda: K.module().scale(K.cfg(4), np.ones(4), 2.0, 4),
     "needs a DeviceArray"),
    ("a kernel given too few arguments", lambda: K.module().scale(K.cfg(4)), "takes 3 arguments"),
    ("a kernel given no LaunchConfig", lambda: K.module().count(4, 5), "LaunchConfig"),  # type: ignore[arg-type]
    ("sync() with a non-policy", lambda: gf.value(1).sync(policy=3), "SchedulingPolicy"),  # type: ignore[arg-type]
]

WRONG_VALUES: list[tuple[str, Callable[[], Any], str]] = [
    ("a negative shape", lambda: gf.zeros(-1), "negative"),
    ("unzip(0)", lambda: gf.value((1,)).unzip(0), "positive int"),
    ("a fill value the dtype cannot hold", lambda: gf.full(3, 300, dtype=np.uint8), "uint8"),
    ("a device that is not there", lambda: gf.use_device(99).__enter__(), "device 99"),
]


@pytest.mark.parametrize(("what", "call", "match"), WRONG_TYPES, ids=[w[0] for w in WRONG_TYPES])
def test_a_wrong_type_is_a_usage_type_error(what: str, call: Callable[[], Any], match: str) -> None:
    with pytest.raises(gf.UsageTypeError, match=match) as info:
        call()
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    ("what", "call", "match"), WRONG_VALUES, ids=[w[0] for w in WRONG_VALUES]
)
def test_a_wrong_value_is_a_usage_error_and_a_value_error(
    what: str, call: Callable[[], Any], match: str
) -> None:
    with pytest.raises(gf.UsageError, match=match) as info:
        call()
    assert isinstance(info.value, ValueError) and not isinstance(info.value, TypeError)
