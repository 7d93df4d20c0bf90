"""The policy conformance suite: what every eviction policy must do inside the engine.

A third-party policy runs it in its own tests::

    from kvlab.testing import check_policy

    def test_my_policy_conforms():
        check_policy("my_policy", {"budget": 32})

Each check raises AssertionError naming what failed:
- budget: after the prompt is compressed every full-attention layer holds at most its budget;
- memory: the pages a sequence holds are exactly those its kept tokens need (the rest went back
  to the pool), and fewer than the full cache holds;
- determinism: the same request twice gives the same tokens;
- batch: a request gives the same tokens alone and in a batch of requests of other lengths;
- block sizes: the same tokens with pages of 1 and 16 tokens;
- no-op: with a budget covering the whole sequence the output equals the full cache's.
"""

from __future__ import annotations

import torch

from kvlab.llm import LLM
from kvlab.models import LoadedModel
from kvlab.sampling_params import SamplingParams

CHECKS = ("budget", "memory", "determinism", "batch", "block_sizes", "no_op")


def prompts(vocab: int, lengths=(120, 77, 150), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def check_policy(name: str, policy_args: dict, model: str = "random:llama-tiny", loaded: LoadedModel | None = None,
                 checks: tuple[str, ...] = CHECKS, max_tokens: int = 8, **engine_args) -> None:
    """Run the conformance checks for policy `name` with `policy_args` (which must compress prompts of
    ~100 tokens: e.g. budget 32 or compression_ratio 0.5) on `model`."""
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
        _check_held(llm, batch[0], checks)
    if "determinism" in checks:
        again = [o.token_ids for o in make(block_size=16).generate(batch, params)]
        assert again == outs, f"{name}: two identical runs gave different tokens"
    if "batch" in checks:
        alone = [llm.generate([p], params)[0].token_ids for p in batch]
        assert alone == outs, f"{name}: a request's tokens depend on the other requests in its batch"
    if "block_sizes" in checks:
        small = [o.token_ids for o in make(block_size=1).generate(batch, params)]
        assert small == outs, f"{name}: pages of 1 and 16 tokens gave different tokens"
    if "no_op" in checks:
        covering = {k: v for k, v in policy_args.items() if k not in ("budget", "compression_ratio")}
        big = make(args={**covering, "budget": 10_000}).generate(batch, params)
        full = make(policy="full", args={}).generate(batch, params)
        assert [o.token_ids for o in big] == [o.token_ids for o in full], (
            f"{name}: a budget covering the sequence changed the output")


def _check_held(llm: LLM, prompt: list[int], checks) -> None:
    """Prefill one prompt, then look at what each layer holds."""
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
    if "budget" in checks:  # with a table per KV head (per-head budgets) the heads share the layer's budget
        for layer, lens in per_layer.items():
            want = policy.layer_budget(layer, num_layers, len(prompt))
            assert sum(lens) <= want * len(lens), (
                f"{engine.config.policy}: layer {layer} holds {lens} tokens, budget {want} per table")
    if "memory" in checks:
        full_pages = len(bm.full_groups) * -(-len(prompt) // bm.block_size)
        assert bm.num_used_blocks() == held and held_full < full_pages, (
            f"{engine.config.policy}: {held_full} pages held by full-attention layers, full cache {full_pages}")
    while engine.has_unfinished():
        engine.step()
    assert bm.allocator.num_free_blocks == bm.num_blocks
