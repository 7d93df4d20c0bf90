"""What the techniques buy together at one KV byte budget: prefix caching, int4, snapkv and n-gram drafts.

Every configuration (fp32 full; each of prefix caching (hashed pages), int4 (KIVI, default arguments),
snapkv at compression_ratio 0.5 (once, at the end of prefill) and n-gram speculation (num_tokens 4) alone;
the six pairs; all four; with --all-subsets also the four triples) serves the same requests at the same
`kv_cache_memory`, chosen so that fp32 full is memory-bound: the pool, not max_num_seqs nor the number of
requests, limits how many sequences run at once (the report checks it). Two workloads, all queued at t=0,
greedy, EOS ignored:
  code    --num-requests rows of the Azure LLM inference trace 2023, code (Patel et al., "Splitwise", ISCA
          2024): prompt lengths x --scale (clipped to --max-context), output lengths x --output-scale
          (clipped to --max-output), prompts cut from WikiText-2 (kvlab.study.workloads.azure);
  shared  --shared-requests requests of one --system-len-token system prompt + a --suffix-len-token suffix
          each, --shared-max-tokens new tokens (kvlab.study.workloads.synthetic.SharedPrefix, one prefix).
Per run: max and mean concurrent sequences, tok/s (generated tokens per second of engine time), the
pool's peak pages, preemptions, prefix hit rate, draft acceptance, and the fraction of requests whose
greedy tokens equal fp32 full's in the same round. Quality per configuration, on an engine of its own:
--num-windows WikiText-2 test windows of --context tokens + --continuation tokens scored teacher-forced
(`LLM.score(..., return_dists=True)`): perplexity of the continuation, and KL(fp32 full || config) of the
next-token distributions (kvlab.study.tasks.agreement.compare), mean and max over positions. With prefix
caching the windows are scored twice and the second pass is measured, so it reads its context from
cached pages (prefix caching and n-gram drafts are lossless: their KL must be 0; the drafts draft nothing
in scoring, so their losslessness is checked by the greedy-token column of the workloads).

For each combination (a pair, a triple, all four): its gain over fp32 full against the product of its
singles' gains, for mean concurrent sequences and tok/s: 0.9-1.1x the product "multiply", more "more than
multiply", within 10% of the larger single "overlap", in between "partly", below 0.9 of the larger single
"interfere" (where the product is within 5% of the larger single, multiply and overlap cannot be told
apart); with the measured reasons a combination cannot add (a single already runs every request at once,
or no longer fills the pool) and the mechanism of each pair.

    python experiments/bench_one_budget.py                       # SmolLM2-135M; ~15 minutes on 2 quiet cores
    python experiments/bench_one_budget.py --repeats 3 --all-subsets
    python experiments/bench_one_budget.py --model random:llama-tiny --num-requests 4 --shared-requests 4 \\
        --max-context 96 --max-output 8 --system-len 64 --suffix-len 16 --shared-max-tokens 8 --context 64 \\
        --continuation 8 --num-windows 2 --max-model-len 512 --out /tmp/one_budget   # smoke, seconds
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import statistics
import time
from types import SimpleNamespace

from kvlab.study.bench_io import REPO, fmt, load_average, log, metadata, provenance, table

TECHNIQUES = ("prefix", "int4", "snapkv", "ngram")
STATS = ("max_concurrent_seqs", "mean_concurrent_seqs", "tokens_per_s", "busy_s", "num_steps", "preemptions",
         "kv_blocks_peak", "kv_blocks_total", "ttft_median_s", "prefix_hit_rate_tokens", "spec_acceptance_rate",
         "spec_mean_accepted_length", "policy_compressions")
COLUMNS = [("config", "configuration"), ("max_concurrent_seqs", "max seqs"), ("mean_concurrent_seqs", "mean seqs"),
           ("tokens_per_s", "tok/s"), ("tok_s_x_full", "tok/s / full"), ("mean_seqs_x_full", "mean seqs / full"),
           ("kl_text", "KL (nats)"), ("kl_max_text", "KL max"), ("ppl", "perplexity"),
           ("same_tokens", "same tokens as full"),
           ("preemptions", "preemptions"), ("pool_use_peak", "pool use peak"),
           ("prefix_hit_rate_tokens", "prefix hit rate"), ("spec_acceptance_rate", "draft acceptance"),
           ("wall_s", "wall s")]
VERDICT_COLUMNS = [("config", "configuration"), ("metric", "metric"), ("singles", "single gains"),
                   ("product", "product"), ("gain", "gain"), ("of_product", "gain / product"),
                   ("verdict", "verdict")]
WHAT = {  # what each technique saves, for the report's reading of the verdicts
    "prefix": "holds a repeated prefix's pages once and skips its prefill (nothing to share on the code trace)",
    "int4": "stores every sealed page in ~1/6 of fp32's bytes (scales included; the newest 32 tokens stay fp32) "
            "and pays a dequantisation per read",
    "snapkv": "drops half of each prompt's tokens at the end of its prefill (a prompt is admitted, and "
              "prefilled, at full length; decoded tokens are kept) and pays a scoring pass",
    "ngram": "saves no memory; verifies up to 4 drafted tokens a step where the output repeats earlier text, "
             "so it shortens decoding only",
}

PAIRS = {  # the mechanism behind each pair's verdict
    ("prefix", "int4"): "different savings (a shared prefix's pages held once; every page in fewer bytes): on memory "
                        "they can multiply; in tok/s prefix's skipped prefill meets int4's slower reads",
    ("prefix", "snapkv"): "a hit's shared pages are kept whole (prefix_keep_shared), so snapkv compresses only each "
                          "request's own tokens: on a shared prompt their memory savings overlap (and what a request "
                          "keeps depends on its hit, a declared deviation)",
    ("prefix", "ngram"): "different phases (prefix saves prefill, ngram decode steps) and no memory from ngram: the "
                         "times saved add, so tok/s lands between the larger single and the product",
    ("int4", "snapkv"): "half the tokens, each in ~1/6 of the bytes, once prefilled: the savings multiply after "
                        "compression, but a prompt is admitted and prefilled at full length",
    ("int4", "ngram"): "more sequences per step (int4) and more tokens per sequence per step (ngram) both make a "
                       "step cost more on CPU, where int4 dequantises every cached token it reads",
    ("snapkv", "ngram"): "ngram drafts from the sequence's own token ids, not from the cache, so compression changes "
                         "its drafts only through changed outputs: memory from snapkv, decode steps from ngram",
}


# -- configurations -------------------------------------------------------------------------
def configurations(all_subsets: bool) -> list[tuple[str, ...]]:
    """fp32 full, each technique alone, the pairs, (the triples), all four: subsets of TECHNIQUES."""
    sizes = (0, 1, 2, 3, 4) if all_subsets else (0, 1, 2, 4)
    return [c for k in sizes for c in itertools.combinations(TECHNIQUES, k)]


def label(config: tuple[str, ...]) -> str:
    return " + ".join(config) if config else "fp32 full"


def engine_args(config: tuple[str, ...], args) -> dict:
    """The engine options of one subset of TECHNIQUES (fp32 full: the engine's defaults, float32 pages)."""
    out: dict = {"quant": "fp32"}
    if "prefix" in config:
        out.update(enable_prefix_caching=True, prefix_cache="hash")
    if "int4" in config:
        out.update(quant="int4", quant_args={})  # KIVI with its defaults
    if "snapkv" in config:
        out.update(policy="snapkv", policy_args={"compression_ratio": args.snapkv_ratio})
    if "ngram" in config:
        out.update(draft="ngram", draft_args={"num_tokens": args.ngram_tokens})
    return out


def build(args, loaded, config: tuple[str, ...], kv_cache_memory):
    from kvlab import LLM

    return LLM(args.model, loaded=copy.deepcopy(loaded), kv_cache_memory=kv_cache_memory, block_size=args.block_size,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_batched_tokens, seed=args.seed, **engine_args(config, args))


# -- workloads --------------------------------------------------------------------------------
def code_trace(shim, args) -> list:
    """The Azure trace's rows: prompt lengths x --scale (load_azure_trace), output lengths x --output-scale."""
    from kvlab.study.tasks.data import get_tokenizer
    from kvlab.study.workloads.azure import load_azure_trace, read_trace

    requests = load_azure_trace(args.trace, args.num_requests, get_tokenizer(shim), max_context=args.max_context,
                                max_output=args.max_output, scale=args.scale, seed=args.seed)
    for request, (_, _, generated) in zip(requests, read_trace(args.trace)[:args.num_requests]):
        request.max_tokens = min(max(1, round(generated * args.output_scale)), args.max_output)
    return requests


def shared_prompt(shim, args) -> list:
    """One system prompt before every request's own suffix (SharedPrefix with a single prefix)."""
    from kvlab.study.tasks.base import RunContext
    from kvlab.study.tasks.data import default_data_dir
    from kvlab.study.workloads.synthetic import SharedPrefix

    task = SharedPrefix(num_prefixes=1, prefix_length=args.system_len, suffix_length=args.suffix_len,
                        num_requests=args.shared_requests, max_tokens=args.shared_max_tokens, seed=args.seed)
    return task.requests(shim, RunContext(data_dir=default_data_dir(), seed=args.seed))


def fp32_budget(model_config, requests_by_workload: dict, args) -> int:
    """--fits whole requests of the larger workload's mean size (in pages), in fp32 pages, all layers."""
    heads, layers = model_config.num_key_value_heads, model_config.num_hidden_layers
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    page_bytes = args.block_size * layers * 2 * heads * head_dim * 4  # K and V, float32
    pages = max(statistics.mean(-(-(len(r.prompt_token_ids) + r.max_tokens) // args.block_size) for r in requests)
                for requests in requests_by_workload.values())
    return math.ceil(args.fits * pages) * page_bytes


# -- one run, and the quality of one configuration ----------------------------------------------------
def serve(llm, requests, warmup: list[int]) -> dict:
    """All requests queued at t=0 (each its own max_tokens, EOS ignored), after a 2-token warm-up."""
    from kvlab import SamplingParams

    llm.generate([warmup], SamplingParams(max_tokens=2))  # shares no prefix with the workload
    llm.reset_stats()
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests],
                        [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in requests])
    wall = time.perf_counter() - start
    stats = llm.stats()
    return {**{k: stats.get(k, float("nan")) for k in STATS}, "wall_s": wall,
            "token_ids": [list(o.token_ids) for o in outs]}


def quality_windows(shim, args) -> tuple[list, list]:
    from kvlab.study.tasks.data import corpus_tokens, evenly_spaced_windows, get_tokenizer
    from kvlab.study.workloads.azure import DEFAULT_CORPUS

    windows = evenly_spaced_windows(corpus_tokens(DEFAULT_CORPUS, None, get_tokenizer(shim)),
                                    args.context + args.continuation, args.num_windows)
    return [w[:args.context] for w in windows], [w[args.context:] for w in windows]


def quality(llm, windows, reference: list | None, prefix: bool) -> tuple[dict, list]:
    """Perplexity of the continuations and KL(reference || llm) per position; with prefix caching the
    measured pass is the second, which finds the contexts' pages cached."""
    from kvlab.study.tasks.agreement import compare

    contexts, continuations = windows
    if prefix:
        llm.score(contexts, continuations)
    llm.reset_stats()
    outs = llm.score(contexts, continuations, return_dists=True)
    nll = -sum(sum(o.logprobs) for o in outs) / sum(len(o.logprobs) for o in outs)
    dists = [o.dists for o in outs]
    pairs = zip(continuations, reference or dists, dists)  # fp32 full is its own reference
    rows = [compare(i, c, c, c, ref, d, len(c)) for i, (c, ref, d) in enumerate(pairs)]  # KL of [T, V] log-probs
    return {"ppl": math.exp(nll), "kl": statistics.mean(r["kl"] for r in rows),
            "kl_max": max(r["kl_max"] for r in rows),
            "quality_prefix_hit_rate": llm.stats().get("prefix_hit_rate_tokens", float("nan"))}, dists


# -- gains: multiply or overlap ------------------------------------------------------------------
def verdict(gain: float, singles: list[float]) -> tuple[float, str]:
    """(gain / product of the singles' gains, the word for it); gains are ratios to fp32 full."""
    product, larger = math.prod(singles), max(singles)
    of_product = gain / product
    if of_product > 1.1:
        return of_product, "more than multiply"
    if abs(product - larger) <= 0.05 * larger and of_product >= 0.9:
        return of_product, "multiply = overlap (the other gains ~1x)"
    if of_product >= 0.9:  # also where a single is a slowdown (< 1x): it multiplies the other's gain
        return of_product, "multiply"
    if gain < 0.9 * larger:
        return of_product, "interfere (below the larger single)"
    if gain <= 1.1 * larger:
        return of_product, "overlap"
    return of_product, "partly"


def verdicts(rows: list[dict]) -> list[dict]:
    by = {row["techniques"]: row for row in rows}
    out = []
    for row in rows:
        if len(row["techniques"]) < 2 or not all((t,) in by for t in row["techniques"]):
            continue
        for key, metric in (("mean_seqs_x_full", "mean seqs"), ("tok_s_x_full", "tok/s")):
            singles = [by[(t,)][key] for t in row["techniques"]]
            of_product, word = verdict(row[key], singles)
            out.append({"config": row["config"], "metric": metric, "gain": row[key], "product": math.prod(singles),
                        "singles": " x ".join(f"{s:.2f}" for s in singles), "of_product": of_product,
                        "verdict": word, "ceiling": ceiling(row, by, key)})
    return out


def ceiling(row: dict, by: dict, key: str) -> str:
    """Why a combination stops short of the product on concurrency: a single technique already runs every
    request at once, or no longer fills the pool (then memory is not what limits it, and saving more cannot add)."""
    if key != "mean_seqs_x_full":
        return ""
    notes = []
    for t in row["techniques"]:
        single = by[(t,)]
        if t == "ngram":  # saves no memory: not what limits a combination's concurrency
            continue
        if single["max_concurrent_seqs"] >= single["num_requests"]:
            notes.append(f"{t} alone already runs all {single['num_requests']} requests at once")
        elif single["pool_use_peak"] < 0.9:
            notes.append(f"{t} alone fills at most {single['pool_use_peak']:.0%} of the pool (memory no longer "
                         f"limits it)")
    return "; ".join(notes)


# -- the run -------------------------------------------------------------------------------------
def run(args) -> dict:
    import torch

    from kvlab.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    shim = SimpleNamespace(tokenizer=loaded.tokenizer, model_config=loaded.model.config)  # what get_tokenizer reads
    makers = {"code": code_trace, "shared": shared_prompt}
    workloads = {name: makers[name](shim, args) for name in args.workloads}
    budget = args.kv_memory or fp32_budget(loaded.model.config, workloads, args)
    log(f"KV budget: {budget if isinstance(budget, str) else f'{budget / 2**20:.2f} MiB'}")
    windows = quality_windows(shim, args)
    warmup = windows[0][-1][:32]  # a quality context's tail: no workload prompt starts with it
    configs = configurations(args.all_subsets)
    first = next(iter(workloads.values()))
    serve(build(args, loaded, (), budget), first[:2], warmup)  # the process's first passes, not measured
    runs = {(w, c): [] for w in workloads for c in configs}
    for r in range(args.repeats):
        for w, requests in workloads.items():
            order = configs if r % 2 == 0 else configs[:1] + configs[:0:-1]  # fp32 full first: the reference
            for config in order:
                llm = build(args, loaded, config, budget)
                runs[w, config].append(serve(llm, requests, warmup))
                x = runs[w, config][-1]
                full = runs[w, ()][-1]["token_ids"]
                x["same_tokens"] = statistics.mean(a == b for a, b in zip(x["token_ids"], full))
                log(f"round {r + 1} {w} {label(config)}: max {x['max_concurrent_seqs']} mean "
                    f"{x['mean_concurrent_seqs']:.2f} seqs, {x['tokens_per_s']:.2f} tok/s, same tokens "
                    f"{x['same_tokens']:.2f}")
                del llm
    qualities, reference = {}, None
    for config in configs:  # fp32 full first: its distributions are the reference
        llm = build(args, loaded, config, args.quality_kv_memory)
        qualities[config], dists = quality(llm, windows, reference, "prefix" in config)
        reference = reference or dists
        log(f"quality {label(config)}: ppl {qualities[config]['ppl']:.3f}, KL {qualities[config]['kl']:.2e}")
        del llm
    results = {"kv_cache_memory": budget, "quality": {label(c): {**q, "techniques": c} for c, q in qualities.items()},
               "workloads": {}}
    for w, requests in workloads.items():
        rows = [summarise(config, runs[w, config], qualities[config], len(requests)) for config in configs]
        for row in rows:
            row["tok_s_x_full"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
            row["mean_seqs_x_full"] = row["mean_concurrent_seqs"] / rows[0]["mean_concurrent_seqs"]
            row["max_seqs_x_full"] = row["max_concurrent_seqs"] / rows[0]["max_concurrent_seqs"]
            row["pool_use_peak"] = row["kv_blocks_peak"] / row["kv_blocks_total"]  # pages differ in size by config
            row["kl_text"], row["kl_max_text"] = f"{row['kl']:.2e}", f"{row['kl_max']:.2e}"
        results["workloads"][w] = {"rows": rows, "verdicts": verdicts(rows), "num_requests": len(requests),
                                   "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                                   "output_tokens": sum(r.max_tokens for r in requests)}
    return results


def summarise(config: tuple[str, ...], runs: list[dict], qual: dict, num_requests: int) -> dict:
    row = {"config": label(config), "techniques": config, "num_requests": num_requests,
           **{k: statistics.median(x[k] for x in runs) for k in (*STATS, "wall_s", "same_tokens")}, **qual}
    row["runs"] = [{k: v for k, v in x.items() if k != "token_ids"} for x in runs]
    return row


# -- the report -------------------------------------------------------------------------------------
def memory_bound(w: dict) -> str:
    full = w["rows"][0]
    bound = full["max_concurrent_seqs"] < w["num_requests"] and full["kv_blocks_peak"] >= 0.9 * full["kv_blocks_total"]
    return (f"fp32 full ran at most {full['max_concurrent_seqs']} of {w['num_requests']} requests at once, its pages "
            f"peaked at {fmt(full['kv_blocks_peak'])} of {fmt(full['kv_blocks_total'])}, {fmt(full['preemptions'])} "
            f"preemptions: memory-bound {'yes' if bound else 'NO (raise --num-requests or lower --kv-memory)'}")


def workload_text(name: str, w: dict, args) -> str:
    if name == "code":
        return (f"{w['num_requests']} rows of the Azure {args.trace} trace: prompt lengths x {args.scale} (<= "
                f"{args.max_context}), output lengths x {args.output_scale} (<= {args.max_output}); "
                f"{w['prompt_tokens']} prompt and {w['output_tokens']} output tokens in all")
    return (f"{w['num_requests']} requests of one {args.system_len}-token system prompt + a {args.suffix_len}-token "
            f"suffix, {args.shared_max_tokens} new tokens each; {w['prompt_tokens']} prompt and {w['output_tokens']} "
            f"output tokens in all")


def report(results: dict, meta: dict, args) -> str:
    budget = results["kv_cache_memory"]
    budget = budget if isinstance(budget, str) else f"{budget / 2**20:.2f} MiB ({budget} bytes)"
    lines = [f"# What the techniques buy together at one KV byte budget ({args.model})", "",
             *provenance(meta),
             f"KV budget (kv_cache_memory) {budget} for every configuration and both workloads"
             + ("" if args.kv_memory else f": {args.fits} requests of the larger workload's mean size in fp32 pages")
             + f"; block {args.block_size}, max_num_batched_tokens {args.max_batched_tokens}, max_num_seqs "
             f"{args.max_num_seqs}, max_model_len {args.max_model_len}, float32 compute, batch_invariant off. "
             f"Techniques: prefix = enable_prefix_caching (hashed pages); int4 = KIVI with its defaults; snapkv = "
             f"compression_ratio {args.snapkv_ratio} at the end of prefill; ngram = n-gram draft, num_tokens "
             f"{args.ngram_tokens}. Requests all queued at t=0, greedy, EOS ignored; a fresh engine per run; "
             f"medians of {args.repeats} round(s). tok/s: generated tokens per second of engine time.", "",
             f"Quality (the same in both tables): {args.num_windows} WikiText-2 test windows of {args.context} context "
             f"+ {args.continuation} continuation tokens scored teacher-forced, on an engine of "
             f"{args.quality_kv_memory}: perplexity of the continuations and KL(fp32 full || configuration) of the "
             f"next-token distributions, mean (and max) over positions. Prefix caching and n-gram drafts are "
             f"lossless: KL 0 and `same tokens as full` 1.0 are checks (int4 under a changing schedule is a "
             f"declared deviation, and prefix caching with snapkv keeps a hit's shared pages whole: both may "
             f"differ).", ""]
    for name, w in results["workloads"].items():
        lines += [f"## {name}: {workload_text(name, w, args)}", "", memory_bound(w) + ".", "",
                  table(w["rows"], COLUMNS), "",
                  "Gains over fp32 full against the product of the single techniques' gains (0.9-1.1x the product: "
                  "multiply; within 10% of the larger single: overlap; see the script's docstring):", "",
                  table(w["verdicts"], VERDICT_COLUMNS), ""]
        lines += [f"- {v['config']}: {v['ceiling']}" for v in w["verdicts"] if v["ceiling"]] + [""]
    hits = [f"{name} {fmt(q['quality_prefix_hit_rate'])}" for name, q in results["quality"].items()
            if "prefix" in q["techniques"]]
    lines += [f"Quality's measured pass, prefix hit rate (tokens): {', '.join(hits)}.", ""] if hits else []
    lines += ["What each technique saves (the reading of the verdicts):", ""]
    lines += [f"- {t}: {WHAT[t]}." for t in TECHNIQUES] + ["", "Why a pair may multiply or overlap (the "
              "mechanism; the tables above say which it did):", ""]
    lines += [f"- {' + '.join(pair)}: {why}." for pair, why in PAIRS.items()] + [""]
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workloads", nargs="+", default=["code", "shared"], choices=["code", "shared"])
    p.add_argument("--trace", default="code", help="Azure trace: code, conv or a CSV path")
    p.add_argument("--num-requests", type=int, default=32, help="trace rows from the first")
    p.add_argument("--scale", type=float, default=0.25, help="prompt length scale")
    p.add_argument("--output-scale", type=float, default=1.0, help="output length scale")
    p.add_argument("--max-context", type=int, default=512, help="prompt length cap after scaling")
    p.add_argument("--max-output", type=int, default=64, help="output length cap after scaling")
    p.add_argument("--shared-requests", type=int, default=24)
    p.add_argument("--system-len", type=int, default=384, help="shared system prompt tokens")
    p.add_argument("--suffix-len", type=int, default=32, help="each shared-prompt request's own tokens")
    p.add_argument("--shared-max-tokens", type=int, default=32)
    p.add_argument("--kv-memory", default=None, help="KV byte budget (default: --fits fp32 requests)")
    p.add_argument("--fits", type=float, default=4, help="the default budget: this many requests of the larger "
                   "workload's mean size, in fp32 pages")
    p.add_argument("--snapkv-ratio", type=float, default=0.5, help="snapkv compression_ratio")
    p.add_argument("--ngram-tokens", type=int, default=4, help="ngram draft num_tokens")
    p.add_argument("--all-subsets", action="store_true", help="also the four triples (16 configurations, not 12)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--context", type=int, default=512, help="quality: context tokens per window")
    p.add_argument("--continuation", type=int, default=64, help="quality: scored tokens per window")
    p.add_argument("--num-windows", type=int, default=4, help="quality: WikiText-2 windows")
    p.add_argument("--quality-kv-memory", default="256MiB",
                   help="the quality engine's KV budget (room for all windows at once)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every run (medians)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "one_budget_smollm2"))
    args = p.parse_args(argv)
    for name in ("num_requests", "shared_requests", "repeats", "num_windows", "context", "continuation"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    meta = metadata(args)
    results = run(args)
    meta["load_end"] = load_average()
    from kvlab.study.loggers.local import write_report

    text = report(results, meta, args)
    print(text)
    md, js = write_report(args.out, text, {"meta": meta, **results})
    log(f"wrote {md} and {js}")
    return results


if __name__ == "__main__":
    main()
