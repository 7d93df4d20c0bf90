"""The one door for KV moves (kvlab/cache/paged_kv.py), without a model: each move changes the page
tables and the tensors together, so that reading a sequence's slots afterwards gives the K/V it should
hold, for an element-wise format and a packed one."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache.allocators.paged import PagedAllocator
from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.paged_kv import PagedKV
from kvlab.registry import QUANT_FORMATS, load_plugins
from kvlab.sampling_params import SamplingParams
from kvlab.sequence import Sequence

BS, HEADS, DIM, LAYERS = 4, 2, 16, (0, 1)
FORMATS = {"fp32": ({}, 0.0), "int8": ({}, 0.05)}  # format -> (quant args, tolerance)


def make(fmt: str, num_blocks: int = 32):
    load_plugins()
    groups = [LayerGroup(LAYERS)]
    bm = BlockManager(groups, PagedAllocator(), num_blocks, BS, 64, 64)
    cache = KVCache(groups, num_blocks, BS, HEADS, DIM, QUANT_FORMATS.build(fmt, **FORMATS[fmt][0]), torch.float32,
                    "cpu")
    return bm, cache, PagedKV(bm, cache)


def write(bm, cache, seq: Sequence, start: int, n: int, gen: torch.Generator) -> dict[int, tuple]:
    """K/V for `seq`'s cache indices start .. start + n - 1 in every layer (what a forward would store)."""
    slots = torch.tensor(bm.slot_ids(seq, 0, start, start + n))
    cache.begin_step([slots])
    out = {}
    for layer in LAYERS:
        k, v = torch.randn(n, HEADS, DIM, generator=gen), torch.randn(n, HEADS, DIM, generator=gen)
        cache.store(layer, k, v, slots)
        out[layer] = (k, v)
    return out


def read(bm, cache, seq: Sequence, n: int, layer: int):
    return cache.read_slots(layer, torch.tensor(bm.slot_ids(seq, 0, 0, n)), torch.float32)


def close(a, b, tol):
    return torch.allclose(a, b, atol=tol * max(1.0, float(b.abs().max())), rtol=0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_compact_moves_the_kept_tokens_to_the_front_and_frees_the_rest(fmt):
    bm, cache, kv = make(fmt)
    seq = Sequence(0, list(range(3, 17)), SamplingParams(max_tokens=4), 18, 0.0)
    bm.allocate(seq, 14)
    kvs = write(bm, cache, seq, 0, 14, torch.Generator().manual_seed(0))
    keep = [0, 1, 5, 6, 9, 13]
    kv.compact(seq, 0, keep)
    assert bm.cached_lens([seq], 0)[0] == len(keep)
    assert bm.num_used_blocks() == -(-len(keep) // BS)  # the pages after the survivors went back
    for layer in LAYERS:
        k, v = read(bm, cache, seq, len(keep), layer)
        assert close(k, kvs[layer][0][keep], FORMATS[fmt][1]) and close(v, kvs[layer][1][keep], FORMATS[fmt][1])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_fork_writing_into_its_shared_last_page_gets_a_copy_and_the_parent_keeps_its_own(fmt):
    bm, cache, kv = make(fmt)
    gen = torch.Generator().manual_seed(1)
    parent = Sequence(0, list(range(3, 9)), SamplingParams(max_tokens=4), 12, 0.0)
    bm.allocate(parent, 6)
    before = write(bm, cache, parent, 0, 6, gen)
    child = Sequence(1, list(parent.token_ids), parent.params, 12, 0.0)
    bm.fork(parent, child)
    bm.append(child, 1)  # the shared, partly filled last page is copied for the child
    assert kv.apply_copies() == 1
    write(bm, cache, child, 6, 1, gen)
    for layer in LAYERS:
        for seq in (parent, child):  # both still hold the parent's first six tokens
            k, v = read(bm, cache, seq, 6, layer)
            assert close(k, before[layer][0], FORMATS[fmt][1]) and close(v, before[layer][1], FORMATS[fmt][1])
    assert bm.slot_ids(parent, 0, 4, 6) != bm.slot_ids(child, 0, 4, 6)  # the last page is the child's own
    assert bm.slot_ids(parent, 0, 0, 4) == bm.slot_ids(child, 0, 0, 4)  # the full page stays shared


def test_move_path_puts_the_accepted_tree_nodes_after_the_root_and_rollback_drops_the_rest():
    bm, cache, kv = make("fp32")
    seq = Sequence(0, list(range(3, 8)), SamplingParams(max_tokens=8), 16, 0.0)
    bm.allocate(seq, 5)
    write(bm, cache, seq, 0, 5, torch.Generator().manual_seed(2))
    bm.append(seq, 4)  # four tentative tree nodes after the root (cache index 4)
    nodes = write(bm, cache, seq, 5, 4, torch.Generator().manual_seed(3))
    kv.move_path(seq, 4, [2, 4])  # of 4 nodes after the root (cache index 4), nodes 2 and 4 (indices 6, 8) accepted
    kv.rollback(seq, 2)
    assert bm.cached_lens([seq], 0)[0] == 7
    for layer in LAYERS:
        k, v = read(bm, cache, seq, 7, layer)
        assert torch.equal(k[5:], nodes[layer][0][[1, 3]]) and torch.equal(v[5:], nodes[layer][1][[1, 3]])
