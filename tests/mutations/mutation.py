"""What a planted bug is: where it goes, what it replaces, which tests must catch it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str  # relative to src/gpuflow
    old: str  # occurs exactly once in that file
    new: str
    tests: tuple[str, ...]  # pytest arguments (files or node ids), run on sim
