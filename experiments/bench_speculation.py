"""Speculative decoding on SmolLM2 (or Gemma 3): plain decoding vs each draft, in the same run.

Two tasks: a repetition-heavy one (copy a given passage with its spelling corrected: most of the
output already appears in the prompt) and free generation (a short story: little to look up).
Greedy, EOS ignored, batch 1 (--batch1 prompts one at a time) and batch 8. Drafts (--drafts, each
`name:key=value,...`): `ngram` by default; `layerskip` (the target's first layers) and `tree` (a
token tree of the early exit's top-k branches). For each: tokens/s of engine time for plain
decoding and for the draft, their ratio, the acceptance rate a, the
mean accepted length (tokens per verification, bonus included) against the i.i.d. prediction
(1 - a^(g+1)) / (1 - a) for g drafted tokens, the draft's share of step time, and whether the
outputs are token-identical (they must be). Medians over --repeats rounds. With --hf, the Hugging
Face assisted-generation anchor at batch 1 on the same prompts: plain `generate` against
`prompt_lookup_num_tokens` (for ngram) and `assistant_early_exit` (for layerskip), wall-clock tok/s.

    python experiments/bench_speculation.py                      # ~10 minutes on 2 busy cores
    python experiments/bench_speculation.py --model random:llama-tiny --max-tokens 16 --repeats 1 --out /tmp/spec
    python experiments/bench_speculation.py --drafts ngram:num_tokens=4 layerskip:layers=24,num_tokens=3 \
        tree:layers=24,width=2,depth=3 --hf --out experiments/results/speculation_selfspec_smollm2
    python experiments/bench_speculation.py --drafts self_compressed:policy=streaming_llm,policy_args.budget=256 \
        self_compressed:policy=streaming_llm,policy_args.budget=64 --out experiments/results/speculation_self_compressed_smollm2
    python experiments/bench_speculation.py --policy snapkv:compression_ratio=0.5 --drafts ngram layerskip:layers=24 \
        --out experiments/results/speculation_over_snapkv_smollm2     # speculation over a compressed cache
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from kvlab.study.bench_io import commit_line, fmt, load_average, log, metadata, table

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more then a hundred years. Every night its keeper "
    "climbed the narow stairs, lit the lamp and watched the ships pass safely through the rocky straight.",
    "Our garden has three aple trees, a row of carrots and a small pond where frogs sing in the evening. "
    "In summer we pick beans every morning and give the extra ones to our neigbours.",
    "The train to the capital leaves at seven oclock. Pasengers should arrive early, because the platform "
    "changes often and the announcements are hard to here over the noise of the station.",
    "Bread needs only flour, water, salt and yeast, but good bread needs time. Let the dough rise slowley "
    "overnight in a cool place, then bake it in a very hot oven untill the crust is dark.",
    "The museum opened a new room for old maps. Visitors can see how sailors once drew the coastlines, "
    "with sea monsters in the empty corners and rivers that were never realy there.",
    "Every winter the lake freezes and the children of the village skate on it from morning till night. "
    "Their parents watch from the shore, drinking hot tea and worrying about thin ice.",
    "The library lends books, music and even tools. Members can borow a drill for a weekend, as long as "
    "they bring it back clean and on time, with all its peices in the box.",
    "A good map is simple. It shows the roads you need, the places you want to see and nothing else, so "
    "that a traveller can find the way without geting lost in details.",
]
STORIES = ["a robot who learns to paint", "a cat that finds a secret door", "two friends lost in a forest",
           "a baker who wins a prize", "a storm at sea", "a girl who talks to birds", "the last day of summer",
           "a clock that runs backwards"]

COLUMNS = [("task", "task"), ("batch", "batch"), ("draft", "draft"), ("plain_tok_s", "plain tok/s"),
           ("spec_tok_s", "draft tok/s"),
           ("speedup", "speedup"), ("predicted", "predicted (memory traffic)"), ("acceptance", "acceptance a"), ("accepted_len", "mean accepted length"),
           ("predicted_len", "(1-a^(g+1))/(1-a)"), ("draft_share", "draft share of step time"),
           ("identical", "outputs identical")]


def prompts(tokenizer, task: str) -> list[list[int]]:
    if task == "edit":
        texts = [f"Copy the following passage, correcting its spelling mistakes.\n\nPassage: {p}\n\n"
                 f"Corrected passage: " for p in PASSAGES]
    else:
        texts = [f"Write a short story about {s}.\n\nStory: " for s in STORIES]
    return [tokenizer(t)["input_ids"] for t in texts]


def run(llm, batches: list[list[list[int]]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    from kvlab import SamplingParams

    llm.reset_stats()
    outs = []
    for batch in batches:
        outs += [o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    return llm.stats(), outs


def main(argv=None) -> dict:
    args = parse_args(argv)
    import copy

    import torch

    from kvlab import LLM
    from kvlab.study.loggers.local import write_report
    from kvlab.models import load_model

    torch.set_num_threads(args.threads)
    meta = metadata(args)
    loaded = load_model(args.model)
    engine = dict(block_size=16, kv_cache_memory="512MiB", max_num_batched_tokens=512, **cache_args(args))
    plain = LLM(args.model, loaded=copy.deepcopy(loaded), **engine)
    drafts = [parse_draft(d, args.num_tokens) for d in args.drafts]
    specs = [LLM(args.model, loaded=copy.deepcopy(loaded), draft=name, draft_args=dargs, **engine)
             for _, name, dargs in drafts]
    tokenizer = plain.tokenizer
    rows, anchors = [], []
    for task in args.tasks:
        ps = prompts(tokenizer, task) if tokenizer is not None else [[5, 6, 7] * 10] * 8
        for batch in args.batches:
            batches = [[p] for p in ps[:args.batch1]] if batch == 1 else [ps[:batch]]
            runs = [[] for _ in drafts]
            for r in range(args.repeats):
                base, base_out = run(plain, batches, args.max_tokens)
                for (label, _, _), spec, draft_runs in zip(drafts, specs, runs):
                    sp, sp_out = run(spec, batches, args.max_tokens)
                    draft_runs.append({"plain_tok_s": base["tokens_per_s"], "spec_tok_s": sp["tokens_per_s"],
                                       "speedup": sp["tokens_per_s"] / base["tokens_per_s"],
                                       "acceptance": sp["spec_acceptance_rate"],
                                       "accepted_len": sp["spec_mean_accepted_length"],
                                       "draft_share": sp["spec_draft_time_share"], "identical": sp_out == base_out,
                                       "verifications": sp["spec_verifications"], "drafted": sp["spec_drafted_tokens"],
                                       "generated": sp["generated_tokens"], "requests": sp["num_requests"],
                                       "per_position": sp["spec_per_position_acceptance"]})
                    log(f"{task} batch {batch} round {r}: plain {base['tokens_per_s']:.2f} tok/s, {label} "
                        f"{sp['tokens_per_s']:.2f} tok/s, a={sp['spec_acceptance_rate']:.2f}")
            context = statistics.mean(len(p) for b in batches for p in b) + args.max_tokens / 2
            for (label, _, dargs), spec, draft_runs in zip(drafts, specs, runs):
                rows.append(summarise(task, batch, label, draft_runs, dargs.get("depth", dargs.get("num_tokens"))))
                rows[-1]["predicted"] = predicted(plain, spec, batch, context, draft_runs[-1])
            if args.hf and batch == 1:
                anchors += hf_anchor(loaded, task, [b[0] for b in batches], drafts, args.max_tokens, base_out)
    text = report(rows, meta, args, anchors)
    print(text)
    md, _ = write_report(args.out, text, {"meta": meta, "rows": rows})
    log(f"wrote {md}")
    return {"rows": rows}


def cache_args(args) -> dict:
    """The cache both plain decoding and every draft run over: --policy name:key=value,... and --quant."""
    out = {}
    if args.policy:
        _, name, pargs = parse_draft(args.policy, args.num_tokens)
        out.update(policy=name, policy_args=pargs)
    if args.quant:
        out["quant"] = args.quant
    if args.batch_invariant:
        out["batch_invariant"] = True
    return out


def parse_draft(spec: str, num_tokens: int) -> tuple[str, str, dict]:
    """`name:key=value,...` -> (label, name, draft_args); ngram / layerskip / self_compressed default to
    --num-tokens. A dotted key nests: `self_compressed:policy=streaming_llm,policy_args.budget=256` gives
    draft_args {"policy": "streaming_llm", "policy_args": {"budget": 256}}."""
    import ast

    name, _, rest = spec.partition(":")
    dargs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        *outer, key = key.split(".")
        into = dargs
        for part in outer:
            into = into.setdefault(part, {})
        try:
            into[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            into[key] = value
    if name in ("ngram", "layerskip", "model", "self_compressed"):
        dargs.setdefault("num_tokens", num_tokens)
    return spec, name, dargs


def predicted(plain, spec, batch: int, context: float, last: dict) -> float:
    """What memory traffic predicts (kvlab/speculation/cost_model.py) from the last round's drafted and emitted
    tokens per verification, at this batch and the mean context during decoding; 1.0 when nothing was verified."""
    from kvlab.speculation.cost_model import run_speedup
    from kvlab.speculation.engine_traffic import draft_pass, target_traffic

    if not last["verifications"]:
        return 1.0
    target = target_traffic(plain.engine)
    k, emitted = last["drafted"] / last["verifications"], last["accepted_len"]
    decode_tokens = last["generated"] - last["requests"]  # each request's first token comes from its prefill
    share = min(1.0, emitted * last["verifications"] / decode_tokens) if decode_tokens > 0 else 0.0
    return run_speedup(target.pass_bytes(batch, context), target.pass_bytes(batch, context + k),
                       draft_pass(spec.engine)(batch, context), k, emitted, share)


def summarise(task: str, batch: int, label: str, runs: list[dict], g: int) -> dict:
    row = {"task": task, "batch": batch, "draft": label, "runs": runs}
    for k in ("plain_tok_s", "spec_tok_s", "speedup", "acceptance", "accepted_len", "draft_share"):
        row[k] = statistics.median(x[k] for x in runs)
    a = row["acceptance"]
    row["predicted_len"] = (1 - a ** (g + 1)) / (1 - a) if a < 1 else g + 1.0
    row["identical"] = "yes" if all(x["identical"] for x in runs) else "NO"
    row["per_position"] = runs[-1]["per_position"]
    return row


def hf_anchor(loaded, task: str, prompts_: list[list[int]], drafts, max_tokens: int, kvlab_out) -> list[dict]:
    """Hugging Face `generate` at batch 1 on the same prompts: plain, and assisted generation for the
    drafts it has (prompt lookup for ngram, `assistant_early_exit` for layerskip). Wall-clock tok/s."""
    import copy

    import torch

    model = copy.deepcopy(loaded.model).eval()
    model.set_attn_implementation("sdpa")
    kinds = [("plain", {})]
    for label, name, dargs in drafts:
        if name == "ngram":
            ngram = dargs.get("max_ngram", 3)  # HF's default max_matching_ngram_size is 2: kvlab's longest suffix
            kinds.append((f"prompt_lookup_num_tokens={dargs['num_tokens']}, max_matching_ngram_size={ngram}",
                          {"prompt_lookup_num_tokens": dargs["num_tokens"], "max_matching_ngram_size": ngram}))
        if name == "layerskip":  # like for like: HF's assistant defaults to a confidence stop at 0.4; state kvlab's
            threshold = dargs.get("confidence_threshold") or 0.0
            schedule = dargs.get("length_rule", "step") if dargs.get("adaptive") else "constant"
            if schedule == "step":  # HF has no +1 / -1 schedule: its nearest is heuristic (+2 / -1)
                schedule = "heuristic"
            kinds.append((f"assistant_early_exit={dargs['layers']}, num_assistant_tokens={dargs['num_tokens']}, "
                          f"schedule={schedule}, assistant_confidence_threshold={threshold}",
                          {"assistant_early_exit": dargs["layers"], "num_assistant_tokens": dargs["num_tokens"],
                           "num_assistant_tokens_schedule": schedule, "assistant_confidence_threshold": threshold}))
    with torch.no_grad():  # warm-up, not timed
        model.generate(torch.tensor([prompts_[0][:8]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    rows, plain_s = [], None
    for label, extra in kinds:
        outs, t0 = [], time.perf_counter()
        try:
            for p in prompts_:
                ids = torch.tensor([p])
                out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                     eos_token_id=None, pad_token_id=0, **extra)
                outs.append(out[0, len(p):].tolist())
        except Exception as e:  # an option this transformers version refuses: say so in the table
            rows.append({"task": task, "hf": label, "tok_s": float("nan"), "speedup": float("nan"),
                         "identical": f"failed: {type(e).__name__}: {str(e)[:80]}"})
            continue
        s = time.perf_counter() - t0
        plain_s = plain_s or s
        rows.append({"task": task, "hf": label, "tok_s": max_tokens * len(prompts_) / s, "speedup": plain_s / s,
                     "identical": "yes" if outs == kvlab_out else "NO"})
        log(f"HF {task} {label}: {rows[-1]['tok_s']:.2f} tok/s")
    return rows


HF_COLUMNS = [("task", "task"), ("hf", "Hugging Face generate"), ("tok_s", "tok/s"),
              ("speedup", "speedup vs HF plain"), ("identical", "output = kvlab plain")]


def report(rows: list[dict], meta: dict, args, anchors: list[dict] = ()) -> str:
    per_pos = "\n".join(f"- {r['task']}, batch {r['batch']}, {r['draft']}: " +
                        ", ".join(fmt(x) for x in r["per_position"]) for r in rows)
    hf = ["Hugging Face assisted generation at batch 1, same prompts and token count, wall clock "
          "(prefill included, sdpa attention), with the draft length, schedule and confidence threshold of the "
          "kvlab draft stated (Hugging Face's assistant otherwise stops drafting below a top probability of 0.4):",
          "", table(anchors, HF_COLUMNS), ""] if anchors else []
    return "\n".join([
        f"# Speculative decoding on {args.model}: {', '.join(args.drafts)}", "",
        f"Command: `{meta['command']}`  ", f"Date: {meta['started_at']}  ", f"Commit: {commit_line(meta)}  ",
        f"Load average at the end (1/5/15 min): {load_average()} -- the machine (2 cores) ran other agents' "
        f"jobs at the same time, so absolute figures are noisy; ratios come from the same run.", "",
        f"Cache (plain decoding and every draft alike): policy {args.policy or 'full'}, format "
        f"{args.quant or 'fp32'}{', batch-invariant mode' if args.batch_invariant else ''}. "
        f"Greedy, EOS ignored, {args.max_tokens} new tokens per request, drafts as named (g = num_tokens for "
        f"a chain, the depth for a tree), block size 16, {args.threads} torch threads; "
        + "; ".join(f"batch {b} = {args.batch1 if b == 1 else b} prompts {'one at a time' if b == 1 else 'together'}"
                    for b in args.batches) + f"; medians of {args.repeats} rounds. "
        f"tok/s are generated tokens per second of engine time. `edit` copies a given passage with its "
        f"spelling corrected (repetition-heavy); `free` writes a short story.", "",
        table(rows, COLUMNS), "", *hf,
        "Per-position acceptance (last round; position i counts when drafts 0..i-1 were accepted):", "",
        per_pos, "",
        "The predicted speed-up counts bytes read per pass (kvlab/speculation/cost_model.py: the weights once, each "
        "sequence's KV per layer, for target and draft, at the mean context during decoding) with the measured tokens "
        "drafted and emitted per verification; compute and Python overhead, which dominate on two CPU cores, are "
        "not in it.", "",
        "The prediction (1 - a^(g+1)) / (1 - a) assumes every draft is accepted independently with "
        "probability a; n-gram acceptance is bursty (a copied span is accepted whole, a fresh phrase has no "
        "match at all), and rows with no match draft nothing, so the two differ.", ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--num-tokens", type=int, default=4, help="draft length g (chain drafts without num_tokens)")
    p.add_argument("--drafts", nargs="+", default=["ngram"], help="name:key=value,... (e.g. tree:layers=24,width=2)")
    p.add_argument("--hf", action="store_true", help="also run the Hugging Face assisted-generation anchor")
    p.add_argument("--tasks", nargs="+", default=["edit", "free"], choices=["edit", "free"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (1: prompts one at a time)")
    p.add_argument("--batch1", type=int, default=2, help="prompts run one at a time for batch 1")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default=None, help="a compressing policy both runs use, name:key=value,... "
                                                  "(e.g. snapkv:compression_ratio=0.5): speculation over a compressed cache")
    p.add_argument("--quant", default=None, help="the cache format both runs use (e.g. int4)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="both runs in the batch-invariant mode (a rounding format's outputs then match exactly)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "speculation_smollm2"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
