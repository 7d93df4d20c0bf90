"""Pages released in the middle of sequences are never read, and compaction keeps exactly the kept tokens.

Both backends (Triton under TRITON_INTERPRET=1 on CPU) attend over tables whose middle pages the block
manager released; the released pages are then reused by another sequence and overwritten with huge
values. Attention must equal dense attention over the kept tokens only. Then every sequence is
compacted (kept tokens moved to the front, whole pages returned to the pool) and must give the same
output again. Batch of 3 with different lengths, decode and extend rows mixed.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported

import pytest  # noqa: E402

from kvlab.kernels.attention_plan import plan_paged_attention  # noqa: E402
from kvlab.cache.block_manager import BlockManager, LayerGroup  # noqa: E402
from kvlab.kernels import ops  # noqa: E402
from kvlab.kernels.testing import attention_tolerance  # noqa: E402
from kvlab.registry import ALLOCATORS  # noqa: E402
from kvlab.sampling_params import SamplingParams  # noqa: E402
from kvlab.sequence import Sequence  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS, HKV, HQ, D, PAGES = 4, 2, 4, 32, 40
LENS = [13, 22, 9]
Q_LENS = [1, 3, 1]  # the last q_len tokens of each sequence are this step's queries
RELEASE = {0: [1], 1: [1, 3], 2: []}  # table indices of pages an eviction policy frees


def seq(i: int, n: int) -> Sequence:
    return Sequence(i, list(range(n)), SamplingParams(), n + 1, arrival_time=0.0)


def dense(q, keys, values, kept, q_lens, scale):
    """Attention of each sequence's queries over its kept cache indices only (causal in cache order)."""
    outs = []
    t = 0
    for b, idx in enumerate(kept):
        k, v = keys[b][idx], values[b][idx]  # [n, Hkv, D]
        n_q = q_lens[b]
        for i in range(n_q):
            qi = q[t + i]  # [Hq, D]
            visible = len(idx) - n_q + i + 1  # the queries are the last kept tokens
            kk = k[:visible].repeat_interleave(HQ // HKV, dim=1)  # [n, Hq, D]
            vv = v[:visible].repeat_interleave(HQ // HKV, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", qi, kk) * scale, dim=-1)
            outs.append(torch.einsum("hn,nhd->hd", p, vv))
        t += n_q
    return torch.stack(outs)  # [T, Hq, D]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_released_pages_are_never_read_and_compaction_keeps_the_kept_tokens(backend):
    g = torch.Generator().manual_seed(0)
    bm = BlockManager([LayerGroup((0,))], ALLOCATORS.build("paged"), PAGES, BS, max_model_len=64)
    k_cache = torch.zeros(PAGES + 1, BS, HKV, D, device=DEVICE)  # + the null page
    v_cache = torch.zeros_like(k_cache)
    seqs = [seq(i, n) for i, n in enumerate(LENS)]
    keys = [torch.randn(n, HKV, D, generator=g).to(DEVICE) for n in LENS]
    values = [torch.randn(n, HKV, D, generator=g).to(DEVICE) for n in LENS]
    for s, k, v in zip(seqs, keys, values):
        bm.allocate(s, s.num_tokens)
        slots = torch.tensor(bm.allocator.slot_ids(bm.key(s, 0), 0, s.num_tokens), device=DEVICE)
        ops.store_kv(k, v, k_cache, v_cache, slots)
    q = torch.randn(sum(Q_LENS), HQ, D, generator=g).to(DEVICE)
    cu = [0]
    for n in Q_LENS:
        cu.append(cu[-1] + n)
    scale = D ** -0.5

    free_before = bm.allocator.num_free_blocks
    for s in seqs:
        assert bm.release_blocks(s, 0, RELEASE[s.seq_id]) == len(RELEASE[s.seq_id])
    assert bm.allocator.num_free_blocks == free_before + 3
    # another sequence takes every free page and fills it with huge values: a read of a released page shows
    intruder = seq(9, (PAGES - sum(-(-n // BS) for n in LENS) + 3) * BS - 1)
    bm.allocate(intruder, intruder.num_tokens)
    assert bm.allocator.num_free_blocks == 0
    for page in bm.block_tables([intruder], 0)[0]:
        k_cache[page], v_cache[page] = 1e4, -1e4
    kept = [[j for j in range(n) if j // BS not in RELEASE[b]] for b, n in enumerate(LENS)]
    want = dense(q, keys, values, kept, Q_LENS, scale)

    def attend():
        tables, lens = bm.block_tables(seqs, 0), bm.cached_lens(seqs, 0)
        plan = plan_paged_attention(cu, lens, tables, BS, None, DEVICE, null_block=PAGES)
        with ops.backend(backend):
            return ops.run_paged_attention(q, k_cache, v_cache, plan, scale)

    torch.testing.assert_close(attend(), want, **attention_tolerance(torch.float32))

    bm.free(intruder)
    for s, keep in zip(seqs, kept):
        moves = bm.compact(s, 0, keep)
        src = torch.tensor([a for a, _ in moves], device=DEVICE, dtype=torch.long)
        dst = torch.tensor([b for _, b in moves], device=DEVICE, dtype=torch.long)
        with ops.backend(backend):
            ops.compact_slots(k_cache, v_cache, src, dst)
    assert bm.cached_lens(seqs, 0) == [len(k) for k in kept]
    assert [len(t) for t in bm.block_tables(seqs, 0)] == [-(-len(k) // BS) for k in kept]
    held = sum(-(-len(k) // BS) for k in kept)
    assert bm.allocator.num_free_blocks == PAGES - held  # whole pages went back to the pool
    torch.testing.assert_close(attend(), want, **attention_tolerance(torch.float32))


def test_compacting_a_forked_sequence_never_writes_into_pages_its_sibling_shares():
    """B is forked from A (every page shared); compacting B must copy into fresh pages, so A still reads
    exactly its own keys and values, and B exactly its kept ones. A page the compaction leaves as it is
    (B keeps page 0's four tokens in place) stays shared."""
    g = torch.Generator().manual_seed(1)
    bm = BlockManager([LayerGroup((0,))], ALLOCATORS.build("paged"), PAGES, BS, max_model_len=64)
    k_cache = torch.zeros(PAGES + 1, BS, HKV, D, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    a, b = seq(0, 18), seq(1, 18)
    keys, values = torch.randn(18, HKV, D, generator=g).to(DEVICE), torch.randn(18, HKV, D, generator=g).to(DEVICE)
    bm.allocate(a, 18)
    slots = torch.tensor(bm.allocator.slot_ids(bm.key(a, 0), 0, 18), device=DEVICE)
    ops.store_kv(keys, values, k_cache, v_cache, slots)
    bm.fork(a, b)
    used = bm.num_used_blocks()
    keep = [0, 1, 2, 3, 9, 10, 16, 17]
    moves = bm.compact(b, 0, keep)
    src = torch.tensor([s for s, _ in moves], device=DEVICE, dtype=torch.long)
    dst = torch.tensor([d for _, d in moves], device=DEVICE, dtype=torch.long)
    ops.compact_slots(k_cache, v_cache, src, dst)
    table_a, table_b = bm.block_tables([a], 0)[0], bm.block_tables([b], 0)[0]
    assert not {d // BS for _, d in moves} & set(table_a)  # B writes only into pages A does not hold
    assert table_b[0] == table_a[0] and not set(table_b[1:]) & set(table_a)  # page 0 unchanged: still shared
    assert bm.num_used_blocks() == used + 1  # B copied 9, 10, 16, 17 into 1 fresh page; its other references dropped
    q = torch.randn(2, HQ, D, generator=g).to(DEVICE)
    plan = plan_paged_attention([0, 1, 2], bm.cached_lens([a, b], 0), bm.block_tables([a, b], 0), BS, None, DEVICE,
                                null_block=PAGES)
    got = ops.run_paged_attention(q, k_cache, v_cache, plan, D ** -0.5)
    want = dense(q, [keys, keys], [values, values], [list(range(18)), keep], [1, 1], D ** -0.5)
    torch.testing.assert_close(got, want, **attention_tolerance(torch.float32))
