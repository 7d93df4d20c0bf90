"""Model resolution from every kind of source, and sliding-window blocks going back to the pool."""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.models import load_model, packaged_gguf, resolve


@pytest.mark.model
def test_local_folder_and_gguf_path_load_the_same_model(load_reference):
    """The converted-model cache gives the logits Hugging Face computes from the GGUF file itself."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = load_reference("smollm2-135m")
    gguf = packaged_gguf("smollm2-135m")
    folder = resolve(str(gguf))  # a .gguf path converts (once) into the cache folder
    assert folder == resolve("smollm2-135m")
    local = load_model(str(folder))  # a local Hugging Face folder
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()  # ~18 s
    text = "The capital of France is"
    ids = ref.tokenizer(text)["input_ids"]
    assert local.tokenizer(text)["input_ids"] == ids
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits  # [1, T, V]
        for loaded in (ref, local):
            assert type(loaded.model) is type(hf)
            torch.testing.assert_close(loaded.model(torch.tensor([ids])).logits, expected, atol=1e-4, rtol=0)


def test_random_model_from_a_config_shape():
    loaded = load_model("random:llama-tiny")
    assert loaded.tokenizer is None and loaded.model.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="unknown random model shape 'nope'; known: .*llama-1b"):
        load_model("random:nope")


def test_sliding_window_blocks_go_back_to_the_shared_pool():
    # gemma3-tiny: 5 sliding layers (window 8) + 1 full layer -> 6 one-layer groups drawing on one pool;
    # one 60-token prompt at block size 4
    llm = LLM("random:gemma3-tiny", block_size=4, kv_cache_memory="1MiB")
    bm = llm.engine.block_manager
    assert [g.sliding_window for g in bm.groups] == [8, 8, 8, 8, 8, None]
    seq = llm.engine.make_sequence(list(range(3, 63)), SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.add_sequence(seq)
    llm.engine.step()  # prefills all 60 tokens
    usage = bm.group_usage([seq])
    assert usage["full"] == 15  # every token is kept for the full-attention layer
    for g in range(5):  # only the window (+ a partial block) stays in each sliding group
        assert len([b for b in bm.block_tables([seq], g)[0] if b >= 0]) <= 3
    assert usage["window8"] <= 5 * 3 and bm.num_used_blocks() == usage["full"] + usage["window8"]
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert bm.allocator.num_free_blocks == bm.num_blocks


def test_pages_out_of_the_window_are_never_read_again():
    """After every step, every free page of the pool (sliding-window pages released included) is
    overwritten with huge values: the generated tokens must not change."""
    def run(poison: bool) -> list[int]:
        llm = LLM("random:gemma3-tiny", block_size=4, kv_cache_memory="1MiB")
        engine, bm = llm.engine, llm.engine.block_manager
        engine.add_request(list(range(3, 43)), SamplingParams(max_tokens=12, ignore_eos=True))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
            if poison:
                free = torch.tensor(list(bm.allocator.free_blocks), dtype=torch.long)
                for layer in range(llm.model_config.num_hidden_layers):
                    engine.cache.k(layer)[free] = 1e4
                    engine.cache.v(layer)[free] = -1e4
        return outs[0].token_ids

    assert run(poison=True) == run(poison=False)
