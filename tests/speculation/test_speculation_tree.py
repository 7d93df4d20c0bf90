"""Self-speculation (`layerskip`) and token trees (`tree`) in the engine: greedy output token-identical
to plain decoding, pages returned, the accepted path's K/V moved into place.

Tiny random Llama (`random:llama-tiny`, 2 layers, vocab 256). Trees drafted by the target's own
weights (every first child accepted), by other weights (nearly everything rejected), by the
target's first layer (layerskip), and by an oracle that puts the right continuation on a side
branch (so the accepted path must be moved into place, or the next tokens go wrong). Preemption with
`tree` and `layerskip`: kvlab.testing.check_draft (tests/api/test_conformance_plugins.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.speculation.drafts.base import DraftModel, Proposal

from helpers import MODEL, plain, prompts

SAME = ("tree", {"model": MODEL, "width": 2, "depth": 3})  # first children always accepted
OTHER = ("tree", {"model": MODEL, "seed": 1, "width": 3, "depth": 2, "branch_levels": 2})  # nearly all rejected
SELF = ("tree", {"layers": 1, "width": 2, "depth": 3})  # the target's first layer drafts
LAYERSKIP = ("layerskip", {"layers": 1, "num_tokens": 3})


def run(draft, batch, max_tokens, engine=None, model=MODEL, llm=None, **params):
    llm = llm or LLM(model, draft=draft[0], draft_args=draft[1],
                     **{"block_size": 16, "kv_cache_memory": "4MiB", **(engine or {})})
    outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens, **params))
    bm = llm.engine.block_manager
    assert bm.allocator.num_free_blocks == bm.num_blocks, "pages leaked"
    draft_bm = getattr(llm.engine.draft, "_bm", None)
    if draft_bm is not None:  # the draft's own pool, forks included
        assert draft_bm.allocator.num_free_blocks == draft_bm.num_blocks, "draft pages leaked"
    return [o.token_ids for o in outs], llm.stats(), llm


@dataclass
class OracleTree(DraftModel):
    """Knows the plain greedy continuation of each prompt and hides it on a side branch: the tree is
    root -> wrong (-> wrong), right_1 -> right_2 (-> wrong, right_3 -> ...): the path accepted is
    right_1, right_2, ... and needs moving; its second level puts the right token second again."""

    refs: dict = None  # prompt tuple -> plain greedy output
    registry_name = "oracle"

    def propose(self, seqs, lengths, generators):
        out = []
        for seq, n in zip(seqs, lengths):
            prompt = next(p for p in self.refs if tuple(seq.token_ids[:len(p)]) == p)
            done = seq.token_ids[len(prompt):]
            right = self.refs[prompt][len(done):len(done) + 3]
            if len(right) < 3:
                out.append(Proposal([]))
                continue
            wrong = [(t + 1) % 256 for t in right]
            tokens = [wrong[0], wrong[1], right[0], right[1], wrong[2], right[2]]
            parents = [-1, 0, -1, 2, 3, 3]
            out.append(Proposal(tokens[:n], None, parents[:n]))
        return out


CASES = [(d, b, s) for d in (SAME, OTHER, SELF) for b, s in ((1, 1), (8, 16))] + [(SELF, 8, 1), (SAME, 1, 16)]


@pytest.mark.parametrize("draft,batch_size,block_size", CASES,
                         ids=[f"{'same' if d is SAME else 'other' if d is OTHER else 'self'}-batch{b}-block{s}"
                              for d, b, s in CASES])
def test_tree_greedy_matches_plain_decoding(draft, batch_size, block_size):
    batch = prompts(batch_size)
    got, stats, _ = run(draft, batch, 14, {"block_size": block_size}, ignore_eos=True)
    assert got == plain(batch, 14, ignore_eos=True)
    assert stats["spec_tree_nodes"] > 0
    if draft is SAME:
        assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] > 3


@pytest.mark.parametrize("block_size", [1, 16])
def test_side_branch_paths_are_moved_into_place(block_size):
    """The right continuation on a side branch: accepted (3 tokens + bonus a step) and moved to the
    slots after the last committed token -- without the move the next step reads wrong K/V."""
    batch = prompts(8)
    ref = plain(batch, 16, ignore_eos=True)
    llm = LLM(MODEL, draft="ngram", block_size=block_size, kv_cache_memory="4MiB")
    llm.engine.speculator.draft = OracleTree(num_tokens=6, refs={tuple(p): r for p, r in zip(batch, ref)})
    moves = []
    move_tentative = llm.engine.cache.move_tentative
    llm.engine.cache.move_tentative = lambda m: (moves.append(len(m)), move_tentative(m))
    got, stats, _ = run(None, batch, 16, llm=llm, ignore_eos=True)
    assert got == ref
    assert stats["spec_mean_accepted_length"] > 3 and moves  # the side branch won, and was moved


def test_tree_stops_inside_an_accepted_run():
    batch = prompts(4)
    ref = plain(batch, 12, ignore_eos=True)
    cut = next(j for j in range(2, 12) if ref[0][j] not in ref[0][:j]) + 1
    got, stats, _ = run(SAME, [batch[0]], 12, stop_token_ids=(ref[0][cut - 1],), ignore_eos=True)
    assert got[0] == ref[0][:cut] and stats["spec_acceptance_rate"] == 1.0
    llm = LLM(MODEL, draft=SAME[0], draft_args=SAME[1], block_size=16, kv_cache_memory="4MiB")
    eos = ref[2][next(j for j in range(3, 12) if ref[2][j] not in ref[2][:j])]
    llm.engine.eos_token_ids = {eos}
    out = llm.generate([batch[2]], SamplingParams(max_tokens=12))[0]
    assert out.token_ids == ref[2][:ref[2].index(eos) + 1] and out.finish_reason == "stop"
    for max_tokens in (1, 2, 5):
        got, _, _ = run(SAME, batch, max_tokens, ignore_eos=True)
        assert got == [r[:max_tokens] for r in ref]


@pytest.mark.parametrize("batch_size,block_size", [(1, 1), (8, 16), (8, 1)])
def test_layerskip_greedy_matches_plain_decoding(batch_size, block_size):
    batch = prompts(batch_size)
    got, stats, llm = run(LAYERSKIP, batch, 14, {"block_size": block_size}, ignore_eos=True)
    assert got == plain(batch, 14, ignore_eos=True) and stats["spec_drafted_tokens"] > 0
    draft = llm.engine.draft._pool.runner.model
    assert draft.config.num_hidden_layers == 1 and len(draft.model.layers) == 1
    assert draft.model.layers[0] is llm.engine.model.model.layers[0]  # a view: no weights copied
    assert llm.engine.model.config.num_hidden_layers == 2 and len(llm.engine.model.model.layers) == 2


@pytest.mark.parametrize("draft", [SELF, LAYERSKIP], ids=["tree-self", "layerskip"])
def test_sliding_window_model_matches_plain(draft):
    """Gemma 3 tiny (window 8): trees are cut to their first-child chain once they could reach past
    the window; until then they are verified as trees."""
    gemma = "random:gemma3-tiny"
    batch = prompts(3) + [[5, 6], [9]]  # the short prompts' first trees fit inside the window
    got, stats, _ = run(draft, batch, 12, {"block_size": 1}, model=gemma, ignore_eos=True)
    assert got == plain(batch, 12, model=gemma, ignore_eos=True) and stats["spec_drafted_tokens"] > 0
    assert draft is LAYERSKIP or stats["spec_tree_nodes"] > 0


def test_sampled_trees_are_seeded_and_batch_independent():
    batch = prompts(4)
    sp = dict(ignore_eos=True, temperature=1.0, top_k=8, seed=5)
    a, stats, _ = run(SELF, batch, 10, **sp)
    b, _, _ = run(SELF, batch, 10, **sp)
    alone, _, _ = run(SELF, batch[1:2], 10, **sp)
    assert a == b and alone[0] == a[1] and stats["spec_tree_nodes"] > 0
    assert all(len(o) == 10 for o in a)


@pytest.mark.heavy
def test_sampled_tree_outputs_follow_the_plain_distribution():
    """End to end: 2,000 seeded sampled requests (temperature 1, top-k 4), a tree drafted by the
    target's first layer: the 2nd and 3rd output tokens follow plain sampling's distribution
    (two-sample chi-square at 99.9%)."""
    from helpers import chi2_critical, two_sample_chi_square

    n, prompt = 2000, [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    engine = dict(block_size=16, kv_cache_memory="64MiB", max_num_seqs=n, max_num_batched_tokens=n * 16)
    sp = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=i, ignore_eos=True) for i in range(n)]
    plain_out = [o.token_ids for o in LLM(MODEL, **engine).generate([prompt] * n, sp)]
    llm = LLM(MODEL, draft="tree", draft_args={"layers": 1, "width": 3, "depth": 2}, **engine)
    spec_out = [o.token_ids for o in llm.generate([prompt] * n, sp)]
    assert llm.stats()["spec_accepted_tokens"] > 0
    for index in (1, 2):
        stat, df = two_sample_chi_square([o[index] for o in plain_out], [o[index] for o in spec_out])
        assert stat < chi2_critical(df), f"output token {index}: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"


def test_tree_mask_and_positions():
    """The runner lays a tree out at its depths' positions, each node seeing its ancestors only."""
    from kvlab.engine.model_runner import tree_mask
    from kvlab.speculation.tree_verifier import ancestor_mask

    anc = ancestor_mask([-1, 0, 1, 0])  # root -> a -> b, root -> c
    mask = tree_mask([(5, 2, anc)], 6, 11)  # a second sequence of 6 tokens at packed 5, root at its index 2
    assert mask.shape == (11, 6) and mask[:7].all()  # rows before the tree's root see everything
    assert mask[8].tolist() == [True, True, True, True, False, False]  # a sees the root and itself
    assert mask[9].tolist() == [True, True, True, True, True, False]  # b sees the root, a and itself
    assert mask[10].tolist() == [True, True, True, False, False, True]  # c sees the root and itself
    assert tree_mask([], 6, 11) is None


def test_tree_and_layerskip_bad_input_fails_before_any_work():
    for args, match in [({"width": 0}, "width must be an integer >= 1"), ({"depth": 0}, "depth must be"),
                        ({"depth": 2, "branch_levels": 3}, "branch_levels"), ({"adaptive": True}, "adaptive"),
                        ({"layers": 0}, "layers must be")]:
        with pytest.raises(ValueError, match=match):
            LLM(MODEL, draft="tree", draft_args=args)
    with pytest.raises(ValueError, match=r"layers must be in \[1, 1\]"):
        LLM(MODEL, draft="layerskip", draft_args={"layers": 2})
    with pytest.raises(TypeError, match="has no parameter"):
        LLM(MODEL, draft="layerskip", draft_args={"model": MODEL})
    with pytest.raises(ValueError, match="num_tokens must be"):
        LLM(MODEL, draft="layerskip", draft_args={"num_tokens": 0})


def test_tree_shape():
    from kvlab.speculation.drafts.tree import TreeDraft, expansion_sizes, preorder

    assert expansion_sizes(3, 4, 2) == [3, 9, 9, 9]
    assert TreeDraft(width=3, depth=4, branch_levels=2).num_tokens == 30
    # creation order (BFS): 0, 1 under the root; 2, 3 under 0; 4 under 1 -> preorder 0, 2, 3, 1, 4
    assert preorder([(-1, 7), (-1, 8), (0, 9), (0, 10), (1, 11)]) == [0, 2, 3, 1, 4]
    proposal = TreeDraft._proposal([(-1, 7), (-1, 8), (0, 9), (0, 10), (1, 11)], [None] * 5)
    assert proposal.tokens == [7, 9, 10, 8, 11] and proposal.parents == [-1, 0, 0, -1, 3]
    assert proposal.probs is None
    q = [torch.full((4,), float(i)) for i in range(5)]
    assert TreeDraft._proposal([(-1, 7), (0, 9)], q[:2]).probs.shape == (2, 4)


def test_greedy_branches_are_the_drafts_top_k():
    """A greedy tree's root children are the draft's top-`width` tokens by logit (the draft here is the
    target's own weights, so: the target's top 3 after the prompt, best first), and their chains are
    continued greedily."""
    from kvlab.models import load_model
    from kvlab.sequence import Sequence

    prompt = prompts(1)[0]
    llm = LLM(MODEL, draft="tree", draft_args={"model": MODEL, "width": 3, "depth": 2}, block_size=4,
              kv_cache_memory="4MiB")
    seq = Sequence(0, prompt, SamplingParams(max_tokens=50), 100, 0.0)
    proposal = llm.engine.draft.propose([seq], [6], [None])[0]
    with torch.no_grad():
        logits = load_model(MODEL).model(torch.tensor([prompt])).logits[0, -1]  # [V]
    top = logits.topk(3).indices.tolist()
    assert proposal.parents == [-1, 0, -1, 2, -1, 4]
    assert [proposal.tokens[i] for i in (0, 2, 4)] == top
    llm.engine.draft.forget(0)


def test_tree_draft_with_a_full_pool_drafts_less_and_recovers():
    """The draft's pool nearly full (a hog holds all but 6 pages of 4 tokens): shadows and branches
    that do not fit stop growing (a request's shadow is dropped and recomputed later); the output is
    still plain greedy's and, the hog gone, every page is back."""
    batch = prompts(4)
    llm = LLM(MODEL, draft=SELF[0], draft_args=SELF[1], block_size=4, kv_cache_memory="4MiB")
    allocator = llm.engine.draft._pool.block_manager.allocator
    hog = 10**6
    allocator.allocate(hog, (allocator.num_free_blocks - 6) * 4, 10**9)
    outs = llm.generate(batch, SamplingParams(max_tokens=14, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain(batch, 14, ignore_eos=True)
    assert llm.stats()["spec_tree_nodes"] > 0
    allocator.free(hog)
    assert allocator.num_free_blocks == llm.engine.draft._pool.block_manager.num_blocks


@pytest.mark.model
@pytest.mark.heavy  # SmolLM2 and Gemma 3 at batch 8, plain + two drafts each: minutes on busy cores
@pytest.mark.parametrize("name,layers", [("smollm2-135m", 24), ("gemma3-270m", 14)])
def test_real_models_greedy_with_layerskip_and_tree_match_plain(fresh_model, name, layers):
    """Batch 8 and batch 1, block size 16: layerskip and a tree of the early exit's top-2 branches give
    plain greedy's tokens on the real models (Gemma 3: every prompt well inside the 512-token window,
    so its trees stay trees)."""
    import copy

    loaded = fresh_model(name)
    texts = [f"Repeat this sentence three times: the {w} sat on the mat near the door." for w in
             ("cat", "dog", "old man", "child", "bird", "teacher", "farmer", "king")]
    batch = [loaded.tokenizer(t)["input_ids"] for t in texts]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in LLM(name, loaded=copy.deepcopy(loaded), block_size=16).generate(batch, sp)]
    for draft, args in (("layerskip", {"layers": layers, "num_tokens": 3}),
                        ("tree", {"layers": layers, "width": 2, "depth": 3})):
        llm = LLM(name, loaded=copy.deepcopy(loaded), block_size=16, draft=draft, draft_args=args)
        assert [o.token_ids for o in llm.generate(batch, sp)] == ref, draft
        assert [o.token_ids for o in llm.generate(batch[:1], sp)] == ref[:1], draft
        stats = llm.stats()
        assert stats["spec_accepted_tokens"] > 0 and (draft != "tree" or stats["spec_tree_nodes"] > 0)
        bm = llm.engine.block_manager
        assert bm.allocator.num_free_blocks == bm.num_blocks


@pytest.mark.model
@pytest.mark.heavy  # SmolLM2 target + SmolLM2 draft model, batch 8 and 1: minutes on busy cores
def test_tree_drafted_by_a_separate_model_on_smollm2_matches_plain(fresh_model):
    """A token tree drafted by a separate checkpoint (`draft_args` model=smollm2-135m, loaded on its own
    pool; the same weights as the target, so its first children are nearly always accepted and side
    branches must still be rolled back): greedy output token-identical to plain SmolLM2, batch 8 at
    block size 16 and batch 1 at block size 1, every page of both pools returned."""
    import copy

    loaded = fresh_model("smollm2-135m")
    texts = [f"Repeat this sentence three times: the {w} sat on the mat near the door." for w in
             ("cat", "dog", "old man", "child", "bird", "teacher", "farmer", "king")]
    batch = [loaded.tokenizer(t)["input_ids"] for t in texts]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM("smollm2-135m", loaded=copy.deepcopy(loaded), block_size=16).generate(batch, sp)]
    args = {"model": "smollm2-135m", "width": 2, "depth": 3}
    for size, block in ((8, 16), (1, 1)):
        llm = LLM("smollm2-135m", loaded=copy.deepcopy(loaded), block_size=block, draft="tree", draft_args=args)
        got, stats, _ = run(None, batch[:size], 16, llm=llm, ignore_eos=True)
        assert got == ref[:size]
        assert stats["spec_tree_nodes"] > 0 and stats["spec_acceptance_rate"] > 0.5
