"""The batch-invariant mode (EngineConfig.batch_invariant, kvlab/engine/batch_invariant.py).

Its claim is bitwise: the logits the engine computes after a given context are the same bits whatever the
step's shape (solo or batched, one prefill chunk or many, a draft's verification rows), so a rounding cache
format stores the same codes and every output follows. The tests record every logits row the runner
computes, keyed by the context it follows, and compare runs. Each also shows the default mode differing
on the same runs, so the comparison can fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab.engine.batch_invariant import TILE, BatchInvariantMode, tiled_linear
from kvlab.llm import LLM
from kvlab.sampling_params import SamplingParams
from kvlab.testing.builtin_args import DRAFT_ARGS, POLICY_ARGS, SPARSE_ARGS, TINY
from kvlab.testing.combinations import check_combination, verdict

from logit_records import SCHEDULES, prompts, record_logits, run, same_bits

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the linear layers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_of_a_tiled_linear_does_not_depend_on_the_rows_beside_it(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(192, 64, generator=g).to(dtype)
    x = torch.randn(40, 64, generator=g).to(dtype)
    alone = torch.cat([tiled_linear(x[i:i + 1], w) for i in range(40)])
    for rows in (2, 3, 17, 40):
        assert torch.equal(tiled_linear(x[:rows], w), alone[:rows]), rows
    shifted = tiled_linear(torch.cat([torch.randn(5, 64, generator=g).to(dtype), x]), w)[5:]
    assert torch.equal(shifted, alone)


def test_the_plain_product_does_depend_on_them():
    """Why the mode exists: this machine's BLAS gives a row other bits in a 1-row and a 40-row product."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1536, 576, generator=g), torch.randn(40, 576, generator=g)
    alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(40)])
    assert not torch.equal(F.linear(x, w), alone)


def test_the_mode_routes_linear_and_nothing_else():
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    with BatchInvariantMode():
        y = F.linear(x, w)
        z = torch.matmul(x, w.T)
    assert torch.equal(y, tiled_linear(x, w)) and y.shape == (3, 8) and z.shape == (3, 8)
    assert TILE == 16


# -- the engine ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["int4", "fp8_e4m3"])
def test_every_logit_is_the_same_bits_under_any_schedule(quant):
    tokens, base = run({}, quant=quant, batch_invariant=True)
    for name, schedule in SCHEDULES.items():
        other_tokens, other = run(dict(schedule), quant=quant, batch_invariant=True)
        common, differ = same_bits(base, other)
        assert common >= 30 and differ == 0, (quant, name, common, differ)
        assert other_tokens == tokens, (quant, name)


def test_without_the_mode_the_same_runs_differ():
    _, base = run({}, quant="int4")
    differing = []
    for name, schedule in SCHEDULES.items():
        common, differ = same_bits(base, run(dict(schedule), quant="int4")[1])
        assert common >= 30
        differing += [name] if differ else []
    assert len(differing) >= 2, differing


@pytest.mark.parametrize("policy", ["snapkv", "quest"])
def test_a_compressing_or_sparse_reading_policy_keeps_the_bits(policy):
    policy_args = POLICY_ARGS[policy] if policy in POLICY_ARGS else SPARSE_ARGS[policy]
    args = dict(quant="int4", policy=policy, policy_args=policy_args, batch_invariant=True)
    _, base = run({}, **args)
    for schedule in ({"max_num_batched_tokens": 16}, {"draft": "ngram", "draft_args": DRAFT_ARGS["ngram"]}):
        common, differ = same_bits(base, run(dict(schedule), **args)[1])
        assert common >= 30 and differ == 0, schedule


def test_a_sparse_read_keeps_the_bits_under_a_token_tree():
    """quest over int4 with a token tree: every node row's logits are plain decoding's to the bit, its residual
    window counted at the node's depth (token time), not at its tentative slot."""
    args = dict(quant="int4", policy="quest", policy_args=SPARSE_ARGS["quest"], batch_invariant=True)
    tokens, base = run({}, **args)
    tree_tokens, tree = run({"draft": "tree", "draft_args": DRAFT_ARGS["tree"]}, **args)
    common, differ = same_bits(base, tree)
    assert common >= 30 and differ == 0 and tree_tokens == tokens


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_soft_capped_sliding_layers_keep_the_bits_under_a_sparse_read_and_a_token_tree(quant, monkeypatch):
    """A tiny random Gemma-2-like model (logit soft-capping 2.0 on every layer, 5 sliding layers of window 512
    and a full one: trees are not cut to chains) under quest and a token tree: every logit row equals the
    run without the draft to the bit (the sliding layers read densely, the full one sparsely)."""
    from kvlab import models

    shape = dict(models.RANDOM_SHAPES["gemma3-tiny"], sliding_window=512, attn_logit_softcapping=2.0)
    monkeypatch.setitem(models.RANDOM_SHAPES, "gemma2ish-tiny", shape)

    def go(**extra):
        llm = LLM(model="random:gemma2ish-tiny", kv_cache_memory="4MiB", quant=quant, policy="quest",
                  policy_args=SPARSE_ARGS["quest"], batch_invariant=True, **extra)
        assert llm.engine.runner.model.config.attn_logit_softcapping == 2.0
        seen = record_logits(llm)
        outs = llm.generate(prompts(), SamplingParams(max_tokens=8, temperature=0.0))
        return [o.outputs[0].token_ids for o in outs], seen, llm.stats()

    tokens, base, _ = go()
    tree_tokens, tree, stats = go(draft="tree", draft_args=DRAFT_ARGS["tree"])
    common, differ = same_bits(base, tree)
    assert stats["spec_tree_nodes"] > 0 and stats["sparse_reads"] > 0
    assert common >= 25 and differ == 0 and tree_tokens == tokens


@pytest.mark.parametrize("engine_args", [
    dict(quant="int4", draft="ngram", draft_args=DRAFT_ARGS["ngram"]),
    dict(quant="int2", draft="model", draft_args=DRAFT_ARGS["model"]),
    dict(quant="bf16", draft="tree", draft_args=DRAFT_ARGS["tree"]),
    dict(quant="int2", n=2),  # a fork's copy of an open page whose other holder was preempted keeps its row
    dict(quant="int2", policy="adakv", policy_args=POLICY_ARGS["adakv"]),  # per-head tables: a snapshot per head
], ids=["int4-ngram", "int2-model", "bf16-tree", "int2-n2", "int2-adakv"])
def test_the_combination_suite_finds_rounding_formats_exact(engine_args):
    assert check_combination(batch_invariant=True, **engine_args) == "exact"


def two_passes(quant: str, prefix_cache: str) -> tuple[int, int]:
    """Prompts and prompts sharing 50 tokens with another, twice (the second pass hits the first's pages)
    -> same_bits(first pass, second pass)."""
    llm = LLM(model=TINY, kv_cache_memory="4MiB", quant=quant, batch_invariant=True, enable_prefix_caching=True,
              prefix_cache=prefix_cache)
    seen = record_logits(llm)
    ps = prompts()
    ps += [ps[3][:50] + p for p in ps[:3]]
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    llm.generate(ps, sp)
    first = dict(seen)
    seen.clear()
    llm.generate(ps, sp)
    assert llm.engine.stats()["prefix_hit_tokens"] > 0
    return same_bits(first, seen)


@pytest.mark.parametrize("quant,prefix_cache", [("fp8_e4m3", "hash"), ("bf16", "radix")])
def test_prefix_hits_keep_the_bits_without_a_residual_window(quant, prefix_cache):
    common, differ = two_passes(quant, prefix_cache)
    assert common >= 40 and differ == 0


def test_a_residual_window_under_prefix_hits_is_the_declared_deviation():
    """A hit's pages are sealed where the request's own first rows would read them in full precision: other
    bits, declared in the capability table (and so excused by the combination suite)."""
    common, differ = two_passes("int4", "hash")
    assert common >= 40 and differ > 0
    _, deviating = verdict(quant="int4", batch_invariant=True, enable_prefix_caching=True)
    assert [d.name for d in deviating] == ["prefix caching with a residual window"]
    assert verdict(quant="int4", batch_invariant=True)[1] == []
    assert verdict(quant="int4", quant_args={"residual": 0}, batch_invariant=True, enable_prefix_caching=True)[1] == []


def test_a_sparse_reads_rows_are_placed_at_their_cache_indices_in_the_sequence():
    """A sparse read's reduced plan holds only the selected pages: the token-time window rule must use each key's
    cache index in its sequence, not its place in the reduced table."""
    from kvlab.kernels.attention_plan import plan_paged_attention
    from kvlab.kernels.reference.attention_parts import plan_parts
    from kvlab.kernels.reference.row_attention import in_sequence

    base = plan_paged_attention([0, 2, 3], [60, 20], [[10, 11, 12, 13], [20, 21]], 16, None, torch.device("cpu"))
    reduced = plan_paged_attention([0, 1, 2, 3], [27, 28, 20], [[11, 13], [11, 13], [20, 21]], 16, None,
                                   torch.device("cpu"))  # the first sequence's two verify rows, rows of their own
    part = plan_parts(reduced)[0]
    where = {b: in_sequence(part, reduced, base, r, b) for r, b in enumerate(part.seq_rows)}
    keys, start, first = where[1]
    assert (start, first) == (58, 0)
    assert keys[:16].tolist() == list(range(16, 32)) and keys[16:28].tolist() == list(range(48, 60))
    keys, start, first = where[2]
    assert (start, first) == (19, 2) and keys[:20].tolist() == list(range(20))
    same = in_sequence(plan_parts(base)[0], base, base, 0, plan_parts(base)[0].seq_rows[0])
    assert same[1] in (58, 19)
