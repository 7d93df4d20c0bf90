"""Prefix caching with a compressing policy (tiny random Llama and Gemma 3).

The rules (docs/design.md, "Prefix caching with a compressing policy"): the leading pages a request
shares (taken from the prefix cache, or held by another table) are protected -- the policy keeps them
and its budget applies to the rest; no compaction ever writes a shared or cached page (survivors of a
request's own cached pages are copied out, the originals stay findable); a compacted request registers
nothing more; a hit stops before the policy's observation window so its queries are computed.

What equals what:
- a request that hits nothing is compressed exactly as with prefix caching off (token-identical);
- a request that hits `h` tokens gives the output of the same request with prefix caching off whose
  first `h` tokens are pinned the same way (`BlockManager.protected_slots` returning `h`).
"""

from __future__ import annotations

import pytest
import torch

import kvlab.engine.build
from kvlab import LLM, SamplingParams
from kvlab.cache.allocators import NULL_BLOCK

POLICIES = {  # policy -> arguments that compress ~60-token prompts
    "snapkv": {"budget": 12, "window_size": 6},
    "snapkv-decode": {"budget": 12, "window_size": 6, "when": "decode", "every": 3},
    "streaming_llm": {"budget": 12},
    "adakv": {"budget": 12, "scorer_args": {"window_size": 6}},
    "chunkkv": {"budget": 12, "window_size": 6, "chunk_size": 5},
    "pyramidkv": {"budget": 12, "window_size": 6},
    "rocketkv": {"budget": 16, "window_size": 6, "kernel_size": 5},  # and sparse reading at decode
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def prompts(system_len: int, tails: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 256, (system_len,), generator=g).tolist()
    return [system + torch.randint(3, 256, (n,), generator=g).tolist() for n in tails]


def engine(policy: str, on: bool, model: str = "random:llama-tiny", memory: int = 64 * 1024, **kwargs) -> LLM:
    name = policy.split("-")[0]
    return LLM(model, block_size=4, max_model_len=128, kv_cache_memory=memory, max_num_batched_tokens=32,
               enable_prefix_caching=on, policy=name, policy_args=POLICIES[policy], **kwargs)


PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
HEAVY = pytest.mark.heavy  # the same checks on more policies / models (the fast cases cover every code path)


def record_hits(llm: LLM) -> dict[tuple, int]:
    """Tokens each prompt took from the prefix cache at its (last) admission."""
    bm, hits = llm.engine.block_manager, {}
    allocate = bm.allocate

    def allocate_and_record(seq, n, hit=None):
        hits[tuple(seq.token_ids[: seq.num_prompt_tokens])] = seq.num_computed_tokens
        allocate(seq, n, hit)
    bm.allocate = allocate_and_record
    return hits


def pin(llm: LLM, hits: dict[tuple, int]) -> None:
    """With prefix caching off: protect each prompt's first `hits[prompt]` tokens as a hit would."""
    bm = llm.engine.block_manager
    bm.protected_slots = lambda seq, g: min(hits.get(tuple(seq.token_ids[: seq.num_prompt_tokens]), 0),
                                            bm.cached_lens([seq], g)[0])


def page_contents(llm: LLM, page: int) -> list[torch.Tensor]:
    # element-wise formats: one tensor per side; packed ones: their parts
    return [pool[page].clone() for pool in llm.engine.cache.page_tensors()]


def watch_pages(llm: LLM) -> dict:
    """Check, around every compression and after every step, that (1) a cached page keeps the contents it
    had when it was registered and (2) a compression leaves every page another owner holds as it was,
    and that no compaction move writes into a page that is shared or cached."""
    eng, seen = llm.engine, {"compressions": 0, "protected": 0, "moves": 0}
    bm, a, pc = eng.block_manager, eng.block_manager.allocator, eng.block_manager.prefix_cache
    registered: dict[int, tuple[object, list[torch.Tensor]]] = {}  # page -> (node, contents when registered)

    def check_cached():
        for page, (node, _) in pc.page_node.items():
            if page in registered and registered[page][0] is node:
                assert all(torch.equal(x, y) for x, y in zip(page_contents(llm, page), registered[page][1])), page
            else:
                registered[page] = (node, page_contents(llm, page))

    compress, move_slots, move_head_slots = eng.compressor.compress, eng.cache.move_slots, eng.cache.move_head_slots

    def watched_compress(seq, *args, **kwargs):
        check_cached()
        own = {p for g in range(len(bm.groups)) for p in a.block_table(bm.key(seq, g)) if p != NULL_BLOCK}
        held = {p for p in range(bm.num_blocks) if a.num_owners(p) > (1 if p in own else 0) or pc.is_registered(p)}
        before = {p: page_contents(llm, p) for p in held}
        tables = {g: list(a.block_table(bm.key(seq, g))) for g in eng.compressor.groups}
        protected = {g: bm.protected_slots(seq, g) for g in eng.compressor.groups}
        freed = compress(seq, *args, **kwargs)
        own = {p for g in range(len(bm.groups)) for p in a.block_table(bm.key(seq, g)) if p != NULL_BLOCK}
        for p, contents in before.items():  # whoever else still holds it (a table, the cache) sees it unchanged
            if a.num_owners(p) > (1 if p in own else 0) or pc.is_registered(p):
                assert all(torch.equal(x, y) for x, y in zip(page_contents(llm, p), contents)), p
        for g, old in tables.items():  # the protected pages are still this request's, in place
            k = protected[g] // bm.block_size
            assert a.block_table(bm.key(seq, g))[:k] == old[:k]
            seen["protected"] += k
        seen["compressions"] += 1
        check_cached()
        return freed

    def check_destinations(dst_slots):
        for page in {int(s) // bm.block_size for s in dst_slots}:
            assert a.num_owners(page) == 1 and not pc.is_registered(page), page
        seen["moves"] += len(dst_slots)

    def watched_move_slots(moves):
        check_destinations([d for _, d in moves])
        move_slots(moves)

    def watched_move_head_slots(src, dst):
        check_destinations(dst.tolist())
        move_head_slots(src, dst)

    eng.compressor.compress = watched_compress
    eng.cache.move_slots = watched_move_slots
    eng.cache.move_head_slots = watched_move_head_slots
    step = eng.step

    def watched_step():
        out = step()
        check_cached()
        return out
    eng.step = watched_step
    return seen


def run(llm: LLM, batches: list[list[list[int]]]) -> list[list[int]]:
    return [o.token_ids for batch in batches for o in llm.generate(batch, PARAMS)]


@pytest.mark.parametrize("policy", ["snapkv", "adakv", pytest.param("streaming_llm", marks=HEAVY)])
def test_a_request_that_hits_nothing_is_compressed_as_with_prefix_caching_off(policy):
    batch = prompts(0, [45, 52, 38], seed=1)
    on = engine(policy, True)
    seen = watch_pages(on)
    assert run(on, [batch]) == run(engine(policy, False), [batch])
    stats = on.stats()
    assert stats["prefix_hit_tokens"] == 0 and stats["policy_compressions"] == 3 and seen["moves"] > 0
    assert stats["prefix_cached_free_pages"] > 0  # the originals of the compacted pages stay findable


@pytest.mark.parametrize("policy", ["snapkv", "snapkv-decode", "adakv", pytest.param("streaming_llm", marks=HEAVY),
                                    pytest.param("chunkkv", marks=HEAVY), pytest.param("pyramidkv", marks=HEAVY),
                                    pytest.param("rocketkv", marks=HEAVY)])
def test_a_hit_keeps_its_shared_pages_and_equals_the_run_without_caching_that_pins_them(policy):
    first, *later = prompts(40, [13, 9, 17, 11])
    on = engine(policy, True)
    hits, seen = record_hits(on), watch_pages(on)
    outputs = run(on, [[first], later])
    window = POLICIES[policy].get("window_size") or POLICIES[policy].get("scorer_args", {}).get("window_size", 0)
    for prompt in later:  # the system prompt's 10 pages, but never into the observation window
        assert hits[tuple(prompt)] == min(40, (len(prompt) - window) // 4 * 4) > 0
    assert seen["protected"] > 0 and on.stats()["prefix_hit_tokens"] == sum(hits.values())
    off = engine(policy, False)
    pin(off, hits)
    assert run(off, [[first], later]) == outputs
    plain = run(engine(policy, False), [[first], later])
    assert plain[0] == outputs[0]  # the first request hit nothing
    if policy == "snapkv":
        assert plain[1:] != outputs[1:]  # pinning matters here (so the comparison above can fail)


@pytest.mark.parametrize("options", [{"prefix_cache": "radix"}, pytest.param({"prefix_match": "token"}, marks=HEAVY),
                                     pytest.param({"quant": "int8"}, marks=HEAVY)])
def test_a_hit_equals_the_pinned_run_with_the_radix_tree_token_matches_and_packed_pages(options):
    first, *later = prompts(40, [13, 9, 17])
    on = engine("snapkv", True, **options)
    hits, seen = record_hits(on), watch_pages(on)
    outputs = run(on, [[first], later])
    assert seen["protected"] > 0 and seen["moves"] > 0
    off = engine("snapkv", False, **{k: v for k, v in options.items() if not k.startswith("prefix")})
    pin(off, hits)
    assert run(off, [[first], later]) == outputs


@pytest.mark.parametrize("model, memory", [("random:llama-tiny", 64 * 1024),
                                           pytest.param("random:gemma3-tiny", 192 * 1024, marks=HEAVY)])
def test_requests_sharing_a_prefix_in_one_batch_leave_each_others_pages_alone(model, memory):
    """Three requests hit A's cached pages in the same step (each page then has three tables and the
    cache as owners); gemma3's sliding-window groups are left uncompressed and share their window."""
    first, *later = prompts(24, [9, 14, 6, 11], seed=3)
    on = engine("snapkv", True, model=model, memory=memory)
    hits, seen = record_hits(on), watch_pages(on)
    outputs = run(on, [[first], later])
    assert seen["protected"] >= 3 * 6 and seen["compressions"] == 4  # 3 hits of 6 pages (in some layer)
    off = engine("snapkv", False, model=model, memory=memory)
    pin(off, hits)
    assert run(off, [[first], later]) == outputs


def test_a_small_pool_preempts_and_evicts_without_leaking_or_writing_a_cached_page():
    batch = prompts(20, [15, 22, 9, 30, 12, 18], seed=4)
    on = engine("snapkv", True, memory=36 * 1024)
    seen = watch_pages(on)
    run(on, [batch[:3], batch, batch[3:]])
    stats = on.stats()
    assert stats["preemptions"] > 0 and stats["prefix_evictions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert seen["compressions"] > 0 and seen["protected"] > 0
    a = on.engine.block_manager.allocator
    assert not a.tables and a.ref_counts == [0] * a.num_blocks and a.num_free_blocks == a.num_blocks


def test_parallel_samples_share_their_compressed_prompt():
    """n = 2: the prompt is compressed once, then the second sample is forked from the compacted tables, so
    both hold what the policy kept, in the same pages; each sample equals a separate n = 1 request with its
    seed on a fresh engine; a later prompt's hit on the first's cached pages is protected; the pages all
    come back."""
    first, *later = prompts(40, [13, 9])
    on = engine("snapkv", True)
    seen = watch_pages(on)
    eng, bm = on.engine, on.engine.block_manager
    forks = []
    admit = eng._admit_samples

    def watched_admit(spawned):
        admit(spawned)
        for parent, _, children in spawned:
            for child in children:
                groups = eng.compressor.groups
                forks.append((all(bm.block_tables([child], g) == bm.block_tables([parent], g)
                                  and bm.cached_lens([child], g) == bm.cached_lens([parent], g) for g in groups),
                              all(bm.cached_lens([child], g)[0] < parent.num_computed_tokens for g in groups)))
    eng._admit_samples = watched_admit
    params = SamplingParams(max_tokens=8, n=2, seed=3, temperature=1.0, ignore_eos=True)
    got = [[c.token_ids for c in on.generate(batch, params)[0].outputs] for batch in ([first], later)]
    assert seen["compressions"] == 2 and seen["moves"] > 0 and seen["protected"] > 0
    # every sample forked from its first sample's tables after the compression: the first prompt's compacted
    # ones; the later prompt's hit (40 tokens, protected) leaves 9 under the budget of 12: nothing to compact
    assert forks == [(True, True), (True, False)]
    alone = [engine("snapkv", True).generate([first], SamplingParams(max_tokens=8, seed=3 + i, temperature=1.0,
                                                                     ignore_eos=True))[0].token_ids for i in range(2)]
    assert got[0] == alone and alone[0] != alone[1]
    a = bm.allocator
    assert not a.tables and a.num_free_blocks == a.num_blocks


def test_a_compacted_request_registers_nothing_after_its_compaction():
    prompt = prompts(0, [30], seed=5)[0]
    on = engine("snapkv", True)
    pc = on.engine.block_manager.prefix_cache
    run(on, [[prompt]])
    nodes = {id(node) for node, _ in pc.page_node.values()}
    assert len(nodes) == 30 // 4  # the prompt's full pages (registered before the compaction); 38 tokens computed
    follow_up = prompt + [7] * 20
    hits = record_hits(on)
    run(on, [[follow_up]])
    assert hits[tuple(follow_up)] == 28  # the cached originals, uncompressed


# -- bad input ------------------------------------------------------------------------------
def test_prefix_caching_with_a_select_that_cannot_protect_pages_is_refused(monkeypatch):
    from kvlab.policies.chunkkv import ChunkKV
    monkeypatch.setattr(kvlab.engine.build, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(ChunkKV, "select", lambda self, layer_idx, num_layers, keys, values, queries, stats: None)
    with pytest.raises(ValueError, match=r"its select\(\) takes no `protected` argument"):
        LLM("random:llama-tiny", enable_prefix_caching=True, policy="chunkkv", policy_args={"budget": 32})


@pytest.mark.heavy
@pytest.mark.model
def test_on_smollm2_a_hit_equals_the_pinned_run_and_a_miss_the_run_without_caching(fresh_model):
    first, *later = prompts(160, [40, 25, 57], seed=6)
    kwargs = dict(block_size=16, kv_cache_memory="64MiB", max_num_batched_tokens=128, policy="snapkv",
                  policy_args={"budget": 64, "window_size": 16})
    on = LLM("smollm2-135m", loaded=fresh_model("smollm2-135m"), enable_prefix_caching=True, **kwargs)
    hits, seen = record_hits(on), watch_pages(on)
    outputs = run(on, [[first], later])
    assert seen["protected"] > 0 and sorted(hits.values()) == [0, 160, 160]
    off = LLM("smollm2-135m", loaded=fresh_model("smollm2-135m"), **kwargs)
    pin(off, hits)
    assert run(off, [[first], later]) == outputs
    plain = LLM("smollm2-135m", loaded=fresh_model("smollm2-135m"), **kwargs)
    assert run(plain, [[first]])[0] == outputs[0]
