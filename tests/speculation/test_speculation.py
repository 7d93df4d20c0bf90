"""Speculative decoding in the engine: greedy output token-identical to plain decoding.

Tiny random Llama (`random:llama-tiny`, vocab 256, no tokenizer). Drafts: `ngram` (prompt lookup on
prompts that repeat themselves, so runs are accepted) and `model` with the target's own weights
(seed 0: every draft accepted, so EOS / stop / max_tokens fall inside accepted runs) or other
weights (seed 1: nearly every draft rejected, so every step rolls back).
"""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams

from helpers import BYTES_PER_TOKEN, MODEL, plain, prompts

NGRAM = ("ngram", {"num_tokens": 4})
SAME = ("model", {"model": MODEL, "num_tokens": 3})  # the target's weights: all accepted
OTHER = ("model", {"model": MODEL, "seed": 1, "num_tokens": 2})  # other weights: nearly all rejected


def speculative(draft, batch, max_tokens, engine=None, model=MODEL, **params):
    llm = LLM(model, draft=draft[0], draft_args=draft[1], **{"block_size": 16, "kv_cache_memory": "4MiB",
                                                              **(engine or {})})
    outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens, **params))
    bm = llm.engine.block_manager
    assert bm.allocator.num_free_blocks == bm.num_blocks, "pages leaked"
    if draft[0] == "model":  # the draft's own pool too
        dbm = llm.engine.draft._pool.block_manager
        assert dbm.allocator.num_free_blocks == dbm.num_blocks
    return [o.token_ids for o in outs], llm.stats(), llm


CASES = [(NGRAM, b, s) for b in (1, 8) for s in (1, 16)] + [(d, b, s) for d in (SAME, OTHER) for b, s in ((1, 1), (8, 16))]


@pytest.mark.parametrize("draft,batch_size,block_size", CASES,
                         ids=[f"{'ngram' if d is NGRAM else 'model-same' if d is SAME else 'model-other'}-batch{b}-block{s}"
                              for d, b, s in CASES])
def test_greedy_matches_plain_decoding(draft, batch_size, block_size):
    batch, n = prompts(batch_size), 20 if draft is NGRAM else 12  # the model draft runs one sequence at a time
    got, stats, _ = speculative(draft, batch, n, {"block_size": block_size}, ignore_eos=True)
    assert got == plain(batch, n, ignore_eos=True)
    assert stats["spec_drafted_tokens"] > 0
    if draft is SAME:
        assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] > 3
    if draft is OTHER:
        assert stats["spec_acceptance_rate"] < 0.2  # rollback on nearly every step
    if draft is NGRAM and batch_size == 8:
        assert stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("draft", [NGRAM, OTHER], ids=["ngram", "model-other"])
def test_sliding_window_model_matches_plain(draft):
    """Gemma 3 tiny (window 8 on 5 of 6 layers): tentative slots and rollback next to released pages."""
    gemma = "random:gemma3-tiny"
    draft = (draft[0], {**draft[1], "model": gemma}) if draft[0] == "model" else draft
    batch = prompts(8)
    got, stats, _ = speculative(draft, batch, 12, {"block_size": 1}, model=gemma, ignore_eos=True)
    assert got == plain(batch, 12, model=gemma, ignore_eos=True) and stats["spec_drafted_tokens"] > 0


def test_stops_inside_an_accepted_run():
    """Every draft is accepted (runs of 4 tokens after the prefill's one), so a stop at output index
    2 or 7 falls inside a run: the tokens after it are dropped, as plain decoding never made them."""
    batch = prompts(4)
    ref = plain(batch, 12, ignore_eos=True)
    for i, at_least in enumerate((2, 7)):
        cut = next(j for j in range(at_least, 12) if ref[i][j] not in ref[i][:j]) + 1  # a token's first time
        stop = ref[i][cut - 1]
        got, stats, _ = speculative(SAME, [batch[i]], 12, stop_token_ids=(stop,), ignore_eos=True)
        assert got[0] == ref[i][:cut] and stats["spec_acceptance_rate"] == 1.0
    # EOS: the model's end token, here a token the request generates for the first time at index >= 3
    llm_tokens = ref[2]
    eos = llm_tokens[next(j for j in range(3, 12) if llm_tokens[j] not in llm_tokens[:j])]
    llm = LLM(MODEL, draft=SAME[0], draft_args=SAME[1], block_size=16, kv_cache_memory="4MiB")
    llm.engine.eos_token_ids = {eos}
    out = llm.generate([batch[2]], SamplingParams(max_tokens=12))[0]
    assert out.token_ids == llm_tokens[:llm_tokens.index(eos) + 1] and out.finish_reason == "stop"
    # max_tokens: drafts never run past it, so the output ends exactly there
    for max_tokens in (1, 2, 5, 7):
        got, _, _ = speculative(SAME, batch, max_tokens, ignore_eos=True)
        assert got == [r[:max_tokens] for r in ref]


def test_greedy_matches_plain_under_preemption_with_drafts_nearly_always_rejected():
    """Rollback on nearly every step next to preemption and recompute (the drafts that are mostly
    accepted run this scenario in kvlab.testing.check_draft: tests/api/test_conformance_plugins.py)."""
    draft = OTHER
    batch = prompts(8)
    # room for 64 tokens: the scheduler preempts and recomputes; drafts never preempt anyone
    engine = {"block_size": 4, "kv_cache_memory": 64 * BYTES_PER_TOKEN, "max_num_batched_tokens": 32}
    got, stats, _ = speculative(draft, batch, 14, engine, ignore_eos=True)
    assert got == plain(batch, 14, ignore_eos=True)
    assert stats["preemptions"] > 0 and stats["spec_drafted_tokens"] > 0


def test_next_to_prefill_chunks_scoring_and_sampled_requests():
    """Speculative decodes share steps with prefill chunks (a small token budget), a scoring request
    and sampled requests; the greedy tokens and the scores are those of the plain engine."""
    batch = prompts(6)
    engine = {"max_num_batched_tokens": 12}
    for draft in (NGRAM, SAME):
        llm = LLM(MODEL, draft=draft[0], draft_args=draft[1], block_size=4, kv_cache_memory="4MiB", **engine)
        base = LLM(MODEL, block_size=4, kv_cache_memory="4MiB", **engine)
        e = llm.engine
        greedy = SamplingParams(max_tokens=14, ignore_eos=True)
        sampled = SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.8, top_k=20, seed=3)
        ids = [e.add_request(p, greedy if i % 3 else sampled) for i, p in enumerate(batch)]
        scoring = e.make_scoring_sequence(batch[1], batch[3][:9])
        e.add_sequence(scoring)
        done = {}
        while e.has_unfinished():
            for out in e.step():
                done[out.request_id] = out
        ref = plain(batch, 14, ignore_eos=True)
        for i, rid in enumerate(ids):
            if i % 3:
                assert done[rid].token_ids == ref[i]
            else:
                assert len(done[rid].token_ids) == 14 and all(0 <= t < 256 for t in done[rid].token_ids)
        want = base.score([batch[1]], [batch[3][:9]])[0].logprobs
        assert done[scoring.seq_id].logprobs == pytest.approx(want, abs=1e-4)
        assert e.stats()["spec_drafted_tokens"] > 0
        assert e.block_manager.allocator.num_free_blocks == e.block_manager.num_blocks


def test_seeded_sampling_is_reproducible_and_batch_independent():
    batch = prompts(4)
    sp = dict(ignore_eos=True, temperature=1.0, top_p=0.9, seed=11)
    a, _, _ = speculative(OTHER, batch, 10, **sp)
    b, _, _ = speculative(OTHER, batch, 10, **sp)
    alone, _, _ = speculative(OTHER, batch[2:3], 10, **sp)
    assert a == b and alone[0] == a[2]


def test_adaptive_length_grows_on_acceptance_and_shrinks_on_rejection():
    batch = prompts(2)
    _, same, llm = speculative(("model", {**SAME[1], "num_tokens": 1, "adaptive": True, "max_num_tokens": 4}),
                               batch, 20, ignore_eos=True)
    assert len(same["spec_per_position_acceptance"]) == 4  # grew from 1 to 4 drafts
    got, other, _ = speculative(("model", {**OTHER[1], "num_tokens": 4, "adaptive": True}), batch, 16,
                                ignore_eos=True)
    assert got == plain(batch, 16, ignore_eos=True)
    assert other["spec_drafted_tokens"] < 50  # about one draft a step (2 x 15 steps), not 4 (120)


def test_metrics():
    _, stats, llm = speculative(NGRAM, prompts(4), 20, ignore_eos=True)
    rate, per_pos = stats["spec_acceptance_rate"], stats["spec_per_position_acceptance"]
    assert 0 < rate < 1 and len(per_pos) == 4 and all(0 <= r <= 1 or r != r for r in per_pos)  # nan: never reached
    assert stats["spec_accepted_tokens"] == round(rate * stats["spec_drafted_tokens"])
    assert 1 <= stats["spec_mean_accepted_length"] <= 5 and 0 <= stats["spec_draft_time_share"] < 1
    llm.reset_stats()
    assert llm.stats()["spec_drafted_tokens"] == 0


def test_ngram_lookup():
    from kvlab.speculation.drafts.ngram import lookup

    assert lookup([1, 2, 3, 9, 1, 2, 3], 3, 1, 3) == [9, 1, 2]  # the longest suffix, [1, 2, 3]
    assert lookup([1, 2, 3, 9, 8, 2, 3, 7, 2, 3], 2, 1, 3) == [7, 2]  # [2, 3], the most recent match
    assert lookup([4, 5, 6], 2, 1, 3) == []
    assert lookup([5, 1, 5], 4, 2, 3) == []  # only a 1-gram matches, and min_ngram is 2
    assert lookup([5, 1, 5], 4, 1, 3) == [1, 5]


def test_model_draft_resyncs_its_pages_after_partial_acceptance():
    """After a rejection at draft position a, the draft's pool rolls back to the committed tokens: its
    next drafts equal those of a draft that computes the whole sequence afresh, and it holds exactly
    the pages of the tokens it computed."""
    from kvlab.sequence import Sequence

    def engine_draft():
        args = {"model": MODEL, "seed": 1, "num_tokens": 4}
        return LLM(MODEL, draft="model", draft_args=args, block_size=4, kv_cache_memory="4MiB").engine.draft

    draft, fresh = engine_draft(), engine_draft()
    seq = Sequence(0, prompts(1)[0], SamplingParams(max_tokens=100), 200, 0.0)
    tokens = draft.propose([seq], [4], [None])[0].tokens
    for accepted in (0, 2, 4, 1):
        seq.token_ids += tokens[:accepted] + ([(tokens[accepted] + 1) % 256] if accepted < 4 else [17])
        tokens = draft.propose([seq], [4], [None])[0].tokens
        fresh.forget(0)
        assert tokens == fresh.propose([seq], [4], [None])[0].tokens
        bm, shadow = draft._pool.block_manager, draft._shadows[0]
        assert shadow.num_computed_tokens == seq.num_tokens + 3  # committed + all drafts but the last
        assert bm.allocator.num_used_blocks == -(-shadow.num_computed_tokens // 4)
    draft.forget(0)
    assert draft._pool.block_manager.allocator.num_free_blocks == draft._pool.block_manager.num_blocks


@pytest.mark.heavy
def test_sampled_outputs_follow_the_plain_distribution():
    """End to end: 2,000 seeded sampled requests (temperature 1, top-k 4) with a draft of other weights
    (nearly every draft rejected: the corrections carry the distribution) give the same distribution
    of the 2nd and 3rd output tokens as plain sampling (two-sample chi-square at 99.9%).

    Limits: the two tiny random models' top-4 sets barely overlap, so nearly every draft is rejected
    and normalize(max(0, p - q)) is almost p itself: this checks the engine path (rows, generators,
    rollback) end to end, not the residual's arithmetic -- sampling from p instead of the residual
    passes here; tests/speculation/test_verifier.py is what catches that."""
    from helpers import chi2_critical, two_sample_chi_square

    n, prompt = 2000, [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    engine = dict(block_size=16, kv_cache_memory="64MiB", max_num_seqs=n, max_num_batched_tokens=n * 16)
    sp = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=i, ignore_eos=True) for i in range(n)]
    plain_out = [o.token_ids for o in LLM(MODEL, **engine).generate([prompt] * n, sp)]
    llm = LLM(MODEL, draft="model", draft_args={"model": MODEL, "seed": 1, "num_tokens": 2}, **engine)
    spec_out = [o.token_ids for o in llm.generate([prompt] * n, sp)]
    assert llm.stats()["spec_drafted_tokens"] >= n
    assert [o[0] for o in spec_out] == [o[0] for o in plain_out]  # the prefill's token: same stream
    for index in (1, 2):
        stat, df = two_sample_chi_square([o[index] for o in plain_out], [o[index] for o in spec_out])
        assert stat < chi2_critical(df), f"output token {index}: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"


@pytest.mark.model
@pytest.mark.heavy  # two SmolLM2 generations at batch 8: ~30 s on quiet cores
def test_smollm2_greedy_with_ngram_matches_plain(fresh_model):
    """SmolLM2-135M, batch 8, on prompts that invite copying: the n-gram draft's tokens are accepted
    in runs and the output is token-identical to plain greedy decoding."""
    import copy

    loaded = fresh_model("smollm2-135m")
    texts = [f"Repeat this sentence three times: the {w} sat on the mat near the door." for w in
             ("cat", "dog", "old man", "child", "bird", "teacher", "farmer", "king")]
    batch = [loaded.tokenizer(t)["input_ids"] for t in texts]
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    ref = [o.token_ids for o in LLM("smollm2-135m", loaded=copy.deepcopy(loaded), block_size=16).generate(batch, sp)]
    llm = LLM("smollm2-135m", loaded=loaded, block_size=16, draft="ngram", draft_args={"num_tokens": 4})
    assert [o.token_ids for o in llm.generate(batch, sp)] == ref
    assert llm.stats()["spec_mean_accepted_length"] > 1.5


def test_speculation_runs_with_decode_time_compression_and_parallel_samples():
    """Both were refused once (tests/speculation/test_decode_compression.py and test_composition.py test them exact)."""
    llm = LLM("random:llama-tiny", draft="ngram", policy="snapkv", policy_args={"budget": 8, "when": "decode"})
    assert len(llm.generate([[5, 6, 7] * 8], SamplingParams(max_tokens=6))[0].token_ids) == 6
    llm = LLM("random:llama-tiny", draft="ngram")  # parallel samples with a draft run (tests/engine/test_composition.py)
    out = llm.generate([[5, 6, 7] * 20], SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=1))[0]
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 3 for c in out.outputs)
