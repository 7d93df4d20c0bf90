"""Random eviction: the floor every policy must beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import Policy
from kvlab.registry import POLICIES


@POLICIES.register("random")
@dataclass
class Random(Policy):
    """Keeps a uniformly random subset of the cached tokens (the same for every KV head of a layer).

    seed: the draws depend only on the seed, the layer and the number of cached tokens, so a run is
    reproducible whatever else is in the batch.
    """

    seed: int = 0

    def score(self, layer_idx, keys, values, queries, attn_stats):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + layer_idx * 10_007 + keys.shape[0])
        return torch.rand(keys.shape[0], 1, generator=g).expand(-1, keys.shape[1]).to(keys.device)  # [L, Hkv]
