"""Heterogeneous-vocabulary drafts (`slem`, `tli`, `slrs`; Timor et al. 2025) in the engine.

Tiny random Llamas (vocab 256, no tokenizer) given two different toy tokenizers over one alphabet
(kvlab/drafts/vocabulary.py): the target reads its ids as `toy-a`; the draft as `toy-b` (two thirds
of toy-a's strings at the same ids: with the target's own weights it agrees with the target on
runs of shared tokens, so drafts are accepted) or as `toy-p` (a third of toy-a's strings under
other ids, other weights: nearly every draft rejected, so every step rolls back). Greedy output
must be token-identical to plain greedy decoding of the target.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.drafts.vocabulary import Bridge, complete_utf8, from_tokenizer, load_vocabulary, toy

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


def speculative(draft, args, batch, max_tokens, block_size=16, **params):
    llm = LLM(MODEL, block_size=block_size, kv_cache_memory="4MiB", draft=draft, draft_args=args)
    outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens, **params))
    bm = llm.engine.block_manager
    assert bm.allocator.num_free_blocks == bm.num_blocks, "pages leaked"
    if draft != "slrs":  # the draft's own pool too
        dbm = llm.engine.draft._bm
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

    from kvlab.drafts.model import check_same_vocabulary

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
    chi-square at 99.9%). tests/test_cross_vocab_verifier.py checks the arithmetic with 10^5 rows."""
    from test_speculation import two_sample_chi_square
    from test_verifier import chi2_critical

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
