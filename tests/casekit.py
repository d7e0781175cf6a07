"""Exact-result bookkeeping shared by the scripts that tests run under ``mpiexec``
(``tests/help_cases.py``, ``tests/shared_cases.py``): each rank collects what was wrong;
rank 0 prints the verdict."""

from __future__ import annotations

import numpy as np


class Checks:
    """One rank's checks: ``expect`` compares exactly; ``bad`` lists the failures."""

    def __init__(self, rank: int):
        self.rank = rank
        self.bad: list[str] = []
        self.count = 0

    def expect(self, what: str, got: np.ndarray, want: np.ndarray) -> None:
        self.count += 1
        if got.shape != want.shape or not np.array_equal(got, want):
            i = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:5] \
                if got.shape == want.shape else f"shape {got.shape} != {want.shape}"
            self.bad.append(f"rank {self.rank}: {what}: wrong at {i}")
