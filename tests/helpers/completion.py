"""What the tests of the completion side share: a runtime with another
busy-poll budget, the open file descriptors, a wait for a condition."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

import gpuflow as gf

F32 = np.float32


def reinit(busy_poll_us: float) -> None:
    """The fixture's runtime again, with another busy-poll budget."""
    backend = gf.current_backend()
    gf.init_device_contexts(
        backend=backend, num_devices=2 if backend == "sim" else None, busy_poll_us=busy_poll_us
    )


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_until(cond: Any, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


needs_proc = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="counts file descriptors in /proc"
)
