"""The draft conformance suite: a draft changes how fast the output comes, never what it is.

    from kvlab.testing import check_draft

    def test_my_draft_conforms():
        check_draft("my_draft", {"num_tokens": 3})

Each check raises AssertionError naming what failed:
- greedy: the same tokens as plain decoding, for a batch of prompts of several lengths (the draft
  proposing tokens: a draft that proposes none fails rather than passing vacuously);
- preemption: the same again in a pool small enough that requests are preempted and recomputed;
- sampled: a seeded sampled request gives the same tokens twice (its stream is its own);
- nothing left: once every request finished or was aborted, the draft, the speculator and the engine
  keep no per-sequence state and both the engine's and the draft's page pools are free.
"""

from __future__ import annotations

import copy

from kvlab.llm import LLM
from kvlab.models import LoadedModel
from kvlab.sampling_params import SamplingParams
from kvlab.testing.policies import prompts


def check_draft(name: str, draft_args: dict | None = None, model: str = "random:llama-tiny",
                loaded: LoadedModel | None = None, max_tokens: int = 16, small_pool: str = "48KiB",
                **engine_args) -> None:
    """Run the draft conformance checks for draft `name` with `draft_args` on `model` (`small_pool`: a KV
    budget in which the prompts are preempted, for the preemption check)."""
    draft_args = draft_args or {}

    def make(**kw) -> LLM:
        return LLM(model, loaded=copy.deepcopy(loaded) if loaded is not None else None, **{**engine_args, **kw})

    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain = make()
    batch = prompts(plain.model_config.vocab_size, lengths=(40, 23, 61, 9))
    want = [o.token_ids for o in plain.generate(batch, greedy)]
    drafted = make(draft=name, draft_args=draft_args)
    got = [o.token_ids for o in drafted.generate(batch, greedy)]
    assert got == want, f"draft {name!r}: greedy output differs from plain decoding"
    assert drafted.stats()["spec_drafted_tokens"] > 0, f"draft {name!r} proposed nothing, so the check did not run"
    check_nothing_left(drafted, f"draft {name!r}")

    small = make(draft=name, draft_args=draft_args, kv_cache_memory=small_pool, max_num_batched_tokens=32)
    got = [o.token_ids for o in small.generate(batch, greedy)]
    assert small.stats()["preemptions"] > 0, f"draft {name!r}: the small pool preempted nothing, so the check " \
                                             f"did not run: pass a smaller small_pool for {model!r}"
    assert got == want, f"draft {name!r}: greedy output differs from plain decoding under preemption"
    assert small.stats()["spec_drafted_tokens"] > 0, f"draft {name!r} proposed nothing under preemption"
    check_nothing_left(small, f"draft {name!r}")

    sampled = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=7)
    first = [o.token_ids for o in drafted.generate(batch[:2], sampled)]
    assert first == [o.token_ids for o in drafted.generate(batch[:2], sampled)], (
        f"draft {name!r}: a seeded sampled request gave different tokens twice")
    assert all(len(t) == max_tokens for t in first)

    engine = drafted.engine
    ids = [engine.add_request(p, greedy) for p in batch]
    engine.step()
    engine.step()
    for i in ids[::2]:
        engine.abort(i)
    while engine.has_unfinished():
        engine.step()
    check_nothing_left(drafted, f"draft {name!r}")


def check_nothing_left(llm: LLM, name: str) -> None:
    """No component keeps per-sequence state and the engine's (and a draft's private) pool is free (pages the
    prefix cache keeps findable count as free: any request may take them)."""
    engine, bm = llm.engine, llm.engine.block_manager
    assert engine.lifecycle.tracked() == {}, f"{name}: per-sequence state left: {engine.lifecycle.tracked()}"
    assert bm.allocator.num_free_blocks == bm.num_blocks, f"{name}: the engine's pool was not freed"
    pool = getattr(engine.draft, "_pool", None)
    if pool is not None:
        dbm = pool.block_manager
        assert dbm.allocator.num_free_blocks == dbm.num_blocks, f"{name}: the draft's pool was not freed"
