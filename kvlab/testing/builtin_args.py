"""Arguments under which each built-in plugin does something on the tiny random models (prompts of ~20-100
tokens): what the conformance and combination suites, their tests and the composition matrix run."""

from __future__ import annotations

TINY = "random:llama-tiny"

POLICY_ARGS = {  # every compressing policy -> arguments that compress ~50-100-token prompts
    "random": {"budget": 32},
    "streaming_llm": {"budget": 32},
    "knorm": {"budget": 32},
    "keydiff": {"compression_ratio": 0.5},
    "snapkv": {"budget": 32, "window_size": 8},
    "tova": {"compression_ratio": 0.6},
    "pyramidkv": {"budget": 32, "window_size": 8},
    "chunkkv": {"budget": 32, "window_size": 8, "chunk_size": 5},
    "h2o": {"budget": 32, "recent": 8},
    "expected_attention": {"budget": 32, "n_future_positions": 64},
    "adakv": {"budget": 32, "scorer_args": {"window_size": 8}},
    "rocketkv": {"budget": 64, "window_size": 8, "kernel_size": 5},
}

DRAFT_ARGS = {  # the drafts that run on a tiny model (the cross-vocabulary ones need two real tokenizers)
    "ngram": {"num_tokens": 3},
    "model": {"model": TINY, "num_tokens": 3},
    "layerskip": {"layers": 1, "num_tokens": 3},
    "tree": {"layers": 1, "width": 2, "depth": 2},
    "self_compressed": {"policy": "streaming_llm", "policy_args": {"budget": 32}, "num_tokens": 3},
}

SPARSE_ARGS = {  # policies that read selected pages at decode without compacting
    "quest": {"budget": 32, "dense_layers": 0},  # every layer sparse (the default leaves the tiny models' 2 dense)
}

RATIO_ARGS = {  # every compressing policy at kvpress's ratio 0.5 (rocketkv: a budget, tokens read per decode step)
    "random": {"compression_ratio": 0.5},
    "streaming_llm": {"compression_ratio": 0.5},
    "knorm": {"compression_ratio": 0.5},
    "keydiff": {"compression_ratio": 0.5},
    "snapkv": {"compression_ratio": 0.5, "window_size": 8},
    "tova": {"compression_ratio": 0.5},
    "pyramidkv": {"compression_ratio": 0.5, "window_size": 8},
    "chunkkv": {"compression_ratio": 0.5, "window_size": 8, "chunk_size": 5},
    "h2o": {"compression_ratio": 0.5, "recent": 8},
    "expected_attention": {"compression_ratio": 0.5, "n_future_positions": 64},
    "adakv": {"compression_ratio": 0.5, "scorer_args": {"window_size": 8}},
    "rocketkv": {"budget": 32, "window_size": 8, "kernel_size": 5},
}
