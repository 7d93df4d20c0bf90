"""The bytes an engine's target and draft read per decode pass (kvlab/speculation/cost_model.py's `Traffic`),
read off the built engine: parameter bytes per decoder layer in the model's dtype, and K/V bytes per token in the
cache's format (scales included), sliding windows per layer.

Which draft reads what:

    ngram                 nothing (a lookup in the sequence's own tokens)
    self_compressed       the target's weights (its first `layers` with an early exit) and its view of the target's KV
    layerskip, tree       the early exit's weights and its own pool's KV (the same per-layer bytes, its layers only)
    model, slem, tli      the draft model's weights and its own pool's KV
"""

from __future__ import annotations

from typing import Callable

import torch

from kvlab.speculation.cost_model import Traffic


def param_bytes(module: torch.nn.Module | None) -> float:
    """Bytes of `module`'s parameters (each counted once, tied ones too)."""
    if module is None:
        return 0.0
    return float(sum(p.numel() * p.element_size() for p in module.parameters()))


def model_traffic(model: torch.nn.Module, cache) -> Traffic:
    """A causal LM (`.model.layers`, `.model.norm`, `.lm_head`) over a KVCache: its `Traffic`."""
    inner, mc = model.model, model.config
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    per_token = cache.quant.bytes_per_token(mc.num_key_value_heads, head_dim, cache.block_size, cache.compute_dtype)
    windows = {layer: g.sliding_window for g in cache.groups for layer in g.layers}
    layers = list(inner.layers)
    return Traffic(tuple(param_bytes(layer) for layer in layers),
                   param_bytes(getattr(model, "lm_head", None)) + param_bytes(getattr(inner, "norm", None)),
                   tuple(per_token for _ in layers), tuple(windows.get(i) for i in range(len(layers))))


def target_traffic(engine) -> Traffic:
    """The engine's target model over its own cache."""
    return model_traffic(engine.model, engine.cache)


def view_tokens(draft) -> Callable[[float], float]:
    """context -> tokens a self_compressed draft's view holds a sequence: a page view's own count; a token view's
    selection of [0, P) plus the tokens since the refresh point P ((refresh - 1) / 2 on average)."""
    view = draft._view
    if hasattr(view, "tokens"):  # a page view
        return lambda context: view.tokens(int(context))
    return lambda context: min(context, view.policy.budget + (draft.refresh - 1) / 2)


def draft_pass(engine) -> Callable[[int, float], float]:
    """(batch, context) -> bytes one pass of the engine's draft reads; 0 for a draft without a model."""
    draft = engine.speculator.draft if engine.speculator else None
    name = getattr(type(draft), "registry_name", None)
    if draft is None or name in ("ngram",):
        return lambda batch, context: 0.0
    if name == "self_compressed":  # a copied view is read in its own format (int4 codes: QuantSpec)
        copy = getattr(draft, "_copy", None)
        read = model_traffic(engine.model, copy.cache) if copy is not None else target_traffic(engine)
        layers, tokens = draft.layers, view_tokens(draft)
        return lambda batch, context: read.pass_bytes(batch, context, layers, tokens(context))
    pool = getattr(draft, "_pool", None)
    if pool is None:
        raise ValueError(f"engine_traffic: no traffic model for draft {name!r} (it has no model on a pool of its own)")
    own = model_traffic(pool.runner.model, pool.runner.cache)
    return lambda batch, context: own.pass_bytes(batch, context)


def draft_shares(engine, batch: int, context: float) -> tuple[float, float] | None:
    """(weight share, KV share): the bytes one draft pass reads of weights and of KV over the target pass's (at
    `batch` sequences of `context` tokens), for the compute side of the cost model (cost_model.PassTimes); None
    for a draft without a model (nothing to price)."""
    draft = engine.speculator.draft if engine.speculator else None
    name = getattr(type(draft), "registry_name", None)
    if draft is None or name in ("ngram",):
        return None
    target = target_traffic(engine)
    if name == "self_compressed":
        copy = getattr(draft, "_copy", None)
        read = model_traffic(engine.model, copy.cache) if copy is not None else target
        weights, kv = read.weight_bytes(draft.layers), read.kv_bytes(context, draft.layers, view_tokens(draft)(context))
    else:
        pool = getattr(draft, "_pool", None)
        if pool is None:
            raise ValueError(f"engine_traffic: no traffic model for draft {name!r} (it has no model on a pool of its own)")
        own = model_traffic(pool.runner.model, pool.runner.cache)
        weights, kv = own.weight_bytes(), own.kv_bytes(context)
    return weights / target.weight_bytes(), kv / target.kv_bytes(context)
