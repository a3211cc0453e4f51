"""Communicators: the ``Communicator`` scope and its collectives
(``_communicator``), and the bootstrap of the ranks of several processes
(``_bootstrap``).

Builds on :mod:`gpuflow._core`, :mod:`gpuflow._memory` and :mod:`gpuflow._scopes`.
"""

from ._bootstrap import RankInfo as RankInfo
from ._bootstrap import bootstrap_mpi as bootstrap_mpi
from ._bootstrap import new_unique_id as new_unique_id
from ._bootstrap import spawn_ranks as spawn_ranks
from ._communicator import Communicator as Communicator
from ._communicator import open_communicator as open_communicator

__all__ = [
    "Communicator",
    "RankInfo",
    "bootstrap_mpi",
    "new_unique_id",
    "open_communicator",
    "spawn_ranks",
]
