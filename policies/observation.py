"""Attention of an observation window of recent queries over a layer's cached keys (SnapKV, TOVA, PyramidKV)."""

from __future__ import annotations

import torch


def window_attention(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """queries [W, Hq, D] (the last W cached tokens' queries), keys [L, Hkv, D] -> probabilities [Hkv, g, W, L].

    Query i sits at cache index L - W + i and sees the keys at or before it (causal); GQA folds the
    g = Hq / Hkv query heads of each KV head. Scaled by 1/sqrt(D), computed in float32."""
    W, Hq, D = queries.shape
    L, Hkv, _ = keys.shape
    g = Hq // Hkv
    q = queries.float().view(W, Hkv, g, D).permute(1, 2, 0, 3)  # [Hkv, g, W, D]
    k = keys.float().permute(1, 2, 0)  # [Hkv, D, L]
    logits = torch.matmul(q, k[:, None]) * D ** -0.5  # [Hkv, g, W, L]
    pos = torch.arange(L - W, L, device=keys.device)[:, None]  # [W, 1] cache index of each query
    visible = torch.arange(L, device=keys.device)[None, :] <= pos  # [W, L]
    return logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)
