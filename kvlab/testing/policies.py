"""The policy conformance suite: what every eviction policy must do inside the engine.

A third-party policy runs it in its own tests::

    from kvlab.testing import check_policy

    def test_my_policy_conforms():
        check_policy("my_policy", {"budget": 32})

Each check raises AssertionError naming what failed:
- budget: after the prompt is compressed every full-attention layer holds exactly the tokens its budget
  allows, computed here from `policy_args` alone (kvpress's `max(1, int(n * (1 - compression_ratio)))`,
  or `budget`; the built-in schedules of PyramidKV and RocketKV written out from their papers; any other
  schedule passed as `kept=`), never from the policy's own `layer_budget`;
- memory: the pages a sequence holds are exactly those its kept tokens need (the rest went back
  to the pool), and fewer than the full cache holds;
- determinism: the same request twice gives the same tokens;
- batch: a request gives the same tokens alone and in a batch of requests of other lengths;
- block sizes: the same tokens with pages of 1 and 16 tokens;
- no-op: with a budget covering the whole sequence the output equals the full cache's.

Policies that read selected pages at decode (kvlab.policies.sparse_read.SparseReadPolicy: quest, rocketkv)
are checked differently where their nature requires it, and only there:
- budget: also, no decode read covers more slots than the pages the policy reads per step;
- memory: a policy that evicts nothing (quest) holds exactly the full cache's pages: nothing is
  freed, and the check is that nothing is lost either;
- block sizes: the pages *are* the unit of selection, so pages of 1 and 16 tokens select different
  tokens; the check is that both run and read within the budget, not that their tokens agree.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kvlab.llm import LLM
from kvlab.models import LoadedModel
from kvlab.sampling_params import SamplingParams
from kvlab.policies.sparse_read import SparseReadPolicy

CHECKS = ("budget", "memory", "determinism", "batch", "block_sizes", "no_op")


def prompts(vocab: int, lengths=(120, 77, 150), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


Kept = Callable[[int, int, int], int]  # (layer, num_layers, prompt tokens) -> tokens the layer keeps


def kvpress_kept(policy_args: dict, num_tokens: int) -> int:
    """Tokens one layer keeps of `num_tokens` under kvpress's rule, from the arguments alone: `budget`, or
    max(1, int(n * (1 - compression_ratio))) (neither given: every token)."""
    if policy_args.get("budget") is not None:
        return min(num_tokens, policy_args["budget"])
    return min(num_tokens, max(1, int(num_tokens * (1 - (policy_args.get("compression_ratio") or 0.0)))))


def pyramidkv_kept(policy_args: dict, layer: int, num_layers: int, n: int) -> int:
    """PyramidKV's budgets (its reference code, and kvpress): c the uniform budget (unrounded), w the window;
    min = c / beta, max = 2c - min, clamped to max = n - w (min = 2c - max); unless n >= max >= min >= w
    every layer keeps round(c); otherwise layer l keeps round(max - l (max - min) / (L - 1))."""
    w, beta = policy_args.get("window_size", 64), policy_args.get("beta", 20.0)
    budget = policy_args.get("budget")
    c = float(budget) if budget is not None else n * (1 - (policy_args.get("compression_ratio") or 0.0))
    if c >= n:
        return n
    lo, hi = c / beta, 2 * c - c / beta
    if hi >= n - w:
        hi, lo = n - w, 2 * c - (n - w)
    if not n >= hi >= lo >= w:
        return min(n, max(1, round(c)))
    return min(n, max(1, round(hi - layer * (hi - lo) / max(1, num_layers - 1))))


def rocketkv_kept(policy_args: dict, layer: int, num_layers: int, n: int) -> int:
    """RocketKV's stage-1 budget (arXiv:2502.14051): `prompt_budget`, or n / c^r with c = n / budget and
    r = min(0.2 + 0.06 log2 c, 0.8), at least the observation window."""
    if policy_args.get("prompt_budget") is not None:
        return min(n, policy_args["prompt_budget"])
    c = max(1.0, n / policy_args["budget"])
    r = min(0.2 + 0.06 * math.log2(c), 0.8)
    return min(n, max(policy_args.get("window_size", 32), int(n / c ** r)))


SCHEDULES = {"pyramidkv": pyramidkv_kept, "rocketkv": rocketkv_kept}  # built-ins with a budget of their own


def expected_kept(name: str, policy_args: dict, policy, kept: Kept | None = None) -> Kept:
    """The independent budget the "budget" check holds `name` to."""
    if kept is not None:
        return kept
    if name in SCHEDULES:
        return lambda layer, num_layers, n: SCHEDULES[name](policy_args, layer, num_layers, n)
    from kvlab.policies.base import Policy

    if type(policy).layer_budget is not Policy.layer_budget:
        raise AssertionError(f"{name}: the policy has a layer budget schedule of its own; pass check_policy "
                             f"kept=(layer, num_layers, n) -> tokens kept, computed independently")
    return lambda layer, num_layers, n: kvpress_kept(policy_args, n)


def check_policy(name: str, policy_args: dict, model: str = "random:llama-tiny", loaded: LoadedModel | None = None,
                 checks: tuple[str, ...] = CHECKS, max_tokens: int = 8, kept: Kept | None = None,
                 **engine_args) -> None:
    """Run the conformance checks for policy `name` with `policy_args` (which must compress prompts of
    ~100 tokens: e.g. budget 32 or compression_ratio 0.5) on `model`. `kept`: the tokens each full-attention
    layer must hold after the prompt, for a policy with a budget schedule of its own (default: kvpress's
    uniform rule from `policy_args`)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine_args = {"max_num_batched_tokens": 64, **engine_args}

    def make(policy: str = name, args: dict = policy_args, **kw) -> LLM:
        import copy

        return LLM(model, loaded=copy.deepcopy(loaded) if loaded is not None else None,
                   **{**engine_args, "policy": policy, "policy_args": args, **kw})

    llm = make(block_size=16)
    vocab = llm.model_config.vocab_size
    batch = prompts(vocab)
    outs = [o.token_ids for o in llm.generate(batch, params)]
    if "budget" in checks or "memory" in checks:
        _check_held(llm, batch[0], checks, expected_kept(name, policy_args, llm.engine.policy, kept))
    if "determinism" in checks:
        again = [o.token_ids for o in make(block_size=16).generate(batch, params)]
        assert again == outs, f"{name}: two identical runs gave different tokens"
    if "batch" in checks:
        alone = [llm.generate([p], params)[0].token_ids for p in batch]
        assert alone == outs, f"{name}: a request's tokens depend on the other requests in its batch"
    if "block_sizes" in checks:
        small_llm = make(block_size=1)
        small = [o.token_ids for o in small_llm.generate(batch, params)]
        if isinstance(llm.engine.policy, SparseReadPolicy):  # pages are the unit of selection
            _check_reads(small_llm)
        else:
            assert small == outs, f"{name}: pages of 1 and 16 tokens gave different tokens"
    if "no_op" in checks:
        covering = {k: v for k, v in policy_args.items() if k not in ("budget", "compression_ratio")}
        big = make(args={**covering, "budget": 10_000}).generate(batch, params)
        full = make(policy="full", args={}).generate(batch, params)
        assert [o.token_ids for o in big] == [o.token_ids for o in full], (
            f"{name}: a budget covering the sequence changed the output")


def _check_held(llm: LLM, prompt: list[int], checks, kept: Kept) -> None:
    """Prefill one prompt, then look at what each layer holds (`kept`: what each layer must hold)."""
    engine = llm.engine
    bm, policy = engine.block_manager, engine.policy
    engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    while seq.num_computed_tokens < len(prompt):
        engine.step()
    num_layers = len({layer for group in bm.groups for layer in group.layers})
    held = held_full = 0
    per_layer: dict[int, list[int]] = {}  # full-attention layer -> tokens held by each of its tables
    for g, group in enumerate(bm.groups):  # sliding-window layers are bounded by their window, not compressed
        n = bm.cached_lens([seq], g)[0]
        pages = [b for b in bm.block_tables([seq], g)[0] if b >= 0]
        held += len(pages)
        if group.sliding_window is not None:
            continue
        held_full += len(pages)
        per_layer.setdefault(group.layers[0], []).append(n)
        if "memory" in checks:
            assert len(pages) == -(-n // bm.block_size), (
                f"{engine.config.policy}: layer {group.layers[0]} holds {len(pages)} pages for {n} tokens")
    if "budget" in checks and policy.compresses:  # a sparse reader that evicts nothing: see _check_reads
        # with a table per KV head (per-head budgets) the heads share the layer's budget
        for layer, lens in per_layer.items():
            want = kept(layer, num_layers, len(prompt))
            held_ok = sum(lens) == want * len(lens) if policy.head_budgets else lens == [want] * len(lens)
            assert held_ok, (f"{engine.config.policy}: layer {layer} holds {lens} tokens of a {len(prompt)}-token "
                             f"prompt, its budget is {want} per table")
    if "memory" in checks:
        full_pages = len(bm.full_groups) * -(-len(prompt) // bm.block_size)
        freed = held_full == full_pages if not policy.compresses else held_full < full_pages  # sparse reading
        assert bm.num_used_blocks() == held and freed, (
            f"{engine.config.policy}: {held_full} pages held by full-attention layers, full cache {full_pages}")
    while engine.has_unfinished():
        engine.step()
    assert bm.allocator.num_free_blocks == bm.num_blocks
    if "budget" in checks and isinstance(policy, SparseReadPolicy):
        _check_reads(llm)


def _check_reads(llm: LLM) -> None:
    """A sparse-reading policy read something at decode, and never more than its pages per step."""
    reader = llm.engine.cache.sparse_read
    most = reader.pages * llm.engine.block_manager.block_size
    assert 0 < reader.max_tokens_read <= most, (
        f"{llm.engine.config.policy}: a decode step read {reader.max_tokens_read} slots, budget {most}")
