"""The compressor (kvlab/policies/compressor.py) without a model: a hand-built pool of two layers (a
table each, as a compressing policy gets them), K/V written as a forward would, and small policies
whose scores are known. After compression the K/V read back through the cache are exactly the tokens
the scores select, the pages after them are free, recorded queries and attention mass reach the
policy, and the per-sequence state goes with the lifecycle events."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvlab.cache.allocators.paged import PagedAllocator
from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.paged_kv import PagedKV
from kvlab.policies.base import Policy
from kvlab.policies.compressor import Compressor
from kvlab.registry import QUANT_FORMATS, load_plugins
from kvlab.sampling_params import SamplingParams
from kvlab.sequence import Sequence

BS, HKV, HQ, DIM, LAYERS = 4, 2, 4, 8, (0, 1)


@dataclass
class FirstChannel(Policy):
    """Keeps the tokens whose key has the largest first channel (per KV head, or summed)."""

    def score(self, layer_idx, keys, values, queries, attn_stats):
        return keys[:, :, 0].float()


@dataclass
class Recording(Policy):
    """Reads `query_window` queries (scored by their dot product with the keys) and remembers what it got."""

    window: int = 3

    def __post_init__(self):
        super().__post_init__()
        self.seen: dict[int, torch.Tensor] = {}

    @property
    def query_window(self) -> int:
        return self.window

    def score(self, layer_idx, keys, values, queries, attn_stats):
        self.seen[layer_idx] = queries
        return torch.einsum("lhd,qd->lh", keys.float(), queries.float().sum(1))


@dataclass
class ByMass(Policy):
    """H2O's shape: keeps the keys that received the most attention."""

    needs_attention_stats = True

    def score(self, layer_idx, keys, values, queries, attn_stats):
        return attn_stats


def make(policy: Policy, num_blocks: int = 32):
    load_plugins()
    groups = [LayerGroup((layer,)) for layer in LAYERS]  # a table per layer
    bm = BlockManager(groups, PagedAllocator(), num_blocks, BS, 64, 64)
    cache = KVCache(groups, num_blocks, BS, HKV, DIM, QUANT_FORMATS.build("fp32"), torch.float32, "cpu")
    kv = PagedKV(bm, cache)
    return bm, cache, Compressor(policy, kv, torch.float32)


def sequence(n: int, seq_id: int = 0, max_tokens: int = 8) -> Sequence:
    return Sequence(seq_id, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens), n + max_tokens, 0.0)


def write(bm, cache, seq, start, n, gen) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """K/V of `seq`'s cache indices start .. start + n - 1 in every layer (group g holds layer g)."""
    out = {}
    cache.begin_step([torch.tensor(bm.slot_ids(seq, g, start, start + n)) for g in LAYERS])
    for layer in LAYERS:
        slots = torch.tensor(bm.slot_ids(seq, layer, start, start + n))
        k, v = torch.randn(n, HKV, DIM, generator=gen), torch.randn(n, HKV, DIM, generator=gen)
        cache.store(layer, k, v, slots)
        out[layer] = (k, v)
    return out


def read(bm, cache, seq, layer):
    n = bm.cached_lens([seq], layer)[0]
    return cache.read_slots(layer, torch.tensor(bm.slot_ids(seq, layer, 0, n)), torch.float32)


def prefill(policy, n=14, seed=0):
    bm, cache, comp = make(policy)
    seq = sequence(n)
    bm.allocate(seq, n)
    kvs = write(bm, cache, seq, 0, n, torch.Generator().manual_seed(seed))
    seq.num_computed_tokens = n
    return bm, cache, comp, seq, kvs


def test_each_layer_keeps_exactly_the_tokens_its_scores_select_and_frees_the_pages_after_them():
    bm, cache, comp, seq, kvs = prefill(FirstChannel(budget=6, per_head=False))
    assert bm.num_used_blocks() == 2 * 4  # 14 tokens: 4 pages per layer
    freed = comp.compress(seq, {})
    for layer in LAYERS:
        k, v = kvs[layer]
        keep = sorted(k[:, :, 0].sum(1).topk(6).indices.tolist())
        got_k, got_v = read(bm, cache, seq, layer)
        assert bm.cached_lens([seq], layer)[0] == 6
        assert torch.equal(got_k, k[keep]) and torch.equal(got_v, v[keep])
    assert sorted(kvs[0][0][:, :, 0].sum(1).topk(6).indices.tolist()) != \
        sorted(kvs[1][0][:, :, 0].sum(1).topk(6).indices.tolist())  # the layers really chose apart
    assert freed == 2 * (4 - 2) == bm.num_used_blocks() and comp.pages_freed == freed
    assert comp.stats()["policy_tokens_evicted"] == 14 - 6 and comp.calls == 1


def test_per_head_selection_moves_each_kv_heads_own_survivors():
    bm, cache, comp, seq, kvs = prefill(FirstChannel(budget=5, per_head=True), seed=1)
    comp.compress(seq, {})
    for layer in LAYERS:
        k, v = kvs[layer]
        got_k, got_v = read(bm, cache, seq, layer)
        keeps = [sorted(k[:, h, 0].topk(5).indices.tolist()) for h in range(HKV)]
        assert keeps[0] != keeps[1]  # the heads disagree: a list per head
        for h, keep in enumerate(keeps):
            assert torch.equal(got_k[:, h], k[keep, h]) and torch.equal(got_v[:, h], v[keep, h])
    assert bm.num_used_blocks() == 2 * 2


def test_the_policy_gets_the_prompts_last_queries_across_chunks_and_state_ends_with_the_prompt():
    """A prompt of 10 in chunks of 8 and 2 with a window of 3: the policy scores with the queries of
    tokens 7, 8, 9 (one from the first chunk, two from the second); the state is gone once compressed
    for the last time (when="prefill")."""
    policy = Recording(budget=4, window=3, per_head=False)
    bm, cache, comp = make(policy)
    seq = sequence(10)
    gen = torch.Generator().manual_seed(2)
    queries = {layer: torch.randn(10, HQ, DIM, generator=gen) for layer in LAYERS}
    kvs = {}
    for start, n in ((0, 8), (8, 2)):
        bm.allocate(seq, n) if start == 0 else bm.append(seq, n)
        rows = comp.query_rows(seq, n)
        due = comp.due(seq, n)
        assert (rows, due) == ((1, False) if start == 0 else (2, True))
        for layer, kv in write(bm, cache, seq, start, n, gen).items():
            kvs.setdefault(layer, []).append(kv)
        seq.num_computed_tokens += n
        comp.after_step([seq], [n], [due], {layer: [q[start + n - rows:start + n]] for layer, q in queries.items()})
    for layer in LAYERS:
        assert torch.equal(policy.seen[layer], queries[layer][7:])
        k = torch.cat([a for a, _ in kvs[layer]])
        keep = sorted(torch.einsum("lhd,qd->lh", k, queries[layer][7:].sum(1)).sum(1).topk(4).indices.tolist())
        assert torch.equal(read(bm, cache, seq, layer)[0], k[keep])
    assert comp.next_point(seq) is None and comp.num_tracked() == 0


def test_accumulated_attention_follows_its_keys_through_a_compaction():
    """when="decode": the mass of each kept key moves with it, so the next compression ranks by it."""
    policy = ByMass(budget=4, when="decode", every=2, per_head=False)
    bm, cache, comp, seq, kvs = prefill(policy, n=8, seed=3)
    mass = torch.tensor([5.0, 0.1, 9.0, 0.2, 7.0, 0.3, 0.4, 6.0])  # keeps 0, 2, 4, 7
    stats = {layer: mass.expand(HKV, 8)[None].clone() for layer in LAYERS}  # group -> [B, Hkv, cached] (g = layer)
    comp.after_step([seq], [8], [True], {}, stats)
    for layer in LAYERS:
        assert torch.equal(read(bm, cache, seq, layer)[0], kvs[layer][0][[0, 2, 4, 7]])
        assert torch.equal(comp._mass[seq.seq_id][layer][:, 0], mass[[0, 2, 4, 7]])
    assert comp.num_tracked() == 1  # decode compressions follow: the state stays


@pytest.mark.parametrize("event", ["finished", "aborted", "dropped"])
def test_every_lifecycle_event_drops_the_sequences_state_and_a_fork_copies_it(event):
    policy = ByMass(budget=4, when="decode", every=2, per_head=False)
    bm, cache, comp, seq, _ = prefill(policy, n=8)
    comp.after_step([seq], [8], [True], {}, {layer: torch.rand(1, HKV, 8) for layer in LAYERS})
    child = sequence(8, seq_id=1)
    comp.fork(seq, child)
    assert comp.num_tracked() == 2
    comp.on_sequence(event, seq)
    assert comp.num_tracked() == 1 and seq.seq_id not in comp._mass and child.seq_id in comp._mass
    comp.on_sequence(event, child)
    assert comp.num_tracked() == 0
