"""Adaptive vs fixed draft length on free text: SmolLM2-135M at batch 1, kvlab against Hugging Face, same run.

Two drafts of another model (kvlab/speculation/draft_length.py moves their chain length):
- `model`: a smaller model with the target's tokenizer -- SmolLM2's first `--model-draft-layers` layers (24 of
  30, as experiments/bench_speculation.py's `layerskip:layers=24`), with its final norm and head, saved as a
  checkpoint of its own in a temporary folder (no smaller SmolLM2 is packaged); 0: the target's own checkpoint.
- `slem`: a draft with another tokenizer, Gemma3-270M (`--slem-draft`), as experiments/bench_cross_vocab.py's
  reverse pair: its text re-tokenised into SmolLM2's tokens.
Each draws chains `fixed` (num_tokens g), `step` (adaptive +1 / -1 up to --max-num-tokens), `heuristic`
(adaptive +2 / -1, Hugging Face's schedule) and `heuristic+conf` (the same with a confidence stop at
--threshold, Hugging Face's default 0.4). Hugging Face assisted generation runs the same drafts
(`assistant_model`, with `tokenizer` + `assistant_tokenizer` for Gemma) as `constant`, `heuristic_transient`
(kvlab's heuristic: the length restarts at g for every request) and `heuristic_transient` with
`assistant_confidence_threshold` -- set on the assistant's own `generation_config`, which is where this
transformers version reads them (its defaults are 20 tokens and a 0.4 threshold it re-fits by ROC). There is no
Hugging Face +1 / -1 schedule.

Free generation (a short story, little to copy: acceptance is low, where adaptive length should pay), greedy,
EOS ignored, --prompts prompts one at a time, --max-tokens new tokens, medians of --repeats rounds; every round
runs plain kvlab, every kvlab variant, plain Hugging Face and every Hugging Face variant. One kvlab engine per
draft (a draft model and its pool built once: memory is short), its length options set between runs.

    nice -n 10 python experiments/bench_adaptive_length.py --out experiments/results/adaptive_length_smollm2
    python experiments/bench_adaptive_length.py --max-tokens 6 --repeats 1 --out /tmp/adaptive   # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_speculation import prompts  # noqa: E402
from bench_throughput import commit_line, load_average, log, metadata, table  # noqa: E402

VARIANTS = {  # label -> (kvlab length options, Hugging Face assistant options or None)
    "fixed": ({"adaptive": False},
              {"num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}),
    "step": ({"adaptive": True, "length_rule": "step"}, None),
    "heuristic": ({"adaptive": True, "length_rule": "heuristic"},
                  {"num_assistant_tokens_schedule": "heuristic_transient", "assistant_confidence_threshold": 0.0}),
    "heuristic+conf": ({"adaptive": True, "length_rule": "heuristic", "confidence": True},
                       {"num_assistant_tokens_schedule": "heuristic_transient", "confidence": True}),
}
COLUMNS = [("draft", "draft"), ("variant", "length"), ("kvlab_speedup", "kvlab speedup"),
           ("kvlab_tok_s", "kvlab tok/s"), ("acceptance", "acceptance a"), ("chain", "tokens drafted / verification"),
           ("accepted_len", "mean accepted length"), ("draft_share", "draft share of step time"),
           ("identical", "kvlab = plain"), ("hf_speedup", "HF speedup"), ("hf_tok_s", "HF tok/s"),
           ("hf_identical", "HF = kvlab plain")]


def truncated_draft(loaded, layers: int, folder: str):
    """SmolLM2's first `layers` decoder layers with its final norm and head, saved to `folder` (weights and
    tokenizer) -> the model, on sdpa attention, for Hugging Face's assistant."""
    import copy

    model = copy.deepcopy(loaded.model)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    model.set_attn_implementation("sdpa")
    return model.eval()


def set_length(draft, options: dict, args) -> None:
    """A built draft's length options for the next run (the rule object too: kvlab/speculation/draft_length.py)."""
    from kvlab.speculation.draft_length import length_rule

    draft.num_tokens, draft.max_num_tokens = args.num_tokens, args.max_num_tokens
    draft.adaptive = options["adaptive"]
    draft.length_rule = options.get("length_rule", "step")
    draft.rule = length_rule(draft.length_rule, draft.registry_name)
    draft.confidence_threshold = args.threshold if options.get("confidence") else None


def kvlab_run(llm, ps, max_tokens) -> tuple[dict, list[list[int]]]:
    from kvlab import SamplingParams

    llm.reset_stats()
    outs = [o.token_ids for p in ps for o in llm.generate([p], SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    return llm.stats(), outs


def hf_run(target, ps, max_tokens, assistant=None, options=None, args=None, **extra) -> tuple[float, list[list[int]]]:
    """Greedy Hugging Face `generate` of each prompt -> (seconds, new tokens); the assistant's options on its own
    generation_config, set afresh before every call."""
    import torch

    seconds, outs = 0.0, []
    for p in ps:
        kw = {}
        if assistant is not None:
            cfg = assistant.generation_config
            cfg.num_assistant_tokens = args.num_tokens
            cfg.num_assistant_tokens_schedule = options["num_assistant_tokens_schedule"]
            cfg.assistant_confidence_threshold = (args.threshold if options.get("confidence")
                                                  else options["assistant_confidence_threshold"])
            kw = {"assistant_model": assistant, **extra}
        x = torch.tensor([p])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
        seconds += time.perf_counter() - t0
        outs.append(out[0, len(p):].tolist())
    return seconds, outs


def main(argv=None) -> dict:
    args = parse_args(argv)
    import copy

    import torch

    from kvlab import LLM
    from kvlab.models import load_model
    from kvlab.study.loggers.local import write_report

    torch.set_num_threads(args.threads)
    args.model = args.target
    meta = metadata(args)
    target = load_model(args.target)
    shared = copy.deepcopy(target)  # one copy for every kvlab engine (they re-wire its attention alike)
    hf_target = target.model.eval()  # the original for Hugging Face
    hf_target.set_attn_implementation("sdpa")
    engine = dict(block_size=16, kv_cache_memory="128MiB", max_num_batched_tokens=512)
    longest = {"num_tokens": args.num_tokens, "adaptive": True, "max_num_tokens": args.max_num_tokens}
    tmp = tempfile.TemporaryDirectory(prefix="kvlab-draft-")
    drafts = {}  # name -> (kvlab LLM, Hugging Face assistant, Hugging Face extra kwargs)
    if args.model_draft_layers:
        hf_small = truncated_draft(target, args.model_draft_layers, tmp.name)
        drafts["model"] = (LLM(args.target, loaded=shared, draft="model",
                               draft_args={"model": tmp.name, **longest}, **engine), hf_small, {})
    else:
        hf_small = copy.deepcopy(hf_target)
        drafts["model"] = (LLM(args.target, loaded=shared, draft="model",
                               draft_args={"model": args.target, **longest}, **engine), hf_small, {})
    other = load_model(args.slem_draft)
    other.model.set_attn_implementation("sdpa")
    drafts["slem"] = (LLM(args.target, loaded=shared, draft="slem", draft_args={"model": args.slem_draft, **longest},
                          **engine), other.model.eval(),
                      {"tokenizer": target.tokenizer, "assistant_tokenizer": other.tokenizer})
    plain = LLM(args.target, loaded=shared, **engine)
    ps = prompts(target.tokenizer, "free")[:args.prompts]
    hf_run(hf_target, [ps[0][:8]], 2)  # warm-up, not timed
    runs: dict[tuple[str, str], list[dict]] = {(d, v): [] for d in drafts for v in VARIANTS}
    for r in range(args.repeats):
        base, base_out = kvlab_run(plain, ps, args.max_tokens)
        hf_s, hf_out = hf_run(hf_target, ps, args.max_tokens)
        log(f"round {r}: kvlab plain {base['tokens_per_s']:.2f} tok/s, HF plain {len(ps) * args.max_tokens / hf_s:.2f}")
        for name, (llm, assistant, extra) in drafts.items():
            for variant, (options, hf_options) in VARIANTS.items():
                set_length(llm.engine.speculator.draft, options, args)
                sp, out = kvlab_run(llm, ps, args.max_tokens)
                row = {"kvlab_tok_s": sp["tokens_per_s"], "kvlab_speedup": sp["tokens_per_s"] / base["tokens_per_s"],
                       "acceptance": sp["spec_acceptance_rate"], "accepted_len": sp["spec_mean_accepted_length"],
                       "chain": sp["spec_drafted_tokens"] / max(1, sp["spec_verifications"]),
                       "draft_share": sp["spec_draft_time_share"], "identical": out == base_out}
                if hf_options is not None:
                    s, got = hf_run(hf_target, ps, args.max_tokens, assistant, hf_options, args, **extra)
                    row.update(hf_tok_s=len(ps) * args.max_tokens / s, hf_speedup=hf_s / s,
                               hf_identical=got == base_out)
                runs[(name, variant)].append(row)
                log(f"round {r}: {name} {variant}: kvlab {row['kvlab_speedup']:.2f}x (a={row['acceptance']:.2f}, "
                    f"chain {row['chain']:.2f})" + (f", HF {row['hf_speedup']:.2f}x" if "hf_speedup" in row else ""))
    rows = [summarise(name, variant, rs) for (name, variant), rs in runs.items()]
    text = report(rows, meta, args)
    print(text)
    md, _ = write_report(args.out, text, {"meta": {**meta, "load_end": load_average()}, "rows": rows})
    log(f"wrote {md}")
    tmp.cleanup()
    return {"rows": rows}


def summarise(name: str, variant: str, rs: list[dict]) -> dict:
    row = {"draft": name, "variant": variant, "runs": rs}
    for k in ("kvlab_tok_s", "kvlab_speedup", "acceptance", "accepted_len", "chain", "draft_share", "hf_tok_s",
              "hf_speedup"):
        vals = [x[k] for x in rs if k in x]
        row[k] = statistics.median(vals) if vals else float("nan")
    row["identical"] = "yes" if all(x["identical"] for x in rs) else "NO"
    row["hf_identical"] = ("yes" if all(x["hf_identical"] for x in rs) else "NO") if "hf_identical" in rs[0] else "-"
    return row


def report(rows: list[dict], meta: dict, args) -> str:
    draft = (f"SmolLM2's first {args.model_draft_layers} layers (a checkpoint of its own)" if args.model_draft_layers
             else f"{args.target} itself")
    return "\n".join([
        f"# Adaptive vs fixed draft length on free text: {args.target}, batch 1, kvlab and Hugging Face", "",
        f"Command: `nice -n 10 {meta['command']}`  ", f"Date: {meta['started_at']}  ", f"Commit: {commit_line(meta)}  ",
        f"Load average (1/5/15 min) at start: {meta['load_start']}, at end: {load_average()} -- the machine (2 cores) "
        f"ran other agents' jobs at the same time: read the speedups (same round), not the absolute tok/s.", "",
        f"Free generation (a short story), greedy, EOS ignored, {args.prompts} prompt(s) one at a time, "
        f"{args.max_tokens} new tokens, {args.threads} torch thread(s), medians of {args.repeats} rounds. `model` "
        f"draft: {draft}; `slem` draft: {args.slem_draft} (another tokenizer). Lengths: fixed g = {args.num_tokens}; "
        f"adaptive from g up to {args.max_num_tokens} (`step` +1 / -1, `heuristic` +2 / -1); `+conf`: a confidence "
        f"stop at {args.threshold}. kvlab speedup: tok/s of engine time over plain kvlab's in the same round; HF "
        f"speedup: wall time of plain `generate` over assisted `generate` in the same round (prefill included), "
        f"with `constant`, `heuristic_transient` (no upper bound) and, for `+conf`, "
        f"`assistant_confidence_threshold={args.threshold}` (which Hugging Face re-fits by ROC for a same-tokenizer "
        f"assistant as it goes) on the assistant's generation_config, g = {args.num_tokens} to start; no HF row for "
        f"`step` (it has no +1 / -1 schedule).", "",
        table(rows, COLUMNS), ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--model-draft-layers", type=int, default=24,
                   help="the `model` draft: the target's first N layers as a checkpoint of its own (0: the target)")
    p.add_argument("--slem-draft", default="gemma3-270m")
    p.add_argument("--num-tokens", type=int, default=4, help="g: the fixed length, and where adaptive ones start")
    p.add_argument("--max-num-tokens", type=int, default=8)
    p.add_argument("--threshold", type=float, default=0.4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "adaptive_length_smollm2"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
