"""The kvlab side of the kvpress parity harness: run kvlab's policies on the reference prompts and compare.

For every (press, compression ratio) in reference_smollm2.json that kvlab has, kvlab runs the same
prompts (token ids) on SmolLM2-135M with `policy_args={"compression_ratio": r, "when": "prefill"}` plus
the press's parameters, the whole prompt prefilled in one chunk, greedy; it records which cache indices
every layer kept. Reported per press and ratio: prompts whose greedy continuation is identical, and how
kvlab's kept set compares with kvpress's per KV head (exact matches, mean Jaccard). Both keep one set
per KV head (kvlab's `per_head=True`, its default).

    python experiments/kvpress_parity/compare.py      # about 10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

from kvlab.study.bench_io import commit_line, load_average, log, metadata, table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from reference_format import load_reference  # noqa: E402

KVLAB_NAME = {"knorm": "knorm", "streaming_llm": "streaming_llm", "snapkv": "snapkv", "tova": "tova",
              "keydiff": "keydiff", "pyramidkv": "pyramidkv", "pyramidkv_window8": "pyramidkv",
              "expected_attention": "expected_attention"}
COLUMNS = [("press", "press"), ("ratio", "ratio"), ("same_continuation", "same continuation"),
           ("kept_exact", "kept sets identical (layer x head)"), ("kept_jaccard", "kept-set Jaccard (mean)"),
           ("note", "note")]


def run_press(loaded, press: str, params: dict, ratio: float, prompts: list[list[int]], max_tokens: list[int]):
    """kvlab's continuations and kept cache indices ([prompt][layer] -> sorted indices) for one press."""
    from kvlab import LLM, SamplingParams

    args = {"compression_ratio": ratio, "when": "prefill", **params}
    llm = LLM("smollm2-135m", loaded=copy.deepcopy(loaded), policy=KVLAB_NAME[press], policy_args=args,
              max_num_batched_tokens=1024, kv_cache_memory="512MiB")
    policy = llm.engine.compressor.policy
    kept: list[dict[int, list[int]]] = []
    select = type(policy).select

    def recording(self, layer_idx, num_layers, keys, *rest):
        out = select(self, layer_idx, num_layers, keys, *rest)
        kept[-1][layer_idx] = list(range(keys.shape[0])) if out is None else out
        return out

    type(policy).select = recording
    try:
        outs = []
        for ids, n in zip(prompts, max_tokens):  # one at a time: the kept sets are recorded per prompt
            kept.append({})
            outs.append(llm.generate([ids], SamplingParams(max_tokens=n))[0].token_ids)
    finally:
        type(policy).select = select
    return outs, kept


def compare(args) -> dict:
    from kvlab.models import load_model

    ref = load_reference()
    loaded = load_model("smollm2-135m")
    prompts = [p["token_ids"] for p in ref["prompts"]]
    rows = []
    for press, spec in ref["presses"].items():
        if press not in KVLAB_NAME or (args.presses and press not in args.presses):
            continue
        for ratio in sorted({r["compression_ratio"] for r in ref["runs"] if r["press"] == press}):
            runs = sorted((r for r in ref["runs"] if r["press"] == press and r["compression_ratio"] == ratio),
                          key=lambda r: r["prompt"])
            t0 = time.perf_counter()
            outs, kept = run_press(loaded, press, spec["parameters"], ratio, [prompts[r["prompt"]] for r in runs],
                                   [len(r["continuation"]) for r in runs])
            same = sum(o == r["continuation"] for o, r in zip(outs, runs))
            exact, jaccard = 0, []
            for k, r in zip(kept, runs):
                for layer, heads in enumerate(r["kept"]):
                    mine = k.get(layer, [])
                    per_head = mine if mine and isinstance(mine[0], list) else [mine] * len(heads)
                    for ours, theirs in zip(per_head, heads):
                        ours, theirs = set(ours), set(theirs)
                        exact += ours == theirs
                        jaccard.append(len(ours & theirs) / max(1, len(ours | theirs)))
            total = sum(len(r["kept"]) * len(r["kept"][0]) for r in runs)
            rows.append({"press": press, "ratio": ratio, "same_continuation": f"{same}/{len(runs)}",
                         "kept_exact": f"{exact}/{total}", "kept_jaccard": statistics.mean(jaccard),
                         "note": ""})
            log(f"{press} r={ratio}: {same}/{len(runs)} continuations, {exact}/{total} kept sets, "
                f"{time.perf_counter() - t0:.0f} s")
    return {"rows": rows, "reference_meta": ref["meta"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presses", nargs="*", default=None, help="only these presses (default: all kvlab has)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="experiments/results/kvpress_parity_smollm2")
    args = p.parse_args(argv)
    import torch

    from kvlab.study.loggers.local import write_report

    torch.set_num_threads(1)
    meta = metadata(argparse.Namespace(**vars(args), model="smollm2-135m"))
    results = compare(args)
    meta["load_end"] = load_average()
    text = "\n".join([
        "# kvpress parity on SmolLM2-135M: kvlab's policies against kvpress 0.5.5's presses", "",
        f"Command: `{meta['command']}`  ", f"Date: {meta['started_at']}  ", f"Commit: {commit_line(meta)}  ",
        f"Reference: experiments/kvpress_parity/reference_smollm2.json (kvpress "
        f"{results['reference_meta'].get('versions', {}).get('kvpress', '?')}), 6 prompts of 317-577 tokens, "
        "the whole prompt compressed once at the end of prefill, greedy continuations of 32 tokens.", "",
        table(results["rows"], COLUMNS), "",
        "Both libraries keep one set of cache indices per KV head (kvlab: `per_head=True`, the default). "
        "Where a kept set differs, see experiments/kvpress_parity/README.md for near-ties at the top-k boundary "
        "(attention-based scores are averaged probabilities; a different summation order can swap a boundary "
        "token) and exact ties (knorm's layer 0).", ""])
    print(text)
    md, js = write_report(args.out, text, {"meta": meta, **results})
    log(f"wrote {md} and {js}")
    return results


if __name__ == "__main__":
    main()
