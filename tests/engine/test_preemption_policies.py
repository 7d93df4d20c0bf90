"""Preemption never changes an answer under a compressing policy: a recompute rebuilds what the first pass kept.

Compression points are in token time (the prompt's end; with when="decode" every `every` tokens after it)
and the scheduler ends every chunk at the next one, so a recompute of prompt + generated tokens compresses
the prompt alone, then computes its generated tokens against what was kept, compressing where the first
pass did; under sparse reading (quest, rocketkv) a recompute computes its generated tokens one a step, as
decode rows reading the selected pages. Torch-free scheduler cases, then the property on the tiny random
Llama: every compressing built-in (from the registry) in a tiny pool and in a big one, identical greedy
outputs for every request.
The issue's 200-request case is experiments/check_preemption_policies.py.
"""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.registry import POLICIES
from kvlab.engine.scheduler import Scheduler
from kvlab.testing.builtin_args import RATIO_ARGS

from helpers import manager, request, run_step


# -- torch-free: chunks end at compression points ------------------------------------------------
def points(prompt_end: int, every: int | None):
    """A compressor's next_point: the prompt's end, then every `every` tokens after it (None: no more)."""
    def next_point(seq):
        done = seq.num_computed_tokens
        if done < prompt_end:
            return prompt_end
        return None if every is None else prompt_end + every * ((done - prompt_end) // every + 1)
    return next_point


@pytest.mark.parametrize("every, chunks", [(None, [[10], [5], [1], [1]]), (4, [[10], [4], [1], [1]])])
def test_a_recompute_stops_at_the_prompt_end_and_every_compression_point(every, chunks):
    """Preempted after 5 outputs: 15 tokens to recompute in a 64-token step. It computes the prompt (10),
    then the generated tokens up to the next point (5 when only the prompt's end is one; 4 with every=4:
    points at 14, 18, ...), then decodes."""
    seq = request(0, 10, max_tokens=8)
    seq.token_ids += [7] * 5
    s = Scheduler(manager(64, 64), max_num_seqs=8, max_num_batched_tokens=64, stop_at=points(10, every))
    s.add(seq)
    assert [run_step(s).num_new_tokens for _ in range(4)] == chunks


def test_decodes_and_prompts_without_a_point_are_not_cut():
    a, b = request(0, 20, max_tokens=3), request(1, 12, max_tokens=3)
    s = Scheduler(manager(64, 64), max_num_seqs=8, max_num_batched_tokens=64, stop_at=lambda seq: None)
    s.add(a), s.add(b)
    assert [run_step(s).num_new_tokens for _ in range(3)] == [[20, 12], [1, 1], [1, 1]]


def test_the_compressor_names_the_points_in_token_time():
    args = {"compression_ratio": 0.5, "window_size": 4, "when": "decode", "every": 4}
    compressor = LLM("random:llama-tiny", policy="snapkv", policy_args=args).engine.compressor
    seq = request(0, 10, max_tokens=20)
    seen = []
    for done in (0, 9, 10, 13, 14, 17, 18):
        seq.num_computed_tokens = done
        seen.append(compressor.next_point(seq))
    assert seen == [10, 10, 14, 14, 18, 18, 22]
    seq.num_computed_tokens = 13
    assert compressor.due(seq, 1) and not compressor.due(seq, 0)  # computing token 13 reaches point 14
    seq.num_computed_tokens = 10
    assert compressor.due(seq, 4) and not compressor.due(seq, 3)
    prefill = LLM("random:llama-tiny", policy="snapkv", policy_args={"compression_ratio": 0.5, "window_size": 4})
    seq.num_computed_tokens = 10
    assert prefill.engine.compressor.next_point(seq) is None


# -- the engine: a tiny pool against a big one ------------------------------------------------
ARGS = RATIO_ARGS  # every compressing built-in at ratio 0.5 (rocketkv: a budget, read per decode step)
PREFILL_ONLY = {"adakv", "rocketkv"}  # they compress once, at the end of prefill
DECODE = {"when": "decode", "every": 4}
CONFIGS = {name: args for name, args in ARGS.items()}
CONFIGS.update({f"{name}-decode": {**args, **DECODE} for name, args in ARGS.items() if name not in PREFILL_ONLY})
CONFIGS["quest"] = {"budget": 32, "dense_layers": 0}  # sparse reading alone: a recompute decodes one token a step


def test_every_compressing_built_in_is_covered():
    assert {n for n in POLICIES.names() if POLICIES.get(n).compresses} == set(ARGS)


# the default suite runs one configuration of each mechanism a recompute must rebuild (the prompt-end stop,
# decode-time points, recorded queries, accumulated attention, per-head tables, sparse reading); the rest heavy
DEFAULT = {"snapkv-decode", "h2o-decode", "adakv", "rocketkv", "quest"}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(10, 61, (24,), generator=g).tolist()
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def outputs(policy: str, args: dict, memory: str):
    llm = LLM("random:llama-tiny", policy=policy, policy_args=args, kv_cache_memory=memory)
    outs = llm.generate(prompts(), SamplingParams(max_tokens=16, ignore_eos=True))
    bm, compressor = llm.engine.block_manager, llm.engine.compressor
    assert bm.allocator.num_free_blocks == bm.num_blocks and (compressor is None or compressor.num_tracked() == 0)
    return [o.token_ids for o in outs], [o.num_preemptions for o in outs]


@pytest.mark.parametrize("config", [c if c in DEFAULT else pytest.param(c, marks=pytest.mark.heavy)
                                    for c in sorted(CONFIGS)])
def test_preempted_requests_give_what_an_ample_pool_gives(config):
    policy, args = config.removesuffix("-decode"), CONFIGS[config]
    want, none = outputs(policy, args, "16MiB")
    got, preempted = outputs(policy, args, "48KiB")
    assert not any(none) and sum(p > 0 for p in preempted) >= (3 if config in DEFAULT else 1)  # else it proves nothing
    assert [i for i, (a, b) in enumerate(zip(got, want)) if a != b] == []
