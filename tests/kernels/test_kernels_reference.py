"""Fast pure-torch tests: the references against naive per-token loops."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.kernels.reference.attention_stats import attention_stats_ref
from kvlab.kernels.reference.block_ops import compact_slots_ref, copy_blocks_ref
from kvlab.kernels.attention_plan import _memos
from kvlab.kernels.reference.paged_attention import paged_attention_ref, plan_parts, plan_paged_attention
from kvlab.kernels.reference.store_kv import dequantize_ref, store_kv_ref
from kvlab.kernels.testing import CACHE_DTYPES, make_paged_batch, random_pool


def naive_attention(batch, window=None, softcap=None, stats_window=None):
    """Per sequence, per query token, per head: gather visible keys one by one and softmax.

    Returns (out [T, Hq, D] float32, stats [B, Hkv, max seq_len] float32)."""
    q, kc, vc = batch.q.float(), batch.k_cache, batch.v_cache
    bs, hkv, d = kc.shape[1], kc.shape[2], kc.shape[3]
    hq = q.shape[1]
    g = hq // hkv
    ks = batch.k_scale if batch.k_scale is not None else torch.ones(hkv)
    vs = batch.v_scale if batch.v_scale is not None else torch.ones(hkv)
    out = torch.zeros(q.shape)
    seq_lens = batch.seq_lens.tolist()
    stats = torch.zeros(len(seq_lens), hkv, max(seq_lens))
    cu = batch.cu_seqlens_q.tolist()
    for b, n in enumerate(seq_lens):
        q_len = cu[b + 1] - cu[b]
        prefix = n - q_len
        counted = q_len if stats_window is None else min(stats_window, q_len)
        for i in range(q_len):
            t, pos = cu[b] + i, prefix + i
            keys = [j for j in range(pos + 1) if window is None or pos - j < window]
            if batch.tree_mask is not None:  # mask column 0: tree_starts[b], else the first new token
                start = prefix if batch.tree_starts is None else batch.tree_starts[b]
                keys = [j for j in keys if j < start or bool(batch.tree_mask[t, j - start])]
            for h in range(hq):
                kvh = h // g
                logits, values = [], []
                for j in keys:
                    slot_block = int(batch.block_tables[b, j // bs])
                    k = kc[slot_block, j % bs, kvh].float() * ks[kvh]
                    values.append(vc[slot_block, j % bs, kvh].float() * vs[kvh])
                    s = float(q[t, h] @ k) * batch.scale
                    logits.append(softcap * math.tanh(s / softcap) if softcap else s)
                p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0).float()
                out[t, h] = sum(pj * v for pj, v in zip(p, values))
                if i >= q_len - counted:
                    for pj, j in zip(p, keys):
                        stats[b, kvh, j] += pj
    return out, stats


CASES = [
    # q_lens, seq_lens, hkv, group, block_size, cache, window, softcap, tree
    ([1, 1, 1], [1, 15, 17], 2, 1, 16, "fp32", None, None, False),
    ([3, 1], [9, 4], 1, 3, 4, "bf16", 3, None, False),
    ([4, 2, 1], [4, 10, 5], 2, 4, 2, "fp8_e4m3", None, 5.0, False),
    ([5, 3], [12, 3], 1, 2, 1, "fp8_e5m2", 6, None, False),
    ([5, 1, 4], [8, 6, 4], 2, 3, 4, "fp32", None, None, True),
    ([6], [11], 1, 4, 8, "bf16", 4, 3.0, True),
    ([1, 1, 3, 1], [13, 9, 7, 18], 2, 2, 4, "fp32", None, None, "starts"),  # a sparse read's tree rows
    ([1, 4, 1], [10, 9, 21], 1, 3, 4, "bf16", None, 4.0, "starts"),
]


@pytest.mark.parametrize("q_lens,seq_lens,hkv,g,bs,cache,window,softcap,tree", CASES)
def test_reference_matches_naive_loops(q_lens, seq_lens, hkv, g, bs, cache, window, softcap, tree):
    batch = make_paged_batch(q_lens, seq_lens, hkv, g, 16, bs, CACHE_DTYPES[cache], sliding_window=window,
                             tree=bool(tree), tree_starts=tree == "starts")
    for stats_window in (None, 2):
        out, stats = paged_attention_ref(
            *batch.args(), window, softcap, batch.k_scale, batch.v_scale,
            tree_mask=batch.tree_mask, tree_starts=batch.tree_starts, return_stats=True, stats_window=stats_window,
        )
        want_out, want_stats = naive_attention(batch, window, softcap, stats_window)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(stats, want_stats, atol=1e-5, rtol=1e-4)


def test_stats_rows_sum_to_counted_queries():
    """Each counted (query, head) row spreads probability 1 over the keys: stats sum = G * counted queries."""
    batch = make_paged_batch([5, 1], [9, 6], 2, 3, 16, 4)
    stats = attention_stats_ref(*batch.args(), stats_window=3)
    torch.testing.assert_close(stats.sum(dim=(1, 2)), torch.tensor([2 * 3 * 3.0, 2 * 3 * 1.0]))


def test_plan_parts_are_built_once_and_lazily():
    plan = plan_paged_attention([0, 1, 4], [5, 9], [[0, 1], [2, 3, 4]], 4)
    assert plan not in _memos.get("torch.parts", {})
    assert plan_parts(plan) is plan_parts(plan)
    assert [p.seq_rows for p in plan_parts(plan)] == [[0], [1]]


def test_plan_rejects_query_longer_than_cache():
    with pytest.raises(ValueError, match="query length"):
        plan_paged_attention([0, 5], [3], [[0]], 4)


@pytest.mark.parametrize("cache", ["fp32", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_store_kv_ref_matches_loop(cache):
    dtype = CACHE_DTYPES[cache]
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (random_pool(3, 4, 2, 8, dtype, None, gen, "cpu") for _ in range(2))
    key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([7, -1, 0, 11, 3])
    scale = torch.tensor([0.5, 2.0]) if dtype.itemsize == 1 else None
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for want, x in ((want_k, key), (want_v, value)):
            y = x[t] if scale is None else x[t] / scale[:, None]
            if dtype.itemsize == 1:
                y = y.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
            want[slot // 4, slot % 4] = y.to(dtype)
    store_kv_ref(key, value, k_cache, v_cache, slots, scale, scale)
    assert torch.equal(k_cache.float(), want_k.float()) and torch.equal(v_cache.float(), want_v.float())
    if scale is not None:  # dequantised within fp8 precision
        eps = torch.finfo(dtype).eps
        back = dequantize_ref(k_cache.view(-1, 2, 8)[slots[slots >= 0]], scale, torch.float32)
        assert torch.allclose(back, key[slots >= 0], rtol=eps, atol=eps * scale.max())


def test_block_ops_ref_match_loops():
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = (random_pool(6, 4, 2, 8, torch.float32, None, gen, "cpu") for _ in range(2))
    want = k_cache.clone()
    copy_blocks_ref(k_cache, v_cache, torch.tensor([0, 2]), torch.tensor([4, 5]))
    want[4], want[5] = want[0], want[2]
    assert torch.equal(k_cache, want)
    src, dst = torch.tensor([5, 1, 9, 2]), torch.tensor([1, 2, 3, 4])  # overlapping: in-place compaction
    flat = want.view(-1, 2, 8)
    rows = [flat[s].clone() for s in src.tolist()]
    for s, row in zip(dst.tolist(), rows):
        flat[s] = row
    compact_slots_ref(k_cache, v_cache, src, dst)
    assert torch.equal(k_cache, want)


@pytest.mark.parametrize("window, softcap, starts", [(None, 5.0, True), (6, 5.0, False), (5, None, False),
                                                     (None, None, True)])
def test_rows_alone_match_the_reference_under_trees_windows_and_softcap(window, softcap, starts):
    """The batch-invariant oracle (one query row at a time, kernels/reference/row_attention.py) reads what the
    padded reference reads: tree masks (at the new tokens, or from a sparse read's tree_starts), sliding
    windows and Gemma-2's logit soft-capping."""
    from kvlab.kernels.reference.paged_attention import run_paged_attention
    from kvlab.kernels.reference.row_attention import row_attention

    batch = make_paged_batch([1, 4, 1, 3], [13, 11, 21, 9], 2, 2, 16, 4, sliding_window=window, tree=True,
                             tree_starts=starts, seed=3)
    plan = plan_paged_attention(batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist(), batch.block_tables.tolist(),
                                4, window, "cpu", tree_mask=batch.tree_mask, tree_starts=batch.tree_starts)
    got = row_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale, softcap)
    want = run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale, softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    want_naive, _ = naive_attention(batch, window, softcap)
    torch.testing.assert_close(got, want_naive, atol=1e-5, rtol=1e-4)
