"""RocketKV (Behnam et al. 2025, "RocketKV: Accelerating Long-Context LLM Inference via Two-Stage KV
Cache Compression", arXiv:2502.14051): a coarse permanent eviction at the end of prefill (SnapKV
votes of an observation window), then, at every decode step, hybrid sparse attention: approximate
scores from page-level key summaries on the query's largest channels pick the pages the exact
attention reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlab.policies.base import Policy
from kvlab.policies.snapkv import SnapKV
from kvlab.registry import POLICIES
from kvlab.policies.sparse_read import SparseReadPolicy


@POLICIES.register("rocketkv")
@dataclass
class RocketKV(SparseReadPolicy, Policy):
    """budget: the paper's token budget, the KV traffic of one decode step in tokens (required). The
    exact attention reads `budget // 2` tokens (whole pages, the newest page included); the other
    half pays for the approximation (with `channels=None`).
    prompt_budget: tokens each layer keeps after prefill (stage 1); None: the paper's rule, n /
    c^r with c = n / budget and r = min(0.2 + 0.06 log2 c, 0.8) for a prompt of n tokens.
    window_size / kernel_size: stage 1's observation window and vote pooling (the paper's 32 / 63).
    channels: key channels the approximation reads per KV head; None: as many as make the summaries
    read cost `budget // 2` tokens of keys, ceil(D * block_size * (budget // 2) / n), at most D.

    Stage 1 holds a `SnapKV` and uses its scores; the pages it frees go back to the pool. Stage 2
    keeps per-page channel-wise key min and max (kvlab.policies.sparse_read); for each KV head the channels
    are ranked by |q| summed over its query heads, the page bound on a channel is its max where that
    sum is positive and its min where negative (the paper's sign trick), the approximate logits
    q_hat . k_hat are divided by sqrt(D * |q_hat|_1 / |q|_1) times the model's scale, and a softmax
    over pages (each weighted by its token count) is averaged over the query heads.

    Simplified from the paper, by design of the paged engine or for now:
    - chunks are the engine's pages (`block_size` tokens), not sqrt(compression) tokens;
    - one page set per sequence and layer, shared by its KV heads (the paper selects per KV head):
      the approximate attention is averaged over all query heads of the layer;
    - the top-k is over pages, not tokens, and the page holding the newest token is always read;
    - SnapKV++'s max-pooled votes with an adaptive pooling size are replaced by kvlab's `snapkv`
      (average pooling of a fixed `kernel_size`); each KV head keeps its own tokens (`per_head`, the
      default) as SnapKV++ does;
    - the prompt budget does not reserve room for the tokens still to be generated;
    - eviction runs once, at the end of prefill (`when` must be "prefill"); the multi-turn variant
      (RocketKV-MT) is not built.
    """

    window_size: int = 32
    kernel_size: int = 63
    prompt_budget: int | None = None
    channels: int | None = None
    stage1: SnapKV = field(init=False, repr=False)

    needs_attention_stats: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.compression_ratio is not None:
            raise ValueError("rocketkv's budget is tokens read per decode step; compression_ratio is not "
                             "supported, give a budget")
        if self.budget is None:
            raise ValueError("rocketkv needs a budget (the token budget of one decode step)")
        super().__post_init__()
        if self.when != "prefill":
            raise ValueError(f"rocketkv evicts once, at the end of prefill; when={self.when!r} is not supported")
        for name in ("prompt_budget", "channels"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        self.stage1 = SnapKV(window_size=self.window_size, kernel_size=self.kernel_size)

    # -- stage 1: permanent eviction at the end of prefill ---------------------------
    @property
    def query_window(self) -> int:
        return self.stage1.query_window

    def layer_budget(self, layer_idx: int, num_layers: int, num_tokens: int) -> int:
        if self.prompt_budget is not None:
            return min(num_tokens, self.prompt_budget)
        c = max(1.0, num_tokens / self.budget)
        r = min(0.2 + 0.06 * math.log2(c), 0.8)
        return min(num_tokens, max(self.window_size, int(num_tokens / c ** r)))

    def score(self, layer_idx, keys, values, queries, attn_stats):
        return self.stage1.score(layer_idx, keys, values, queries, attn_stats)

    # -- stage 2: hybrid sparse attention at decode ----------------------------------
    def pages_read(self, block_size: int) -> int:
        pages = (self.budget // 2) // block_size
        if pages < 1:
            raise ValueError(f"rocketkv's exact attention reads budget // 2 tokens in whole pages: budget must be "
                             f">= 2 * block_size = {2 * block_size} tokens, got {self.budget}")
        return pages

    def page_scores(self, layer_idx, q, bounds, counts, scale):
        S, Hq, D = q.shape
        Hkv = bounds.shape[2]
        qg = q.float().view(S, Hkv, Hq // Hkv, D)
        up = (qg.sum(dim=2, keepdim=True) > 0).float()  # [S, Hkv, 1, D] the sign of each channel over a KV head
        q_hat = qg * self._channel_mask(qg, counts)[:, :, None]  # [S, Hkv, g, D] only the chosen channels
        # q_hat . (max where up, else min) = [q_hat * up, -q_hat * (1 - up)] . [max | -min]
        q2 = torch.cat([q_hat * up, q_hat * (up - 1)], dim=-1)  # [S, Hkv, g, 2D]
        approx = torch.matmul(q2, bounds.float().permute(0, 2, 3, 1))  # [S, Hkv, g, NB]
        share = q_hat.abs().sum(-1) / qg.abs().sum(-1).clamp_min(1e-30)  # [S, Hkv, g] of |q| in the chosen channels
        logits = approx * (scale / share.clamp_min(1e-30).sqrt())[..., None]
        logits = logits + counts.float().log()[:, None, None, :]  # empty pages: -inf
        return logits.softmax(dim=-1).sum(dim=(1, 2))  # [S, NB] (the paper's mean over heads, times Hq)

    def _channel_mask(self, qg: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """[S, Hkv, D] bool: each row's top channels of |q| summed over the query heads of a KV head."""
        S, Hkv, _, D = qg.shape
        if self.channels is not None:
            r = torch.full((S,), min(self.channels, D), device=qg.device)
        else:
            block = counts.amax(dim=1).clamp_min(1)  # [S] the page size (full pages hold block_size)
            n = counts.sum(dim=1)  # [S] cached tokens
            r = (D * block * (self.budget // 2) + n - 1) // n  # ceil(D * bs * (budget // 2) / n)
            r = r.clamp(1, D)
        weight = qg.abs().sum(dim=2)  # [S, Hkv, D]
        ranked = weight.sort(dim=-1, descending=True).values  # [S, Hkv, D]
        least = ranked.gather(-1, (r - 1).view(S, 1, 1).expand(S, Hkv, 1))  # [S, Hkv, 1] the r-th largest
        return weight >= least  # (channels tied with the r-th all count)
