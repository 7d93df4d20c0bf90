"""The combination conformance suite: plugins that meet keep the contract, or are refused with a reason.

    from kvlab.testing import check_combination

    def test_my_policy_meets_the_drafts():
        for draft in ("ngram", "model"):
            check_combination(policy="my_policy", policy_args={...}, draft=draft)

A configuration (engine arguments: policy, quant, draft, prefix caching, allocator, ...) either is refused
by the capability table (kvlab.engine.capabilities) before the model loads, and `check_combination` returns
"refused: <the error>", or it runs and holds, each check raising AssertionError naming what failed (a
check a declared deviation excuses is reported instead: "runs outside the contract: ...; held" or
"...; differed: <what>"):
- exact with a draft: greedy output equals the same configuration without the draft, for prompts that
  share a prefix and prompts that do not, with `n` samples each;
- prefix hits change nothing: a second pass over the same prompts (every shared prefix now cached) gives the
  first pass's tokens, and a prompt that hits nothing gives what prefix caching off gives;
- schedule-independent: the same tokens in a pool small enough to preempt (or, for an allocator that
  reserves, to run fewer at once), with a 32-token step budget (prefill chunked, drafts cut); a pool that
  refuses the largest request at add_request (BlockManager.capacity_error) is skipped, and a request it
  admits that then cannot be scheduled alone in the empty pool fails the check (a capacity bug);
- nothing left: once every request finished, no component keeps per-sequence state and the page pools are free.
It returns "exact" when every check ran.
"""

from __future__ import annotations

import copy
import gc
import random

from kvlab.engine.build import resolve
from kvlab.engine.capabilities import Deviation, deviations
from kvlab.engine_config import EngineConfig, parse_bytes
from kvlab.llm import LLM
from kvlab.models import LoadedModel
from kvlab.sampling_params import SamplingParams
from kvlab.testing.drafts import check_nothing_left


def verdict(model: str = "random:llama-tiny", **engine_args) -> tuple[str | None, list[Deviation]]:
    """(the capability table's error for this configuration or None, the declared deviations it runs
    under), without loading a model. Any other error (a bad argument) propagates."""
    try:
        *_, caps = resolve(EngineConfig(model=model, **engine_args))
    except (ValueError, NotImplementedError) as exc:
        if getattr(exc, "refusal", None) is None:
            raise
        return str(exc), []
    return None, deviations(caps)


def shared_prompts(vocab: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """Three prompts sharing a 40-token prefix, then two of their own -> (prompts, how many share)."""
    r = random.Random(seed)
    prefix = [r.randrange(3, vocab) for _ in range(40)]
    shared = [prefix + [r.randrange(3, vocab) for _ in range(k)] for k in (5, 17, 30)]
    return shared + [[r.randrange(3, vocab) for _ in range(k)] for k in (23, 61)], len(shared)


def check_combination(model: str = "random:llama-tiny", loaded: LoadedModel | None = None, n: int = 1,
                      max_tokens: int = 12, pool: str = "4MiB",
                      small_pools: tuple[str, ...] = ("24KiB", "32KiB", "40KiB", "48KiB", "64KiB", "96KiB"),
                      **engine_args) -> str:
    """Run the combination checks for the engine arguments `engine_args` (with `n` samples a prompt) ->
    "exact", "refused: <error>", or for a combination under a declared deviation "runs outside the contract:
    <deviations>; held" (every check held anyway on these prompts) or "...; differed: <what>" (a check the
    deviation excuses failed). `pool`: the ample KV budget of every run but the schedule check's, which runs
    in the first of `small_pools` that holds the largest request and constrains the run (each pool plus the
    bytes of a draft's view copy, which the engine takes from its budget)."""
    why, deviating = verdict(model, **engine_args)
    if why is not None:
        return f"refused: {why}"
    name = ", ".join(f"{k}={v!r}" for k, v in engine_args.items()) or "the defaults"
    excused = {e for d in deviating for e in d.excuses}  # what the table says may change the output
    differed: list[str] = []

    def expect(kind: str, ok: bool, message: str) -> None:
        if not ok and kind in excused:
            differed.append(kind)
        elif not ok:
            raise AssertionError(f"{name}: {message}")

    def make(**kw) -> LLM:
        gc.collect()  # the engines of earlier checks: their pools go before a new one is allocated
        args = {"kv_cache_memory": pool, **engine_args, **kw}
        return LLM(model, loaded=copy.deepcopy(loaded) if loaded is not None else None, **args)

    def tokens(llm: LLM, batch) -> list[list[list[int]]]:
        return [[c.token_ids for c in o.outputs] for o in llm.generate(batch, greedy)]

    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
    llm = make()
    batch, num_shared = shared_prompts(llm.model_config.vocab_size)
    first = tokens(llm, batch)
    second = tokens(llm, batch)  # every shared prefix is cached now (with prefix caching)
    expect("prefix hits", second == first, "a second pass over the same prompts (prefix hits) differs")
    check_nothing_left(llm, name)
    if engine_args.get("draft") is not None:
        plain = make(draft=None, draft_args={})
        expect("draft", tokens(plain, batch) == first, "greedy output differs from the same cache without the draft")
        expect("prefix hits" if "prefix hits" in excused else "draft", tokens(plain, batch) == second,
               "greedy output after prefix hits differs from the same cache without the draft")
    if engine_args.get("enable_prefix_caching"):
        off, on = make(enable_prefix_caching=False), make()
        fresh = batch[num_shared:]  # prompts that share no page with each other: a hit on nothing
        expect("schedule", tokens(on, fresh) == tokens(off, fresh), "a prompt that hits nothing differs from "
                                                                  "prefix caching off")
    view = llm.stats().get("spec_view_bytes", 0)  # a draft's copy of its view comes out of the budget: on top
    pools = tuple(parse_bytes(p) + view for p in small_pools) if view else small_pools
    mismatch = _check_schedule_independence(make, batch, n, pools, name)
    expect("schedule", mismatch is None, mismatch or "")
    if not deviating:
        return "exact"
    found = "held" if not differed else "differed: " + ", ".join(dict.fromkeys(differed))
    return f"runs outside the contract: {'; '.join(d.name for d in deviating)}; {found}"


def _check_schedule_independence(make, batch, n: int, small_pools, name: str) -> str | None:
    """The same tokens in an ample pool and in a pool small enough to preempt with a 32-token step budget
    (prefill chunked, drafts cut): ten requests at once, 40 new tokens each, so decoding outgrows the pool.
    None, or what differed."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, n=n)
    batch = batch * 2

    def tokens(llm: LLM) -> list[list[list[int]]]:
        return [[c.token_ids for c in o.outputs] for o in llm.generate(batch, params)]

    want = tokens(make())
    for pool in small_pools:
        small = make(kv_cache_memory=pool, max_num_batched_tokens=32)
        try:
            got = tokens(small)
        except ValueError as exc:  # refused at add_request (BlockManager.capacity_error): try the next pool
            if "the KV pool has only" in str(exc):
                continue
            raise
        except RuntimeError as exc:  # admitted, then stuck alone in the pool: capacity_error said it would run
            if "cannot be scheduled in an empty pool" in str(exc):
                raise AssertionError(f"{name}: in pool {pool}, {exc} (every request BlockManager.capacity_error "
                                     f"admits must run to completion alone in the pool)") from exc
            raise
        stats = small.stats()  # the pool must have constrained it: preempted, or (a reserving allocator) run fewer
        if stats["preemptions"] == 0 and stats["max_concurrent_seqs"] >= len(batch) * n:
            continue
        check_nothing_left(small, name)
        return None if got == want else f"output differs under preemption and a 32-token step budget (pool {pool})"
    raise AssertionError(f"{name}: no pool of {small_pools} both held the largest request and constrained the run "
                         f"(preempted, or ran fewer at once), so the check did not run: pass small_pools for "
                         f"this model")
