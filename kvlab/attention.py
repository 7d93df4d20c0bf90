"""The attention implementation kvlab registers with transformers (`attn_implementation="kvlab_paged"`).

The model's own forward runs on one packed ragged batch ([1, T] tokens from
many sequences). Each attention layer hands us its new queries, keys and values
(RoPE applied); we write the keys/values into the paged pool and attend
through the block tables. Everything per step (slot mappings, attention plans)
is planned once in `StepMetadata` and travels to every layer as the forward
keyword `kvlab_meta`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.kernels import ops
from kvlab.kernels.reference.paged_attention import AttentionPlan
from kvlab.kv_cache import KVCache

ATTN_IMPLEMENTATION = "kvlab_paged"


@dataclass
class StepMetadata:
    cache: KVCache
    slot_mapping: list[torch.Tensor]  # per layer group: [T] int64 slot of each new token
    plans: list[AttentionPlan]  # per layer group


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kvlab_meta: StepMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if kvlab_meta is None:
        raise RuntimeError("kvlab_paged attention runs only inside the kvlab engine (no kvlab_meta given)")
    meta, layer = kvlab_meta, module.layer_idx
    group = meta.cache.group_of[layer]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if softcap is None:
        softcap = getattr(module, "attn_logit_softcapping", None)
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    meta.cache.store(layer, key[0].transpose(0, 1), value[0].transpose(0, 1), meta.slot_mapping[group])
    scales = meta.cache.scales[layer] or (None, None)
    out = ops.run_paged_attention(q, meta.cache.k[layer], meta.cache.v[layer], meta.plans[group], scaling,
                                  softcap, *scales)  # [T, Hq, D]
    return out.unsqueeze(0), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
