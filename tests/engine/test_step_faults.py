"""A stage of a step that raises leaves every sequence as it was: the engine keeps stepping and gives the
answers a run without the fault gives.

Faults are injected into a policy's `score()` (compression runs after the forward pass and after the
scheduler advanced the batch), into advancing (`BlockManager.commit`), into scheduling
(`BlockManager.append`) and into the sampler, on the tiny random Llama. A failed step puts its sequences
back in the queue to be recomputed from their tokens (docs/design.md, "Reliability rules"), so the
recompute must rebuild exactly what the first pass kept: this also exercises compression points in token
time.
"""

from __future__ import annotations

import pytest
import torch

import kvlab.engine.llm_engine
from kvlab import LLM, SamplingParams
from kvlab.sequence import SequenceStatus

MODEL = "random:llama-tiny"
SNAP = {"compression_ratio": 0.5, "window_size": 8}
SNAP_DECODE = {"compression_ratio": 0.5, "window_size": 8, "when": "decode", "every": 4}
H2O_DECODE = {"compression_ratio": 0.5, "recent": 4, "when": "decode", "every": 4}


class Injected(RuntimeError):
    pass


def prompts(lengths=(40, 52, 64), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def make(policy: str = "full", args: dict | None = None, **engine) -> LLM:
    # a 32-token step: the prompts take several steps and are compressed in different ones
    return LLM(MODEL, policy=policy, policy_args=args or {}, max_num_batched_tokens=32, max_model_len=256, **engine)


class Steps:
    """Counts the engine's steps (1-based) and raises once, from a wrapped function, in step `at` (at its
    `call`-th call in that step)."""

    def __init__(self, engine, at: int):
        self.engine, self.at, self.count, self.fired = engine, at, 0, False
        self._step = engine.step
        engine.step = self.step

    def step(self):
        self.count += 1
        return self._step()

    def wrap(self, owner, name: str, call: int = 1) -> None:
        real = getattr(owner, name)
        calls = {}

        def faulty(*args, **kwargs):
            calls[self.count] = calls.get(self.count, 0) + 1
            if self.count == self.at and calls[self.count] == call and not self.fired:
                self.fired = True
                raise Injected(f"injected into {name} at step {self.at}")
            return real(*args, **kwargs)
        setattr(owner, name, faulty)


def drive(engine, params, ps, steps: Steps | None = None):
    """Queue `ps` and step until done (a step that raises the injected fault is checked and passed over);
    the tokens of every sample by (prompt, sample index)."""
    ids = [engine.add_request(p, params) for p in ps]
    outs, failed = {}, 0
    while engine.has_unfinished():
        before = {s.seq_id: list(s.token_ids) for s in engine.scheduler.running + list(engine.scheduler.waiting)}
        try:
            got = engine.step()
        except Injected:
            failed += 1
            check_put_back(engine, before)
            continue
        outs.update({o.request_id: o for o in got})
    assert steps is None or (steps.fired and failed == 1), "the fault never fired: the test checked nothing"
    return {(ids.index(o.group_id), o.sample_index): o.token_ids for o in outs.values()}


def check_put_back(engine, before: dict[int, list[int]]) -> None:
    """After the failed step: nothing appended, nothing left running half-way, no state kept for it."""
    sched = engine.scheduler
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        assert seq.token_ids == before.get(seq.seq_id, seq.token_ids)  # the step's tokens were not appended
        if engine.compressor:
            assert seq.seq_id not in engine.compressor._queries and seq.seq_id not in engine.compressor._mass
    for seq in sched.running:  # sequences the step did not schedule are untouched
        assert seq.token_ids == before[seq.seq_id]
    assert set(engine._samples) <= {s.seq_id for s in sched.running + list(sched.waiting)}


def assert_drained(llm: LLM) -> None:
    engine, bm = llm.engine, llm.engine.block_manager
    assert bm.allocator.num_free_blocks == bm.num_blocks and not bm.allocator.tables
    assert not engine._generators and not engine._samples and not engine._groups
    if engine.compressor:
        assert engine.compressor.num_tracked() == 0


def compression_steps(policy: str, args: dict, params: SamplingParams, ps) -> list[int]:
    """The steps (1-based) in which a clean run compresses something."""
    llm = make(policy, args)
    steps, calls = [], []
    compress = llm.engine.compressor.compress
    llm.engine.compressor.compress = lambda *a, **k: (calls.append(1), compress(*a, **k))[1]
    for p in ps:
        llm.engine.add_request(p, params)
    n = 0
    while llm.engine.has_unfinished():
        n += 1
        before = len(calls)
        llm.engine.step()
        if len(calls) > before:
            steps.append(n)
    return steps


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("policy, args, at", [
    ("snapkv", SNAP, None),  # the second step that compresses a prompt
    ("snapkv", SNAP_DECODE, 6),  # the case: when="decode", every=4, a fault at step 6
    ("h2o", H2O_DECODE, 6),
])
def test_a_fault_in_score_leaves_the_engine_giving_the_clean_answers(policy, args, at):
    ps = prompts()
    want = drive(make(policy, args).engine, GREEDY, ps)
    when = compression_steps(policy, args, GREEDY, ps)
    at = at if at is not None else when[1]
    assert at in when  # the fault fires inside a compression
    llm = make(policy, args)
    steps = Steps(llm.engine, at)
    steps.wrap(llm.engine.policy, "score")
    assert drive(llm.engine, GREEDY, ps, steps) == want
    assert_drained(llm)


def test_a_fault_while_forking_samples_drops_them_and_spawns_them_again():
    """n = 2 (greedy and seeded): the fault hits the step that compresses the prompt and forks the second
    sample; the request goes back whole (n = 2 again) and both samples come out as without the fault."""
    ps = prompts((40, 52))
    for params in (SamplingParams(max_tokens=10, ignore_eos=True, n=2),
                   SamplingParams(max_tokens=10, ignore_eos=True, n=2, temperature=1.0, seed=11)):
        want = drive(make("snapkv", SNAP).engine, params, ps)
        at = compression_steps("snapkv", SNAP, params, ps)[0]
        llm = make("snapkv", SNAP)
        steps = Steps(llm.engine, at)
        steps.wrap(llm.engine.policy, "score")
        assert drive(llm.engine, params, ps, steps) == want
        assert len(want) == 4
        assert_drained(llm)


def test_sampled_requests_draw_again_what_the_failed_step_drew():
    """A seeded sampled request whose step fails after sampling (in a decode-time compression) samples, on
    the retry, the token the step would have given: its random stream is put back with it."""
    ps = prompts()
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=5)
    want = drive(make("snapkv", SNAP_DECODE).engine, params, ps)
    llm = make("snapkv", SNAP_DECODE)
    steps = Steps(llm.engine, 6)
    steps.wrap(llm.engine.policy, "score")
    assert drive(llm.engine, params, ps, steps) == want
    assert_drained(llm)


@pytest.mark.parametrize("stage", ["commit", "append", "sample"])
def test_a_fault_in_advancing_scheduling_or_sampling_leaves_the_clean_answers(stage, monkeypatch):
    """A fault while advancing (BlockManager.commit, after the forward pass), while scheduling
    (BlockManager.append, after earlier sequences of the batch were given their slots) or in the sampler,
    under snapkv compressing while decoding."""
    ps = prompts()
    want = drive(make("snapkv", SNAP_DECODE).engine, GREEDY, ps)
    llm = make("snapkv", SNAP_DECODE)
    steps = Steps(llm.engine, 6)
    if stage == "sample":
        monkeypatch.setattr(kvlab.engine.llm_engine, "sample", kvlab.engine.llm_engine.sample)  # the real one is put back
        steps.wrap(kvlab.engine.llm_engine, "sample")
    else:  # scheduling fails after the first sequence of the batch was given its slots
        steps.wrap(llm.engine.block_manager, stage, call=2 if stage == "append" else 1)
    assert drive(llm.engine, GREEDY, ps, steps) == want
    assert_drained(llm)
