"""Heterogeneous-vocabulary drafts (`slem`, `tli`, `slrs`; Timor et al. 2025) in the engine.

Tiny random Llamas (vocab 256, no tokenizer) given two different toy tokenizers over one alphabet
(kvlab/speculation/drafts/vocabulary.py): the target reads its ids as `toy-a`; the draft as `toy-b` (two thirds
of toy-a's strings at the same ids: with the target's own weights it agrees with the target on
runs of shared tokens, so drafts are accepted) or as `toy-p` (a third of toy-a's strings under
other ids, other weights: nearly every draft rejected, so every step rolls back). Greedy output
must be token-identical to plain greedy decoding of the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.speculation.drafts.base import DraftModel, Proposal
from kvlab.speculation.drafts.vocabulary import Bridge, complete_utf8, from_tokenizer, load_vocabulary, toy

MODEL = "random:llama-tiny"
ALIGNED = {"model": MODEL, "tokenizer": "toy-b", "target_tokenizer": "toy-a"}  # the target's weights
PERMUTED = {"model": MODEL, "seed": 1, "tokenizer": "toy-p", "target_tokenizer": "toy-a"}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of toy-a text: a phrase repeated, or random tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, 256, (3 + i % 4,), generator=g).tolist()
        out.append(phrase * 2 if i % 2 == 0 else torch.randint(3, 256, (6 + 3 * i,), generator=g).tolist())
    return out


_plain: dict = {}


def plain(batch, max_tokens, **params):
    key = (tuple(map(tuple, batch)), max_tokens, tuple(sorted(params.items())))
    if key not in _plain:
        llm = LLM(MODEL, block_size=16, kv_cache_memory="4MiB")
        _plain[key] = [o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=max_tokens, **params))]
    return _plain[key]


def speculative(draft, args, batch, max_tokens, block_size=16, sampling=None, **params):
    llm = LLM(MODEL, block_size=block_size, kv_cache_memory="4MiB", draft=draft, draft_args=args)
    outs = llm.generate(batch, sampling or SamplingParams(max_tokens=max_tokens, **params))
    bm = llm.engine.block_manager
    assert bm.allocator.num_free_blocks == bm.num_blocks, "pages leaked"
    if draft != "slrs":  # the draft's own pool too
        dbm = llm.engine.draft._pool.block_manager
        assert dbm.allocator.num_free_blocks == dbm.num_blocks, "draft pages leaked"
    return [o.token_ids for o in outs], llm.stats()


CASES = [(d, b, s) for d in ("slem", "tli", "slrs") for b in (1, 8) for s in (1, 16)]


@pytest.mark.parametrize("draft,batch_size,block_size", CASES, ids=[f"{d}-batch{b}-block{s}" for d, b, s in CASES])
def test_greedy_matches_plain_decoding(draft, batch_size, block_size):
    batch = prompts(batch_size)
    args = {**ALIGNED, "num_tokens": 2 if draft == "slrs" else 4}
    got, stats = speculative(draft, args, batch, 12, block_size, ignore_eos=True)
    assert got == plain(batch, 12, ignore_eos=True)
    assert stats["spec_drafted_tokens"] > 0
    if batch_size == 8:
        assert stats["spec_accepted_tokens"] > 0  # ragged acceptance: some runs accepted, others rolled back


def recorded(llm) -> tuple[dict, list]:
    """Wrap the engine's speculator: -> ({seq_id: [tokens emitted by each verification]}, [per step:
    {seq_id: (current draft length, length asked, tokens proposed, tokens accepted)}])."""
    spec = llm.engine.speculator
    runs, steps = {}, []
    propose, verify = spec.propose, spec.verify

    def on_propose(running, generators):
        current = {s.seq_id: spec.length(s) for s in running}
        propose(running, generators)
        steps.append({s.seq_id: [current[s.seq_id], min(current[s.seq_id], s.max_len - s.num_tokens - 1),
                                 len(s.draft_token_ids), None] for s in running if s.draft_token_ids})

    def on_verify(out, generators):
        emitted, rejected = verify(out, generators)
        for seq, tokens in emitted:
            runs.setdefault(seq.seq_id, []).append(list(tokens))
            steps[-1][seq.seq_id][3] = len(tokens) - 1
        return emitted, rejected

    spec.propose, spec.verify = on_propose, on_verify
    return runs, steps


def inside_runs(first: int, runs: list[list[int]]) -> list[int]:
    """Output indices of tokens emitted by a verification that emitted more after them (accepted
    drafts, or an accepted draft followed by the corrected / bonus token): a stop there cuts a run."""
    out, start = [], 1  # output index 0 is the prefill's token
    for run in runs:
        out += range(start, start + len(run) - 1)
        start += len(run)
    return out


STOP_CASES = [(d, b, s) for d in ("slem", "tli", "slrs") for b, s in ((1, 1), (8, 16))]


@pytest.mark.parametrize("draft,batch_size,block_size", STOP_CASES,
                         ids=[f"{d}-batch{b}-block{s}" for d, b, s in STOP_CASES])
def test_stops_inside_an_accepted_run(draft, batch_size, block_size):
    """A stop token, EOS and max_tokens that fall where a verification emitted several tokens: the
    output is plain greedy's cut there (the tokens after it dropped), as plain decoding never made them.
    The places are found by a first speculative run that records every verification's run."""
    batch, n = prompts(batch_size, seed=2), 16
    args = {**ALIGNED, "num_tokens": 2 if draft == "slrs" else 4}
    ref = plain(batch, n, ignore_eos=True)
    llm = LLM(MODEL, block_size=block_size, kv_cache_memory="4MiB", draft=draft, draft_args=args)
    runs, _ = recorded(llm)
    outs = llm.generate(batch, SamplingParams(max_tokens=n, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    # a stop token per request: a token emitted inside a run, where the request makes it for the first time
    stops, cut = [], []
    for out, r in zip(outs, ref):
        inside = [j for j in inside_runs(r[0], runs.get(out.request_id, [])) if r[j] not in r[:j]]
        stops.append(r[inside[0]] if inside else None)  # None: no stop token
        cut.append(inside[0] + 1 if inside else n)
    assert sum(c < n for c in cut) >= max(1, batch_size // 2), "too few runs to cut: the test would be vacuous"
    params = [SamplingParams(max_tokens=n, ignore_eos=True, stop_token_ids=() if t is None else (t,)) for t in stops]
    got, _ = speculative(draft, args, batch, n, block_size, sampling=params)
    assert got == [r[:c] for r, c in zip(ref, cut)]
    # EOS: the stop token of the first request that has one, for every request (each cut at its first EOS)
    eos = next(t for t, c in zip(stops, cut) if c < n)  # c < n: t is a token, not None
    llm = LLM(MODEL, block_size=block_size, kv_cache_memory="4MiB", draft=draft, draft_args=args)
    llm.engine.eos_token_ids = {eos}
    outs = llm.generate(batch, SamplingParams(max_tokens=n))
    assert [o.token_ids for o in outs] == [r[:r.index(eos) + 1] if eos in r else r for r in ref]
    assert any(o.finish_reason == "stop" for o in outs)
    # max_tokens: drafts are cut to end at it, so a run accepted up to the end stops exactly there
    ends_in_a_run = 0
    for lengths in ([[2], [5], [9]] if batch_size == 1 else [[3 + i for i in range(batch_size)]]):
        llm = LLM(MODEL, block_size=block_size, kv_cache_memory="4MiB", draft=draft, draft_args=args)
        runs, _ = recorded(llm)
        outs = llm.generate(batch, [SamplingParams(max_tokens=m, ignore_eos=True) for m in lengths])
        assert [o.token_ids for o in outs] == [r[:m] for r, m in zip(ref, lengths)]
        ends_in_a_run += sum(len(runs.get(o.request_id, [[]])[-1]) > 1 for o in outs)
    assert ends_in_a_run > 0, "no request reached max_tokens at the end of an accepted run"


@pytest.mark.parametrize("draft", ["slem", "tli", "slrs"])
def test_greedy_matches_plain_under_preemption(draft):
    """A target pool of 64 tokens for 8 requests: the scheduler preempts and recomputes; the draft's
    shadow of a preempted request is dropped and rebuilt from the committed tokens."""
    from helpers import BYTES_PER_TOKEN

    batch = prompts(8, seed=3)
    engine = {"block_size": 4, "kv_cache_memory": 64 * BYTES_PER_TOKEN, "max_num_batched_tokens": 32}
    llm = LLM(MODEL, draft=draft, draft_args={**ALIGNED, "num_tokens": 2 if draft == "slrs" else 3}, **engine)
    outs = llm.generate(batch, SamplingParams(max_tokens=14, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain(batch, 14, ignore_eos=True)
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["spec_accepted_tokens"] > 0
    bm = llm.engine.block_manager
    assert bm.allocator.num_free_blocks == bm.num_blocks, "pages leaked"
    if draft != "slrs":
        dbm = llm.engine.draft._pool.block_manager
        assert dbm.allocator.num_free_blocks == dbm.num_blocks, "draft pages leaked"


@pytest.mark.parametrize("draft", ["slem", "tli"])
def test_full_draft_pool_drafts_less_and_recovers(draft):
    """The draft's own pool nearly full (a hog holds all but 3 pages of 4 tokens): shadows that do not
    fit draft nothing that step; the output is still plain greedy's and, the hog gone, every page is back."""
    batch = prompts(4, seed=4)
    llm = LLM(MODEL, block_size=4, kv_cache_memory="4MiB", draft=draft, draft_args={**ALIGNED, "num_tokens": 3})
    allocator = llm.engine.draft._pool.block_manager.allocator
    hog = 10**6
    allocator.allocate(hog, (allocator.num_free_blocks - 3) * 4, 10**9)
    outs = llm.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain(batch, 12, ignore_eos=True)
    assert llm.stats()["spec_drafted_tokens"] > 0
    allocator.free(hog)
    assert allocator.num_free_blocks == llm.engine.draft._pool.block_manager.num_blocks


ADAPTIVE = [("slem", 1, 6), ("tli", 1, 6), ("slrs", 1, 2)]  # slrs: 2 tokens is its cap on the toys


@pytest.mark.parametrize("draft,start,longest", ADAPTIVE, ids=[d for d, _, _ in ADAPTIVE])
def test_adaptive_length_grows_on_acceptance_and_shrinks_on_rejection(draft, start, longest):
    """Per sequence: after a verification that accepted every proposed token the next draft is one
    longer (up to max_num_tokens), after a rejection one shorter (down to 1) -- also when slem's
    re-tokenised text gives fewer target tokens than it was asked for. Aligned toys: lengths both
    grow and shrink; a permuted vocabulary (nearly all rejected) keeps drafts at about one a step."""
    batch = prompts(4, seed=5)
    args = {**ALIGNED, "num_tokens": start, "adaptive": True, "max_num_tokens": longest}
    llm = LLM(MODEL, block_size=16, kv_cache_memory="4MiB", draft=draft, draft_args=args)
    _, steps = recorded(llm)
    outs = llm.generate(batch, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain(batch, 24, ignore_eos=True)
    grew = shrank = 0
    for before, after in zip(steps, steps[1:]):
        for seq_id, (current, asked, proposed, accepted) in before.items():
            if seq_id not in after:
                continue
            want = max(1, current - 1) if accepted < proposed else current if asked < current \
                else min(longest, current + 1)
            assert after[seq_id][0] == want, (seq_id, current, asked, proposed, accepted, after[seq_id][0])
            grew += want > current
            shrank += want < current
    assert grew > 0 and shrank > 0
    assert max(c for step in steps for c, *_ in step.values()) >= min(longest, start + 2)  # grew twice in a row
    if draft != "slrs":  # the permuted toy: nearly every draft rejected, lengths stay near 1
        args = {**PERMUTED, "num_tokens": 4, "adaptive": True, "max_num_tokens": 6}
        got, stats = speculative(draft, args, batch, 16, ignore_eos=True)
        assert got == plain(batch, 16, ignore_eos=True)
        assert stats["spec_drafted_tokens"] < 2 * 4 * 15  # about one a step, far from 4 (240)


@dataclass
class ShortOracle(DraftModel):
    """Proposes one token fewer than asked (at least one), each the plain greedy continuation: what
    slem does when its drafted text re-tokenises into fewer, longer target tokens, all accepted."""

    refs: dict = None  # prompt tuple -> plain greedy output
    registry_name = "short-oracle"

    def propose(self, seqs, lengths, generators):
        out = []
        for seq, n in zip(seqs, lengths):
            prompt = next(p for p in self.refs if tuple(seq.token_ids[:len(p)]) == p)
            done = len(seq.token_ids) - len(prompt)
            out.append(Proposal(self.refs[prompt][done:done + max(1, n - 1)]))
        return out


def test_adaptive_length_grows_when_fewer_tokens_than_asked_are_all_accepted():
    batch = prompts(2, seed=6)
    ref = plain(batch, 24, ignore_eos=True)
    llm = LLM(MODEL, draft="ngram", block_size=16, kv_cache_memory="4MiB")
    llm.engine.speculator.draft = ShortOracle(num_tokens=1, adaptive=True, max_num_tokens=6,
                                              refs={tuple(p): r for p, r in zip(batch, ref)})
    _, steps = recorded(llm)
    outs = llm.generate(batch, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref and llm.stats()["spec_acceptance_rate"] == 1.0
    for seq_id in (o.request_id for o in outs):  # grown every step, up to max_num_tokens
        assert [step[seq_id][0] for step in steps if seq_id in step][:6] == [1, 2, 3, 4, 5, 6]


def test_slrs_adaptive_length_stays_within_its_cap():
    with pytest.raises(ValueError, match="draft slrs: at most 4 tokens per step.*max_num_tokens=5"):
        LLM("does-not-exist", draft="slrs", draft_args={"num_tokens": 1, "adaptive": True, "max_num_tokens": 5})
    with pytest.raises(ValueError, match=r"draft slrs: .* may need up to .* 3 drafted tokens"):  # the bound uses the max
        LLM(MODEL, kv_cache_memory="4MiB", draft="slrs",
            draft_args={**ALIGNED, "num_tokens": 1, "adaptive": True, "max_num_tokens": 3})


@pytest.mark.parametrize("draft", ["slem", "tli", "slrs"])
def test_greedy_matches_plain_with_a_permuted_vocabulary(draft):
    batch = prompts(8, seed=1)
    got, stats = speculative(draft, {**PERMUTED, "num_tokens": 2}, batch, 10, 4, ignore_eos=True)
    assert got == plain(batch, 10, ignore_eos=True)
    assert stats["spec_drafted_tokens"] > 0 and stats["spec_acceptance_rate"] < 0.2


@pytest.mark.parametrize("draft", ["tli", "slrs"])
def test_seeded_sampling_is_reproducible_and_batch_independent(draft):
    """Sampled requests draw the draft's tokens and the verifier's uniforms from their own generator."""
    batch = prompts(3)
    sp = dict(ignore_eos=True, temperature=1.0, top_k=3, seed=7)
    args = {**ALIGNED, "num_tokens": 2}
    a, stats = speculative(draft, args, batch, 6, **sp)
    b, _ = speculative(draft, args, batch, 6, **sp)
    alone, _ = speculative(draft, args, batch[1:2], 6, **sp)
    assert a == b and alone[0] == a[1] and stats["spec_drafted_tokens"] > 0
    assert all(len(o) == 6 and all(0 <= t < 256 for t in o) for o in a)


def test_slem_retokenises_draft_text_for_the_target():
    """toy-a cuts the draft's text by longest match: three letters drafted one by one become one
    target token where toy-a has that triple."""
    llm = LLM(MODEL, kv_cache_memory="4MiB", draft="slem", draft_args={**ALIGNED, "num_tokens": 3})
    d = llm.engine.draft
    draft_vocab, target_vocab = d._bridge.draft, d._bridge.target
    word = next(t.decode() for t in target_vocab.ids_of if len(t) == 3 and t not in draft_vocab.ids_of)
    ids = [draft_vocab.ids_of[c.encode()] for c in word]
    assert target_vocab.encode(complete_utf8(draft_vocab.text_bytes(ids))[0]) == [target_vocab.ids_of[word.encode()]]


def test_toy_vocabularies_share_one_alphabet():
    a, b, p = (load_vocabulary(n) for n in ("toy-a", "toy-b", "toy-p"))
    ab, ap = Bridge(b, a), Bridge(p, a)
    assert 150 < len(ab.target_of) < 253 and all(d == t for d, t in ab.target_of.items())  # same ids
    assert 60 < len(ap.target_of) < 120 and sum(d != t for d, t in ap.target_of.items()) > 50  # other ids
    text = "abcdefghhgfedcba"
    for v in (a, b, p):
        assert v.text_bytes(v.encode(text)) == text.encode()
    # a target context translated token by token: the same text in the draft's vocabulary
    target_ids = a.encode(text)
    assert p.text_bytes(ap.to_draft(target_ids)) == text.encode()
    assert ap.to_draft(target_ids[:5], key=0) + ap.to_draft(target_ids, key=0)[len(ap.to_draft(target_ids[:5])):] \
        == ap.to_draft(target_ids, key=0)
    with pytest.raises(ValueError, match="no token for"):
        toy(["a", "b"]).encode("abc")


@pytest.mark.model
def test_real_tokenizers_read_as_bytes(load_reference):
    """SmolLM2 (byte-level BPE) and Gemma 3 (`▁` + byte fallback): every token's bytes decode back to
    the text, and the two share tens of thousands of tokens."""
    smol, gemma = load_reference("smollm2-135m").tokenizer, load_reference("gemma3-270m").tokenizer
    vs, vg = from_tokenizer(smol), from_tokenizer(gemma)
    text = "Hello world, the  cat\n\tcafé 😀 naïve"
    for v, tok in ((vs, smol), (vg, gemma)):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert v.text_bytes(ids) == text.encode()
        assert v.token_bytes[tok.eos_token_id] is None
    bridge = Bridge(vs, vg)
    assert len(bridge.target_of) > 20_000
    assert vs.text_bytes(bridge.to_draft(gemma(text)["input_ids"])) == text.encode()  # BOS has no text


def test_bad_input_fails_before_any_work():
    # a `model` draft with another vocabulary points to slem / tli (the engine runs this check after
    # loading the draft; with the real pair in the heavy test below)
    from types import SimpleNamespace

    from kvlab.speculation.drafts.model import check_same_vocabulary

    other = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=49152)), tokenizer=None)
    with pytest.raises(ValueError, match="draft='slem' or draft='tli'"):
        check_same_vocabulary("smollm2-135m", other, MODEL, SimpleNamespace(vocab_size=256), None)
    with pytest.raises(ValueError, match="draft slrs: at most 4 tokens per step"):
        LLM("does-not-exist", draft="slrs", draft_args={"num_tokens": 5})
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 1"):
        LLM("does-not-exist", draft="tli", draft_args={"num_tokens": 0})
    with pytest.raises(ValueError, match=r"draft slrs: .* may need up to .* use slem or tli"):
        LLM(MODEL, kv_cache_memory="4MiB", draft="slrs", draft_args={**ALIGNED, "num_tokens": 3})
    with pytest.raises(ValueError, match="has no tokenizer.*'tokenizer'"):
        LLM(MODEL, kv_cache_memory="4MiB", draft="tli", draft_args={"model": MODEL, "target_tokenizer": "toy-a"})
    with pytest.raises(ValueError, match="has no tokenizer.*'target_tokenizer'"):
        LLM(MODEL, kv_cache_memory="4MiB", draft="slem", draft_args={"model": MODEL, "tokenizer": "toy-a"})
    with pytest.raises(ValueError, match="unknown toy tokenizer 'toy-z'"):
        LLM(MODEL, kv_cache_memory="4MiB", draft="slem", draft_args={**ALIGNED, "tokenizer": "toy-z"})


@pytest.mark.model
@pytest.mark.heavy  # two real models, two drafts, batch 1 and 8: a minute or more on two cores
@pytest.mark.parametrize("draft", ["slem", "tli"])
def test_smollm2_drafting_for_gemma3_matches_plain(fresh_model, draft):
    """The real pair (different tokenizers): greedy output token-identical to plain Gemma 3 greedy
    decoding at batch 1 and 8, block sizes 1 and 16; slrs refuses the pair (far beyond its cap)."""
    import copy

    loaded = fresh_model("gemma3-270m")
    tok = loaded.tokenizer
    texts = [f"Repeat this sentence twice: the {w} sat on the mat near the door." for w in
             ("cat", "dog", "old man", "child", "bird", "teacher", "farmer", "king")]
    batch = [tok(t)["input_ids"] for t in texts]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM("gemma3-270m", loaded=copy.deepcopy(loaded), block_size=16).generate(batch, sp)]
    for size, block in ((1, 1), (8, 16)):
        llm = LLM("gemma3-270m", loaded=copy.deepcopy(loaded), block_size=block, draft=draft,
                  draft_args={"model": "smollm2-135m", "num_tokens": 4})
        assert [o.token_ids for o in llm.generate(batch[:size], sp)] == ref[:size]
        assert llm.stats()["spec_accepted_tokens"] > 0
    with pytest.raises(ValueError, match="use slem or tli"):
        LLM("gemma3-270m", loaded=copy.deepcopy(loaded), draft="slrs", draft_args={"model": "smollm2-135m"})
    with pytest.raises(ValueError, match="draft='slem' or draft='tli'"):
        LLM("gemma3-270m", loaded=copy.deepcopy(loaded), draft="model", draft_args={"model": "smollm2-135m"})


@pytest.mark.heavy  # 2 x 1,000 sampled requests on the tiny model
def test_tli_sampled_outputs_follow_the_plain_distribution():
    """End to end through the engine: 1,000 seeded sampled requests (temperature 1, top-k 4) with
    the `tli` draft (toy-b over toy-a, the target's own weights: drafts accepted and rejected) give
    the same distribution of the 2nd and 3rd output tokens as plain sampling (two-sample
    chi-square at 99.9%). tests/speculation/test_cross_vocab_verifier.py checks the arithmetic with 10^5 rows."""
    from helpers import chi2_critical, two_sample_chi_square

    n, prompt = 1000, prompts(1)[0]
    engine = dict(block_size=16, kv_cache_memory="64MiB", max_num_seqs=n, max_num_batched_tokens=n * 16)
    sp = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=i, ignore_eos=True) for i in range(n)]
    plain_out = [o.token_ids for o in LLM(MODEL, **engine).generate([prompt] * n, sp)]
    llm = LLM(MODEL, draft="tli", draft_args={**ALIGNED, "num_tokens": 2}, **engine)
    spec_out = [o.token_ids for o in llm.generate([prompt] * n, sp)]
    stats = llm.stats()
    assert stats["spec_drafted_tokens"] >= n and 0 < stats["spec_acceptance_rate"] < 1
    for index in (1, 2):
        stat, df = two_sample_chi_square([o[index] for o in plain_out], [o[index] for o in spec_out])
        assert stat < chi2_critical(df), f"output token {index}: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"


@pytest.mark.model
@pytest.mark.heavy  # two real models, two drafts, batch 1 and 8: a minute or more on two cores
@pytest.mark.parametrize("draft", ["slem", "tli"])
def test_gemma3_drafting_for_smollm2_matches_plain(fresh_model, draft):
    """The reverse real pair: Gemma 3 (262k-token `▁` vocabulary, BOS prefix) drafts for SmolLM2
    (byte-level BPE): greedy output token-identical to plain SmolLM2 greedy decoding at batch 1 and 8,
    block sizes 1 and 16; slrs refuses the pair (its exact sum is far beyond its cap)."""
    import copy

    loaded = fresh_model("smollm2-135m")
    tok = loaded.tokenizer
    texts = [f"Repeat this sentence twice: the {w} sat on the mat near the door." for w in
             ("cat", "dog", "old man", "child", "bird", "teacher", "farmer", "king")]
    batch = [tok(t)["input_ids"] for t in texts]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM("smollm2-135m", loaded=copy.deepcopy(loaded), block_size=16).generate(batch, sp)]
    for size, block in ((1, 1), (8, 16)):
        llm = LLM("smollm2-135m", loaded=copy.deepcopy(loaded), block_size=block, draft=draft,
                  draft_args={"model": "gemma3-270m", "num_tokens": 4})
        assert [o.token_ids for o in llm.generate(batch[:size], sp)] == ref[:size]
        assert llm.stats()["spec_accepted_tokens"] > 0
        bm = llm.engine.block_manager
        assert bm.allocator.num_free_blocks == bm.num_blocks
    with pytest.raises(ValueError, match="use slem or tli"):
        LLM("smollm2-135m", loaded=copy.deepcopy(loaded), draft="slrs", draft_args={"model": "gemma3-270m"})
