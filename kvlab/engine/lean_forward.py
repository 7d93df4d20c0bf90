"""A Llama model's forward for the engine's steps without transformers' module stack (issue 27, item 2).

A batch-1 decode step of SmolLM2-135M reads 269 MB of bf16 weights (~7 ms at this machine's streaming rate)
but took ~19 ms: most of the rest was Python between the ops: ~400 module calls a step (`nn.Module.__call__`,
its hook checks, keyword plumbing through every decoder layer, the attention interface lookup), views and
transposes in and out of the [1, heads, T, D] layout, a fused projection's bookkeeping. This forward runs the
same tensor operations in the same order on the packed rows ([T, hidden]; [T, heads, D] for attention) and
calls the layers' own functions (`forward`, never `__call__`): the embedding, RMSNorm, the rotary embedding
(computed once per step, as transformers does), the q/k/v projections (one product when the layout fused them),
`kvlab.engine.attention.paged_attention`, o_proj, the residual adds, SiLU(gate) * up, down_proj, the final norm
and the lm_head over the kept rows. Every elementwise op and reduction meets the same operands in the same
dtype as transformers' forward, so the logits are the same to the bit (tests/engine/test_lean_forward.py).

The norms and RoPE are one call each of kernels/cpu/layer_ops.cpp (where it built and its probe agrees with
torch): transformers' RMSNorm is 7-8 small ops and RoPE 4, ~3 us of dispatch each at batch 1, and the kernel
computes the same values with the same roundings (torch's summation order included). The residual add of
every sublayer's output is done by the norm that follows it (`add_rms_norm`: the sum and its norm, one call);
the final norm runs on the kept rows only (it is row-wise). Without the kernel these are transformers' ops.

It takes a model only when it is transformers' LlamaForCausalLM with its own decoder layers, SiLU MLP, the default
attention scaling and no soft-cap; a model with forward hooks on any module (a profiler's scopes, a draft's
layer taps) runs transformers' forward, as does the batch-invariant mode. What it holds of the linear modules is
rebuilt whenever kvlab/engine/linear_layout.py or linear_backend.py changes them (a counter on the model).

    forward = lean_forward(model)   # None: this model runs transformers' forward
    logits = forward(input_ids [T], positions [T], keep [R], meta)  # [R, vocab] in the model's dtype
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.engine.attention import StepMetadata, paged_attention
from kvlab.engine.linear_layout import FusedPart, rewirings
from kvlab.kernels.cpu import layer_ops


def lean_forward(model: nn.Module) -> Callable | None:
    """The lean forward of `model`, or None where it does not apply."""
    if type(model).__name__ != "LlamaForCausalLM" or model.training:
        return None
    cfg, inner = model.config, model.model
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return None
    layers = list(inner.layers[: cfg.num_hidden_layers])
    for layer in layers:
        if type(layer).__name__ != "LlamaDecoderLayer" or type(layer.mlp).__name__ != "LlamaMLP":
            return None
        attn = layer.self_attn
        if getattr(attn, "attn_logit_softcapping", None) or attn.scaling != attn.head_dim ** -0.5:
            return None
    held = {}  # the layers' plans and the modules' hook tables, as of `rewirings(model)` changes of its linears

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                meta: StepMetadata) -> torch.Tensor | None:
        if held.get("at") != rewirings(model):  # a layout or backend changed the modules: plan them again
            held.update(at=rewirings(model), plans=[_layer_plan(layer) for layer in layers], final=_add_norm(inner.norm),
                        hooks=[d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)])
        if any(held["hooks"]) or _global_hooks():
            return None  # someone listens to the modules: transformers' forward calls them
        plans = held["plans"]
        emb = inner.embed_tokens
        h = F.embedding(input_ids, emb.weight, emb.padding_idx, emb.max_norm, emb.norm_type,
                        emb.scale_grad_by_freq, emb.sparse)  # [T, H]
        cos, sin = inner.rotary_emb.forward(h[None], positions[None])  # [1, T, D] each
        cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, D]
        half = cos.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # rotate_half's signs moved onto sin
        out = None  # the last layer's MLP output, added to the residual stream by the next norm (add_norm)
        for plan in plans:
            h, out = plan(h, out, cos, sin, meta)
        _, x = held["final"](h[keep], out[keep])  # [R, H]: only the kept rows (the norm is row-wise)
        return model.lm_head.forward(x)  # [R, V]

    return forward


def _global_hooks() -> bool:
    from torch.nn.modules import module as m

    return bool(m._global_forward_hooks or m._global_forward_pre_hooks)


def _fused(owner: nn.Module, names: tuple[str, ...]):
    """The FusedProduct (kvlab/engine/linear_layout.py) whose parts are exactly owner's projections `names`, in
    order, or None."""
    parts = [getattr(owner, n) for n in names]
    if not all(isinstance(p, FusedPart) for p in parts):
        return None
    product = parts[0].product
    same = all(p.product is product for p in parts) and [p.i for p in parts] == list(range(len(parts)))
    return product if same and len(product.sizes) == len(parts) else None


def _plain_rms_norm(norm: nn.Module) -> bool:
    """transformers' own LlamaRMSNorm (not a hub kernel's forward in its place)."""
    return type(norm).__name__ == "LlamaRMSNorm" and type(norm).forward.__qualname__ == "LlamaRMSNorm.forward"


def _add_norm(norm: nn.Module) -> Callable:
    """(h, out) -> (h + out, norm(h + out)), out None: (h, norm(h)); in one kernel call (kernels/cpu/layer_ops.py:
    the same bits) where it takes transformers' plain RMSNorm, else the module's forward after a torch add."""
    weight, eps = norm.weight, getattr(norm, "variance_epsilon", None)
    if _plain_rms_norm(norm) and isinstance(eps, float) and layer_ops.available():
        return lambda h, out: (h, layer_ops.rms_norm(h, weight, eps)) if out is None else \
            layer_ops.add_rms_norm(out, h, weight, eps)
    return lambda h, out: (h, norm.forward(h)) if out is None else (lambda s: (s, norm.forward(s)))(h + out)


def _layer_plan(layer: nn.Module) -> Callable:
    """One decoder layer as transformers' LlamaDecoderLayer computes it, on packed rows h [T, H]; the residual
    add of its MLP output is left to the next norm: (h, previous layer's MLP output) -> (h, this one's)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = _fused(attn, ("q_proj", "k_proj", "v_proj")), _fused(mlp, ("gate_proj", "up_proj"))
    q_proj, k_proj, v_proj = attn.q_proj.forward, attn.k_proj.forward, attn.v_proj.forward
    gate_proj, up_proj = mlp.gate_proj.forward, mlp.up_proj.forward
    norm1, norm2 = _add_norm(layer.input_layernorm), _add_norm(layer.post_attention_layernorm)
    o_proj, down, act = attn.o_proj.forward, mlp.down_proj.forward, mlp.act_fn
    index, d, scaling = attn.layer_idx, attn.head_dim, attn.scaling
    hq = attn.config.num_attention_heads

    def run(h: torch.Tensor, out: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
            meta: StepMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        (h, x), t = norm1(h, out), h.shape[0]  # h [T, H] the residual stream, x normed
        if qkv is not None:  # one product; q and k side by side in it take RoPE as one tensor
            heads = qkv.matmul(x, qkv.weight, qkv.bias).view(t, -1, d)  # [T, Hq + 2 Hkv, D]
            hkv = (heads.shape[1] - hq) // 2
            qk = layer_ops.rope(heads[:, : hq + hkv], cos, sin)  # [T, Hq + Hkv, D]
            q, k, v = qk[:, :hq], qk[:, hq:], heads[:, hq + hkv:]
        else:
            q, k, v = q_proj(x).view(t, -1, d), k_proj(x).view(t, -1, d), v_proj(x).view(t, -1, d)
            q, k = layer_ops.rope(q, cos, sin), layer_ops.rope(k, cos, sin)
        o = paged_attention(meta, index, q, k, v, scaling, None)  # [T, Hq, D]
        h, x = norm2(h, o_proj(o.reshape(t, -1)))  # h + o_proj(o), and its norm
        if gate_up is not None:
            gate, up = gate_up.matmul(x, gate_up.weight, gate_up.bias).split(gate_up.sizes, dim=-1)
        else:
            gate, up = gate_proj(x), up_proj(x)
        return h, down(act(gate) * up)  # the next norm adds it to h

    return run
