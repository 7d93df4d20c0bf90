"""The full cache: keep every token (the quality reference every policy is measured against)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlab.registry import POLICIES
from kvlab.policies.base import Policy


@POLICIES.register("full")
@dataclass
class Full(Policy):
    """No eviction. The common policy parameters (budget, compression_ratio, when, every) are accepted and
    ignored, so a sweep over policies x budgets includes the full-cache baseline."""

    compresses: ClassVar[bool] = False

    def score(self, layer_idx, keys, values, queries, attn_stats):
        return None
