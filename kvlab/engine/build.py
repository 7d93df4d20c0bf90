"""Assembly of an engine, in one place.

`build(config) -> Parts` makes every component once: the plugins (resolved and checked against the
capability table before the model loads), the model, the page pool (`page_pool`: block manager, KV
cache, prefix index), the scheduler, the model runner, the compressor and the speculator. `LLMEngine`
keeps the parts and runs the step loop. `PrivatePools` lends a plugin that runs a model of its own
(the model draft's shadow sequences) that model and a pool for it, so that no plugin imports the
engine or the cache to build one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvlab.cache.allocators.paged import PagedAllocator
from kvlab.cache.block_manager import BlockManager, LayerGroup, equal_groups
from kvlab.cache.kv_cache import KVCache, bytes_per_block
from kvlab.cache.paged_kv import PagedKV
from kvlab.cache.kept_turns import KeptTurns
from kvlab.cache.prefix_index import prefix_index
from kvlab.cache.tiers.offload import make_tiers, offload_problem
from kvlab.cache.tiers.places import Places
from kvlab.cache.quant.lease import lessor_for, row_claims
from kvlab.engine import attention
from kvlab.engine.capabilities import Capabilities, capabilities, check
from kvlab.engine.linear_backend import MAX_ROWS, apply_linear
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.scheduler import ScheduledBatch, Scheduler
from kvlab.kernels import ops
from kvlab.models import LoadedModel, load_model
from kvlab.policies.compressor import DEFAULT_CHUNK, Compressor
from kvlab.policies.sparse_read import SparseRead, SparseReadPolicy, check_engine
from kvlab.registry import ALLOCATORS, DRAFTS, PLACEMENTS, POLICIES, PREFIX_EVICTIONS, QUANT_FORMATS, load_plugins
from kvlab.sequence import Sequence
from kvlab.speculation.speculator import Speculator


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
        if bm.can_allocate(seq, None, n):
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


def residual_budget(quant, groups, config, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(rows, bytes) of a residual area paid for before the pages: none. A format with a residual window
    leases each open page's full-precision row from the pool's free pages while the page is open
    (kvlab.cache.quant.lease), so the whole budget buys pages and rows cost pages only while in use."""
    return 0, 0


def kept_tokens(policy, groups: list[LayerGroup]) -> Callable[[int, int], int] | None:
    """For admission: (group, prompt tokens) -> tokens the group keeps of the prompt, when the policy
    compresses after every prefill chunk (so a prompt never holds more than that plus one chunk)."""
    if not policy.compresses or policy.when != "chunk":
        return None
    num_layers = sum(len(g.layers) for g in groups)
    return lambda g, n: policy.layer_budget(groups[g].layers[0], num_layers, n)


def chunk_end(compressor, cache: KVCache) -> Callable[[Sequence], int | None]:
    """The scheduler's stop_at: the computed-token count a chunk of a sequence must not pass (None: any),
    its next compression point (compression points are in token time); under sparse reading, the
    prompt's end, then one token a step, with its drafts when it has some (a decode or verify row reads
    the pages the policy selects, a longer chunk reads every page densely). So a recompute rebuilds what
    the first pass did."""
    def stop_at(seq: Sequence) -> int | None:
        point = compressor.next_point(seq) if compressor else None
        if cache.sparse_read is not None and not seq.is_scoring:
            done = seq.num_computed_tokens
            drafts = len(seq.draft_token_ids) if seq.num_uncomputed_tokens == 1 else 0  # a verify step
            read = seq.num_prompt_tokens if done < seq.num_prompt_tokens else done + 1 + drafts
            point = read if point is None else min(point, read)
        return point
    return stop_at


@dataclass
class Parts:
    """Every component of an engine, made once by `build`; the engine keeps them under these names (and
    a plugin's `setup(engine)` reads config, model, tokenizer, model_config, quant and private_pools)."""

    config: object
    policy: object
    quant: object
    draft: object
    capabilities: Capabilities
    model: torch.nn.Module
    tokenizer: object
    model_config: object
    max_model_len: int
    bos_token_id: int | None
    eos_token_ids: set
    bytes_per_block: float
    block_manager: BlockManager
    cache: KVCache
    kv: PagedKV
    scheduler: Scheduler
    runner: ModelRunner
    compressor: Compressor | None
    private_pools: PrivatePools
    speculator: Speculator | None = None
    plan_view: Callable = attention.plan_view  # a self-speculating draft's pass over a view of the pool's pages


def resolve(config):
    """Every plugin of `config` built (bad names and parameters fail here, before the model loads) and
    the capability table checked -> (allocator, policy, quant, draft, capabilities)."""
    load_plugins()
    allocator = ALLOCATORS.build(config.allocator, **config.allocator_args)
    policy = POLICIES.build(config.policy, **config.policy_args)
    quant = QUANT_FORMATS.build(config.quant, **config.quant_args)
    PREFIX_EVICTIONS.build(config.prefix_eviction, **config.prefix_eviction_args)
    PLACEMENTS.build(config.offload_placement, **config.offload_placement_args)
    problem = offload_problem(config.offload, config.offload_args)
    if problem:
        raise ValueError(f"offload_args: {problem}")
    draft = DRAFTS.build(config.draft, **config.draft_args) if config.draft is not None else None
    caps = capabilities(config, policy, quant, type(allocator), draft)
    check(caps)
    check_engine(policy, config)
    return allocator, policy, quant, draft, caps


def load(config, loaded: LoadedModel | None) -> LoadedModel:
    """The target model on kvlab's paged attention, on the configured device."""
    impl = attention.register()
    if loaded is None:
        loaded = load_model(config.model, dtype=getattr(torch, config.dtype), attn_implementation=impl,
                            seed=config.seed)
    else:
        loaded.model.set_attn_implementation(impl)
    loaded.model.to(config.device)
    # after .to(): the fused weights are the storage; under the batch-invariant mode the kernel takes every pass
    apply_linear(loaded.model, config.linear_layout, config.linear_backend,
                 None if config.batch_invariant else MAX_ROWS)
    return loaded


def context_length(config, mc) -> int:
    if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={config.max_model_len} is longer than the model's context of "
                         f"{mc.max_position_embeddings} tokens (max_position_embeddings): set max_model_len <= "
                         f"{mc.max_position_embeddings}, or None for the model's context")
    return config.max_model_len or mc.max_position_embeddings


def special_tokens(tokenizer, mc) -> tuple[int | None, set]:
    """(bos token id, eos token ids) from the tokenizer, else the model config."""
    bos = getattr(tokenizer, "bos_token_id", None)
    bos = bos if bos is not None else getattr(mc, "bos_token_id", None)
    eos = mc.eos_token_id if tokenizer is None else (tokenizer.eos_token_id or mc.eos_token_id)
    return bos, set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


def page_pool(config, allocator, policy, quant, mc, max_model_len: int,
              draft=None) -> tuple[BlockManager, KVCache, float]:
    """The one shared page pool sized from the byte budget: (block manager, KV cache, bytes per block); a
    draft's scratch pages (`DraftModel.scratch_pages`, per layer group) sit past the block manager's, outside
    the budget (as a model draft's own pool); a draft's copy of its view (`DraftModel.reserved_bytes`) is taken
    from the budget."""
    dtype = getattr(torch, config.dtype)
    groups = layer_groups(mc, per_layer=policy.compresses, per_head=policy.head_budgets)
    num_kv_heads, head_dim = mc.num_key_value_heads, head_dim_of(mc)
    quant.check_shape(num_kv_heads, head_dim, config.block_size)
    per_block = bytes_per_block(groups, config.block_size, num_kv_heads, head_dim, quant, dtype)
    _, residual_bytes = residual_budget(quant, groups, config, num_kv_heads, head_dim, dtype)  # 0: leased
    view_bytes = draft.reserved_bytes(groups, config.block_size, num_kv_heads, head_dim, dtype,
                                      bool(quant.packed)) if draft is not None else 0  # a draft's copy of its view
    num_blocks = int((config.kv_cache_memory - residual_bytes - view_bytes) // per_block)
    if num_blocks < 1:
        if view_bytes:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes leaves less than one block of "
                             f"{config.block_size} tokens after the draft's view copy ({view_bytes} bytes); raise "
                             f"kv_cache_memory, or lower draft_args.max_batch / policy_args.budget")
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes is less than one block of "
                         f"{config.block_size} tokens ({per_block:.0f} bytes across {len(groups[0].layers)} "
                         f"layers); raise kv_cache_memory")
    salt = repr((config.model, config.quant, sorted(config.quant_args.items()), config.dtype)).encode()
    index, match = prefix_index(config.prefix_cache if config.enable_prefix_caching else None,
                                PREFIX_EVICTIONS.build(config.prefix_eviction, **config.prefix_eviction_args),
                                config.block_size, salt, config.prefix_match)
    max_chunk = min(config.max_num_batched_tokens, config.max_prefill_chunk or config.max_num_batched_tokens)
    if policy.compresses and policy.when == "chunk":  # a prompt holds its compressed past and one chunk
        max_chunk = max(max_chunk, compression_chunk(config))
    bm = BlockManager(groups, allocator, num_blocks, config.block_size, max_model_len, max_chunk, index, match,
                      kept_tokens(policy, groups))
    scratch = len(groups) * draft.scratch_pages(config.block_size, bool(quant.packed)) if draft is not None else 0
    cache = KVCache(groups, num_blocks, config.block_size, num_kv_heads, head_dim, quant, dtype, config.device,
                    lessor=lessor_for(quant, bm.allocator, config.block_size), scratch_pages=scratch)
    bm.on_free = cache.release_unheld  # leased residual rows follow their pages
    bm.rows = row_claims(cache.area, quant.residual or 0)
    if isinstance(policy, SparseReadPolicy):  # decode reads only the pages the policy selects
        cache.sparse_read = SparseRead(policy, cache, config.block_size, num_kv_heads, head_dim, dtype, config.device)
    if policy.compresses:  # a prefix hit (and a kept-turn hit) leaves the policy's observation window to compute
        bm.recompute_tail = bm.turn_tail = policy.query_window
        bm.keep_shared = config.prefix_keep_shared
    if draft is not None:  # a draft reading the target's queries of a prompt's last tokens: a hit leaves them to compute
        bm.recompute_tail = max(bm.recompute_tail, draft.prompt_query_tail())
    if config.reuse_compressed:  # finished compressed turns kept for the next (kvlab/cache/kept_turns.py)
        bm.allocator.kept_turns = KeptTurns(len(groups), config.reuse_compressed_max_turns)
        if cache.area is not None and cache.area.lessor is not None:  # a kept turn's open pages keep their rows
            bm.allocator.row_pages, bm.allocator.release_rows = cache.area.row_pages, cache.area.release
    if index is not None and cache.area is not None:
        # a residual window: a hit leaves the prompt's window to compute and shares no page that is
        # open in another sequence's window (docs/design.md, "Prefix caching with a residual window")
        bm.recompute_tail = max(bm.recompute_tail, quant.residual)
        bm.shareable = cache.shareable
    return bm, cache, per_block


def attach_tiers(config, kv: PagedKV) -> None:
    """The tiers `config.offload` names, their placement and bookkeeping, handed to the one door."""
    nbytes = kv.page_nbytes()
    tiers = make_tiers(config.offload, config.offload_args, nbytes, pin=torch.device(config.device).type == "cuda")
    places = Places([t.kind for t in tiers], [t.capacity for t in tiers],
                    PLACEMENTS.build(config.offload_placement, **config.offload_placement_args), nbytes, config.block_size)
    kv.attach_tiers(tiers, places)
    kv.calibrate()  # the cost model's start-up restore rates (kvlab.cache.tiers.placement.cost_aware)


def compression_chunk(config) -> int:
    """Prompt tokens between a when="chunk" policy's compression points: `max_prefill_chunk`, else 512 (never
    the step budget, which would make what a prompt keeps depend on it)."""
    return config.max_prefill_chunk or DEFAULT_CHUNK


def build(config, loaded: LoadedModel | None = None) -> Parts:
    """Every component of an engine for `config`, each made once: plugins resolved and checked before the
    model loads, the model, the page pool, the scheduler, the runner, the compressor and the speculator."""
    allocator, policy, quant, draft, caps = resolve(config)
    ops.set_backend(config.kernel_backend)
    loaded = load(config, loaded)
    model, mc = loaded.model, loaded.model.config
    max_model_len = context_length(config, mc)
    bos, eos = special_tokens(loaded.tokenizer, mc)
    bm, cache, per_block = page_pool(config, allocator, policy, quant, mc, max_model_len, draft)
    kv = PagedKV(bm, cache)  # the one door for KV moves (kvlab/cache/paged_kv.py)
    if config.offload is not None:  # tiers below the pool (docs/design.md, "Tiers below the pool")
        attach_tiers(config, kv)
    scheduler = Scheduler(bm, config.max_num_seqs, config.max_num_batched_tokens, config.max_prefill_chunk)
    compressor = Compressor(policy, kv, getattr(torch, config.dtype), compression_chunk(config)) \
        if policy.compresses else None
    if compressor:
        compressor.bind(model)  # binds the policy too
    if compressor and bm.kept_turns is not None:
        compressor.keep_turns = True
        bm.on_turn_hit = compressor.seed_turn
    if compressor or cache.sparse_read is not None:
        scheduler.stop_at = chunk_end(compressor, cache)
    if compressor and compressor.prefix_mass is not None:  # where a prefix's attention mass is kept
        scheduler.stats_at = compressor.stats_point
    parts = Parts(config, policy, quant, draft, caps, model, loaded.tokenizer, mc, max_model_len, bos, eos,
                  per_block, bm, cache, kv, scheduler,
                  ModelRunner(model, kv, config.device, config.batch_invariant), compressor,
                  PrivatePools(config, bm, max_model_len))
    if draft is not None:
        draft.setup(parts)  # e.g. loads the draft model (through private_pools) and checks its vocabulary
        parts.speculator = Speculator(draft, mc.vocab_size, kv)
    return parts
