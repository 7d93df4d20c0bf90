"""KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments", arXiv:2504.15364): keep the keys least similar to
the layer's mean key direction."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from kvlab.policies.base import Policy
from kvlab.registry import POLICIES


@POLICIES.register("keydiff")
@dataclass
class KeyDiff(Policy):
    """Score = -cosine(key, anchor), the anchor being the mean of the normalised keys of each KV head."""

    def score(self, layer_idx, keys, values, queries, attn_stats):
        k = F.normalize(keys.float(), dim=-1)  # [L, Hkv, D]
        anchor = k.mean(dim=0, keepdim=True)  # [1, Hkv, D]
        return -F.cosine_similarity(k, anchor, dim=-1)  # [L, Hkv]
