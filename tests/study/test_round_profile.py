"""The timers of kvlab/study/round_profile.py on a tiny engine: decode steps counted (prefill steps left out),
a speculative engine's draft and verification parts apart, nothing counted twice (the named parts fit in the
step), and everything put back afterwards."""

from __future__ import annotations

import pytest

from kvlab import LLM, SamplingParams
from kvlab.engine import attention, lean_forward
from kvlab.kernels.cpu import linear as cpu_linear
from kvlab.study.round_profile import PARTS, instrument

from helpers import MODEL

pytestmark = pytest.mark.usefixtures("one_thread")
STREAMING = {"policy": "streaming_llm", "policy_args": {"budget": 32}, "num_tokens": 3}


@pytest.mark.parametrize("draft", [None, "self_compressed"])
def test_the_timers_count_decode_steps_by_part_and_are_taken_off(draft):
    extra = dict(draft=draft, draft_args=STREAMING) if draft else {}
    llm = LLM(MODEL, block_size=16, kv_cache_memory="4MiB", linear_backend="cpu", **extra)
    engine = llm.engine
    originals = (engine.step, engine.runner.run, attention.paged_attention, lean_forward.paged_attention,
                 cpu_linear.linear, engine.model.lm_head.forward)
    timers = instrument(engine)
    llm.generate([list(range(3, 40))], SamplingParams(max_tokens=12, ignore_eos=True))
    timers.remove()
    ms = timers.ms_per_step()
    stats = llm.stats()
    if draft:  # a step per verification, and one plain step where a single token was left (no room for a draft)
        assert timers.steps - stats["spec_verifications"] in (0, 1) and stats["spec_verifications"] > 1
    else:
        assert timers.steps == 11  # the first token comes from the prefill step, which is left out
    named = sum(ms[p] for p in PARTS if p != "step rest")
    assert 0 < named <= ms["step"] * 1.0001 and ms["step rest"] >= -1e-6
    assert ms["verify: linear"] > 0 and ms["verify: attention"] > 0
    if draft:
        assert ms["draft: linear"] > 0 and ms["draft: attention"] > 0 and ms["draft: total"] > ms["draft: linear"]
    else:
        assert ms["draft: total"] == 0 and ms["draft: linear"] == 0
    assert (engine.step, engine.runner.run, attention.paged_attention, lean_forward.paged_attention,
            cpu_linear.linear, engine.model.lm_head.forward) == originals
    assert "step" not in vars(engine) and "run" not in vars(engine.runner)
