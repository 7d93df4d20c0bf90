"""The allocator conformance suite: the allocator decides where pages go, never what a query reads.

    from kvlab.testing import check_allocator

    def test_my_allocator_conforms():
        check_allocator("my_allocator")

Each check raises AssertionError naming what failed:
- outputs: greedy tokens equal the `paged` allocator's, in an ample pool and in one small enough that
  requests are preempted and recomputed (or, for an allocator that reserves whole sequences, admitted
  fewer at a time), and with a compressing policy when the allocator compacts;
- accounting: while requests run, no page is in two tables unless both hold it by reference (forks),
  and free + used pages always equal the pool;
- nothing left: once every request finished or was aborted, every page is free and no table remains.
"""

from __future__ import annotations

from kvlab.cache.allocators.base import Allocator
from kvlab.llm import LLM
from kvlab.registry import ALLOCATORS, load_plugins
from kvlab.sampling_params import SamplingParams
from kvlab.testing.policies import prompts


def check_allocator(name: str, allocator_args: dict | None = None, model: str = "random:llama-tiny",
                    max_tokens: int = 12, small_pool: str = "48KiB", **engine_args) -> None:
    """Run the allocator conformance checks for allocator `name` with `allocator_args` on `model`
    (`small_pool`: a KV budget in which the prompts are preempted)."""
    load_plugins()
    allocator_args = allocator_args or {}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    configs = [dict(), dict(kv_cache_memory=small_pool, max_num_batched_tokens=32)]
    if ALLOCATORS.get(name).compact is not Allocator.compact:
        configs.append(dict(policy="snapkv", policy_args={"compression_ratio": 0.5, "window_size": 8}))
    batch = None
    for config in configs:
        ref = LLM(model, **{**engine_args, **config})
        batch = batch or prompts(ref.model_config.vocab_size, lengths=(40, 23, 61, 9, 33))
        want = [o.token_ids for o in ref.generate(batch, params)]
        llm = LLM(model, allocator=name, allocator_args=allocator_args, **{**engine_args, **config})
        engine = llm.engine
        ids = [engine.add_request(p, params) for p in batch]
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o.token_ids for o in engine.step()})
            _check_accounting(llm, name)
        got = [outs[i] for i in ids]
        if "kv_cache_memory" in config:  # the pool must have constrained it: preempted, or run fewer at once
            stats = llm.stats()
            assert stats["preemptions"] > 0 or stats["max_concurrent_seqs"] < len(batch), (
                f"allocator {name!r}: the small pool constrained nothing, so the check did not run: pass a "
                f"smaller small_pool")
        assert got == want, f"allocator {name!r}: tokens differ from the paged allocator's with {config or 'defaults'}"
        _check_free(llm, name)
        ids = [engine.add_request(p, params) for p in batch]  # aborts: running and waiting
        engine.step()
        for i in ids[::2]:
            engine.abort(i)
        while engine.has_unfinished():
            engine.step()
            _check_accounting(llm, name)
        _check_free(llm, name)


def _check_accounting(llm: LLM, name: str) -> None:
    bm = llm.engine.block_manager
    a = bm.allocator
    owners: dict[int, int] = {}
    for key in a.tables:
        for page in a.block_table(key):
            if page >= 0:
                owners[page] = owners.get(page, 0) + 1
    counted = getattr(a, "num_owners", None)  # allocators that share pages count their owners
    for page, n in owners.items():
        assert n == 1 or (counted is not None and counted(page) >= n), (
            f"allocator {name!r}: page {page} is in {n} tables but counts {counted(page) if counted else 1} owners")
    assert a.num_free_blocks + bm.num_used_blocks() <= bm.num_blocks, (
        f"allocator {name!r}: {a.num_free_blocks} free + {bm.num_used_blocks()} used pages exceed the pool")


def _check_free(llm: LLM, name: str) -> None:
    bm = llm.engine.block_manager
    assert not bm.allocator.tables, f"allocator {name!r}: tables left after every request ended"
    assert bm.allocator.num_free_blocks == bm.num_blocks, (
        f"allocator {name!r}: {bm.num_blocks - bm.allocator.num_free_blocks} pages not freed")
