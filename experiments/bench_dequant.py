"""What reading a quantised cache costs per decode step on CPU (the engine's torch reference path).

For each format, --batch sequences of --context tokens are prefilled, then decoded: one decode step's time
is (time of --steps + 1 generated tokens - time of 1 generated token) / --steps, both runs on the same
engine, median over --repeats. The difference from fp32 is the cost of storing (quantising) one new token
per sequence and reading (dequantising) every cached one, per step. All formats run in one process, in
turn, every repeat cycling through them (so load drifts hit every format alike).

    python experiments/bench_dequant.py                                   # SmolLM2-135M, batch 8, 1024 tokens
    python experiments/bench_dequant.py --model random:llama-tiny --context 64 --steps 4 --out /tmp/dq
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from kvlab.study.bench_io import REPO, log, metadata, provenance, save, table

FORMATS = ["fp32", "bf16", "fp8_e4m3", "int8", "int4", "int2"]
COLUMNS = [("format", "format"), ("step_ms", "decode step ms (median)"), ("vs_fp32", "vs fp32"),
           ("extra_ms", "ms over fp32"), ("per_token_us", "us per cached token read over fp32"),
           ("spread", "min-max ms")]


def run(args) -> list[dict]:
    import torch

    from kvlab import LLM, SamplingParams
    from kvlab.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    vocab = loaded.model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, vocab, (args.context,), generator=g).tolist() for _ in range(args.batch)]
    llms = {}
    for fmt in args.formats:
        qargs = {"group_size": args.group_size} if fmt in ("int4", "int2") else {}
        llms[fmt] = LLM(args.model, loaded=copy.deepcopy(loaded), quant=fmt, quant_args=qargs,
                        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                        max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.context)

    def timed(llm, n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    steps: dict[str, list[float]] = {fmt: [] for fmt in args.formats}
    for r in range(args.repeats + 1):  # the first round warms up
        for fmt, llm in llms.items():
            short, long = timed(llm, 1), timed(llm, args.steps + 1)
            if r:
                steps[fmt].append((long - short) / args.steps)
                log(f"{fmt} round {r}: {1000 * steps[fmt][-1]:.1f} ms per decode step")
    rows = []
    base = statistics.median(steps[args.formats[0]])
    for fmt in args.formats:
        med = statistics.median(steps[fmt])
        rows.append({"format": fmt, "step_ms": 1000 * med, "vs_fp32": med / base, "extra_ms": 1000 * (med - base),
                     "per_token_us": 1e6 * (med - base) / (args.batch * args.context),
                     "spread": f"{1000 * min(steps[fmt]):.1f}-{1000 * max(steps[fmt]):.1f}", "steps_s": steps[fmt]})
    return rows


def report(rows: list[dict], meta: dict, args) -> str:
    return "\n".join([
        f"# Dequantisation cost per decode step on CPU ({args.model})",
        "",
        *provenance(meta),
        f"Batch {args.batch}, {args.context}-token random prompts, block size {args.block_size}; one decode step = "
        f"(generate {args.steps + 1} tokens - generate 1) / {args.steps}, median of {args.repeats} rounds (formats "
        "interleaved within each round). KIVI formats (int4, int2) with group size "
        f"{args.group_size} and their default 32-token residual. Torch reference path (the Triton kernels fuse "
        "the same dequantisation; timed only on a GPU).",
        "",
        table(rows, COLUMNS),
        "",
    ])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--formats", nargs="+", default=FORMATS)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "dequant_cost_smollm2"))
    args = p.parse_args(argv)
    if args.formats[0] != "fp32":
        p.error("--formats must start with fp32 (the baseline)")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    meta = metadata(args)
    rows = run(args)
    text = report(rows, meta, args)
    save(args.out, text, meta, rows)
    return rows


if __name__ == "__main__":
    main()
