"""Triton paged attention (decode, extend, tree) and attention statistics against the torch reference.

Runs under TRITON_INTERPRET=1 on CPU (compiled on CUDA when present). The grid
is a pairwise selection, not the full product: every head ratio (1, 3, 4),
head_dim (64, 256), block size (1, 16, 32), cache format, sliding window on/off,
soft-capping, forced and heuristic split-K, lengths 1 and block boundary +-1.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is imported

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvlab.kernels import ops  # noqa: E402
from kvlab.kernels.paged_attention import attention_stats, paged_attention  # noqa: E402
from kvlab.kernels.reference.attention_stats import attention_stats_ref  # noqa: E402
from kvlab.kernels.attention_plan import _memos  # noqa: E402
from kvlab.kernels.reference.paged_attention import paged_attention_ref, plan_paged_attention  # noqa: E402
from kvlab.kernels.testing import CACHE_DTYPES, attention_tolerance, make_paged_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def lengths(mode: str, bs: int) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens): ragged, with 1 and block boundary +-1 among the cache lengths."""
    edge = [1, max(bs - 1, 1), bs, bs + 1, 2 * bs + 1]
    if mode == "decode":
        return [1] * len(edge), edge
    if mode == "extend":  # full prefill, chunked prefill against a cache, short verification chunk
        return [bs + 1, 3, 2], [bs + 1, 2 * bs + 1, max(bs - 1, 2)]
    return [1, bs + 1, 1, 4], [1, 2 * bs + 1, bs + 1, bs - 1 + 4]  # mixed decode + extend


CASES = [
    # id, group, head_dim, block_size, mode, cache, window, softcap, num_splits, q dtype
    ("decode-r1-d64-b16-fp32", 1, 64, 16, "decode", "fp32", None, None, 1, torch.float32),
    ("decode-r3-d64-b1-bf16-win-split3", 3, 64, 1, "decode", "bf16", 5, None, 3, torch.float32),
    ("decode-r4-d256-b32-e4m3-cap-split2", 4, 256, 32, "decode", "fp8_e4m3", None, 20.0, 2, torch.float32),
    ("decode-r1-d256-b16-e5m2-win-auto", 1, 256, 16, "decode", "fp8_e5m2", 17, None, None, torch.float32),
    ("extend-r4-d64-b16-e5m2-win", 4, 64, 16, "extend", "fp8_e5m2", 7, None, 1, torch.float32),
    ("extend-r3-d256-b1-fp32-cap", 3, 256, 1, "extend", "fp32", None, 10.0, None, torch.float32),
    ("extend-r1-d64-b32-bf16-win-split3", 1, 64, 32, "extend", "bf16", 33, 5.0, 3, torch.float32),
    ("mixed-r1-d256-b1-bf16-split2", 1, 256, 1, "mixed", "bf16", None, None, 2, torch.float32),
    ("mixed-r4-d64-b32-e4m3-win", 4, 64, 32, "mixed", "fp8_e4m3", 20, None, None, torch.float32),
    ("mixed-r3-d64-b16-fp32-cap", 3, 64, 16, "mixed", "fp32", None, 30.0, 1, torch.float32),
    ("mixed-r4-d64-b16-bf16-bf16q", 4, 64, 16, "mixed", "bf16", 9, None, None, torch.bfloat16),
]


def run_both(batch, window, softcap, num_splits, **kw):
    common = dict(k_scale=batch.k_scale, v_scale=batch.v_scale, tree_mask=batch.tree_mask,
                  tree_starts=batch.tree_starts, **kw)
    poisoned = torch.full_like(batch.q, float("nan"))
    if kw.get("return_stats"):
        B, L = batch.seq_lens.shape[0], int(batch.seq_lens.max())
        common["stats_out"] = torch.full((B, batch.k_cache.shape[2], L), float("nan"), device=batch.q.device)
    got = paged_attention(*batch.args(), window, softcap, out=poisoned, num_splits=num_splits, **common)
    common.pop("stats_out", None)
    want = paged_attention_ref(*batch.args(), window, softcap, **common)
    return got, want


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_attention_matches_reference(case):
    _, g, d, bs, mode, cache, window, softcap, num_splits, q_dtype = case
    q_lens, seq_lens = lengths(mode, bs)
    batch = make_paged_batch(q_lens, seq_lens, 2, g, d, bs, CACHE_DTYPES[cache], q_dtype, DEVICE, sliding_window=window)
    got, want = run_both(batch, window, softcap, num_splits)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **attention_tolerance(q_dtype))


TREE_CASES = [
    # id, group, head_dim, block_size, cache, window
    ("tree-r4-d64-b16-bf16", 4, 64, 16, "bf16", None),
    ("tree-r3-d64-b1-fp32-win", 3, 64, 1, "fp32", 4),
    ("tree-r1-d256-b32-e4m3", 1, 256, 32, "fp8_e4m3", None),
]


@pytest.mark.parametrize("case", TREE_CASES, ids=[c[0] for c in TREE_CASES])
def test_tree_mask_attention(case):
    """Token-tree verification (SpecInfer): each new token sees the cache and its ancestors only."""
    _, g, d, bs, cache, window = case
    batch = make_paged_batch([5, 1, 7], [bs + 5, bs, 2 * bs + 7], 2, g, d, bs, CACHE_DTYPES[cache],
                             device=DEVICE, sliding_window=window, tree=True)
    got, want = run_both(batch, window, None, None)
    torch.testing.assert_close(got, want, **attention_tolerance(torch.float32))
    # a tree that is not a chain changes the answer (the mask is really applied)
    chain = paged_attention_ref(*batch.args(), window, None, batch.k_scale, batch.v_scale)
    assert not torch.allclose(got, chain, atol=1e-3)


TREE_START_CASES = [
    # id, group, head_dim, block_size, cache, softcap, num_splits
    ("starts-r2-d64-b4-fp32-cap", 2, 64, 4, "fp32", 6.0, 1),
    ("starts-r3-d64-b16-bf16-split2", 3, 64, 16, "bf16", None, 2),
]


@pytest.mark.parametrize("case", TREE_START_CASES, ids=[c[0] for c in TREE_START_CASES])
def test_tree_starts_attention(case):
    """A sparse read's token-tree rows (kvlab.policies.sparse_read): a row's mask starts at its plan's
    `tree_starts` (cache indices before it visible), not at its first new token; output and statistics."""
    _, g, d, bs, cache, softcap, num_splits = case
    batch = make_paged_batch([1, 1, 3, 1], [bs + 5, 2, 2 * bs + 3, 3 * bs], 2, g, d, bs, CACHE_DTYPES[cache],
                             device=DEVICE, tree=True, tree_starts=True, seed=4)
    assert any(s < n - 1 for s, n in zip(batch.tree_starts, batch.seq_lens.tolist()))  # masks reach back
    (out, stats), (want_out, want_stats) = run_both(batch, None, softcap, num_splits, return_stats=True)
    tol = attention_tolerance(torch.float32)
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(stats, want_stats, **tol)
    plain = paged_attention_ref(*batch.args(), None, softcap, tree_mask=batch.tree_mask)  # mask at the new tokens
    assert not torch.allclose(out, plain, atol=1e-3)  # the starts really move the mask


STATS_CASES = [
    # id, group, head_dim, block_size, mode, cache, window, stats_window, num_splits, tree
    ("stats-decode-r1-d64-b16", 1, 64, 16, "decode", "fp32", None, None, 1, False),
    ("stats-extend-r3-d64-b1-win-sw2", 3, 64, 1, "extend", "bf16", 5, 2, None, False),
    ("stats-mixed-r4-d256-b32-e4m3-sw1-split2", 4, 256, 32, "mixed", "fp8_e4m3", None, 1, 2, False),
    ("stats-extend-r4-d64-b16-e5m2-tree-cap", 4, 64, 16, "extend", "fp8_e5m2", 9, 3, None, True),
]


@pytest.mark.parametrize("case", STATS_CASES, ids=[c[0] for c in STATS_CASES])
def test_attention_stats_match_reference(case):
    """Per-key summed probabilities per KV head over the last `stats_window` queries (H2O / SnapKV / TOVA)."""
    _, g, d, bs, mode, cache, window, stats_window, num_splits, tree = case
    q_lens, seq_lens = lengths(mode, bs)
    softcap = 8.0 if tree else None
    batch = make_paged_batch(q_lens, seq_lens, 2, g, d, bs, CACHE_DTYPES[cache], device=DEVICE,
                             sliding_window=window, tree=tree)
    (out, stats), (want_out, want_stats) = run_both(batch, window, softcap, num_splits,
                                                    return_stats=True, stats_window=stats_window)
    tol = attention_tolerance(torch.float32)
    torch.testing.assert_close(out, want_out, **tol)
    assert not stats.isnan().any()
    torch.testing.assert_close(stats, want_stats, **tol)
    alone = attention_stats(*batch.args(), window, softcap, batch.k_scale, batch.v_scale, stats_window, batch.tree_mask)
    torch.testing.assert_close(alone, stats)
    ref_alone = attention_stats_ref(*batch.args(), window, softcap, batch.k_scale, batch.v_scale, stats_window,
                                    batch.tree_mask)
    torch.testing.assert_close(ref_alone, want_stats)


def test_ops_plan_is_reused_across_layers():
    """The engine's path: one plan per step, run by every layer through ops with the Triton backend."""
    bs = 16
    batch = make_paged_batch([1, 3], [bs + 1, 2 * bs], 2, 2, 64, bs, device=DEVICE)
    plan = plan_paged_attention(batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist(), batch.block_tables.tolist(),
                                bs, None, DEVICE)
    with ops.backend("triton"):
        first = ops.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale)
        cached = _memos["triton.batch"][plan]
        second, stats = ops.run_paged_attention(batch.q, batch.v_cache, batch.k_cache, plan, batch.scale,
                                                return_stats=True, stats_window=1)
    assert plan not in _memos.get("torch.parts", {})  # the torch-only padded groups were never built
    assert _memos["triton.batch"][plan] is cached  # built once, reused by the second layer
    with ops.backend("torch"):
        torch.testing.assert_close(first, ops.run_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale),
                                   **attention_tolerance(torch.float32))
        want, want_stats = ops.run_paged_attention(batch.q, batch.v_cache, batch.k_cache, plan, batch.scale,
                                                   return_stats=True, stats_window=1)
    torch.testing.assert_close(second, want, **attention_tolerance(torch.float32))
    torch.testing.assert_close(stats, want_stats, **attention_tolerance(torch.float32))


@st.composite
def attention_configs(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    B = draw(st.integers(1, 3))
    q_lens = [draw(st.integers(1, 6)) for _ in range(B)]
    seq_lens = [q + draw(st.integers(0, 3 * bs + 2)) for q in q_lens]
    return dict(
        q_lens=q_lens,
        seq_lens=seq_lens,
        hkv=draw(st.integers(1, 2)),
        g=draw(st.sampled_from([1, 2, 3, 4, 5])),
        d=draw(st.sampled_from([16, 48, 64])),  # 48: head_dim that is not a power of two
        bs=bs,
        cache=draw(st.sampled_from(["fp32", "bf16", "fp8_e4m3", "fp8_e5m2"])),
        window=draw(st.one_of(st.none(), st.integers(1, 20))),
        softcap=draw(st.one_of(st.none(), st.just(5.0))),
        num_splits=draw(st.one_of(st.none(), st.integers(1, 4))),
        tree=draw(st.booleans()),
        stats_window=draw(st.one_of(st.none(), st.integers(1, 4))),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=15, deadline=None, derandomize=True)
@given(cfg=attention_configs())
def test_attention_and_stats_random_batches(cfg):
    batch = make_paged_batch(cfg["q_lens"], cfg["seq_lens"], cfg["hkv"], cfg["g"], cfg["d"], cfg["bs"],
                             CACHE_DTYPES[cfg["cache"]], device=DEVICE, sliding_window=cfg["window"],
                             tree=cfg["tree"], seed=cfg["seed"])
    (out, stats), (want, want_stats) = run_both(batch, cfg["window"], cfg["softcap"], cfg["num_splits"],
                                                return_stats=True, stats_window=cfg["stats_window"])
    tol = attention_tolerance(torch.float32)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(stats, want_stats, **tol)
