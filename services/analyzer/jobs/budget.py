"""One job's memory budget on the analyzer, and how it is shared.

``LAYERDIFF_MEMORY_BUDGET`` (1 GiB) bounds the reference values a job keeps
in memory (``layerdiff.analyzer.reference.segments``). Diagnosis keeps device values
beside them, as much again at most: half of it for the producers of failing
nodes (their isolated re-runs), a quarter each for failing nodes waiting
for their producers and for the nodes whose impact on the outputs is
measured; never less than ``DIAGNOSIS_FLOOR`` each, so that a small budget
does not starve the diagnosis of a small model. What a job holds is
therefore about twice the budget plus the tensors in flight, whatever the
size of the dump.
"""
from __future__ import annotations

from dataclasses import dataclass

from layerdiff.common.settings import env_limit

MEMORY_BUDGET_DEFAULT = 1 << 30
DIAGNOSIS_FLOOR = 64 << 20


@dataclass(frozen=True)
class MemoryBudget:
    total: int = MEMORY_BUDGET_DEFAULT

    @classmethod
    def from_env(cls) -> MemoryBudget:
        return cls(env_limit("LAYERDIFF_MEMORY_BUDGET", MEMORY_BUDGET_DEFAULT, size=True))

    @property
    def reference(self) -> int:
        return self.total

    @property
    def producers(self) -> int:
        """Device values kept for the isolated re-runs of failing nodes."""
        return max(DIAGNOSIS_FLOOR, self.total // 2)

    @property
    def waiting(self) -> int:
        """Failing nodes waiting for their producers' device values."""
        return max(DIAGNOSIS_FLOOR, self.total // 4)

    @property
    def impact(self) -> int:
        """Device values kept for the impact re-runs."""
        return max(DIAGNOSIS_FLOOR, self.total // 4)


# The budget when none is given (LAYERDIFF_MEMORY_BUDGET's default); immutable, so one is shared.
DEFAULT_BUDGET = MemoryBudget()
