"""AdaKV (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient
LLM Inference", arXiv:2407.11550): the layer's budget (`budget` x KV heads) is shared by its KV heads
adaptively -- the best-scored tokens over all heads of a layer are kept, so a head whose attention is
concentrated keeps few tokens and a dispersed head keeps many -- with a safeguard: every head keeps at
least `alpha_safeguard` of the uniform budget.

A wrapper: the scores come from another policy (`scorer`, SnapKV by default as in the paper; kvpress pairs
it with Expected Attention). A scorer ranking keys by accumulated attention (H2O: Zhang et al. 2023,
arXiv:2306.14048) reads it per KV head: every (layer, KV head) table keeps its own running totals (the mass its
query heads paid each key it holds, kvlab.policies.compressor), so each head keeps the tokens its own mass
ranks first, and a head's totals follow the tokens it keeps.

kvpress masks the evicted keys of each head (its docstring: this "does not reduce peak memory"); here every
(layer, KV head) has a table of its own (`head_budgets`), so each head's evicted tokens free their pages.
Compresses once, at the end of prefill (as the paper and kvpress do): after that the heads hold different
numbers of tokens. A request continuing a kept compressed turn (EngineConfig.reuse_compressed) compresses again
at its prompt's end, over heads of different lengths (each its kept tokens, then the tokens computed since):
`select_heads` scores each head over its own tokens only (the scorer called per head, with that head's query
heads and totals) and shares the layer's budget over the heads as at prefill, a head never keeping more than
it holds (`ragged_adaptive_top_k`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlab.policies.base import Policy
from kvlab.registry import POLICIES


@POLICIES.register("adakv")
@dataclass
class AdaKV(Policy):
    """scorer / scorer_args: the policy whose `score` ranks tokens per KV head (its own budget is unused);
    alpha_safeguard: the fraction of the uniform budget every head keeps at least (the paper's and
    kvpress's 0.2; at least one token)."""

    scorer: str = "snapkv"
    scorer_args: dict = field(default_factory=dict)
    alpha_safeguard: float = 0.2
    head_budgets: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.alpha_safeguard <= 1.0:
            raise ValueError(f"alpha_safeguard must be in [0, 1], got {self.alpha_safeguard!r}")
        if self.when != "prefill":
            raise ValueError(f"adakv compresses once, at the end of prefill (when='prefill'), got when={self.when!r}: "
                             f"after it the heads hold different numbers of tokens")
        if not isinstance(self.scorer_args, dict):
            raise ValueError(f"scorer_args must be a mapping of the scorer's parameters, got {self.scorer_args!r}")
        try:
            inner = POLICIES.build(self.scorer, **self.scorer_args)
        except KeyError as exc:  # an unknown scorer name
            raise ValueError(f"adakv scorer: {exc}") from None
        if not inner.compresses or inner.head_budgets:
            raise ValueError(f"adakv's scorer must be a scoring policy without per-head budgets of its own, "
                             f"got {self.scorer!r}")
        self._inner = inner

    @property
    def query_window(self) -> int:
        return self._inner.query_window

    @property
    def needs_attention_stats(self) -> bool:  # the scorer's: the engine accumulates them per KV head's table
        return self._inner.needs_attention_stats

    def bind(self, model: torch.nn.Module) -> None:
        self._inner.bind(model)

    def begin(self, seq_len: int) -> None:
        super().begin(seq_len)
        self._inner.begin(seq_len)

    def score(self, layer_idx, keys, values, queries, attn_stats):
        return self._inner.score(layer_idx, keys, values, queries, attn_stats)

    def choose(self, scores, keep):
        return adaptive_top_k(scores, keep, self.alpha_safeguard)

    def select_heads(self, layer_idx: int, num_layers: int, keys: list[torch.Tensor], values: list[torch.Tensor],
                     queries: torch.Tensor | None, attn_stats: list[torch.Tensor] | None,
                     protected: int = 0) -> list[list[int]] | None:
        """One layer whose KV heads hold different numbers of tokens (keys[h], values[h]: [L_h, 1, D]; attn_stats[h]:
        [L_h, 1]; queries: [W, Hq, D], the layer's): per KV head the sorted cache indices kept, or None (all). Each
        head is scored over its own tokens (the scorer sees that head alone, with its query heads), and the layer
        keeps `layer_budget` x Hkv tokens as `adaptive_top_k` shares them; the first `protected` of every head kept."""
        heads = len(keys)
        lens = [k.shape[0] - protected for k in keys]
        keep = self.layer_budget(layer_idx, num_layers, max(self._seq_len or 0, max(lens) + protected) - protected)
        if keep * heads >= sum(lens):
            return None
        scores = []
        for h in range(heads):
            q = None if queries is None else queries.unflatten(1, (heads, -1))[:, h]  # [W, Hq / Hkv, D]
            stats = None if attn_stats is None else attn_stats[h]
            s = self._inner.score(layer_idx, keys[h], values[h], q, stats)  # [L_h, 1]
            if s is None:
                return None
            scores.append(s[protected:, 0])
        kept = ragged_adaptive_top_k(scores, keep, self.alpha_safeguard)
        return [list(range(protected)) + [protected + i for i in head] for head in kept]


def adaptive_top_k(scores: torch.Tensor, keep: int, alpha: float) -> list[list[int]]:
    """Per KV head, the sorted cache indices kept when the heads share `keep * Hkv` slots: every head's best
    max(1, int(keep * alpha)) first, then the best remaining scores over all heads."""
    scores = scores.float().T.clone()  # [Hkv, L]
    heads, n = scores.shape
    safe = max(1, int(keep * alpha))
    scores.scatter_(1, scores.topk(safe, dim=1).indices, torch.inf)
    chosen = scores.flatten().topk(keep * heads).indices  # [keep * Hkv] over (head, token)
    mask = torch.zeros(heads * n, dtype=torch.bool)
    mask[chosen] = True
    return [row.nonzero()[:, 0].tolist() for row in mask.view(heads, n)]


def ragged_adaptive_top_k(scores: list[torch.Tensor], keep: int, alpha: float) -> list[list[int]]:
    """`adaptive_top_k` over heads of different lengths (scores[h]: [L_h]): every head's best
    min(L_h, max(1, int(keep * alpha))) first, then the best remaining scores over all heads up to `keep * Hkv`
    (the caller keeps everything when the heads hold no more). Padding is masked: never ranked, never kept."""
    heads, n = len(scores), max(s.shape[0] for s in scores)
    valid = torch.zeros(heads, n, dtype=torch.bool)
    padded = torch.full((heads, n), -torch.inf)
    for h, s in enumerate(scores):
        valid[h, : s.shape[0]] = True  # a real score is never -inf here: below it only the padding
        padded[h, : s.shape[0]] = s.float().nan_to_num(neginf=torch.finfo(torch.float32).min)
    safe = max(1, int(keep * alpha))
    for h, s in enumerate(scores):
        padded[h, padded[h, : s.shape[0]].topk(min(safe, s.shape[0])).indices] = torch.inf
    chosen = padded.flatten().topk(keep * heads).indices  # [keep * Hkv] over (head, token), padding last
    mask = torch.zeros(heads * n, dtype=torch.bool)
    mask[chosen] = True
    mask = mask.view(heads, n) & valid
    return [row.nonzero()[:, 0].tolist() for row in mask]
