"""Greedy runs compared with Hugging Face `generate`: the prompts and checks several test files share."""

from __future__ import annotations

import torch

from kvlab import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The three primary colours are",
    "Translate to French: 'Good morning, my friend.'\n",
    "In 1969, Neil Armstrong",
]


def hf_greedy(model, prompt_ids: list[list[int]], max_new: int) -> list[list[int]]:
    out = []
    for ids in prompt_ids:
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


def bytes_per_token(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # K and V, float32


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


_expected: dict = {}  # HF outputs are the same for every engine setting: compute them once per session


def check(fresh_model, load_reference, name, prompts, max_new, **engine):
    key = (name, tuple(map(tuple, prompts)), max_new)
    if key not in _expected:
        _expected[key] = hf_greedy(load_reference(name).model, prompts, max_new)
    expected = _expected[key]
    llm = LLM(name, loaded=fresh_model(name), **engine)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, ignore_eos=True))
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.token_ids == e, f"prompt {i} ({len(prompts[i])} tokens) diverged"
    return llm.stats()
