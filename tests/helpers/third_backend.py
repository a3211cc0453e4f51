"""A third backend, to run the suite on one that is neither ``sim`` nor
``cuda``: ``sim`` under a name of its own, registered when pytest loads this
module as a plugin.

    python -m pytest -p helpers.third_backend --backends third tests/core

Nothing in gpuflow or in the suite knows its name: what differs between
backends is asked of the backend (``Backend.simulated``,
``Backend.cuda_native``), as a new backend's author would need.
"""

from __future__ import annotations

from gpuflow import lowlevel
from gpuflow._backends import SimBackend, backend_names


class ThirdBackend(SimBackend):
    """``sim``, named ``third``."""

    name = "third"


if "third" not in backend_names():
    lowlevel.register_backend("third", ThirdBackend)
