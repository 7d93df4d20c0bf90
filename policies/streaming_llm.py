"""StreamingLLM: attention sinks plus a recent window (Xiao et al. 2023, "Efficient Streaming Language
Models with Attention Sinks", arXiv:2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import Policy
from kvlab.registry import POLICIES


@POLICIES.register("streaming_llm")
@dataclass
class StreamingLLM(Policy):
    """Keeps the first `n_sink` tokens (the attention sinks) and the most recent ones up to the budget.

    n_sink: sink tokens always kept (the paper's 4; 0 gives a plain recent window).
    """

    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"n_sink must be an integer >= 0, got {self.n_sink!r}")

    def score(self, layer_idx, keys, values, queries, attn_stats):
        L, Hkv = keys.shape[:2]
        score = torch.arange(L, dtype=torch.float32, device=keys.device)  # recent = higher
        score[: self.n_sink] = float(L)  # sinks above everything
        return score[:, None].expand(L, Hkv)
