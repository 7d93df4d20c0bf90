"""TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs", arXiv:2401.06104): keep the tokens the
most recent query attends to most, averaged over heads."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.policies.base import Policy
from kvlab.policies.observation import window_attention
from kvlab.registry import POLICIES


@POLICIES.register("tova")
@dataclass
class TOVA(Policy):
    """Score = attention of the last query, averaged over all query heads; the last token is always kept."""

    @property
    def query_window(self) -> int:
        return 1

    def score(self, layer_idx, keys, values, queries, attn_stats):
        probs = window_attention(queries[-1:], keys)  # [Hkv, g, 1, L]
        score = probs.mean(dim=(0, 1, 2))  # [L]
        score[-1] = score.max() + 1.0
        return score[:, None].expand(-1, keys.shape[1])  # [L, Hkv]
