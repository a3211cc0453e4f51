"""Communicators: the ``Communicator`` scope, collectives, the bootstrap.

Builds on :mod:`gpuflow._core`, :mod:`gpuflow._memory` and :mod:`gpuflow._scopes`.
"""

from ._comm import Communicator as Communicator
from ._comm import RankInfo as RankInfo
from ._comm import bootstrap_mpi as bootstrap_mpi
from ._comm import new_unique_id as new_unique_id
from ._comm import open_communicator as open_communicator
from ._comm import spawn_ranks as spawn_ranks

__all__ = [
    "Communicator",
    "RankInfo",
    "bootstrap_mpi",
    "new_unique_id",
    "open_communicator",
    "spawn_ranks",
]
