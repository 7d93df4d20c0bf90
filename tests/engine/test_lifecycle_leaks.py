"""No per-sequence state outlives its sequence: finished, aborted (running or waiting), preempted, or dropped
by a failed `generate()`, every stateful plugin forgets it, and the pool comes back fully free.

What keeps per-sequence state: the compressor (recorded queries, accumulated attention), the speculator
and its draft, the engine (generators, parallel-sample groups, return_dists), the metrics (waste history),
the block manager (tables, prefix hits, compacted set) and the prefix cache (hash chains). Tiny random
Llama, a small pool (so requests are preempted) and 32-token steps (so prompts take several steps and an
abort can land while a prompt's observation-window queries, 32 of them, are being recorded).
"""

from __future__ import annotations

import pytest
import torch

import kvlab.engine.llm_engine
from kvlab import LLM, SamplingParams

MODEL = "random:llama-tiny"
CONFIGS = {
    "snapkv": dict(policy="snapkv", policy_args={"compression_ratio": 0.5, "window_size": 32}),
    "snapkv-decode": dict(policy="snapkv", policy_args={"compression_ratio": 0.5, "window_size": 16,
                                                        "when": "decode", "every": 4}),
    "h2o-decode": dict(policy="h2o", policy_args={"compression_ratio": 0.5, "recent": 4, "when": "decode",
                                                  "every": 4}),
    "adakv": dict(policy="adakv", policy_args={"compression_ratio": 0.5, "scorer_args": {"window_size": 32}}),
    "rocketkv": dict(policy="rocketkv", policy_args={"budget": 32, "window_size": 32, "kernel_size": 5}),
    "snapkv-prefix-caching": dict(policy="snapkv", policy_args={"compression_ratio": 0.5, "window_size": 32},
                                  enable_prefix_caching=True),
    "quest": dict(policy="quest", policy_args={"budget": 32, "dense_layers": 0}),
    "ngram": dict(draft="ngram", draft_args={"num_tokens": 3}),
    "model-draft": dict(draft="model", draft_args={"model": MODEL, "num_tokens": 3}),
    "tree-draft": dict(draft="tree", draft_args={"layers": 1, "width": 2, "depth": 2}),
}


def leftovers(engine) -> dict[str, int]:
    """Every per-sequence store of the engine and its plugins that is not empty, with its size."""
    bm, sched = engine.block_manager, engine.scheduler
    found = {"running": len(sched.running), "waiting": len(sched.waiting), "generators": len(engine._generators),
             "samples": len(engine._samples), "groups": len(engine._groups),
             "return_dists": len(engine._return_dists), "metrics": len(engine.metrics._live),
             "tables": len(bm.allocator.tables), "hits": len(bm._hits), "compacted": len(bm._compacted),
             "on a kept turn": len(bm._on_turn),
             "pages in use": bm.num_used_blocks()}
    found.update(engine.lifecycle.tracked())  # every subscriber: compressor, speculator and draft, engine
    if engine.speculator and hasattr(engine.draft, "_shadows"):
        found["draft pool pages"] = engine.draft._pool.block_manager.num_used_blocks()
    if bm.prefix_cache is not None:
        found["prefix chains"] = len(bm.prefix_cache.chains)
    return {k: v for k, v in found.items() if v}


def tracked(engine, seq_id: int) -> bool:
    c = engine.compressor
    return c is not None and (seq_id in c._queries or seq_id in c._mass)


def prompts(n: int, seed: int = 0, lo: int = 40, hi: int = 70) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    shared = torch.randint(3, 256, (32,), generator=g).tolist()  # a common prefix: prefix caching hits it
    return [shared + torch.randint(3, 256, (k - 32,), generator=g).tolist() for k in lengths]


def make(config: str) -> LLM:
    return LLM(MODEL, **CONFIGS[config], kv_cache_memory="64KiB", max_num_batched_tokens=32, max_model_len=128)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_aborted_preempted_and_finished_requests_leave_nothing_behind(config):
    llm = make(config)
    engine = llm.engine
    parallel = engine.speculator is None  # n > 1 with a draft is refused
    ps = prompts(12)
    ids = [engine.add_request(p, SamplingParams(max_tokens=32, ignore_eos=True, n=2 if parallel and i == 1 else 1,
                                                temperature=1.0 if i % 3 == 2 else 0.0, seed=i))
           for i, p in enumerate(ps)]
    scored = engine.add_sequence(engine.make_scoring_sequence(ps[0][:40], ps[1][:10]), return_dists=True)
    # abort a request while its prompt is half computed (once a policy reading queries has recorded some)
    for _ in range(8):
        engine.step()
        half = [s for s in engine.scheduler.running if 0 < s.num_computed_tokens < s.num_prompt_tokens]
        mid = next((s for s in half if tracked(engine, s.seq_id)), None)
        if mid is not None or (half and not engine.compressor):
            break
    mid = mid or half[0]
    had_state = tracked(engine, mid.seq_id)
    assert engine.abort(mid.seq_id)
    assert not tracked(engine, mid.seq_id)
    waiting = next(s.seq_id for s in reversed(engine.scheduler.waiting) if not s.is_scoring)  # never admitted
    assert engine.abort(waiting)
    decode_abort, preempted_seen, outs = None, False, {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
        for seq in engine.scheduler.waiting:  # preempted requests are recomputed: nothing kept for them
            preempted_seen |= seq.num_preemptions > 0
            assert not tracked(engine, seq.seq_id), f"preempted request {seq.seq_id} kept compressor state"
        decoding = [s for s in engine.scheduler.running if s.num_output_tokens >= 6 and not s.is_scoring]
        if decode_abort is None and decoding:  # abort one while it decodes (with when="decode": state held)
            decode_abort = tracked(engine, decoding[-1].seq_id)
            assert engine.abort(decoding[-1].seq_id)
            assert not tracked(engine, decoding[-1].seq_id)
    assert preempted_seen and llm.stats()["preemptions"] > 0
    if engine.compressor and (engine.policy.query_window or engine.policy.needs_attention_stats):
        assert had_state  # the first abort had something to forget
    if engine.compressor and engine.policy.when == "decode":
        assert decode_abort  # and so had the second
    assert scored in outs and len(outs) >= len(ids) - 3
    assert leftovers(engine) == {}


@pytest.mark.parametrize("config", ["h2o-decode", "ngram"])
def test_a_failed_generate_leaves_nothing_behind(config, monkeypatch):
    """A step fails (the sampler raises) while requests decode, some with n > 1: generate() aborts them all."""
    llm = make(config)
    real = kvlab.engine.llm_engine.sample
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 12:
            raise RuntimeError("injected sampler failure")
        return real(*args, **kwargs)
    monkeypatch.setattr(kvlab.engine.llm_engine, "sample", failing)
    n = 1 if llm.engine.speculator else 2
    with pytest.raises(RuntimeError, match="injected sampler failure"):
        llm.generate(prompts(6, seed=1), SamplingParams(max_tokens=24, ignore_eos=True, n=n))
    assert leftovers(llm.engine) == {}
    monkeypatch.setattr(kvlab.engine.llm_engine, "sample", real)
    outs = llm.generate(prompts(2, seed=2), SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert leftovers(llm.engine) == {}


def test_a_failed_generate_aborts_the_samples_of_a_finished_first_sample(monkeypatch):
    """n = 3 sampled with stop tokens: once the first sample has stopped while the others still run, a step
    fails; generate() must abort the others too (their first sample, the request's id, already finished)."""
    llm = make("snapkv-decode")
    engine = llm.engine
    real = kvlab.engine.llm_engine.sample
    fired = {"n": 0}

    def failing(*args, **kwargs):
        if any(first not in group for first, group in engine._groups.items()):  # sample 0 done, others not
            fired["n"] += 1
            raise RuntimeError("injected sampler failure")
        return real(*args, **kwargs)
    monkeypatch.setattr(kvlab.engine.llm_engine, "sample", failing)
    for seed in range(20):  # seeded: the first seed whose sample 0 stops first is always the same
        params = SamplingParams(max_tokens=24, n=3, temperature=1.5, seed=seed, stop_token_ids=list(range(3, 60)))
        try:
            llm.generate(prompts(1, seed=4), params)
        except RuntimeError as exc:
            assert str(exc) == "injected sampler failure"
            break
    assert fired["n"] == 1
    assert leftovers(engine) == {}


@pytest.mark.parametrize("quant, memory, prefix", [("int4", "96KiB", None), ("fp8_e4m3", "32KiB", None),
                                                   ("int4", "96KiB", "hash"), ("fp8_e4m3", "32KiB", "radix")])
def test_kept_turns_under_preemption_and_aborts_leave_nothing_behind(quant, memory, prefix):
    """Second turns continue from kept compressed turns (int4: their open pages' leased residual rows) beside
    fresh requests while the pool preempts and a request is aborted; once every kept turn is dropped the pool
    is fully free (with prefix caching: free or cached-free)."""
    index = dict(enable_prefix_caching=True, prefix_cache=prefix) if prefix else {}
    llm = LLM(MODEL, **CONFIGS["snapkv"], reuse_compressed=True, quant=quant, kv_cache_memory=memory,
              max_num_batched_tokens=32, max_model_len=128, **index)
    engine, ps = llm.engine, prompts(3, seed=3, lo=30, hi=50)
    firsts = llm.generate(ps, SamplingParams(max_tokens=8, ignore_eos=True))
    g = torch.Generator().manual_seed(5)
    for p, o in zip(ps, firsts):  # 40 new tokens: more than the policy's observation window, so the turn is hit
        engine.add_request(p + list(o.outputs[0].token_ids) + torch.randint(3, 256, (40,), generator=g).tolist(),
                           SamplingParams(max_tokens=24, ignore_eos=True))
    for p in prompts(3, seed=4, lo=30, hi=50):
        engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True))
    aborted = False
    while engine.has_unfinished():
        engine.step()
        decoding = [s for s in engine.scheduler.running if s.num_output_tokens >= 4]
        if not aborted and decoding:
            aborted = engine.abort(decoding[-1].seq_id)
    st = llm.stats()
    assert aborted and st["preemptions"] > 0 and st["turn_reuse_hits"] > 0
    a = engine.block_manager.allocator
    assert leftovers(engine).keys() <= {"tables"}  # the kept turns' tables
    while engine.block_manager.kept_turns:
        a.drop_kept_turn()
    parked = engine.block_manager.prefix_cache.num_parked if prefix else 0
    assert leftovers(engine) == {} and len(a.free_blocks) + parked == a.num_blocks
