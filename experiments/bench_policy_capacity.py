"""What eviction buys: concurrent sequences, throughput and the policy's cost at one KV byte budget.

The MLSys'25 study "Rethinking Key-Value Cache Compression Techniques for Large Language Model Serving"
found that the memory a policy saves often does not turn into throughput: this measures it instead of
assuming it. Every policy in --policies compresses each prompt once at the end of prefill (`when="prefill"`);
those in --chunk-policies also run compressing after every prefill chunk (`when="chunk"`), each sequence
computing at most --max-prefill-chunk prompt tokens per step, so that the scheduler admits a prompt on its
compressed footprint (what it keeps of the prompt plus one chunk) rather than on its whole length. The pages
a policy evicts go back to the shared pool, where the scheduler admits more sequences.

Workload: --num-requests WikiText-2 prompts of --min-len..--max-len tokens, or with --trace the prompt
lengths of the Azure production trace (`code`: long prompts, median 1,469 tokens; clipped to --max-len,
text cut from WikiText-2), all queued at t=0, greedy, --max-tokens new tokens each (EOS ignored). One
process, policies in turn, --repeats rounds (medians).

    python experiments/bench_policy_capacity.py                       # about 15 minutes on 2 quiet cores
    python experiments/bench_policy_capacity.py --trace code --max-len 1536 --kv-memory 160MiB --repeats 3
    python experiments/bench_policy_capacity.py --model random:llama-tiny --num-requests 4 --out /tmp/cap
    python experiments/bench_policy_capacity.py --trace code --max-len 1536 --policies snapkv \
        --chunk-policies snapkv --max-prefill-chunk 128        # full vs snapkv (prefill) vs snapkv (chunk + cap)

--replay counts concurrency without running the model, in seconds: the engine is built as for a run and its
own scheduler, block manager and policy budget are driven step by step in the engine's order (schedule,
advance, record, compress, append a placeholder token, finish). What a policy keeps depends on lengths only
(how many tokens, never which), so the concurrency, pages and preemptions equal a run's
(tests/experiments/test_bench_policy_capacity.py checks it on the tiny model); it says nothing about tok/s or cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_shared_pool import make_prompts
from kvlab.study.bench_io import commit_line, fmt, load_average, log, metadata, table

STATS = ("max_concurrent_seqs", "mean_concurrent_seqs", "tokens_per_s", "busy_s", "num_steps", "preemptions",
         "ttft_median_s", "policy_compressions", "policy_s", "policy_pages_freed", "policy_bytes_freed")
COLUMNS = [("policy", "policy"), ("max_concurrent_seqs", "max seqs"), ("mean_concurrent_seqs", "mean seqs"),
           ("tokens_per_s", "tok/s (busy)"), ("wall_s", "wall s"), ("ttft_median_s", "TTFT p50 s"),
           ("preemptions", "preemptions"), ("ms_per_compression", "ms per compression"),
           ("policy_ms_per_step", "policy ms per step"), ("policy_share", "policy share of busy time"),
           ("kib_freed_per_seq", "KV KiB freed per seq")]  # bytes: a policy's pages hold one layer


def measure(model: str, loaded, policy: str, policy_args: dict, engine_args: dict, prompts, args) -> dict:
    import copy

    from kvlab import LLM, SamplingParams

    llm = LLM(model, loaded=copy.deepcopy(loaded), policy=policy, policy_args=policy_args,
              kv_cache_memory=args.kv_memory, block_size=args.block_size, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_batched_tokens, **engine_args)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    stats = {k: llm.stats().get(k, 0) for k in STATS}
    return {**stats, "wall_s": time.perf_counter() - t0, "generated": sum(len(o.token_ids) for o in outs)}


def replay(model: str, loaded, policy: str, policy_args: dict, engine_args: dict, prompts, args) -> dict:
    """A run's concurrency without the model (see --replay): the engine's pieces, driven in its step order."""
    from kvlab import LLM, SamplingParams
    from kvlab.engine.attention import plan_step

    engine = LLM(model, loaded=loaded, policy=policy, policy_args=policy_args, kv_cache_memory=args.kv_memory,
                 block_size=args.block_size, max_model_len=args.max_model_len,
                 max_num_batched_tokens=args.max_batched_tokens, **engine_args).engine
    sched, bm, comp = engine.scheduler, engine.block_manager, engine.compressor
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    num_layers = sum(len(g.layers) for g in bm.groups)
    while sched.has_unfinished():
        batch = sched.schedule()
        if not batch.seqs:
            raise RuntimeError("replay: nothing could be scheduled")
        due = [comp.due(q, n) for q, n in zip(batch.seqs, batch.num_new_tokens)] if comp else [False] * len(batch)
        plan_step(batch.seqs, batch.num_new_tokens, bm, engine.cache, engine.config.device)
        engine.cache.plan_writes()  # the writes' residual rows, leased from the pool as a run's forward does
        sched.advance(batch)
        engine._record_step(batch.num_preempted)
        for seq, is_due in zip(batch.seqs, due):
            if is_due:  # what Compressor.compress keeps, by count: which tokens does not change the pages
                comp.policy.begin(seq.num_computed_tokens)
                for g in comp.groups:
                    n = bm.cached_lens([seq], g)[0]
                    keep = comp.policy.num_kept(bm.groups[g].layers[0], num_layers, n)
                    if keep < n:
                        bm.compact(seq, g, list(range(keep)))
        for seq in batch.seqs:
            if seq in sched.running and seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(0)
                if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= engine.max_model_len:
                    sched.finish(seq, "length")
        for seq in sched.running:
            bm.release_out_of_window(seq)
    stats = engine.metrics.summary()
    return {"max_concurrent_seqs": stats["max_concurrent_seqs"], "mean_concurrent_seqs": stats["mean_concurrent_seqs"],
            "preemptions": stats["preemptions"], "num_steps": stats["num_steps"],
            "kv_blocks_peak": stats["kv_blocks_peak"],
            "kv_mib_peak": stats["kv_blocks_peak"] * engine.bytes_per_block / 2**20}  # pages' size varies: bytes


def variants(args) -> list[tuple[str, str, dict, dict]]:
    """(row name, policy, policy_args, engine options) of every configuration measured, `full` first."""
    ratio = {"compression_ratio": args.ratio}
    chunked = [(f"chunk, prefill chunk <= {c}", {"max_prefill_chunk": c}) if c else ("chunk", {})
               for c in args.max_prefill_chunk]
    rows = ([("full", "full", {}, {})] + [(p, p, {**ratio, "when": "prefill"}, {}) for p in args.policies]
            + [(f"{p} ({label})", p, {**ratio, "when": "chunk"}, cap) for p in args.chunk_policies
               for label, cap in chunked])
    common = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    if not args.formats:  # the engine's default cache format
        return [(name, policy, pargs, {**common, **eng}) for name, policy, pargs, eng in rows]
    kivi = {"residual_dtype": args.residual_dtype, "group_size": args.group_size}  # int4 / int2
    return [(f"{name} [{fmt}]", policy, pargs,
             {**common, **eng, "quant": fmt, "quant_args": kivi if fmt in ("int4", "int2") else {}})
            for fmt in args.formats for name, policy, pargs, eng in rows]


def summarise(name: str, runs: list[dict], num_requests: int) -> dict:
    row = {"policy": name, **{k: statistics.median(r[k] for r in runs) for k in (*STATS, "wall_s")}}
    calls = row["policy_compressions"]
    row["ms_per_compression"] = 1000 * row["policy_s"] / calls if calls else float("nan")
    row["policy_share"] = row["policy_s"] / row["busy_s"] if row["busy_s"] else float("nan")
    row["policy_ms_per_step"] = 1000 * row["policy_s"] / row["num_steps"] if row["num_steps"] else float("nan")
    row["pages_freed_per_seq"] = row["policy_pages_freed"] / num_requests  # pages of one layer: not full's size
    row["kib_freed_per_seq"] = row["policy_bytes_freed"] / 1024 / num_requests
    row["runs"] = runs
    return row


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from kvlab.study.loggers.local import write_report
    from kvlab.models import load_model
    from kvlab.study.tasks.data import get_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    meta = metadata(args)
    loaded = load_model(args.model)
    vocab = loaded.model.config.vocab_size
    if args.trace:
        from kvlab.study.workloads.azure import load_azure_trace

        requests = load_azure_trace(args.trace, args.num_requests, get_tokenizer(loaded), max_context=args.max_len,
                                    max_output=args.max_tokens, seed=args.seed)
        prompts = [r.prompt_token_ids for r in requests]
    elif loaded.tokenizer is not None:
        prompts = make_prompts(get_tokenizer(loaded), args.num_requests, args.min_len, args.max_len, args.seed)
    else:
        g = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(3, vocab, (args.min_len,), generator=g).tolist() for _ in range(args.num_requests)]
    if args.replay:
        return replay_all(args, meta, loaded, prompts)
    runs: dict[str, list[dict]] = {name: [] for name, *_ in variants(args)}
    for i in range(args.repeats):
        for name, policy, policy_args, engine_args in variants(args):
            runs[name].append(measure(args.model, loaded, policy, policy_args, engine_args, prompts, args))
            r = runs[name][-1]
            log(f"round {i + 1} {name}: max {r['max_concurrent_seqs']} mean {r['mean_concurrent_seqs']:.2f} seqs, "
                f"{r['tokens_per_s']:.2f} tok/s")
    rows = [summarise(name, runs[name], len(prompts)) for name in runs]
    full = rows[0]
    for row in rows:
        row["concurrency_x_full"] = row["mean_concurrent_seqs"] / full["mean_concurrent_seqs"]
        row["max_concurrency_x_full"] = row["max_concurrent_seqs"] / full["max_concurrent_seqs"]
        row["throughput_x_full"] = row["tokens_per_s"] / full["tokens_per_s"]
    meta["load_end"] = load_average()
    results = {"rows": rows, "mean_prompt_len": statistics.mean(len(p) for p in prompts)}
    text = report(results, meta, args)
    print(text)
    md, js = write_report(args.out, text, {"meta": meta, **results})
    log(f"wrote {md} and {js}")
    return results


def replay_all(args, meta: dict, loaded, prompts) -> dict:
    from kvlab.study.loggers.local import write_report

    rows = [{"policy": name, **replay(args.model, loaded, policy, policy_args, engine_args, prompts, args)}
            for name, policy, policy_args, engine_args in variants(args)]
    for row in rows:
        row["max_concurrency_x_full"] = row["max_concurrent_seqs"] / rows[0]["max_concurrent_seqs"]
        row["concurrency_x_full"] = row["mean_concurrent_seqs"] / rows[0]["mean_concurrent_seqs"]
    meta["load_end"] = load_average()
    results = {"rows": rows, "mean_prompt_len": statistics.mean(len(p) for p in prompts)}
    cols = [("policy", "policy"), ("max_concurrent_seqs", "max seqs"), ("mean_concurrent_seqs", "mean seqs"),
            ("preemptions", "preemptions"), ("num_steps", "steps"), ("kv_mib_peak", "peak KV MiB"),
            ("max_concurrency_x_full", "max seqs / full"), ("concurrency_x_full", "mean seqs / full")]
    text = report(results, meta, args, cols, title="concurrency replayed without the model")
    print(text)
    md, _ = write_report(args.out, text, {"meta": meta, **results})
    log(f"wrote {md}")
    return results


def report(results: dict, meta: dict, args, cols=None, title="concurrency, throughput, cost") -> str:
    cols = cols or COLUMNS + [("max_concurrency_x_full", "max seqs / full"), ("concurrency_x_full", "mean seqs / full"),
                              ("throughput_x_full", "tok/s / full")]
    lines = [f"# Eviction policies at one KV budget: {title} ({args.model})", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['started_at']}  ", f"Commit: {commit_line(meta)}  ",
             f"Machine: {meta['machine']}  ",
             f"Load average (1/5/15 min) at start: {meta['load_start']}, at end: {meta['load_end']}  ", "",
             (f"{args.num_requests} prompts with the lengths of the first rows of the Azure {args.trace} trace, "
              f"clipped to {args.max_len} tokens (mean " if args.trace else
              f"{args.num_requests} prompts of {args.min_len}-{args.max_len} tokens (mean ")
             + f"{results['mean_prompt_len']:.0f}), {args.max_tokens} new tokens each, all queued at t=0; KV budget "
             f"{args.kv_memory}, block {args.block_size}, max_num_batched_tokens {args.max_batched_tokens}; "
             f"policies at compression_ratio {args.ratio}: those named alone once at the end of prefill, those "
             f"marked `chunk` after every prefill chunk"
             + (f", each sequence computing at most the marked number of prompt tokens per step (admitted on "
                f"its compressed prompt plus one chunk)" if any(args.max_prefill_chunk) else "")
             + (". Replayed without the model (--replay): the engine's scheduler, block manager and policy budgets "
                "stepped in the engine's order; concurrency, preemptions, steps and pages are a run's, time is not "
                "measured." if args.replay else
                f". Medians of {args.repeats} rounds. tok/s counts generated tokens per second of engine time."), "",
             table(results["rows"], cols), ""]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policies", nargs="*", default=["snapkv", "streaming_llm", "knorm"],
                   help="policies compressing once at the end of prefill (none: only full and --chunk-policies)")
    p.add_argument("--chunk-policies", nargs="*", default=[],
                   help="policies also run with when='chunk' (compressed after every prefill chunk)")
    p.add_argument("--max-prefill-chunk", type=int, nargs="+", default=[0],
                   help="engine max_prefill_chunk of the --chunk-policies runs, one run per value (0: none, "
                        "a prompt's chunk is bounded by the step's budget only)")
    p.add_argument("--ratio", type=float, default=0.75, help="compression_ratio of every policy")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--trace", default=None, help="Azure trace (code, conv or a CSV path) giving the prompt lengths")
    p.add_argument("--min-len", type=int, default=700)
    p.add_argument("--max-len", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--kv-memory", default="64MiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--formats", nargs="*", default=[],
                   help="cache formats: every row once per format (row names say which; the first row, full in "
                        "the first format, is the x-full baseline); none: the engine's default format")
    p.add_argument("--group-size", type=int, default=32, help="int4 / int2 group size (divides --block-size)")
    p.add_argument("--residual-dtype", default="compute", help="int4 / int2 residual rows' dtype (kvlab.cache.quant.kivi)")
    p.add_argument("--max-num-seqs", type=int, default=0, help="engine.max_num_seqs (0: the engine's default; it "
                   "also sizes the int4 / int2 residual area)")
    p.add_argument("--replay", action="store_true",
                   help="count concurrency without running the model (the engine's scheduler and budgets; seconds)")
    p.add_argument("--out", default="experiments/results/policy_capacity")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
