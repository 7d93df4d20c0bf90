"""The fused weight layout (EngineConfig.linear_layout, kvlab/engine/linear_layout.py).

`auto` changes how the projections are multiplied, never what a step computes: the model's logits, the
engine's greedy tokens (also against Hugging Face `generate`), and the batch-invariant mode's bits are
the same as with `none`, on both tiny model shapes and in float32 and bfloat16."""

from __future__ import annotations

import copy

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.engine.linear_layout import FusedPart, apply_linear_layout, layout_of
from logit_records import SCHEDULES, run, same_bits
from hf_equivalence import check, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
NAMES = ["random:llama-tiny", "random:gemma3-tiny"]


def fused_parts(model) -> int:
    return sum(isinstance(m, FusedPart) for m in model.modules())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_model_computes_the_same_logits(fresh_model, name, dtype):
    model = fresh_model(name).model.to(dtype)
    ids = torch.tensor(random_prompts(256, [21]), dtype=torch.int64)  # [1, 21]
    with torch.inference_mode():
        before = model(ids).logits
        groups = apply_linear_layout(model, "auto")
        after = model(ids).logits
    layers = model.config.num_hidden_layers
    assert groups == 2 * layers and fused_parts(model) == 5 * layers and layout_of(model) == "auto"
    assert torch.equal(before, after)
    assert apply_linear_layout(model, "none") == 0 and fused_parts(model) == 0 and layout_of(model) == "none"
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)


def test_the_fused_weight_is_the_storage_of_the_originals(fresh_model):
    model = fresh_model("random:llama-tiny").model
    params = sum(p.numel() for p in model.parameters())
    apply_linear_layout(model, "auto")
    attn = model.model.layers[0].self_attn
    product = attn.q_proj.product
    assert product.weight.data_ptr() == attn.q_proj.weight.data_ptr()  # q's rows come first
    assert attn.k_proj.weight.data_ptr() == product.weight[attn.q_proj.out_features:].data_ptr()
    assert sum(p.numel() for p in model.parameters()) == params  # nothing counted (or held) twice


@pytest.mark.parametrize("name", NAMES)
def test_the_engine_with_fused_layers_still_matches_hf(fresh_model, load_reference, name):
    prompts = random_prompts(256, [5, 17, 1, 33, 8, 16, 40, 31])
    check(fresh_model, load_reference, name, prompts, 12, block_size=16, kv_cache_memory="4MiB",
          max_num_batched_tokens=48, linear_layout="auto")


def test_a_reused_model_follows_each_engines_layout(fresh_model):
    loaded = fresh_model("random:llama-tiny")
    LLM("random:llama-tiny", loaded=loaded, kv_cache_memory="4MiB", linear_layout="auto")
    assert layout_of(loaded.model) == "auto"
    LLM("random:llama-tiny", loaded=loaded, kv_cache_memory="4MiB")
    assert layout_of(loaded.model) == "none" and fused_parts(loaded.model) == 0


@pytest.mark.parametrize("quant", ["int4", "fp8_e4m3"])
def test_batch_invariance_holds_with_fused_layers(quant):
    tokens, base = run({}, quant=quant, batch_invariant=True, linear_layout="auto")
    plain_tokens, plain = run({}, quant=quant, batch_invariant=True)
    common, differ = same_bits(base, plain)
    assert common >= 30 and differ == 0 and tokens == plain_tokens  # fused = separate, bit for bit
    for name in SCHEDULES:  # solo, chunked, the ngram and layerskip drafts (layerskip runs fused layers too)
        other_tokens, other = run(copy.deepcopy(SCHEDULES[name]), quant=quant, batch_invariant=True,
                                  linear_layout="auto")
        common, differ = same_bits(base, other)
        assert common >= 30 and differ == 0 and other_tokens == tokens, (quant, name)


@pytest.mark.model
def test_smollm2_with_fused_layers_matches_hf(fresh_model, load_reference):
    from hf_equivalence import PROMPTS

    tok = load_reference("smollm2-135m").tokenizer
    check(fresh_model, load_reference, "smollm2-135m", [tok(p)["input_ids"] for p in PROMPTS], 16, block_size=16,
          kv_cache_memory="64MiB", max_num_batched_tokens=64, linear_layout="auto")
