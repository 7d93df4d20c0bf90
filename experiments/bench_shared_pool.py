"""Concurrent sequences and throughput at one KV byte budget, before and after the shared page pool.

Before (--before, default ce793cb) every layer group had a pool of its own, all with the same number of
blocks, so on Gemma 3 (15 sliding-window layers, window 512, and 3 full-attention layers) 15/18 of the
budget sat in the sliding-window pool, which needs at most window/block_size + 1 blocks per sequence.
After (this checkout), layer groups of equal size draw pages from one pool (kvlab/cache/block_manager.py).

Workload: --num-requests WikiText-2 prompts of --min-len..--max-len tokens (beyond the window), all
queued at t=0, greedy, --max-tokens new tokens each with EOS ignored. The default budget lets the
"before" full-attention pool hold --before-fits of the longest requests.

Every measurement runs in a fresh subprocess of this script: "after" imports this checkout's kvlab,
"before" the package assembled from `git archive <rev>` by that revision's setuptools package-dir
mapping, put first on PYTHONPATH. Variants alternate for --repeats rounds; tables show medians.

    python experiments/bench_shared_pool.py                     # about 15 minutes on 2 quiet cores
    python experiments/bench_shared_pool.py --num-requests 4 --repeats 1 --out /tmp/shared_pool
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # kvlab.study.bench_io is imported where used, never at the top: the
# "before" child runs this file against an older kvlab that lacks it

STATS = ("max_concurrent_seqs", "mean_concurrent_seqs", "tokens_per_s", "busy_s", "kv_blocks_total",
         "kv_blocks_peak", "preemptions", "num_steps", "ttft_median_s", "generated_tokens")
COLUMNS = [("variant", "variant"), ("max_concurrent_seqs", "max seqs"), ("mean_concurrent_seqs", "mean seqs"),
           ("tokens_per_s", "tok/s (busy)"), ("wall_s", "wall s"), ("ttft_median_s", "TTFT p50 s"),
           ("kv_blocks_total", "KV pages"), ("page_layers", "layers per page"), ("kv_blocks_peak", "pages peak"),
           ("kv_bytes", "KV MiB"), ("preemptions", "preemptions"), ("num_steps", "steps")]


# -- the measurement (runs in the subprocess, against whichever kvlab it imports) ---------------------
def measure(spec: dict) -> dict:
    """One engine, one `generate` over spec["prompts"] (token ids); stats, wall time and the tokens."""
    import torch

    import kvlab
    from kvlab import LLM, SamplingParams

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    llm = LLM(spec["model"], **spec["engine"])
    llm.generate([spec["prompts"][0][:32]], SamplingParams(max_tokens=2))  # warm-up
    llm.reset_stats()
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)  # greedy
    start = time.perf_counter()
    outputs = llm.generate(spec["prompts"], params)
    wall = time.perf_counter() - start
    stats = llm.stats()
    bm = llm.engine.block_manager
    shared = hasattr(bm, "allocator")  # one allocator for all groups (after) or one per group (before)
    layers = [len(g.layers) for g in bm.groups]
    modules = sorted({m.__file__ for n, m in sys.modules.items()
                      if (n == "kvlab" or n.startswith("kvlab.")) and getattr(m, "__file__", None)})
    return {**{k: stats[k] for k in STATS}, "wall_s": wall, "kvlab_file": kvlab.__file__, "kvlab_modules": modules,
            "shared_pool": shared,
            "kv_bytes": llm.engine.cache.nbytes() / 2**20, "num_groups": len(layers),
            "page_layers": layers[0] if shared else sum(layers),  # layers whose K/V one page (block id) holds
            "token_ids": [list(o.token_ids) for o in outputs]}


# -- the engine at another revision ---------------------------------------------------------------------
def assemble(rev: str, root: Path) -> Path:
    """kvlab as of `rev`, laid out as setuptools installs it (package-dir of that pyproject.toml), in root/site."""
    src, site = root / "src", root / "site"
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        tarfile.open(fileobj=f).extractall(src, filter="data")
    mapping = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):  # parents first
        (site / package.replace(".", "/")).parent.mkdir(parents=True, exist_ok=True)
        (src / folder).rename(site / package.replace(".", "/"))
    return site


def run_child(spec: dict, site: Path | None, workdir: Path) -> dict:
    """`measure(spec)` in a fresh interpreter; kvlab from `site` (first on PYTHONPATH) or this checkout."""
    name = "before" if site else "after"
    spec_path, out_path = workdir / f"{name}_spec.json", workdir / f"{name}_out.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site:
        env["PYTHONPATH"] = str(site)
    subprocess.run([sys.executable, __file__, "--child", str(spec_path), str(out_path)], env=env, check=True)
    result = json.loads(out_path.read_text())
    inside = Path(result["kvlab_file"]).resolve().is_relative_to((site or REPO).resolve())
    if not inside:
        raise RuntimeError(f"{name}: imported kvlab from {result['kvlab_file']}, not from {site or REPO}")
    # the checkout's editable install still finds kvlab's subpackages the old revision lacks: none may be imported
    mixed = [f for f in result["kvlab_modules"] if site and not Path(f).resolve().is_relative_to(site.resolve())]
    if mixed:
        raise RuntimeError(f"{name}: imported modules of this checkout beside kvlab at {site}: {mixed}")
    return result


# -- workload and budget ----------------------------------------------------------------------------------
def before_budget(model_config, args) -> int:
    """Bytes for which the per-group pools (one block id = block_size tokens of every layer) hold
    `before_fits` of the longest requests in their full-attention pool."""
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    per_block = 2 * model_config.num_hidden_layers * args.block_size * model_config.num_key_value_heads * head_dim * 4
    blocks = -(-(args.max_len + args.max_tokens) // args.block_size)
    return args.before_fits * blocks * per_block


# -- summary and report -----------------------------------------------------------------------------------
def summarise(runs: dict[str, list[dict]]) -> dict:
    rows = {name: {"variant": name, **{k: statistics.median(r[k] for r in rs) for k in (*STATS, "wall_s")},
                   "kv_bytes": rs[0]["kv_bytes"], "page_layers": rs[0]["page_layers"],
                   "num_groups": rs[0]["num_groups"], "runs": [{k: r[k] for k in (*STATS, "wall_s")} for r in rs]}
            for name, rs in runs.items()}
    ratios = {}
    if {"before", "after"} <= set(rows):
        b, a = rows["before"], rows["after"]
        ratios = {"max_concurrent_seqs": a["max_concurrent_seqs"] / b["max_concurrent_seqs"],
                  "mean_concurrent_seqs": a["mean_concurrent_seqs"] / b["mean_concurrent_seqs"],
                  "tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"], "wall_s": a["wall_s"] / b["wall_s"]}
        ratios["same_greedy_tokens"] = all(r["token_ids"] == runs["before"][0]["token_ids"]
                                           for rs in runs.values() for r in rs)
    return {"rows": list(rows.values()), "ratios": ratios}


def report(results: dict, meta: dict) -> str:
    from kvlab.study.bench_io import commit_line, fmt, table

    a, r = meta["args"], results["ratios"]
    lines = [f"# Shared page pool: before ({results['before_rev'][:7]}) vs after ({commit_line(meta)}), "
             f"{a['model']}", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['started_at']}  ", f"Machine: {meta['machine']}  ",
             f"Load average (1/5/15 min) at start: {meta['load_start']}, at end: {meta['load_end']}  ",
             f"Versions: python {meta['python']}, torch {meta['versions']['torch']}, "
             f"transformers {meta['versions']['transformers']}", "",
             f"{a['num_requests']} WikiText-2 prompts of {a['min_len']}-{a['max_len']} tokens (mean "
             f"{results['mean_prompt_len']:.0f}), {a['max_tokens']} new tokens each (greedy, EOS ignored), all "
             f"queued at t=0; KV budget {results['kv_memory'] / 2**20:.1f} MiB (the before-pool holds "
             f"{a['before_fits']} longest requests in its full-attention pool), block {a['block_size']}, "
             f"max_model_len {a['max_model_len']}, max_num_batched_tokens {a['max_batched_tokens']}, float32. "
             f"Medians of {a['repeats']} runs, before and after alternating, each in a fresh process.", "",
             "Before: a page (block id) holds every layer, and each layer group (full attention, sliding window) "
             "has a pool of its own of that many pages. After: a page holds one group's layers and the "
             f"{results['rows'][-1]['num_groups']} groups share one pool.", "",
             table(results["rows"], COLUMNS), ""]
    if r:
        lines += [f"after / before: max concurrent sequences {r['max_concurrent_seqs']:.2f}x, mean "
                  f"{r['mean_concurrent_seqs']:.2f}x, tok/s {r['tokens_per_s']:.2f}x, wall time {r['wall_s']:.2f}x  ",
                  "Greedy outputs identical before and after (every request, every run): "
                  f"{'yes' if r['same_greedy_tokens'] else 'NO'}", ""]
    lines += ["Per run (tok/s; max / mean concurrent sequences):  "]
    lines += [f"{row['variant']}: " + ", ".join(f"{fmt(x['tokens_per_s'])} ({x['max_concurrent_seqs']} / "
                                                f"{fmt(x['mean_concurrent_seqs'])})" for x in row["runs"]) + "  "
              for row in results["rows"]]
    return "\n".join(lines) + "\n"


# -- command line -----------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="gemma3-270m", help="kvlab model name")
    p.add_argument("--before", default="ce793cb", help="git revision of the engine before the shared pool")
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--min-len", type=int, default=1000, help="shortest prompt, tokens")
    p.add_argument("--max-len", type=int, default=1500, help="longest prompt, tokens")
    p.add_argument("--max-tokens", type=int, default=24, help="new tokens per request")
    p.add_argument("--kv-memory", default=None, help="KV byte budget (default: from --before-fits)")
    p.add_argument("--before-fits", type=int, default=4,
                   help="default budget: the before-engine's full-attention pool holds this many longest requests")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-batched-tokens", type=int, default=512, help="engine max_num_batched_tokens")
    p.add_argument("--repeats", type=int, default=3, help="rounds of (before, after)")
    p.add_argument("--variants", nargs="+", choices=("before", "after"), default=["before", "after"])
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in each measurement (0: torch's default); on the shared, loaded 2 cores "
                        "here 1 thread prefilled 4x faster than 2")
    p.add_argument("--seed", type=int, default=0, help="prompt lengths")
    p.add_argument("--out", default="experiments/results/shared_pool_gemma3", help="writes <out>.md and <out>.json")
    return p.parse_args(argv)


def engine_spec(args, prompts: list[list[int]], kv_memory: int) -> dict:
    engine = dict(block_size=args.block_size, kv_cache_memory=kv_memory, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_batched_tokens, dtype="float32")
    return {"model": args.model, "engine": engine, "prompts": prompts, "max_tokens": args.max_tokens,
            "threads": args.threads}


def main(argv=None) -> dict:
    import torch

    from kvlab.study.bench_io import load_average, log, metadata
    from kvlab.study.loggers.local import write_report
    from kvlab.models import load_model
    from kvlab.study.corpus_prompts import corpus_prompts  # here, not at the top: the child may import an older kvlab
    from kvlab.study.tasks.data import get_tokenizer

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # as in each measurement, so the metadata records it
    loaded = load_model(args.model)
    prompts = corpus_prompts(get_tokenizer(loaded), args.num_requests, args.min_len, args.max_len, args.seed)
    kv_memory = int(args.kv_memory) if args.kv_memory else before_budget(loaded.model.config, args)
    del loaded
    meta = {**metadata(args), "args": vars(args)}
    before_rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.before], check=True,
                                capture_output=True, text=True).stdout.strip()
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory(prefix="kvlab_before_") as tmp:
        site = assemble(before_rev, Path(tmp)) if "before" in args.variants else None
        for i in range(args.repeats):
            for variant in args.variants:
                result = run_child(engine_spec(args, prompts, kv_memory),
                                   site if variant == "before" else None, Path(tmp))
                runs[variant].append(result)
                log(f"round {i + 1} {variant}: max {result['max_concurrent_seqs']} mean "
                    f"{result['mean_concurrent_seqs']:.2f} seqs, {result['tokens_per_s']:.2f} tok/s, "
                    f"{result['wall_s']:.1f} s")
    results = {**summarise(runs), "before_rev": before_rev, "kv_memory": kv_memory,
               "mean_prompt_len": statistics.mean(len(p) for p in prompts)}
    meta["load_end"] = load_average()
    text = report(results, meta)
    print(text)
    md, js = write_report(args.out, text, {"meta": meta, **results, "prompt_lens": [len(p) for p in prompts]})
    log(f"wrote {md} and {js}")
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        spec_file, out_file = sys.argv[2:4]
        Path(out_file).write_text(json.dumps(measure(json.loads(Path(spec_file).read_text()))))
    else:
        main()
