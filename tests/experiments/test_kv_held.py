"""KV held in bytes and tokens compares across configurations; pages do not (issue 21, item 16).

A compressing policy gives every layer (AdaKV: every layer and KV head) its own table, so its pages hold
one layer (one head): on random:llama-tiny (2 layers, 2 KV heads) a snapkv page is half a full-cache
page and an adakv page a quarter. Two 200-token prompts, budget 64: the compressing policies hold fewer
bytes and tokens than the full cache while using more pages."""

from __future__ import annotations

import random

import pandas as pd
import pytest

from kvlab import LLM, SamplingParams
from kvlab.study.analysis import COSTS, leaderboard
from kvlab.cache.block_manager import LayerGroup
from kvlab.metrics import tokens_per_page

BLOCK, LAYERS, HEADS, HEAD_DIM = 16, 2, 2, 16  # random:llama-tiny's shape
TOKEN_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * 4  # K and V of every layer and KV head, fp32


@pytest.fixture(scope="module")
def held():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(200)] for _ in range(2)]
    out = {}
    for name, policy, args, quant in (("full", "full", {}, "auto"), ("snapkv", "snapkv", {"budget": 64}, "auto"),
                                      ("adakv", "adakv", {"budget": 64}, "auto"), ("int8", "full", {}, "int8")):
        llm = LLM("random:llama-tiny", policy=policy, policy_args=args, quant=quant, kv_cache_memory="4MiB",
                  block_size=BLOCK, seed=0)
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        out[name] = llm.stats()
    return out


def test_compressing_policies_hold_fewer_bytes_and_tokens_though_more_pages(held):
    full = held["full"]
    for name in ("snapkv", "adakv"):
        s = held[name]
        assert s["kv_bytes_mean"] < full["kv_bytes_mean"] and s["kv_tokens_mean"] < full["kv_tokens_mean"], name
        assert s["kv_blocks_mean"] > full["kv_blocks_mean"], name  # why pages are not on the leaderboard


@pytest.mark.parametrize("name,layers,heads", [("full", LAYERS, HEADS), ("snapkv", 1, HEADS), ("adakv", 1, 1)])
def test_bytes_and_tokens_follow_what_a_page_holds(held, name, layers, heads):
    s = held[name]
    page_bytes = BLOCK * layers * heads * HEAD_DIM * 2 * 4  # from the model's shape, not from the engine
    for key in ("peak", "mean"):
        assert s[f"kv_bytes_{key}"] == pytest.approx(s[f"kv_blocks_{key}"] * page_bytes)
        assert s[f"kv_tokens_{key}"] == pytest.approx(s[f"kv_bytes_{key}"] / TOKEN_BYTES)  # fp32: bytes = tokens
    if name == "full":
        assert s["kv_tokens_peak"] == s["kv_blocks_peak"] * BLOCK
    else:
        assert s["policy_bytes_freed"] == s["policy_pages_freed"] * page_bytes > 0


def test_tokens_do_not_depend_on_the_cache_format(held):
    """int8 pages cost fewer bytes than fp32 ones but hold the same tokens."""
    assert held["int8"]["kv_tokens_mean"] == held["full"]["kv_tokens_mean"]
    assert held["int8"]["kv_bytes_mean"] < held["full"]["kv_bytes_mean"] / 2


def test_tokens_per_page_counts_a_page_as_the_share_of_the_model_it_holds():
    whole = [LayerGroup((0, 1))]
    per_layer = [LayerGroup((0,)), LayerGroup((1,))]
    per_head = [LayerGroup((layer,), None, head) for layer in (0, 1) for head in (0, 1)]
    gemma = [LayerGroup((i,), 8 if i < 5 else None) for i in range(6)]  # gemma3-tiny: 6 groups of one layer
    assert tokens_per_page(whole, 16, 2) == 16
    assert tokens_per_page(per_layer, 16, 2) == 8
    assert tokens_per_page(per_head, 16, 2) == 4
    assert tokens_per_page(gemma, 16, 1) == pytest.approx(16 / 6)


def test_the_leaderboard_reports_bytes_and_tokens_never_pages():
    assert not [name for _, name, _, _ in COSTS if "page" in name.lower()]
    assert not [column for column, *_ in COSTS if "blocks" in column or "pages" in column]
    runs = pd.DataFrame([{"status": "finished", "model.name": "m", "policy.name": policy,
                          "policy.compression_ratio": ratio, "workload/kv_blocks_mean": blocks,
                          "workload/kv_bytes_mean": mib * 2**20, "workload/kv_tokens_mean": tokens,
                          "workload/policy_pages_freed": freed, "workload/policy_bytes_freed": freed * 2**19}
                         for policy, ratio, blocks, mib, tokens, freed in (("full", 0.0, 26, 2.0, 416, 0),
                                                                          ("snapkv", 0.5, 28, 1.0, 224, 36))])
    board = leaderboard(runs).set_index("method")
    assert board.loc["snapkv", "KV MiB held (mean)"] == 1.0 and board.loc["snapkv", "KV tokens held (mean)"] == 224
    assert board.loc["snapkv", "KV MiB freed"] == 18.0
    assert not [c for c in board.columns if "page" in c.lower() or "block" in c.lower()]
