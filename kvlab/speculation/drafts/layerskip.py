"""Self-speculation: the target's own first `layers` decoder layers and its head draft for it.

Based on LayerSkip (Elhoushi et al. 2024, arXiv:2404.16710) and Draft & Verify (Zhang et al. 2024,
arXiv:2309.08168): an early exit of the target itself -- embeddings, decoder layers 0..k-1, the final
norm and the LM head -- is a draft model with the target's vocabulary and tokenizer by construction,
and no second checkpoint. No weights are copied: the draft network is a view of the target's modules
(`early_exit`). Checkpoints not trained with an early-exit loss (SmolLM2, Gemma 3) give low acceptance
from shallow exits; that is measured, not hidden (experiments/results/speculation_smollm2.md).

Where the draft's KV lives: its own pages, in the `model` draft's second pool (one shadow sequence
per request, rolled back to the committed tokens each step), not the target's pages. The draft's
K/V for layers 0..k-1 of committed tokens equal the target's, so sharing would save the draft's
prefill; but the draft writes its own tentative tokens (which the target never computes at those
cache indices), and a shared page would then need a second rollback and copy-on-write rules between
two writers of one table. The cost is k/L of the target's KV again, and the draft's prefill of each
prompt through k layers (docs/design.md, "Tentative slots and rollback").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from kvlab.speculation.drafts.model import ModelDraft
from kvlab.registry import DRAFTS


def early_exit(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A causal LM that runs `model`'s embeddings, its first `layers` decoder layers, its final norm and
    head: shallow copies of the two outer modules sharing every parameter (nothing is copied on the device)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise ValueError(f"draft layerskip: {type(model).__name__} has no .model.layers to exit early from")
    total = len(inner.layers)
    if not 1 <= layers < total:
        raise ValueError(f"draft layerskip: layers must be in [1, {total - 1}] for a target of {total} decoder "
                         f"layers (all {total} would be the target itself), got {layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:layers])
    head = copy.copy(inner)
    head._modules = dict(inner._modules)
    head.layers = torch.nn.ModuleList(list(inner.layers)[:layers])
    head.config = config
    outer = copy.copy(model)
    outer._modules = dict(model._modules)
    outer.model = head
    outer.config = config
    return outer


@DRAFTS.register("layerskip")
@dataclass
class LayerSkipDraft(ModelDraft):
    """The target's first `layers` decoder layers and its head, on a pool of their own."""

    model: str | None = field(default=None, init=False)  # no checkpoint: the draft is the target's early exit
    seed: int = field(default=0, init=False)
    layers: int = 4  # decoder layers the draft runs (the early exit), 1 .. num_hidden_layers - 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.layers, int) or isinstance(self.layers, bool) or self.layers < 1:
            raise ValueError(f"draft layerskip: layers must be an integer >= 1, got {self.layers!r}")

    def _draft_model(self, engine) -> torch.nn.Module:
        return early_exit(engine.model, self.layers).eval()
