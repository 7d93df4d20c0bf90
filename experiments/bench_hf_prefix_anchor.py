"""Same-run anchor for prefix sharing: Hugging Face's continuous batching (`generate_batch` machinery, with and
without its own block sharing, `ContinuousBatchingConfig.allow_block_sharing`) beside kvlab (no caching, hashed
pages, radix tree) on one shared-system-prompt workload: prefix hit rate and throughput.

Every request = one WikiText-2 system prompt of --system-len tokens + a unique --suffix-len-token question;
--max-tokens new tokens each (EOS ignored), all queued at t=0. Both systems get the same KV byte budget
(--kv-memory) and tokens per step (--max-batched-tokens). Transformers' hit rate is counted by wrapping its
`PagedAttentionCache.search_prefix_match` (tokens it returned as matched, over the prompt tokens looked up).

    python experiments/bench_hf_prefix_anchor.py        # a few minutes on two busy cores
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from pathlib import Path

from kvlab.study.loggers.local import write_report
from kvlab.study.timed_runs import Run, hf_generate_batch, kvlab_generate
from kvlab.study.workloads.replay import Request

REPO = Path(__file__).resolve().parents[1]

SYSTEMS = ("hf-cb", "hf-cb-sharing", "kvlab", "kvlab-hash", "kvlab-radix")


def make_requests(tokenizer, args) -> list[Request]:
    import random

    from kvlab.study.tasks.data import corpus_tokens, resolve_data_dir

    corpus = corpus_tokens("wikitext-2-raw/wiki.test.raw", resolve_data_dir(args.data_dir), tokenizer)
    rng = random.Random(args.seed)

    def cut(n: int) -> list[int]:
        i = rng.randrange(0, len(corpus) - n)
        return corpus[i:i + n]

    system = cut(args.system_len)
    return [Request(system + cut(args.suffix_len), args.max_tokens) for _ in range(args.num_requests)]


class HFHits:
    """Counts the prompt tokens transformers' continuous batching found in its cache (per request: the
    last lookup, since a pending request is looked up again each step until it is scheduled)."""

    def __init__(self):
        from transformers.generation.continuous_batching import cache

        self.cls = cache.PagedAttentionCache
        self.original = self.cls.search_prefix_match
        self.seen: dict[str, tuple[int, int]] = {}  # request id -> (matched tokens, prompt tokens)
        counter = self

        def search_prefix_match(cache_self, request_id, prompt_ids):
            n = counter.original(cache_self, request_id, prompt_ids)
            counter.seen[request_id] = (n, len(prompt_ids))
            return n

        self.cls.search_prefix_match = search_prefix_match

    @property
    def hit(self) -> int:
        return sum(n for n, _ in self.seen.values())

    @property
    def looked_up(self) -> int:
        return sum(m for _, m in self.seen.values())

    def close(self) -> None:
        self.cls.search_prefix_match = self.original


def run_hf(loaded, requests, args, sharing: bool) -> Run:
    import warnings

    from kvlab.engine_config import parse_bytes

    from transformers import ContinuousBatchingConfig

    c = loaded.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_page = args.hf_page_size * c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 4  # fp32 K and V
    cfg = ContinuousBatchingConfig(num_blocks=max(1, parse_bytes(args.kv_memory) // per_page),
                                   max_batch_tokens=args.max_batched_tokens, page_size=args.hf_page_size,
                                   allow_block_sharing=sharing)
    hits = HFHits()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        loaded.model.set_attn_implementation("paged|sdpa")
    try:
        run = hf_generate_batch(loaded.model, requests, cfg)
    finally:
        loaded.model.set_attn_implementation("sdpa")
        hits.close()
    # search_prefix_match is only called with sharing on; with it off nothing is looked up (0 hits)
    run.extra.update(prefix_hit_rate_tokens=hits.hit / hits.looked_up if hits.looked_up else 0.0,
                     prefix_hit_tokens=hits.hit)
    return run


def run_kvlab(loaded, requests, args, system: str) -> Run:
    from kvlab import LLM

    engine = dict(block_size=args.block_size, kv_cache_memory=args.kv_memory, max_num_batched_tokens=args.max_batched_tokens,
                  max_model_len=args.max_model_len, enable_prefix_caching=system != "kvlab",
                  prefix_cache="radix" if system == "kvlab-radix" else "hash")
    llm = LLM(model=args.model, loaded=copy.deepcopy(loaded), **engine)
    return kvlab_generate(llm, requests)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from kvlab.models import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    from kvlab.study.tasks.data import ByteTokenizer

    requests = make_requests(loaded.tokenizer or ByteTokenizer(loaded.model.config.vocab_size), args)
    results: dict[str, list[Run]] = {s: [] for s in args.systems}
    load_start = open("/proc/loadavg").read().split()[:3]
    for rep in range(args.repeats):
        for system in args.systems:  # interleaved: each repeat runs every system once
            t = time.perf_counter()
            if system.startswith("hf"):
                run = run_hf(loaded, requests, args, sharing=system == "hf-cb-sharing")
            else:
                run = run_kvlab(loaded, requests, args, system)
            results[system].append(run)
            print(f"repeat {rep} {system}: {run.tokens_per_s:.1f} tok/s, hit rate "
                  f"{run.extra.get('prefix_hit_rate_tokens', 0.0):.3f} ({time.perf_counter() - t:.1f} s)", flush=True)
    rows = []
    for system, runs in results.items():
        rows.append({"system": system, "tok_s_median": statistics.median(r.tokens_per_s for r in runs),
                     "wall_s_median": statistics.median(r.wall_s for r in runs),
                     "hit_rate_tokens": runs[-1].extra.get("prefix_hit_rate_tokens", 0.0),
                     "hit_tokens": runs[-1].extra.get("prefix_hit_tokens", 0),
                     "max_concurrent_seqs": runs[-1].extra.get("max_concurrent_seqs"),
                     "tok_s_all": [round(r.tokens_per_s, 2) for r in runs]})
    load_end = open("/proc/loadavg").read().split()[:3]
    lines = ["# Prefix sharing anchor: Hugging Face continuous batching vs kvlab (same run)", "",
             "Command: `" + " ".join(["python experiments/bench_hf_prefix_anchor.py", *sys.argv[1:]]) + "`  ",
             f"Date: {time.strftime('%Y-%m-%dT%H:%M:%S')}; {platform.machine()}, torch threads {args.threads}; "
             f"load average at start {' / '.join(load_start)}, at end {' / '.join(load_end)} (other agents' jobs "
             "shared the two cores: absolute tok/s are low and noisy; systems were interleaved, medians over "
             f"{args.repeats} repeats).", "",
             f"Workload: {args.num_requests} requests = one {args.system_len}-token WikiText-2 system prompt + a unique "
             f"{args.suffix_len}-token suffix, {args.max_tokens} new tokens each (EOS ignored), all queued at t=0; "
             f"model {args.model} (fp32, CPU); KV budget {args.kv_memory} for both; {args.max_batched_tokens} tokens "
             f"per step; kvlab block {args.block_size}, transformers page size {args.hf_page_size}.", "",
             "| system | tok/s (median) | wall s (median) | prefix hit rate (tokens) | hit tokens | kvlab max batch | "
             "tok/s per repeat |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        batch = "-" if r["max_concurrent_seqs"] is None else str(r["max_concurrent_seqs"])
        lines.append(f"| {r['system']} | {r['tok_s_median']:.1f} | {r['wall_s_median']:.1f} | "
                     f"{r['hit_rate_tokens']:.3f} | {r['hit_tokens']} | {batch} | {r['tok_s_all']} |")
    lines += ["", "hf-cb: `allow_block_sharing=False`; hf-cb-sharing: `True` (transformers' default). kvlab: "
              "`enable_prefix_caching` off; kvlab-hash: hashed full pages; kvlab-radix: `prefix_cache=radix`. "
              "Hit rate = prompt tokens served from the cache / prompt tokens looked up (kvlab: "
              "`prefix_hit_rate_tokens`; transformers: counted at `search_prefix_match`)."]
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(args.out, text, {"args": vars(args), "rows": rows})
    return {"rows": rows}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--system-len", type=int, default=500)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-memory", default="256MiB")
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hf-page-size", type=int, default=16, help="transformers' page size (its default is 256)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--data-dir", default=None, help="shared data folder (default: $KVLAB_DATA or ../shared/data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "hf_prefix_anchor_smollm2"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
