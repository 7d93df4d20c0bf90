"""KVCache's two page layouts (kvlab.cache.dense_layout, kvlab.cache.packed_layout) through the one
KVCache interface, without a model: what each format gets, store and read back, a page copy, slot and
per-head compaction, the pool's bytes, and no branch on the format's packing left in KVCache."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

import kvlab.cache.kv_cache as kv_cache
from kvlab.cache.block_manager import LayerGroup
from kvlab.cache.dense_layout import DenseLayout
from kvlab.cache.kv_cache import KVCache, bytes_per_block
from kvlab.cache.kv_layout import PageLayout
from kvlab.cache.packed_layout import PackedLayout
from kvlab.registry import QUANT_FORMATS, load_plugins

BS, HEADS, DIM, LAYERS, NUM_BLOCKS = 8, 2, 16, (0, 1), 6
# case -> (format, layout, whether pages stay open in the window, tolerance relative to the largest value)
CASES = {"fp32": ("fp32", DenseLayout, False, 0.0), "int8": ("int8", PackedLayout, False, 0.02),
         "int4-sealed": ("int4", PackedLayout, False, 0.2), "int4-open": ("int4", PackedLayout, True, 0.0)}


def make(case: str) -> KVCache:
    load_plugins()
    return KVCache([LayerGroup(LAYERS)], NUM_BLOCKS, BS, HEADS, DIM, QUANT_FORMATS.build(CASES[case][0]),
                   torch.float32, "cpu")


def write(cache: KVCache, case: str, slots: list[int], seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """One step: each layer stores its own K/V [len(slots), Hkv, D] at `slots`; sealed unless the case keeps
    its pages open (a residual window with nothing leaving it)."""
    gen = torch.Generator().manual_seed(seed)
    mapping = torch.tensor(slots)
    cache.begin_step([mapping], [set()] if CASES[case][2] else None)
    out = {}
    for layer in LAYERS:
        out[layer] = (torch.randn(len(slots), HEADS, DIM, generator=gen),
                      torch.randn(len(slots), HEADS, DIM, generator=gen))
        cache.store(layer, *out[layer], mapping)
    return out


def read(cache: KVCache, layer: int, slots) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.read_slots(layer, torch.as_tensor(slots, dtype=torch.int64), torch.float32)


def close(got: torch.Tensor, want: torch.Tensor, case: str) -> bool:
    tol = CASES[case][3]
    return torch.allclose(got, want, atol=tol * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_each_format_gets_its_layout_behind_the_same_names(case):
    cache = make(case)
    fmt, layout, open_, _ = CASES[case]
    assert type(cache.layout) is layout and isinstance(cache.layout, PageLayout)
    assert (cache.codecs is None) == (layout is DenseLayout)
    assert (cache.area is not None) == (fmt == "int4") and (cache.residual is not None) == (fmt == "int4")
    assert cache.k(1) is cache.layout.k[1] and cache.v(0) is cache.layout.v[0] and cache.k(0) is not cache.k(1)
    assert cache.k(0).shape == (NUM_BLOCKS + 1, BS, HEADS, DIM)
    page = bytes_per_block([LayerGroup(LAYERS)], BS, HEADS, DIM, cache.quant, torch.float32)
    assert cache.pool_nbytes() == (NUM_BLOCKS + 1) * page  # every page part is counted, and only those
    assert len(cache.page_tensors()) == 2 * len(LAYERS) * (1 if layout is DenseLayout else len(cache.codecs[0].parts(
        BS, HEADS, DIM)))
    assert all(t.shape[0] == NUM_BLOCKS + 1 for t in cache.page_tensors())


@pytest.mark.parametrize("case", CASES)
def test_store_reads_back_each_layers_own_kv(case):
    cache = make(case)
    slots = [BS + 0, BS + 1, BS + 2, 3 * BS + 5]  # pages 1 and 3, partly filled
    data = write(cache, case, slots, seed=0)
    for layer in LAYERS:
        k, v = read(cache, layer, slots)
        assert close(k, data[layer][0], case) and close(v, data[layer][1], case), layer
        assert not close(k, data[1 - layer][0], case)  # the other layer's slot holds other K
    assert cache.area is None or bool(cache.area.open_pages()) == CASES[case][2]
    assert read(cache, 0, [2 * BS])[0].abs().max() == 0  # an unwritten page stays zero


@pytest.mark.parametrize("case", CASES)
def test_copy_blocks_gives_the_copy_the_sources_kv(case):
    cache = make(case)
    src, dst = [BS + j for j in range(BS)], [4 * BS + j for j in range(BS)]
    write(cache, case, src, seed=1)
    cache.copy_blocks([(1, 4)])
    for layer in LAYERS:
        want, got = read(cache, layer, src), read(cache, layer, dst)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and want[0].abs().max() > 0
    if cache.area is not None and CASES[case][2]:  # an open copy has a row of its own
        assert cache.area.row(4) >= 0 and cache.area.row(4) != cache.area.row(1)


@pytest.mark.parametrize("case", CASES)
def test_move_slots_compacts_the_kept_tokens_to_the_front(case):
    cache = make(case)
    slots = [BS + j for j in range(BS)] + [2 * BS + j for j in range(BS)]  # pages 1 and 2
    data = write(cache, case, slots, seed=2)
    kept = [1, 4, 9, 14]  # cache indices kept, moved to indices 0 .. 3
    cache.move_slots([(slots[j], slots[i]) for i, j in enumerate(kept) if i != j])
    for layer in LAYERS:
        k, v = read(cache, layer, slots[: len(kept)])
        want_k, want_v = data[layer][0][kept], data[layer][1][kept]
        tol = max(CASES[case][3], CASES["int4-sealed"][3] if CASES[case][0] == "int4" else 0.0)  # re-quantised
        atol = tol * float(want_k.abs().max())
        assert torch.allclose(k, want_k, atol=atol, rtol=0) and not torch.allclose(k, data[layer][0][:4], atol=atol)
        assert torch.allclose(v, want_v, atol=tol * float(want_v.abs().max()), rtol=0)
    assert cache.area is None or 1 not in cache.area.open_pages()  # compaction seals the pages it writes


@pytest.mark.parametrize("case", CASES)
def test_move_head_slots_packs_each_heads_survivors(case):
    cache = make(case)
    slots = [BS + j for j in range(BS)]
    data = write(cache, case, slots, seed=3)
    src = torch.tensor([[slots[2], slots[5]], [slots[7], slots[1]]])  # head h keeps src[h]
    dst = torch.tensor(slots[:2])
    cache.move_head_slots(src, dst)
    tol = CASES["int4-sealed"][3] if CASES[case][0] == "int4" else CASES[case][3]
    for layer in LAYERS:
        k, _ = read(cache, layer, slots[:2])
        for h, kept in enumerate(([2, 5], [7, 1])):
            want = data[layer][0][kept, h]
            assert torch.allclose(k[:, h], want, atol=tol * float(want.abs().max()), rtol=0), (layer, h)


def test_kv_cache_reads_the_formats_packing_once_to_choose_its_layout():
    """KVCache delegates every layout difference: the one `.packed` it reads is the layout choice in __init__."""
    tree = ast.parse(inspect.getsource(kv_cache))
    reads = [(fn.name, node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
             for node in ast.walk(fn) if isinstance(node, ast.Attribute) and node.attr == "packed"]
    assert [name for name, _ in reads] == ["__init__"]
    branches = [node for node in ast.walk(tree) if isinstance(node, ast.If)
                and any(isinstance(n, ast.Attribute) and n.attr == "packed" for n in ast.walk(node.test))]
    assert not branches
