"""Assembly of a page pool and the model runner on it, in one place.

`build_pool` makes the groups, the block manager, the KV pool and the runner for a model; the engine
builds its own pool with it, and hands `PrivatePools` to plugins that need a pool of their own (the
model draft's shadow sequences), so that no plugin imports the engine or the cache to build one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.allocators.paged import PagedAllocator
from kvlab.cache.block_manager import BlockManager, LayerGroup, equal_groups
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.paged_kv import PagedKV
from kvlab.engine import attention
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.scheduler import ScheduledBatch
from kvlab.models import LoadedModel, load_model
from kvlab.registry import QUANT_FORMATS
from kvlab.sequence import Sequence


def layer_groups(config, per_layer: bool = False, per_head: bool = False) -> list[LayerGroup]:
    """Layers grouped by attention kind (full, or a sliding window: Gemma 2/3, Mistral) into groups of
    equal size, so that every page of the shared pool has one size; `per_layer`: one layer a group;
    `per_head`: one (layer, KV head) a group (a model with one KV head needs no split)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * n
    heads = config.num_key_value_heads if per_head and config.num_key_value_heads > 1 else None
    return equal_groups([int(window) if t == "sliding_attention" and window else None for t in types],
                        1 if per_layer or heads else None, heads)


def head_dim_of(mc) -> int:
    """A model config's head size (head_dim, else hidden size / query heads)."""
    return getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads


@dataclass
class PrivatePool:
    """A model of a plugin's own on a page pool of its own: sequences are allocated, run and freed here,
    never in the engine's pool."""

    block_manager: BlockManager
    runner: ModelRunner

    def take_slots(self, seq: Sequence) -> bool:
        """Slots for `seq`'s uncomputed tokens (a first allocation or an append); False, and nothing
        taken, if the pool cannot hold them."""
        bm, n = self.block_manager, seq.num_uncomputed_tokens
        if self.holds(seq):
            if bm.can_append(seq, n):
                bm.append(seq, n)
                return True
            return False
        if bm.can_allocate(seq):
            bm.allocate(seq, n)
            return True
        return False

    def holds(self, seq: Sequence) -> bool:
        return self.block_manager.key(seq, 0) in self.block_manager.allocator.tables

    def forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """One packed pass over every sequence's uncomputed tokens -> the last position's logits [B, V],
        in the order of `seqs` (their tokens counted as computed)."""
        batch = ScheduledBatch(list(seqs), [s.num_uncomputed_tokens for s in seqs])
        out = self.runner.run(batch)
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            s.num_computed_tokens += n
        for s in seqs:
            self.block_manager.release_out_of_window(s)
        rows = torch.tensor([r for _, r in out.sample_rows])
        return out.logits[rows]

    def rollback(self, seq: Sequence, n: int) -> None:
        self.runner.kv.rollback(seq, n)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        if self.holds(seq):
            self.block_manager.free(seq)


class PrivatePools:
    """What the engine lends a plugin that runs a model of its own: the model, loaded on kvlab's paged
    attention on the engine's device and dtype, and a pool for it as large as the engine's plus room."""

    def __init__(self, config, block_manager: BlockManager, max_model_len: int):
        self._config, self._target, self.max_model_len = config, block_manager, max_model_len

    def load_model(self, name: str, seed: int = 0) -> LoadedModel:
        cfg = self._config
        loaded = load_model(name, dtype=getattr(torch, cfg.dtype), attn_implementation=attention.register(),
                            seed=seed)
        loaded.model.to(cfg.device).eval()
        return loaded

    def pool(self, model: torch.nn.Module, extra_tokens: int) -> PrivatePool:
        """A pool holding as many tokens as the engine's, plus `extra_tokens`, in the format `auto`; a
        sequence computes its whole prompt in one pass (admission counts every token)."""
        cfg, target = self._config, self._target
        bs, mc = cfg.block_size, model.config
        groups = layer_groups(mc)
        tokens = target.num_blocks * bs // len(target.groups) + extra_tokens
        num_blocks = len(groups) * -(-tokens // bs)
        cache = KVCache(groups, num_blocks, bs, mc.num_key_value_heads, head_dim_of(mc), QUANT_FORMATS.build("auto"),
                        getattr(torch, cfg.dtype), cfg.device)
        bm = BlockManager(groups, PagedAllocator(), num_blocks, bs, self.max_model_len, self.max_model_len)
        return PrivatePool(bm, ModelRunner(model, PagedKV(bm, cache), cfg.device))
