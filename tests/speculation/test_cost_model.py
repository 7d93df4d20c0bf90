"""The memory-traffic cost model (kvlab/speculation/cost_model.py, pure Python) and the bytes it reads off an
engine (kvlab/speculation/engine_traffic.py, tiny random Llama)."""

from __future__ import annotations

import pytest

from kvlab.speculation.cost_model import (Traffic, expected_accepted_length, predict, run_speedup,
                                          step_speedup)

from helpers import BYTES_PER_TOKEN, MODEL

# two layers of 100 weight bytes, a head of 50; 10 bytes of KV a token a layer; layer 1 has a window of 8
T = Traffic((100.0, 100.0), 50.0, (10.0, 10.0), (None, 8))


def test_a_pass_reads_the_weights_once_and_every_sequences_kv_within_windows_and_views():
    assert T.weight_bytes() == 250 and T.weight_bytes(layers=1) == 150
    assert T.kv_bytes(20) == 20 * 10 + 8 * 10  # layer 1 reads its window only
    assert T.kv_bytes(20, view=4) == 4 * 10 + 4 * 10 and T.kv_bytes(20, layers=1) == 200
    assert T.pass_bytes(3, 20) == 250 + 3 * 280
    assert T.pass_bytes(3, 5, layers=1, view=16) == 150 + 3 * 50


def test_the_expected_accepted_length_of_iid_acceptance():
    assert expected_accepted_length(0.0, 4) == 1.0 and expected_accepted_length(1.0, 4) == 5.0
    assert expected_accepted_length(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_a_free_draft_pays_what_it_emits_less_the_tentative_tokens_read():
    weights_only = Traffic((1000.0,), 0.0, (0.0,))
    assert predict(weights_only, 1, 100, k=4, acceptance=1.0, draft_pass=0.0) == pytest.approx(5.0)
    assert predict(weights_only, 1, 100, k=4, acceptance=0.0, draft_pass=0.0) == pytest.approx(1.0)


def test_the_target_drafting_for_itself_pays_only_once_its_kv_outweighs_its_weights():
    """The MagicDec crossover: the target through a 16-token view, 4 drafts at acceptance 0.8."""
    model = Traffic((1000.0,) * 4, 0.0, (10.0,) * 4)

    def self_spec(batch, context):
        return predict(model, batch, context, 4, 0.8, model.pass_bytes(batch, context, view=16))

    assert self_spec(1, 16) < 1.0  # weights dominate: 4 full passes to save 2.4
    assert self_spec(64, 4096) > 2.5  # KV dominates: the draft's passes are nearly weights only
    assert self_spec(64, 4096) > self_spec(16, 4096) > self_spec(1, 4096)


def test_a_whole_run_mixes_speculative_and_plain_steps():
    assert step_speedup(10.0, 10.0, 0.0, 4, 3.0) == pytest.approx(3.0)
    assert run_speedup(10.0, 10.0, 0.0, 4, 3.0, verified_share=1.0) == pytest.approx(3.0)
    assert run_speedup(10.0, 10.0, 0.0, 4, 3.0, verified_share=0.0) == pytest.approx(1.0)
    # half the tokens from steps emitting 3 per pass, half from plain steps: 2 / (1/3 + 1) passes per token
    assert run_speedup(10.0, 10.0, 0.0, 4, 3.0, verified_share=0.5) == pytest.approx(1 / (0.5 / 3 + 0.5))
    with pytest.raises(ValueError, match="verified_share"):
        run_speedup(10.0, 10.0, 0.0, 4, 3.0, verified_share=1.5)


def test_engine_traffic_reads_the_parameters_and_the_cache_format(one_thread):
    from kvlab import LLM
    from kvlab.speculation.engine_traffic import draft_pass, param_bytes, target_traffic

    llm = LLM(MODEL, draft="self_compressed", draft_args={"policy": "streaming_llm", "policy_args": {"budget": 32}},
              block_size=16, kv_cache_memory="4MiB")
    t = target_traffic(llm.engine)
    model = llm.engine.model
    assert t.num_layers == 2 and sum(t.kv_bytes_per_token) == BYTES_PER_TOKEN
    embed = 0 if model.config.tie_word_embeddings else param_bytes(model.model.embed_tokens)
    assert t.weight_bytes() == param_bytes(model) - embed  # every parameter but a lookup-only embedding
    assert draft_pass(llm.engine)(4, 100) == t.weight_bytes() + 4 * 32 * BYTES_PER_TOKEN  # the view's 32 tokens
    snap = LLM(MODEL, draft="self_compressed", block_size=16, kv_cache_memory="8MiB",
               draft_args={"policy": "snapkv", "policy_args": {"budget": 32, "window_size": 16}, "refresh": 9})
    st = target_traffic(snap.engine)  # a token view: its 32 selected tokens + 4 since the refresh point on average
    assert draft_pass(snap.engine)(4, 100) == pytest.approx(st.weight_bytes() + 4 * 36 * BYTES_PER_TOKEN)
    assert draft_pass(snap.engine)(4, 20) == pytest.approx(st.weight_bytes() + 4 * 20 * BYTES_PER_TOKEN)
    ngram = LLM(MODEL, draft="ngram", block_size=16, kv_cache_memory="4MiB")
    assert draft_pass(ngram.engine)(4, 100) == 0.0
    int8 = LLM(MODEL, quant="int8", block_size=16, kv_cache_memory="4MiB")
    assert BYTES_PER_TOKEN / 4 < sum(target_traffic(int8.engine).kv_bytes_per_token) < BYTES_PER_TOKEN / 2


def test_timed_speedup_in_seconds_proportional_to_bytes_is_the_byte_prediction():
    """With every part priced by its bytes (linear by weight bytes, attention by KV bytes, no overhead, a
    verification's parts costing what a decode pass's do), the seconds model is the byte model."""
    from kvlab.speculation.cost_model import PassTimes, timed_speedup

    B, c, k, view, rate = 3, 20.0, 2, 4.0, 1e-3
    times = PassTimes(T.weight_bytes() * rate, B * T.kv_bytes(c) * rate, 0.0, 0.0)
    shares = (1.0, T.kv_bytes(c, view=view) / T.kv_bytes(c))
    verify = T.kv_bytes(c + k) / T.kv_bytes(c)
    assert verify > 1.0 and shares[1] < 1.0
    want = run_speedup(T.pass_bytes(B, c), T.pass_bytes(B, c + k), T.pass_bytes(B, c, view=view), k, 2.5, 0.9)
    assert timed_speedup(times, *shares, verify, k, 2.5, 0.9) == pytest.approx(want)


def test_timed_speedup_prices_overheads_and_a_verifications_compute():
    """Only a per-pass overhead: k + 1 passes emit E tokens (E / (k + 1)); a step overhead is paid once a round;
    a verification whose attention costs twice a decode pass's, and a view's refresh, slow it down."""
    from kvlab.speculation.cost_model import PassTimes, timed_speedup

    only_passes = PassTimes(0.0, 0.0, 1.0, 0.0)
    assert timed_speedup(only_passes, 1.0, 0.1, 1.0, 4, 3.0) == pytest.approx(3.0 / 5)
    steps = PassTimes(0.0, 0.0, 1.0, 1.0)  # plain: 2; a round: 4 draft passes + a verification of 2
    assert timed_speedup(steps, 1.0, 0.1, 1.0, 4, 3.0) == pytest.approx(3.0 * 2 / 6)
    attention = PassTimes(1.0, 4.0, 0.0, 0.0, verify_attention=2.0)  # plain 5; draft 1 + 0.4; verify 1 + 8
    assert timed_speedup(attention, 1.0, 0.1, 1.0, 2, 3.0) == pytest.approx(3.0 * 5 / (2 * 1.4 + 9))
    assert timed_speedup(attention, 1.0, 0.1, 1.0, 2, 3.0, round_extra_s=1.0) == pytest.approx(3.0 * 5 / (2 * 1.4 + 10))
    with pytest.raises(ValueError, match="verified_share"):
        timed_speedup(attention, 1.0, 0.1, 1.0, 2, 3.0, verified_share=1.5)


def test_pass_times_split_a_plain_step_into_its_parts():
    from kvlab.speculation.pass_costs import pass_times

    parts = {"step": 100.0, "verify: linear": 30.0, "verify: lm_head": 5.0, "verify: attention": 50.0,
             "verify: plan": 1.0, "verify: forward rest": 9.0}
    times = pass_times(parts, attention_ratio=2.0, linear_ratio=1.5)
    assert times.plain() == pytest.approx(0.1) and times.step_overhead_s == pytest.approx(0.005)
    assert (times.linear_s, times.attention_s, times.pass_overhead_s) == pytest.approx((0.035, 0.05, 0.01))
    assert times.verify() == pytest.approx(0.035 * 1.5 + 0.05 * 2.0 + 0.015)
