"""The full cache: keep every token (the quality reference every policy is measured against)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

from kvlab.registry import POLICIES
from kvlab.policies.base import Policy


@POLICIES.register("full")
@dataclass
class Full(Policy):
    """No eviction. The common policy parameters (budget, compression_ratio, when, every) are accepted and
    ignored, so a sweep over policies x budgets includes the full-cache baseline; a budget or a nonzero
    ratio is warned about (the run keeps every token, whatever its label says)."""

    compresses: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        given = [f"budget={self.budget}"] if self.budget is not None else []
        given += [f"compression_ratio={self.compression_ratio}"] if self.compression_ratio else []
        if given:
            warnings.warn(f"policy 'full' keeps every token: {', '.join(given)} is ignored (a full-cache "
                          f"baseline, whatever the run's label says)", UserWarning, stacklevel=2)

    def score(self, layer_idx, keys, values, queries, attn_stats):
        return None
