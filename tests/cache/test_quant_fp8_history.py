"""fp8 caches depend on the configuration and each token's own K/V, never on the request history: the
same prompt on a fresh engine and after an unrelated 3-token request gives the same tokens and the same
cached K/V under every fp8 option (per-token scales, fixed scales). A first-chunk calibration failed
this: the 3-token request's chunk set every layer's scales."""

import pytest
import torch

from kvlab import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
OPTIONS = [{}, {"candidates": 8}, {"scaling": "fixed"}, {"scaling": "fixed", "scale": 0.02}]


def prompt_kv_and_tokens(llm: LLM, prompt: list[int]) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The greedy tokens of `prompt` and its cached K/V (every layer, dequantised) once its prompt is in."""
    engine = llm.engine
    engine.add_request(prompt, GREEDY)
    kv, outputs = None, []
    while engine.has_unfinished():
        outputs += engine.step()
        for seq in engine.scheduler.running:
            if kv is None and seq.num_computed_tokens >= len(prompt):
                slots = torch.tensor(engine.block_manager.slot_ids(seq, 0, 0, len(prompt)))
                kv = [engine.cache.read_slots(layer, slots, torch.float32)
                      for layer in range(engine.model_config.num_hidden_layers)]
    return outputs[-1].token_ids, kv


def fresh_and_after_other(model: str, quant: str, qargs: dict, prompt, other, **kw):
    runs = []
    for history in ([], [other]):
        llm = LLM(model, quant=quant, quant_args=qargs, **kw)
        for earlier in history:
            llm.generate([earlier], SamplingParams(max_tokens=2))
        runs.append(prompt_kv_and_tokens(llm, prompt))
    return runs


@pytest.mark.parametrize("quant", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("qargs", OPTIONS, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default")
def test_fp8_cache_does_not_depend_on_earlier_requests(quant, qargs):
    prompt = torch.randint(3, 256, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    (tokens, kv), (tokens_after, kv_after) = fresh_and_after_other(
        "random:llama-tiny", quant, qargs, prompt, [5, 6, 7], block_size=16, kv_cache_memory="1MiB",
        max_num_batched_tokens=32)
    assert tokens == tokens_after
    for (k, v), (k2, v2) in zip(kv, kv_after):
        assert torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.model
@pytest.mark.heavy
@pytest.mark.parametrize("qargs", [{}, {"scaling": "fixed"}], ids=["default", "fixed"])
def test_smollm2_text_does_not_depend_on_an_earlier_request(load_reference, qargs):
    """The issue's case: SmolLM2, a sentence on a fresh engine and after an unrelated 3-token request."""
    import copy

    loaded = load_reference("smollm2-135m")
    tok = loaded.tokenizer
    prompt = tok("The history of the Roman Empire spans many centuries, and historians", add_special_tokens=False)
    other = tok("Hi there!", add_special_tokens=False)["input_ids"][:3]
    runs = []
    for history in ([], [other]):
        llm = LLM("smollm2-135m", loaded=copy.deepcopy(loaded), quant="fp8_e4m3", quant_args=qargs,
                  kv_cache_memory="64MiB", block_size=32)
        for earlier in history:
            llm.generate([earlier], SamplingParams(max_tokens=2))
        runs.append(llm.generate([prompt["input_ids"]], SamplingParams(max_tokens=24, temperature=0.0))[0].text)
    assert runs[0] == runs[1]
