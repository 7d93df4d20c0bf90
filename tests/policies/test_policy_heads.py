"""Per-KV-head selection (each head keeps its own tokens, pages really freed), ChunkKV's layer-wise index
reuse, PyramidKV's budget schedule as kvpress computes it, and Expected Attention's RoPE algebra."""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.policies.base import top_k


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def capture_compression(llm: LLM, ids: list[int]):
    """Prefill `ids` and record, per layer, the cached keys/values before compression and the kept indices."""
    comp = llm.engine.compressor
    seen = {}
    select = comp.policy.select

    def recording(layer, num_layers, keys, values, *rest):
        kept = select(layer, num_layers, keys, values, *rest)
        seen[layer] = (keys.clone(), values.clone(), kept)
        return kept

    comp.policy.select = recording
    engine = llm.engine
    engine.add_request(ids, SamplingParams(max_tokens=3, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    while seq.num_computed_tokens < len(ids):
        engine.step()
    return engine, seq, seen


def test_each_kv_head_keeps_its_own_tokens_in_the_layers_first_slots():
    llm = LLM("random:llama-tiny", policy="knorm", policy_args={"budget": 24}, block_size=4,
              max_num_batched_tokens=64)
    engine, seq, seen = capture_compression(llm, prompt(90))
    comp, bm = engine.compressor, engine.block_manager
    for g in comp.groups:
        layer = bm.groups[g].layers[0]
        keys, values, kept = seen[layer]
        assert isinstance(kept[0], list) and len(kept) == keys.shape[1] and kept[0] != kept[1]  # heads differ
        assert bm.cached_lens([seq], g)[0] == 24
        assert len([b for b in bm.block_tables([seq], g)[0] if b >= 0]) == 6  # 24 tokens in 4-token pages
        k_after, v_after = comp.gather(seq, g, layer)  # [24, Hkv, D]
        for h, idx in enumerate(kept):
            assert idx == sorted(idx) and len(idx) == 24
            torch.testing.assert_close(k_after[:, h], keys[idx, h], rtol=0, atol=0)
            torch.testing.assert_close(v_after[:, h], values[idx, h], rtol=0, atol=0)
    while engine.has_unfinished():
        engine.step()
    assert bm.allocator.num_free_blocks == bm.num_blocks


def test_per_head_false_keeps_one_set_per_layer():
    llm = LLM("random:llama-tiny", policy="knorm", policy_args={"budget": 24, "per_head": False},
              max_num_batched_tokens=64)
    _, _, seen = capture_compression(llm, prompt(90))
    for keys, _, kept in seen.values():
        assert isinstance(kept[0], int)
        want = sorted((-keys.float().norm(dim=-1)).sum(dim=-1).topk(24).indices.tolist())
        assert kept == want


def test_top_k_per_head_matches_a_topk_along_each_head():
    scores = torch.randn(50, 3, generator=torch.Generator().manual_seed(1))
    heads = top_k(scores, 10, per_head=True)
    for h in range(3):
        assert heads[h] == sorted(scores[:, h].topk(10).indices.tolist())
    same = scores[:, :1].expand(50, 3)
    assert top_k(same, 10, per_head=True) == sorted(scores[:, 0].topk(10).indices.tolist())  # heads agree: one list


def test_per_head_generation_is_deterministic_and_batch_independent():
    from kvlab.testing import check_policy

    check_policy("snapkv", {"budget": 32, "window_size": 8, "per_head": True}, checks=("determinism", "batch"))


def test_chunkkv_reuses_the_first_layers_chunks_across_a_run_of_layers():
    llm = LLM("random:llama-tiny", policy="chunkkv",
              policy_args={"budget": 30, "window_size": 8, "chunk_size": 5, "reuse_layers": 2},
              max_num_batched_tokens=64)
    _, _, seen = capture_compression(llm, prompt(90, seed=3))
    assert seen[0][2] == seen[1][2] and len(seen[0][2]) == 30
    alone = LLM("random:llama-tiny", policy="chunkkv",
                policy_args={"budget": 30, "window_size": 8, "chunk_size": 5}, max_num_batched_tokens=64)
    _, _, own = capture_compression(alone, prompt(90, seed=3))
    assert own[0][2] == seen[0][2] and own[1][2] != seen[1][2]  # without reuse layer 1 chooses its own


@pytest.mark.parametrize("n, ratio, window, want", [
    (375, 0.75, 64, [94] * 30),  # kvpress falls back to round(c) = 94 (SnapKV's int keeps 93)
    (577, 0.5, 64, None),  # clamped: max = n - w, the last layer keeps exactly the window
])
def test_pyramidkv_budgets_follow_the_reference_formula(n, ratio, window, want):
    from kvlab.policies.pyramidkv import PyramidKV

    p = PyramidKV(compression_ratio=ratio, window_size=window)
    budgets = [p.layer_budget(layer, 30, n) for layer in range(30)]
    if want is not None:
        assert budgets == want
    else:
        assert budgets[0] == n - window and budgets[-1] == window
        assert budgets == sorted(budgets, reverse=True)
        assert abs(sum(budgets) - 30 * n * (1 - ratio)) <= 15  # mean = c, up to each layer's rounding


def test_expected_attention_unrotates_queries_and_averages_the_rotation():
    from kvlab.models import load_model
    from kvlab.policies.expected_attention import mean_rotation, rotary_of, rotate_half, unrotate

    rope = rotary_of(load_model("random:llama-tiny").model)
    pos = torch.arange(5, 12)
    cos, sin = rope(pos)  # [P, D]
    q = torch.randn(7, 4, cos.shape[-1], generator=torch.Generator().manual_seed(2))
    rotated = q * cos[:, None] + rotate_half(q) * sin[:, None]
    torch.testing.assert_close(unrotate(rotated, cos, sin), q, atol=1e-5, rtol=1e-5)
    x = torch.randn(cos.shape[-1])
    explicit = torch.stack([x * c + rotate_half(x) * s for c, s in zip(cos, sin)]).mean(dim=0)
    torch.testing.assert_close(mean_rotation(cos, sin) @ x, explicit, atol=1e-5, rtol=1e-5)


def test_expected_attention_score_is_the_expected_softmax_of_future_queries():
    """The score against an independent computation: pre-RoPE queries rotated to their positions are handed
    in; mu' . k comes from the mean rotation applied to each sample, k^T Sigma' k is the sample variance of
    (R q) . k, and the sinks are forced kept."""
    from kvlab.models import load_model
    from kvlab.policies.expected_attention import ExpectedAttention, rotary_of, rotate_half

    model = load_model("random:llama-tiny").model
    rope = rotary_of(model)
    g = torch.Generator().manual_seed(4)
    n, L, Hq, Hkv, D = 30, 30, 4, 2, model.config.head_dim
    pre = torch.randn(n, Hq, D, generator=g)  # pre-RoPE queries of positions 0..n-1
    cos, sin = rope(torch.arange(n))
    post = pre * cos[:, None] + rotate_half(pre) * sin[:, None]
    keys, values = torch.randn(L, Hkv, D, generator=g), torch.randn(L, Hkv, D, generator=g)
    policy = ExpectedAttention(budget=10, n_future_positions=8, n_sink=2)
    policy.bind(model)
    policy.begin(n)
    got = policy.score(0, keys, values, post, None)  # [L, Hkv]

    fc, fs = rope(torch.arange(n, n + 8))
    q = pre[2:]  # sinks left out of the statistics
    rq = torch.stack([q * c + rotate_half(q) * s for c, s in zip(fc, fs)]).mean(dim=0)  # [N, Hq, D] = R q
    k = keys[2:].repeat_interleave(Hq // Hkv, dim=1)  # [L', Hq, D]
    proj = torch.einsum("nhd,lhd->nlh", rq, k)  # [N, L', Hq]
    logits = proj.mean(0) / D ** 0.5 + proj.var(0, unbiased=False) / (2 * D)
    want = logits.softmax(dim=0).view(-1, Hkv, Hq // Hkv).mean(-1) * values[2:].norm(dim=-1)
    torch.testing.assert_close(got[2:], want, atol=1e-5, rtol=1e-4)
    assert (got[:2] > got[2:].max()).all()


def test_adakv_shares_the_layer_budget_between_heads_and_frees_each_heads_pages():
    from kvlab.policies.adakv import adaptive_top_k

    llm = LLM("random:llama-tiny", policy="adakv", policy_args={"budget": 24, "scorer_args": {"window_size": 8}},
              block_size=4, max_num_batched_tokens=64)
    engine, seq, seen = capture_compression(llm, prompt(90, seed=8))
    bm = engine.block_manager
    assert [(g.layers, g.head) for g in bm.groups] == [((0,), 0), ((0,), 1), ((1,), 0), ((1,), 1)]
    assert engine.cache.k(0).shape[2] == 1  # a page holds one KV head
    for layer in (0, 1):
        kept = seen[layer][2]
        lens = [bm.cached_lens([seq], g)[0] for g in (2 * layer, 2 * layer + 1)]
        assert lens == [len(k) for k in kept] and sum(lens) == 48 and min(lens) >= int(24 * 0.2)
        for g, n in zip((2 * layer, 2 * layer + 1), lens):
            assert len([b for b in bm.block_tables([seq], g)[0] if b >= 0]) == -(-n // 4)
    scores = torch.tensor([[5.0, 0.0], [4.0, 0.1], [3.0, 0.2], [2.0, 0.3], [1.0, 0.4]])  # head 0 dominates
    assert adaptive_top_k(scores, 2, 0.5) == [[0, 1, 2], [4]]  # 4 slots: head 1 keeps only its safeguard


def test_adakv_with_a_covering_budget_is_the_full_cache():
    p = prompt(70, seed=9)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    full = LLM("random:llama-tiny").generate([p], params)[0].token_ids
    ada = LLM("random:llama-tiny", policy="adakv", policy_args={"budget": 500}).generate([p], params)[0].token_ids
    assert ada == full


@pytest.mark.parametrize("args, message", [
    ({"budget": 8, "when": "decode"}, "compresses once, at the end of prefill"),
    ({"budget": 8, "scorer": "adakv"}, "without per-head budgets of its own"),
    ({"budget": 8, "alpha_safeguard": 1.5}, r"alpha_safeguard must be in \[0, 1\]"),
    ({"budget": 8, "scorer": "nope"}, "nope"),
])
def test_adakv_bad_parameters_fail_before_the_model_loads(args, message):
    with pytest.raises(ValueError, match=message):
        LLM("random:llama-tiny", policy="adakv", policy_args=args)


def test_a_compressing_policy_needs_an_allocator_that_can_compact():
    from dataclasses import dataclass

    from kvlab.cache.allocators.paged import PagedAllocator
    from kvlab.cache.allocators.base import Allocator
    from kvlab.registry import ALLOCATORS

    @dataclass
    class NoCompact(PagedAllocator):
        compact = Allocator.compact

    ALLOCATORS.register("test_no_compact")(NoCompact)
    try:
        with pytest.raises(ValueError, match="cannot do"):
            LLM("random:llama-tiny", policy="knorm", policy_args={"budget": 8}, allocator="test_no_compact")
    finally:
        ALLOCATORS._classes.pop("test_no_compact", None)
