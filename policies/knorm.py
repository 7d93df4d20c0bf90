"""Key-norm eviction (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", arXiv:2406.11430): keys with a low L2 norm attract attention, so keep those."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.policies.base import Policy
from kvlab.registry import POLICIES


@POLICIES.register("knorm")
@dataclass
class KNorm(Policy):
    """Keeps the tokens whose keys have the smallest L2 norm. No parameters beyond the budget."""

    def score(self, layer_idx, keys, values, queries, attn_stats):
        return -keys.float().norm(dim=-1)  # [L, Hkv]
