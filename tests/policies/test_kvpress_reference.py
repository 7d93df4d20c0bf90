"""kvlab's policies against the committed kvpress 0.5.5 reference (experiments/kvpress_parity/reference_smollm2.json).

The reference holds, for 6 SmolLM2 prompts x 8 presses x 3 compression ratios, the token ids, the tokens every
layer and KV head kept after the whole prompt was compressed once at the end of prefill, and the greedy
continuation (how it was made: experiments/kvpress_parity/README.md). Here kvlab runs the same token ids with
the same policy parameters and ratio (`when="prefill"`, the prompt in one chunk) and must keep exactly the
reference's set in every layer and KV head, and continue with exactly the reference's tokens. The no-press
control: the full cache continues as `continuation_no_press`.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from kvlab import LLM, SamplingParams

HERE = Path(__file__).resolve().parents[2] / "experiments" / "kvpress_parity"
KVLAB_NAME = {"knorm": "knorm", "streaming_llm": "streaming_llm", "snapkv": "snapkv", "tova": "tova",
              "keydiff": "keydiff", "pyramidkv": "pyramidkv", "pyramidkv_window8": "pyramidkv",
              "expected_attention": "expected_attention"}


def reference_format():
    spec = importlib.util.spec_from_file_location("reference_format", HERE / "reference_format.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def reference():
    return json.loads((HERE / "reference_smollm2.json").read_text())


def test_the_reference_covers_every_press_kvlab_matches(reference):
    """Every press of the reference maps to a kvlab policy, at every ratio, on every prompt."""
    assert set(reference["presses"]) == set(KVLAB_NAME)
    cells = {(r["press"], r["compression_ratio"], r["prompt"]) for r in reference["runs"]}
    assert cells == {(p, r, i) for p in KVLAB_NAME for r in (0.25, 0.5, 0.75) for i in range(6)}


def kvlab_run(loaded, press: str, params: dict, ratio: float | None, token_ids: list[int], max_tokens: int):
    """kvlab's greedy continuation and, per layer, the kept cache indices per KV head."""
    policy_args = {} if ratio is None else {"compression_ratio": ratio, "when": "prefill", **params}
    llm = LLM("smollm2-135m", loaded=copy.deepcopy(loaded), policy=KVLAB_NAME[press] if ratio is not None else "full",
              policy_args=policy_args, max_num_batched_tokens=1024, kv_cache_memory="64MiB")
    kept: dict[int, tuple[list[list[int]], list[list[float]]]] = {}  # layer -> (kept per head, scores per head)
    if ratio is not None:
        policy = llm.engine.compressor.policy
        select = policy.select

        def recording(layer, num_layers, keys, values, queries, stats, *args, **kwargs):
            out = select(layer, num_layers, keys, values, queries, stats, *args, **kwargs)
            heads = [list(range(keys.shape[0]))] * keys.shape[1] if out is None else out
            scores = policy.score(layer, keys, values, queries, stats).float().T.tolist()  # [Hkv][L]
            kept[layer] = (heads if heads and isinstance(heads[0], list) else [heads] * keys.shape[1], scores)
            return out

        policy.select = recording
    out = llm.generate([token_ids], SamplingParams(max_tokens=max_tokens))[0].token_ids
    return list(out), kept


def check_run(loaded, reference, run: dict, continuation: bool = True) -> None:
    """kvlab keeps the reference's tokens in every layer and KV head (and continues with its tokens)."""
    decode = reference_format().decode_kept
    prompt = reference["prompts"][run["prompt"]]["token_ids"]
    press, ratio = run["press"], run["compression_ratio"]
    out, kept = kvlab_run(loaded, press, reference["presses"][press]["parameters"], ratio, prompt,
                          len(run["continuation"]) if continuation else 1)
    where = f"{press} r={ratio} prompt {run['prompt']}"
    assert sorted(kept) == list(range(len(run["kept"]))), f"{where}: layers compressed {sorted(kept)}"
    for layer, heads in enumerate(run["kept"]):
        ours, scores = kept[layer]
        assert len(ours) == len(heads)
        for head, mask in enumerate(heads):
            theirs = decode(mask, len(prompt))
            assert len(ours[head]) == len(theirs) == run["n_kept_per_layer"][layer], where
            if ours[head] == theirs:
                continue
            # only a tie at the boundary may be broken otherwise (README: knorm's layer 0, where repeated tokens
            # have keys of one norm; attention scores a rounding apart): kvpress's margin there is within float32
            # rounding of the scores, and so are the scores of the swapped tokens here
            mine, other = set(ours[head]) - set(theirs), set(theirs) - set(ours[head])
            swapped = [scores[head][i] for i in mine | other]
            tol = 1e-5 * max(abs(x) for x in swapped)  # float32 rounding of a sum, relative to the boundary's scores
            margin = run["score_margin_per_layer"][layer]
            assert margin <= tol and max(swapped) - min(swapped) <= tol, (
                f"{where}: layer {layer} head {head} keeps {len(mine)} tokens the reference drops "
                f"({sorted(mine)[:6]}...) instead of {sorted(other)[:6]}... (their scores span "
                f"{max(swapped) - min(swapped):.1e}, kvpress's boundary margin {margin:.1e})")
    assert out == run["continuation"][: len(out)], f"{where}: continuation differs"


FAST = ("snapkv", "streaming_llm", "knorm", "pyramidkv_window8")  # a vote, a fixed pattern, a norm, a schedule


@pytest.mark.model
def test_presses_keep_the_reference_tokens(load_reference, reference):
    """Four presses at ratio 0.5 on the shortest prompt (317 tokens): every kept set (30 layers x 3 KV heads),
    and SnapKV's and StreamingLLM's 32-token continuations (every press, ratio and continuation: heavy, below)."""
    loaded = load_reference("smollm2-135m")
    runs = [r for r in reference["runs"] if r["prompt"] == 0 and r["compression_ratio"] == 0.5 and r["press"] in FAST]
    assert len(runs) == len(FAST)
    for run in runs:
        check_run(loaded, reference, run, continuation=run["press"] in ("snapkv", "streaming_llm"))


@pytest.mark.heavy
@pytest.mark.model
def test_the_full_cache_continues_as_the_no_press_control(load_reference, reference):
    prompt = reference["prompts"][0]
    out, _ = kvlab_run(load_reference("smollm2-135m"), "knorm", {}, None, prompt["token_ids"],
                       len(prompt["continuation_no_press"]))
    assert out == prompt["continuation_no_press"] == prompt["continuation_hf_generate"]


@pytest.mark.heavy
@pytest.mark.model
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("prompt", [0, 1, 3])  # 317, 375 (PyramidKV's round-half-even budget) and 577 tokens
def test_every_press_keeps_the_reference_tokens_and_continues_alike(load_reference, reference, prompt, ratio):
    loaded = load_reference("smollm2-135m")
    for run in (r for r in reference["runs"] if r["prompt"] == prompt and r["compression_ratio"] == ratio):
        check_run(loaded, reference, run)
