"""A token tree over packed pages, without a model: after a tree step with a rejected branch (the accepted
path moved into place, the rest rolled back), every page of the sequence -- its codes, scales and zero
points, its residual row, whether it is open -- is bit-identical to the pages of a sequence that wrote only
the accepted path's K/V, and stays so as later steps seal pages; the rejected nodes leave nothing in any
page or row (kvlab.cache.paged_kv.PagedKV.move_path, kvlab.engine.attention.leaving_window)."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache.allocators.paged import PagedAllocator
from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.paged_kv import PagedKV
from kvlab.cache.quant.lease import lessor_for, row_claims
from kvlab.engine.attention import plan_step
from kvlab.registry import QUANT_FORMATS, load_plugins
from kvlab.sampling_params import SamplingParams
from kvlab.sequence import Sequence

BS, HEADS, DIM, LAYERS, BLOCKS = 4, 2, 16, (0, 1), 96
PARENTS = [-1, 0, 1, -1, 3, 4, 3]  # drafts 0-2: the first-child chain; 3-5 a second branch, 6 a sibling of 4
FORMATS = [("int8", {}), ("fp8_e4m3", {}), ("int4", {"residual": 0}), ("int4", {"residual": 6}),
           ("int2", {"residual": 3}), ("int4", {})]  # residual 0: every node lies past the window


class Pool:
    """A block manager and a cache wired as the engine wires them (leased rows, row claims)."""

    def __init__(self, fmt: str, args: dict, leased: bool):
        load_plugins()
        quant = QUANT_FORMATS.build(fmt, **args)
        groups = [LayerGroup(LAYERS)]
        self.bm = BlockManager(groups, PagedAllocator(), BLOCKS, BS, 256, 256)
        self.cache = KVCache(groups, BLOCKS, BS, HEADS, DIM, quant, torch.float32, "cpu",
                             lessor=lessor_for(quant, self.bm.allocator, BS) if leased else None)
        self.bm.on_free = self.cache.release_unheld
        self.bm.rows = row_claims(self.cache.area, quant.residual or 0)
        self.kv = PagedKV(self.bm, self.cache)
        self.seq = Sequence(0, [], SamplingParams(max_tokens=64), 256, 0.0)

    def step(self, tokens: list[int], kv: torch.Tensor, parents: list[int] = ()) -> None:
        """Compute `tokens` (the last committed one first; with `parents`, the others are a tree's drafts)
        with kv [layers, 2, T, Hkv, D], as an engine step does."""
        seq, bm = self.seq, self.bm
        self.cache.release_unheld()
        bm.begin_step()
        if parents:
            seq.token_ids.append(tokens[0])
            seq.draft_token_ids, seq.draft_parents = list(tokens[1:]), list(parents)
        else:
            seq.token_ids.extend(tokens)
        n = len(tokens)
        if bm.key(seq, 0) in bm.allocator.tables:
            assert bm.can_append(seq, n)
            bm.append(seq, n)
        else:
            bm.allocate(seq, n)
        area, taken = self.cache.area, []
        if area is not None:
            take = area.take
            area.take = lambda page: taken.append(take(page)) or taken[-1]  # noqa: E731 (counts the rows taken)
        meta = plan_step([seq], [n], bm, self.cache, torch.device("cpu"))
        for layer in LAYERS:
            self.cache.store(layer, kv[layer, 0], kv[layer, 1], meta.slot_mapping[0])
        if area is not None:
            del area.take
        if bm.rows is not None:  # the rows the scheduler claimed are the rows the step leased
            assert len(taken) == bm._claimed_rows and min(taken, default=0) >= 0

    def verify(self, nodes: list[int]) -> None:
        """Accept tree `nodes` (1-based, root's child first): the path moved into place, the rest rolled back."""
        seq, k = self.seq, len(self.seq.draft_token_ids)
        self.kv.move_path(seq, k, nodes)
        self.kv.rollback(seq, k - len(nodes))
        seq.num_computed_tokens = len(seq.token_ids) + len(nodes)
        seq.token_ids.extend(seq.draft_token_ids[n - 1] for n in nodes)
        seq.draft_token_ids, seq.draft_parents = [], []

    def decode(self, kv: torch.Tensor) -> None:
        """One plain decode step of the token after the last one."""
        self.step([7], kv)
        self.seq.num_computed_tokens += 1

    def pages(self) -> list[tuple]:
        """Per table position: (open, every part's bytes, the row's bytes if open), every layer slot and side."""
        table = self.bm.block_tables([self.seq], 0)[0]
        area = self.cache.area
        out = []
        for page in table:
            row = area.row(page) if area is not None else -1
            stores = [*self.cache.layout.k, *self.cache.layout.v]
            parts = [(name, t[page].clone()) for s in stores for name, t in s.parts.items()]
            rows = [s.read_rows(torch.tensor([row]))[0].clone() for s in stores] if row >= 0 else []
            out.append((row >= 0, parts, rows))
        return out

    def unused_pages_are_empty(self) -> bool:
        """Pages no table holds: zero codes and scales, and zero rows where open (own rows only)."""
        held = set(self.bm.block_tables([self.seq], 0)[0])
        area = self.cache.area
        for store in (*self.cache.layout.k, *self.cache.layout.v):
            for page in set(range(BLOCKS)) - held:
                if any(t[page].any() for t in store.parts.values()):
                    return False
                if area is not None and area.row(page) >= 0 and store.read_rows(torch.tensor([area.row(page)])).any():
                    return False
        return True


def same(a: list[tuple], b: list[tuple]) -> bool:
    if len(a) != len(b):
        return False
    for (open_a, parts_a, rows_a), (open_b, parts_b, rows_b) in zip(a, b):
        if open_a != open_b or any(not torch.equal(x, y) for (_, x), (_, y) in zip(parts_a, parts_b)):
            return False
        if any(not torch.equal(x, y) for x, y in zip(rows_a, rows_b)):
            return False
    return True


def kv_of(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randn(len(LAYERS), 2, n, HEADS, DIM, generator=gen)  # [layers, K/V, T, Hkv, D]


@pytest.mark.parametrize("fmt,args", FORMATS, ids=[f"{f}-{a.get('residual', 'default')}" for f, a in FORMATS])
@pytest.mark.parametrize("nodes", [[4, 5, 6], [4, 7], [1, 2, 3], []], ids=["branch", "side", "chain", "none"])
@pytest.mark.parametrize("leased", [True, False], ids=["leased", "own-rows"])
def test_a_tree_step_leaves_the_pages_plain_decoding_of_the_accepted_path_leaves(fmt, args, nodes, leased):
    gen = torch.Generator().manual_seed(len(nodes) + 7 * leased)
    prompt, tree = kv_of(gen, 10), kv_of(gen, 1 + len(PARENTS))  # tree: the root and 7 nodes
    later = [kv_of(gen, 1) for _ in range(9)]
    tree_pool, path_pool = Pool(fmt, args, leased), Pool(fmt, args, leased)
    for pool in (tree_pool, path_pool):
        pool.step(list(range(3, 13)), prompt)
        pool.seq.num_computed_tokens = 10
    tree_pool.step([20 + i for i in range(1 + len(PARENTS))], tree, PARENTS)
    tree_pool.verify(nodes)
    path = [0] + nodes  # the root, then the accepted nodes' K/V, computed as plain tokens
    path_pool.step([20 + i for i in path], tree[:, :, path])
    path_pool.seq.num_computed_tokens += len(path)
    assert tree_pool.seq.token_ids == path_pool.seq.token_ids
    assert same(tree_pool.pages(), path_pool.pages())
    for kv in later:  # pages leave the window and are sealed as the sequence grows
        tree_pool.decode(kv)
        path_pool.decode(kv)
        assert same(tree_pool.pages(), path_pool.pages())
    if not leased:  # leased rows live in free pages' codes, so only own rows show free pages as they are
        assert tree_pool.unused_pages_are_empty() and path_pool.unused_pages_are_empty()
    area = tree_pool.cache.area
    assert area is None or area.early_seals == 0
    if leased and area is not None:  # the rows the rejected nodes' pages held went back
        tree_pool.cache.release_unheld()
        path_pool.cache.release_unheld()
        assert area.num_leased == path_pool.cache.area.num_leased
        assert tree_pool.bm.allocator.num_free_blocks == path_pool.bm.allocator.num_free_blocks
