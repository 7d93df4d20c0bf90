"""Throughput of kvlab against Hugging Face `generate` and `generate_batch`, and paged vs contiguous KV allocation.

One process, so every ratio compares numbers measured in the same run:

  micro        one 32-token WikiText prompt, forced `--micro-tokens` new tokens, batch 1 and 16;
               median tok/s of `--repeats` timed runs after one warm-up, per system.
  trace        `--num-requests` rows of the Azure LLM inference trace 2023 (conv; Patel et al., "Splitwise",
               ISCA 2024), lengths scaled to the model, prompts cut from WikiText-2, all queued at t=0.
               tok/s counts useful tokens only: each request's own max_tokens.
  concurrency  the same trace through kvlab at one small KV byte budget, allocator=paged vs contiguous
               (classic max_model_len reservation, and Orca-style prompt+max_tokens); concurrent
               sequences and the waste breakdown of Kwon et al. 2023 (arXiv:2309.06180, section 3).

Systems: hf-generate (padded static batches, `model.generate`), hf-generate-batch (transformers'
continuous-batching paged path, driven through its manager so each request gets its own
max_new_tokens), kvlab (`LLM.generate`). Model loads and engine builds are outside timed regions.

    python experiments/bench_throughput.py                  # full run (about an hour on 2 quiet cores)
    python experiments/bench_throughput.py --quick --out /tmp/bench_quick
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import warnings

from kvlab.study.bench_io import commit_line, fmt, load_average, log, metadata, table
from kvlab.study.timed_runs import Run, hf_cb_config, hf_generate, hf_generate_batch, kvlab_generate

SYSTEMS = ("hf-generate", "hf-generate-batch", "kvlab")
SECTIONS = ("micro", "trace", "concurrency")
ALLOCATORS = (  # (row name, allocator, allocator_args)
    ("paged", "paged", {}),
    ("contiguous", "contiguous", {"reserve": "max_model_len"}),
    ("contiguous (reserve=request)", "contiguous", {"reserve": "request"}),
)


# -- building what is measured ----------------------------------------------------
def build_llm(args, loaded, **overrides):
    from kvlab import LLM

    engine = dict(block_size=args.block_size, kv_cache_memory=args.kv_memory, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens, seed=args.seed)
    engine.update(overrides)
    return LLM(model=args.model, loaded=copy.deepcopy(loaded), **engine)


def micro_prompt(tokenizer, length: int = 32) -> list[int]:
    """A `length`-token WikiText-2 cut, the same for every system."""
    from kvlab.study.tasks.data import corpus_tokens
    from kvlab.study.workloads.azure import DEFAULT_CORPUS

    return corpus_tokens(DEFAULT_CORPUS, None, tokenizer)[1000:1000 + length]


class Bench:
    """The loaded model, the systems under test and the runner for each."""

    def __init__(self, args):
        import torch

        from kvlab.engine_config import parse_bytes
        from kvlab.models import load_model

        torch.manual_seed(args.seed)
        if args.threads:
            torch.set_num_threads(args.threads)
        self.args = args
        self.loaded = load_model(args.model)  # sdpa; Hugging Face runs on it, kvlab gets deep copies
        self.hf = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        self.cb_config = None if args.hf_cb_auto else hf_cb_config(parse_bytes(args.kv_memory),
                                                                   args.max_batched_tokens, self.hf.config)
        self._llm = None

    @property
    def llm(self):
        if self._llm is None:
            self._llm = build_llm(self.args, self.loaded)
        return self._llm

    def run(self, system: str, requests, force_min: bool = False) -> Run:
        if system == "hf-generate":
            return hf_generate(self.hf, requests, self.args.hf_batch, self.pad_token_id)
        if system == "hf-generate-batch":
            return self._hf_generate_batch(requests, force_min)
        return kvlab_generate(self.llm, requests)

    def _hf_generate_batch(self, requests, force_min: bool) -> Run:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*paged\\|.*prefix", category=FutureWarning)
            self.hf.set_attn_implementation("paged|sdpa")  # generate_batch's paged path over sdpa
        try:
            return hf_generate_batch(self.hf, requests, self.cb_config, force_min)
        finally:
            self.hf.set_attn_implementation("sdpa")


# -- sections -----------------------------------------------------------------------
def section_micro(bench: Bench, systems) -> list[dict]:
    from kvlab.study.workloads.replay import Request

    args = bench.args
    prompt = micro_prompt(bench.tokenizer)
    rows = []
    for batch in args.micro_batches:
        requests = [Request(list(prompt), args.micro_tokens) for _ in range(batch)]
        for system in systems:
            bench.run(system, requests, force_min=True)  # warm-up
            runs = [bench.run(system, requests, force_min=True) for _ in range(args.repeats)]
            speeds = [r.tokens_per_s for r in runs]
            row = {"batch": batch, "system": system, "tok_s": statistics.median(speeds), "tok_s_runs": speeds,
                   "wall_s": statistics.median(r.wall_s for r in runs),
                   "tok_per_cpu_s": statistics.median(r.useful_tokens / r.cpu_s for r in runs),
                   "new_tokens": runs[0].useful_tokens}
            if system == "hf-generate-batch":
                row["generation_tok_s"] = statistics.median(r.useful_tokens / r.extra["generation_s"] for r in runs)
            rows.append(row)
            log(f"micro batch {batch} {system}: {row['tok_s']:.1f} tok/s")
    return rows


def load_trace(bench: Bench):
    from kvlab.study.workloads.azure import load_azure_trace

    args = bench.args
    return load_azure_trace(args.trace, args.num_requests, bench.tokenizer, max_context=args.max_context,
                            max_output=args.max_output, scale=args.scale, seed=args.seed)


def section_trace(bench: Bench, systems, requests) -> list[dict]:
    rows = []
    for system in systems:
        bench.run(system, requests[:2])  # warm-up on two requests
        run = bench.run(system, requests)
        row = {"system": system, "tok_s": run.tokens_per_s, "wall_s": run.wall_s,
               "tok_per_cpu_s": run.useful_tokens / run.cpu_s, "useful_tokens": run.useful_tokens,
               "generated_tokens": run.generated_tokens}
        if system == "hf-generate":
            row.update(prompt_tokens=sum(len(r.prompt_token_ids) for r in requests), **run.extra)
        if system == "hf-generate-batch":
            row.update(generation_tok_s=run.useful_tokens / run.extra["generation_s"], **run.extra)
        if system == "kvlab":
            row.update(kvlab_stats(run.extra))
        rows.append(row)
        log(f"trace {system}: {row['tok_s']:.1f} tok/s in {run.wall_s:.1f} s")
    return rows


def kvlab_stats(stats: dict) -> dict:
    keys = ("ttft_median_s", "ttft_p90_s", "tpot_median_s", "tpot_p90_s", "kv_blocks_total", "kv_blocks_peak",
            "kv_blocks_mean", "preemptions", "max_concurrent_seqs", "mean_concurrent_seqs", "waste_internal",
            "waste_reservation", "waste_external", "num_steps", "tokens_per_s")
    return {("engine_tok_s" if k == "tokens_per_s" else k): stats[k] for k in keys}


def section_concurrency(bench: Bench, requests) -> list[dict]:
    args = bench.args
    rows = []
    for name, allocator, allocator_args in ALLOCATORS:
        llm = build_llm(args, bench.loaded, allocator=allocator, allocator_args=allocator_args,
                        kv_cache_memory=args.concurrency_kv_memory)
        kvlab_generate(llm, requests[:2])  # warm-up
        run = kvlab_generate(llm, requests)
        rows.append({"allocator": name, "tok_s": run.tokens_per_s, "wall_s": run.wall_s,
                     "tok_per_cpu_s": run.useful_tokens / run.cpu_s, **kvlab_stats(run.extra)})
        log(f"concurrency {name}: max {rows[-1]['max_concurrent_seqs']} mean {rows[-1]['mean_concurrent_seqs']:.1f}")
        del llm
    return rows


# -- ratios and tables -----------------------------------------------------------------
def ratios(results: dict) -> dict:
    out = {}
    micro = {(r["batch"], r["system"]): r["tok_s"] for r in results.get("micro", [])}
    for batch in sorted({b for b, _ in micro}):
        if (batch, "kvlab") in micro and (batch, "hf-generate") in micro:
            out[f"micro_b{batch}_kvlab_over_generate"] = micro[batch, "kvlab"] / micro[batch, "hf-generate"]
    trace = {r["system"]: r["tok_s"] for r in results.get("trace", [])}
    hf = [v for k, v in trace.items() if k != "kvlab"]
    if "kvlab" in trace and hf:
        out["trace_kvlab_over_best_hf"] = trace["kvlab"] / max(hf)
    conc = {r["allocator"]: r for r in results.get("concurrency", [])}
    if "paged" in conc and "contiguous" in conc:
        for stat in ("mean", "max"):
            key = f"{stat}_concurrent_seqs"
            out[f"concurrency_{stat}_paged_over_contiguous"] = conc["paged"][key] / max(conc["contiguous"][key], 1e-9)
    return out


def report(results: dict, meta: dict) -> str:
    args, r, versions = meta["args"], results["ratios"], meta["versions"]
    parts = [f"# Throughput benchmark: kvlab vs Hugging Face ({meta['model']})", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['started_at']}  ",
             f"Machine: {meta['machine']}  ", f"Load average (1/5/15 min) at start: {meta['load_start']}, "
             f"at end: {meta['load_end']} (other work on the cores inflates wall and CPU time alike; "
             "see --threads)  ",
             f"Versions: python {meta['python']}, torch {versions['torch']}, transformers {versions['transformers']}  ",
             f"Commit: {commit_line(meta)}", ""]
    if "micro" in results:
        parts += [f"## Micro: one {args['micro_prompt_tokens']}-token prompt, {args['micro_tokens']} new tokens "
                  f"forced, median of {args['repeats']} after a warm-up", "",
                  table(results["micro"], [("batch", "batch"), ("system", "system"), ("tok_s", "tok/s (median)"),
                                           ("wall_s", "wall s"), ("tok_per_cpu_s", "tok per CPU-s"),
                                           ("generation_tok_s", "tok/s excl. setup")]), ""]
        for key, value in r.items():
            if key.startswith("micro_"):
                batch = int(key.split("_")[1][1:])
                target = " (target >= 0.80)" if batch == 1 else ""
                parts.append(f"kvlab / HF generate at batch {batch}: {value:.2f}x{target}  ")
        parts.append("")
    if "trace" in results:
        parts += [f"## Trace: {args['num_requests']} requests of Azure {args['trace']} (scale {args['scale']}, "
                  f"context <= {args['max_context']}, output <= {args['max_output']}), all queued at t=0, "
                  f"KV budget {args['kv_memory']}", "",
                  "tok/s = useful tokens (each request's own max_tokens) / wall time. HF generate runs static "
                  f"batches of {args['hf_batch']} consecutive requests to the batch's longest output (computed "
                  "tokens include that padding); generate_batch gets each request's own max_new_tokens"
                  + (" and sizes its cache itself (--hf-cb-auto)." if args["hf_cb_auto"] else
                     " and the same KV budget and batch-token limit as kvlab."), "",
                  table(results["trace"], [("system", "system"), ("tok_s", "tok/s"), ("wall_s", "wall s"),
                                           ("tok_per_cpu_s", "tok per CPU-s"),
                                           ("useful_tokens", "useful tokens"), ("generated_tokens", "computed tokens"),
                                           ("ttft_median_s", "TTFT p50 s"), ("ttft_p90_s", "TTFT p90 s"),
                                           ("tpot_median_s", "TPOT p50 s"), ("tpot_p90_s", "TPOT p90 s"),
                                           ("kv_blocks_peak", "KV blocks peak"), ("kv_blocks_mean", "KV blocks mean"),
                                           ("kv_blocks_total", "KV blocks total"), ("preemptions", "preemptions")]),
                  ""]
        for row in results["trace"]:
            if row["system"] == "hf-generate":
                parts += [f"HF generate prefilled {row['padded_prompt_tokens']} prompt positions (left padding) for "
                          f"{row['prompt_tokens']} prompt tokens.  "]
            if row["system"] == "hf-generate-batch":
                parts += [f"generate_batch: {fmt(row['generation_tok_s'])} tok/s excluding setup "
                          f"({fmt(row['setup_s'])} s) and teardown ({fmt(row['teardown_s'])} s); "
                          f"{row['short_requests']} requests stopped short of their max_tokens.  "]
        kv = [row for row in results["trace"] if row["system"] == "kvlab"]
        if kv:
            parts += ["kvlab waste (fraction of the pool, mean over steps): "
                      f"internal {fmt(kv[0]['waste_internal'])}, reservation {fmt(kv[0]['waste_reservation'])}, "
                      f"external {fmt(kv[0]['waste_external'])}; concurrent sequences max "
                      f"{kv[0]['max_concurrent_seqs']}, mean {fmt(kv[0]['mean_concurrent_seqs'])}", ""]
        if "trace_kvlab_over_best_hf" in r:
            parts += [f"kvlab / best HF path: {r['trace_kvlab_over_best_hf']:.2f}x (target >= 2)", ""]
    if "concurrency" in results:
        parts += [f"## Concurrency at one KV byte budget ({args['concurrency_kv_memory']}, max_model_len "
                  f"{args['max_model_len']}, max_num_seqs {args['max_num_seqs']}, block {args['block_size']})", "",
                  "Waste as fractions of the pool, mean over steps (Kwon et al. 2023, section 3).", "",
                  table(results["concurrency"], [("allocator", "allocator"), ("max_concurrent_seqs", "max seqs"),
                                                 ("mean_concurrent_seqs", "mean seqs"), ("tok_s", "tok/s"),
                                                 ("tok_per_cpu_s", "tok per CPU-s"),
                                                 ("wall_s", "wall s"), ("preemptions", "preemptions"),
                                                 ("waste_internal", "internal"), ("waste_reservation", "reservation"),
                                                 ("waste_external", "external"), ("kv_blocks_total", "blocks")]),
                  ""]
        parts += [f"paged / contiguous {stat} concurrent sequences: {r[k]:.2f}x (target >= 2)  "
                  for stat in ("mean", "max") if (k := f"concurrency_{stat}_paged_over_contiguous") in r] + [""]
    return "\n".join(parts)


# -- command line ----------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="kvlab model name (kvlab.models.load_model)")
    p.add_argument("--trace", default="conv", help="Azure trace: conv, code or a CSV path")
    p.add_argument("--num-requests", type=int, default=256, help="trace rows from the first")
    p.add_argument("--scale", type=float, default=0.25, help="trace length scale")
    p.add_argument("--max-context", type=int, default=512, help="prompt length cap after scaling")
    p.add_argument("--max-output", type=int, default=64, help="output length cap after scaling")
    p.add_argument("--hf-batch", type=int, default=16, help="static batch size of HF generate on the trace")
    p.add_argument("--micro-tokens", type=int, default=64, help="new tokens per request in the micro benchmark")
    p.add_argument("--micro-batches", type=int, nargs="+", default=None,
                   help="micro benchmark batch sizes (default 1 16; 1 4 with --quick)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per micro cell (after one warm-up)")
    p.add_argument("--kv-memory", default="1GiB", help="KV byte budget of kvlab and generate_batch on the trace")
    p.add_argument("--concurrency-kv-memory", default="192MiB",
                   help="KV byte budget of the allocator study (small, so memory limits concurrency)")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="engine max_model_len (the contiguous allocator reserves this per sequence)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="kvlab running sequences at most")
    p.add_argument("--max-batched-tokens", type=int, default=512,
                   help="tokens per step at most (kvlab max_num_batched_tokens, generate_batch max_batch_tokens)")
    p.add_argument("--hf-cb-auto", action="store_true",
                   help="let generate_batch size its cache from free RAM (transformers' default) instead of "
                        "--kv-memory and --max-batched-tokens")
    p.add_argument("--block-size", type=int, default=16, help="kvlab tokens per KV block")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems to run")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default, one per core); on a shared, loaded machine "
                        "1 was 2-10x faster and far steadier here than oversubscribed OpenMP threads")
    p.add_argument("--seed", type=int, default=0, help="torch seed and prompt offsets in the corpus")
    p.add_argument("--out", default="experiments/results/throughput", help="writes <out>.md and <out>.json")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 8 requests, max-output 8, micro-tokens 8, micro-batches 1 4, repeats 1")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_output, args.micro_tokens, args.repeats = 8, 8, 8, 1
    if args.micro_batches is None:
        args.micro_batches = [1, 4] if args.quick else [1, 16]
    for name in ("num_requests", "max_output", "micro_tokens", "repeats", "hf_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    from kvlab.study.loggers.local import write_report

    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    bench = Bench(args)
    meta = metadata(args)  # after Bench: it records the thread count Bench set
    meta["args"]["micro_prompt_tokens"] = 32  # micro_prompt's length
    systems = [s for s in SYSTEMS if s in args.systems]
    results: dict = {}
    if "micro" in args.sections:
        results["micro"] = section_micro(bench, systems)
    if {"trace", "concurrency"} & set(args.sections):
        requests = load_trace(bench)
        if "trace" in args.sections:
            results["trace"] = section_trace(bench, systems, requests)
        if "concurrency" in args.sections:
            bench._llm = None  # free the throughput engine's KV pool first
            results["concurrency"] = section_concurrency(bench, requests)
    results["ratios"] = ratios(results)
    meta["load_end"] = load_average()
    text = report(results, meta)
    print(text)
    md, js = write_report(args.out, text, {"meta": meta, **results})
    log(f"wrote {md} and {js}")
    return results


if __name__ == "__main__":
    main()
