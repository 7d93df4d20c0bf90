"""The cache-policy interface: which cached tokens a sequence keeps.

The narrowest hook is `score`: one number per cached token per KV head
(higher = keep); the framework does the budget, the top-k and the compaction
of survivors into fewer blocks (the freed blocks go back to the pool). Policies
that need more (chunk-level, two-stage, per-layer budgets) will override
lower-level hooks, added with the first policy that needs one; wrappers compose by holding
another policy, e.g. `AdaKV(SnapKV())`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.registry import POLICIES


@dataclass
class Policy(ABC):
    """Base class of eviction / compression policies; subclasses are dataclasses of their parameters."""

    compresses: ClassVar[bool] = True  # False: the engine never calls the policy (full cache)

    @abstractmethod
    def score(
        self,
        layer_idx: int,
        keys: torch.Tensor,  # [L, Hkv, D] cached keys of one sequence (RoPE applied)
        values: torch.Tensor,  # [L, Hkv, D]
        queries: torch.Tensor | None,  # [Q, Hq, D] most recent queries, if the policy asks for them
        attn_stats: torch.Tensor | None,  # [L, Hkv] attention mass each key received, if collected
    ) -> torch.Tensor | None:  # [L, Hkv] importance, or None to keep everything
        """Importance of every cached token per KV head."""


POLICIES.base = Policy
