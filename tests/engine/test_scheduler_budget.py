"""The step's token budget charges a prefix hit nothing, and parallel samples draw their own random streams.

Tiny random Llama (vocab 256): its next-token distributions are nearly uniform, so two samples drawn from
different streams differ, and two drawn from one stream are equal.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvlab import LLM, SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def completions(out) -> list[list[int]]:
    """The token ids of each sample of one prompt's output (a list of outputs, or one with `.outputs`)."""
    if isinstance(out, list):
        return [o.token_ids for o in out]
    return [c.token_ids for c in getattr(out, "outputs", [out])]


def record_batches(llm: LLM) -> list[list[tuple[int, int, int]]]:
    """Per step: (seq id, tokens computed before the step, tokens scheduled) of every scheduled sequence."""
    scheduler, batches = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        batches.append([(s.seq_id, s.num_computed_tokens, n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        return batch

    scheduler.schedule = recording
    return batches


def test_a_prefix_hit_is_charged_only_its_uncached_tokens():
    """A 72-token prompt hitting 56 cached tokens computes its 16 others in one step of a 20-token budget,
    beside a 4-token prompt (16 + 4 = 20): the hit costs no budget. Outputs equal caching off."""
    prefix = tokens(64, 0)
    hit, short = prefix[:56] + tokens(16, 1), tokens(4, 2)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm = LLM("random:llama-tiny", enable_prefix_caching=True, block_size=8, max_num_batched_tokens=20)
    llm.generate([prefix], SamplingParams(max_tokens=1))  # registers its 8 full pages
    batches = record_batches(llm)
    got = [o.token_ids for o in llm.generate([hit, short], params)]
    assert [(done, n) for _, done, n in batches[0]] == [(56, 16), (0, 4)], batches[0]  # (hit, computed) each
    want = [o.token_ids for o in LLM("random:llama-tiny", block_size=8, max_num_batched_tokens=20).generate(
        [hit, short], params)]
    assert got == want


def test_unseeded_samples_draw_streams_of_their_own():
    """n = 4, temperature 1, no seed: after the first step (the prompt and each sample's first token) the four
    samples hold four distinct generators in four distinct states (a copy of the parent's stream would be
    in the parent's state after one draw each), and their outputs differ from each other."""
    llm = LLM("random:llama-tiny")
    engine = llm.engine
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, ignore_eos=True)
    engine.add_request(tokens(20, 3), params)
    engine.step()
    samples = list(engine.scheduler.running)
    assert len(samples) == 4
    generators = [engine._generators[s.seq_id] for s in samples]
    assert len({id(g) for g in generators}) == 4, "samples share a generator object"
    states = [g.get_state() for g in generators]
    assert all(not torch.equal(states[i], states[j]) for i in range(4) for j in range(i)), (
        "two samples' generators are in the same state: they draw the same stream")
    while engine.has_unfinished():
        engine.step()
    outs = completions(llm.generate([tokens(20, 3)], params)[0])
    assert len(outs) == 4 and len({tuple(o) for o in outs}) == 4, outs
    seeded = completions(llm.generate([tokens(20, 3)], dataclasses.replace(params, seed=7))[0])
    assert len({tuple(o) for o in seeded}) == 4  # seeds 7, 8, 9, 10: four streams as well
