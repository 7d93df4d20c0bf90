"""The tiny random Llama with its two KV heads made to attend differently, so that per-head budgets (AdaKV) give
them different counts: shared by tests/policies/test_adakv_h2o.py and tests/engine/test_compressed_turns_heads.py."""

from __future__ import annotations

import torch

from kvlab.models import LoadedModel, load_model


def sharp_and_flat() -> LoadedModel:
    """The tiny random Llama with KV head 0's query heads made sharp (queries x 30) and KV head 1's flat (queries
    0: uniform causal attention). A random model's accumulated attention is ruled by position alike in every
    head (a key is seen by every later query), so AdaKV would share the budget almost evenly; here the heads'
    masses differ enough that they keep different numbers of tokens."""
    loaded = load_model("random:llama-tiny")
    with torch.no_grad():
        for layer in loaded.model.model.layers:
            q = layer.self_attn.q_proj.weight  # [Hq * D, hidden]: KV head 0 reads query heads 0-1 (rows 0-31)
            q[: q.shape[0] // 2] *= 30
            q[q.shape[0] // 2 :] = 0
    return loaded


def sharper() -> LoadedModel:
    """The tiny random Llama with KV head 0's query heads 4x sharper than KV head 1's (whose stay as drawn): SnapKV
    and the key norms then give the heads different counts, each head keeping some and evicting some of its own."""
    loaded = load_model("random:llama-tiny")
    with torch.no_grad():
        for layer in loaded.model.model.layers:
            q = layer.self_attn.q_proj.weight  # [Hq * D, hidden]: KV head 0 reads query heads 0-1 (rows 0-31)
            q[: q.shape[0] // 2] *= 4
    return loaded
