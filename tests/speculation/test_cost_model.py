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
