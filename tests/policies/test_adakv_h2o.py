"""AdaKV over H2O: per-head budgets (Feng et al. 2024, arXiv:2407.11550) over accumulated attention (Zhang et
al. 2023, arXiv:2306.14048), once refused because the statistics were gathered per layer.

Every (layer, KV head) table keeps its own running totals (kvlab.policies.compressor), so each head keeps what
its own accumulated mass ranks first: here against a torch reference that sums eager attention weights over
every prompt query and each KV head's query heads, and writes AdaKV's selection out (each head's safeguard,
then the best (head, token) pairs of the layer). Each head's totals follow its kept tokens. The combination
keeps the contract with batching, chunking, preemption, samples, drafts and prefix caching
(kvlab.testing.check_combination, heavy: ~10-30 s each on two shared cores once warm).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.models import LoadedModel
from kvlab.testing import check_combination, check_policy
from head_models import sharp_and_flat

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BUDGET, RECENT, ALPHA = 20, 2, 0.2  # safeguard max(1, int(20 * 0.2)) = 4 > the recent window: both matter
ARGS = {"budget": BUDGET, "alpha_safeguard": ALPHA, "scorer": "h2o", "scorer_args": {"recent": RECENT}}
COMBO = {"budget": 32, "scorer": "h2o", "scorer_args": {"recent": 8}}  # what the combination suite runs


def prompt(n: int, seed: int = 5) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_mass(loaded: LoadedModel, ids: list[int]) -> dict[int, torch.Tensor]:
    """layer -> [Hkv, L]: the attention every prompt query paid each key (the model's eager attention weights,
    the query heads of each KV head summed)."""
    model = copy.deepcopy(loaded.model)
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        attentions = model(torch.tensor([ids]), output_attentions=True).attentions  # per layer [1, Hq, L, L]
    heads = model.config.num_key_value_heads
    return {layer: a[0].sum(dim=1).unflatten(0, (heads, -1)).sum(dim=1) for layer, a in enumerate(attentions)}


def reference_keep(mass: torch.Tensor) -> tuple[list[list[int]], float]:
    """AdaKV over H2O written out, from mass [Hkv, L]: H2O's score per head (its mass, the last RECENT tokens
    first), each head's best max(1, int(BUDGET * ALPHA)), then the best remaining (head, token) pairs of the
    layer up to BUDGET x Hkv -> (kept cache indices per head, the smallest score gap at a cut: how far the
    choice is from a tie)."""
    heads, n = mass.shape
    score = [[math.inf if j >= n - RECENT else float(mass[h, j]) for j in range(n)] for h in range(heads)]
    safe = max(1, int(BUDGET * ALPHA))
    kept, gaps = set(), []
    for h in range(heads):
        ranked = sorted(range(n), key=lambda j: -score[h][j])
        kept |= {(h, j) for j in ranked[:safe]}
        gaps.append(score[h][ranked[safe - 1]] - score[h][ranked[safe]])
    rest = sorted(((score[h][j], h, j) for h in range(heads) for j in range(n) if (h, j) not in kept), reverse=True)
    free = BUDGET * heads - len(kept)
    kept |= {(h, j) for _, h, j in rest[:free]}
    gaps.append(rest[free - 1][0] - rest[free][0])
    return [sorted(j for g, j in kept if g == h) for h in range(heads)], min(gaps)


def run_kvlab(loaded: LoadedModel, ids: list[int]):
    """Prefill `ids` in 16-token chunks (the totals summed over four steps) -> (engine, seq, per layer what
    select saw and kept, the compressor's running totals before and after the compression)."""
    llm = LLM("random:llama-tiny", loaded=copy.deepcopy(loaded), policy="adakv", policy_args=ARGS, block_size=4,
              max_num_batched_tokens=16)
    engine = llm.engine
    comp = engine.compressor
    seen, totals = {}, {}
    select, compress = comp.policy.select, comp.compress

    def recording_select(layer, num_layers, keys, values, queries, stats, *rest, **kw):
        kept = select(layer, num_layers, keys, values, queries, stats, *rest, **kw)
        seen[layer] = (keys.clone(), None if stats is None else stats.clone(), kept)
        return kept

    def recording_compress(seq, queries, mass=None):
        totals["before"] = {g: m.clone() for g, m in (mass or {}).items()}
        freed = compress(seq, queries, mass)
        totals["after"] = {g: m.clone() for g, m in (mass or {}).items()}
        return freed

    comp.policy.select, comp.compress = recording_select, recording_compress
    engine.add_request(ids, SamplingParams(max_tokens=2, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    while seq.num_computed_tokens < len(ids):
        engine.step()
    return engine, seq, seen, totals


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return sharp_and_flat()


def test_each_head_keeps_what_its_own_accumulated_attention_ranks_first(model):
    ids = prompt(60)
    engine, seq, seen, _ = run_kvlab(model, ids)
    bm, comp = engine.block_manager, engine.compressor
    assert sorted(seen) == [0, 1]
    adaptive, reference = False, reference_mass(model, ids)
    for layer, (keys, stats, kept) in seen.items():
        want_mass = reference[layer]  # [Hkv, L]
        assert stats is not None, f"layer {layer}: no accumulated attention reached the policy"
        torch.testing.assert_close(stats.T, want_mass, rtol=1e-4, atol=1e-5)
        want, gap = reference_keep(want_mass)
        assert gap > 1e-3, f"layer {layer}: the reference's choice is within {gap} of a tie (pick another prompt)"
        assert kept == want, f"layer {layer}: kept {kept}, the reference keeps {want}"
        adaptive |= len({len(k) for k in kept}) > 1
        for h, g in enumerate(comp.layers[layer]):  # head h's own table holds its kept keys, in order
            assert bm.groups[g].head == h and bm.cached_lens([seq], g)[0] == len(kept[h])
            k_after, _ = comp.gather(seq, g, layer)  # [kept_h, 1, D]
            torch.testing.assert_close(k_after[:, 0], keys[kept[h], h], rtol=0, atol=0)
    assert adaptive, "every head kept as many tokens: the test would not see per-head budgets"
    while engine.has_unfinished():
        engine.step()
    assert bm.allocator.num_free_blocks == bm.num_blocks and comp.num_tracked() == 0


def test_each_heads_running_totals_follow_its_kept_tokens(model):
    """Per-head tables keep a total each ([L_h, 1]); compaction carries head h's at its kept indices."""
    engine, seq, seen, totals = run_kvlab(model, prompt(60))
    comp = engine.compressor
    for layer, (_, stats, kept) in seen.items():
        for h, g in enumerate(comp.layers[layer]):
            before, after = totals["before"][g], totals["after"][g]
            assert before.shape == (60, 1) and torch.equal(before[:, 0], stats[:, h])
            assert torch.equal(after, before[kept[h]]), f"layer {layer} head {h}: totals not carried with its tokens"


def test_adakv_over_h2o_conforms():
    """Every check of the policy conformance suite (~4 s once the engine's code is warm)."""
    check_policy("adakv", COMBO, "random:llama-tiny")


@pytest.mark.heavy
@pytest.mark.parametrize("extra", [
    {},
    {"n": 2},
    {"draft": "ngram", "draft_args": {"num_tokens": 3}},
    {"draft": "tree", "draft_args": {"layers": 1, "width": 2, "depth": 2}},
    {"enable_prefix_caching": True, "prefix_cache": "hash", "prefix_keep_shared": False},
    {"enable_prefix_caching": True, "prefix_cache": "radix", "prefix_keep_shared": False, "n": 2},
], ids=["plain", "n2", "ngram", "tree", "prefix-hash", "prefix-radix-n2"])
def test_adakv_over_h2o_keeps_the_contract(extra):
    assert check_combination(policy="adakv", policy_args=COMBO, **extra) == "exact"


@pytest.mark.heavy
def test_adakv_over_h2o_keeping_shared_pages_whole_runs_under_its_deviation():
    got = check_combination(policy="adakv", policy_args=COMBO, enable_prefix_caching=True)
    assert got.startswith("runs outside the contract: prefix caching with a compressing policy keeping shared "
                          "pages whole; "), got
