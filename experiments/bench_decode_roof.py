"""Decode at the memory roof (issue 27): the bytes a decode step must read, over its time, as a fraction of
what this machine streams, for kvlab and for Hugging Face `generate`, in one run.

A decode step must read every weight once (the model's unique parameters: a tied embedding / lm_head counts
once) and every cached K/V byte of the batch (at the cache format's size: int4 codes and scales, not the
float they decode to). bytes/s = (weights + K/V) / step time; the roof is measured before every cell (the
load of other jobs drifts), in the same process and thread count: `torch.sum` over a large tensor of random
float32 values (random, because zero or constant pages read faster than memory delivers them), median of
--repeats. A torch matrix-vector product over a
matrix of the same size is quoted beside it (what a linear layer at batch 1 can reach).

Per cell (dtype x cache format x batch x context) one prefill, then --warmup + --repeats x --steps decode
steps, each timed alone: kvlab steps its engine (`LLMEngine.step`); Hugging Face `generate` is timed between
successive calls of a logits processor (one per step: forward, cache update and its own per-step work).
kvlab's weight layouts (--layouts, `engine.linear_layout`, kvlab/engine/linear_layout.py) and linear backends
(--linear-backends, `engine.linear_backend`, kvlab/engine/linear_backend.py) take turns within one prefill:
block r of --steps steps runs variant r mod len(variants), the variants being every (layout, backend) pair
(load drifts hit each alike). A row's figure is the median over its blocks of the block's mean step time. Hugging Face's int4 peer is its
quantised cache (quanto backend, 4 bits, residual 128), where optimum-quanto is installed.

"K/V GB/s": the extra K/V bytes of a longer context over the extra time, against the same row at the
shortest context (what the K/V-reading part of the step streams). "attention ms": the wall time a step spends in
the CPU attention launcher (kvlab.kernels.cpu.decode_attention.run_paged_attention, all layers: the K/V read
itself), and "attention K/V of roof" the step's K/V bytes over that time, as a fraction of the roof. With
--kernel-baseline REV the decode-attention kernel of that git revision (kvlab.study.kernel_revision) takes
turns with this checkout's, block by block within the same prefill (a variant like a layout).

    python experiments/bench_decode_roof.py --batches 1 16 --contexts 32 512 2048 --quants auto int4
    python experiments/bench_decode_roof.py --linear-backends torch cpu --layouts auto --quants auto --no-hf
    python experiments/bench_decode_roof.py --model random:llama-tiny --batches 1 --contexts 16 --steps 2 --out /tmp/r
    python experiments/bench_decode_roof.py --batches 16 --contexts 32 3000 --quants auto --layouts auto \
        --linear-backends cpu --no-hf --threads 2 --max-prompt-tokens 50000 --kernel-baseline a2790e0
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvlab.study.bench_io import REPO, log, metadata, provenance, save, table
from kvlab.study.kernel_revision import kernel_at

COLUMNS = [("system", "system"), ("dtype", "dtype"), ("quant", "cache"), ("layout", "layout"),
           ("linear_backend", "linear"), ("forward", "forward"), ("kernel", "attention kernel"), ("batch", "batch"),
           ("context", "context"), ("step_ms", "step ms (median)"), ("tok_s", "tok/s"),
           ("weight_mb", "weights MB"), ("kv_mb", "K/V MB"), ("gb_s", "GB/s"), ("roof_gb_s", "roof GB/s"),
           ("roof_fraction", "of roof"),
           ("kv_gb_s", "K/V GB/s"), ("kv_roof_fraction", "K/V of roof"), ("attn_ms", "attention ms"),
           ("attn_roof_fraction", "attention K/V of roof"), ("vs_hf", "vs HF (same cache)")]


# -- the roof ------------------------------------------------------------------------------------------
def measure_roof(mib: int, repeats: int) -> dict:
    """Streaming read of `mib` MiB of random float32 (torch.sum) and a matrix-vector product over as many bytes."""
    import torch

    n = mib * (1 << 20) // 4
    x = torch.rand(n, generator=torch.Generator().manual_seed(0))
    side = int((n // 576))  # a [side, 576] matrix: SmolLM2's hidden size
    w, v = x[: side * 576].view(side, 576), torch.rand(576)
    reads = {"sum": (lambda: x.sum(), x.numel() * 4), "matvec": (lambda: w @ v, w.numel() * 4)}
    out = {}
    for name, (fn, nbytes) in reads.items():
        fn()
        times = []
        for _ in range(max(repeats, 3)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[f"{name}_gb_s"] = nbytes / statistics.median(times) / 1e9
    return out


# -- bytes a step reads ---------------------------------------------------------------------------------
def weight_bytes(model) -> int:
    """Every unique parameter once (a tied lm_head / embedding counts once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def hf_kv_bytes_per_token(config, dtype, nbits: int | None) -> float:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elems = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return elems * (nbits / 8 if nbits else dtype.itemsize)


# -- timed decoding -------------------------------------------------------------------------------------
def kvlab_cell(llm, prompts, blocks: int, args, variants, kernels) -> list[tuple[tuple, float, float, float]]:
    """((layout, backend, forward, kernel), mean step s, mean cached tokens per sequence, mean attention s a step)
    per block of --steps decode steps; `kernels`: {name: kernel function, None for this checkout's}."""
    from kvlab import SamplingParams
    from kvlab.engine.linear_backend import apply_linear
    from kvlab.kernels.cpu import decode_attention as cpu

    engine, total = llm.engine, 1 + args.warmup + blocks * args.steps
    lean, own_kernel, launcher = engine.runner.lean, cpu._kernel, cpu.run_paged_attention
    attention = [0.0]  # seconds this step spent in the attention launcher

    def timed_launcher(*a, **kw):
        t0 = time.perf_counter()
        try:
            return launcher(*a, **kw)
        finally:
            attention[0] += time.perf_counter() - t0

    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=total, ignore_eos=True))
    times, attn, out = [], [], []
    cpu.run_paged_attention = timed_launcher
    try:
        while engine.has_unfinished():
            i = len(times) - 1 - args.warmup  # decode step index after the warm-up (-1 - warmup: the prefill)
            if i >= 0 and i % args.steps == 0:
                layout, backend, forward, kernel = variants[(i // args.steps) % len(variants)]
                apply_linear(engine.model, layout, backend)
                engine.runner.lean = lean if forward == "lean" else None  # hf: transformers' forward
                cpu._kernel = own_kernel if kernels[kernel] is None else (lambda fn=kernels[kernel]: fn)
            attention[0] = 0.0
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            attn.append(attention[0])
    finally:
        cpu.run_paged_attention, cpu._kernel = launcher, own_kernel
    if len(times) != total:  # step 1 is the whole prefill, every later step one token per sequence
        raise RuntimeError(f"{len(times)} engine steps for {total} tokens: the prefill did not fit one step")
    apply_linear(engine.model, "none", "torch")
    engine.runner.lean = lean
    decode, decode_attn = times[1 + args.warmup:], attn[1 + args.warmup:]
    for b in range(blocks):
        start = len(prompts[0]) + 1 + args.warmup + b * args.steps  # cached tokens at the block's first step
        block = slice(b * args.steps, (b + 1) * args.steps)
        out.append((variants[b % len(variants)], statistics.mean(decode[block]), start + (args.steps - 1) / 2,
                    statistics.mean(decode_attn[block])))
    return out


def hf_cell(model, prompts, args, quantized: bool) -> list[tuple[str, float, float]]:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    stamp, new = Stamp(), 1 + args.warmup + args.repeats * args.steps
    ids = torch.tensor(prompts, dtype=torch.int64)  # [b, c], equal lengths: no padding
    quanto = {"cache_implementation": "quantized", "cache_config": {"backend": "quanto", "nbits": 4}}
    extra = quanto if quantized else {}
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([stamp]), **extra)
    steps = [b - a for a, b in zip(stamp.times, stamp.times[1:])][args.warmup:]  # step i: forward at context c+i
    c = len(prompts[0])
    return [("none", statistics.mean(steps[r * args.steps:(r + 1) * args.steps]),
             c + 1 + args.warmup + r * args.steps + (args.steps - 1) / 2, None) for r in range(args.repeats)]


def rows_of(system, dtype, quant, batch, context, blocks, weights, kv_per_token, roof: float) -> list[dict]:
    """One row per variant ((layout, linear backend), or a system's own name) in `blocks`; `roof`: bytes/s
    streamed just before the cell."""
    rows = []
    for variant in dict.fromkeys(b[0] for b in blocks):
        mine = [b for b in blocks if b[0] == variant]
        layout, backend, forward, kernel = variant if isinstance(variant, tuple) else (variant, None, None, None)
        step = statistics.median(b[1] for b in mine)
        cached = statistics.mean(b[2] for b in mine)
        kv = batch * cached * kv_per_token
        attn = None if mine[0][3] is None else statistics.median(b[3] for b in mine)
        rows.append({"system": system, "dtype": dtype, "quant": quant, "layout": layout,
                     "linear_backend": backend, "forward": forward, "kernel": kernel, "batch": batch,
                     "context": context, "step_ms": 1000 * step, "tok_s": batch / step, "weight_mb": weights / 1e6,
                     "kv_mb": kv / 1e6, "gb_s": (weights + kv) / step / 1e9,
                     "roof_gb_s": roof / 1e9, "roof_fraction": (weights + kv) / step / roof,
                     "steps_s": [b[1] for b in mine],
                     "kv_bytes": kv, "step_s": step})
        if attn:
            rows[-1].update(attn_ms=1000 * attn, attn_roof_fraction=kv / attn / roof,
                            attn_s=[b[3] for b in mine])
    return rows


def add_derived(rows: list[dict]) -> None:
    """K/V GB/s against the same system/dtype/cache/layout/batch at the shortest context; kvlab over HF."""
    key = lambda r: (r["system"], r["dtype"], r["quant"], r["layout"], r.get("linear_backend"), r.get("forward"),
                     r.get("kernel"), r["batch"])  # noqa: E731
    for r in rows:
        base = min((o for o in rows if key(o) == key(r)), key=lambda o: o["context"])
        dt = r["step_s"] - base["step_s"]
        if r is not base and dt > 0:
            r["kv_gb_s"] = (r["kv_bytes"] - base["kv_bytes"]) / dt / 1e9
            r["kv_roof_fraction"] = r["kv_gb_s"] / r["roof_gb_s"]
        hf = [o for o in rows if o["system"] == "hf-generate" and (o["dtype"], o["quant"], o["batch"], o["context"])
              == (r["dtype"], r["quant"], r["batch"], r["context"])]
        if hf:
            r["vs_hf"] = hf[0]["step_s"] / r["step_s"]


def run(args) -> tuple[list[dict], list[dict]]:
    import torch

    from kvlab import LLM
    from kvlab.models import load_model

    roofs = []

    def roof() -> float:
        """The streaming roof now (measured before every cell: other jobs' load drifts during a run)."""
        roofs.append(measure_roof(args.roof_mib, args.repeats))
        log(f"roof: sum {roofs[-1]['sum_gb_s']:.1f} GB/s, matvec {roofs[-1]['matvec_gb_s']:.1f} GB/s")
        return roofs[-1]["sum_gb_s"] * 1e9

    g = torch.Generator().manual_seed(args.seed)
    cells = [(b, c) for b in args.batches for c in args.contexts if b * c <= args.max_prompt_tokens]
    kernels = {"this": None, **({args.kernel_baseline: kernel_at(args.kernel_baseline)} if args.kernel_baseline else {})}
    variants = [(layout, backend, forward, kernel) for layout in args.layouts for backend in args.linear_backends
                for forward in args.forwards for kernel in kernels]
    blocks = args.repeats * len(variants)
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        loaded = load_model(args.model, dtype=dtype)
        vocab, weights = loaded.model.config.vocab_size, weight_bytes(loaded.model)
        longest = max(b * (c + 2 + args.warmup + blocks * args.steps) for b, c in cells)
        per_token = hf_kv_bytes_per_token(loaded.model.config, dtype, None)
        hf = load_model(args.model, dtype=dtype).model if not args.no_hf else None
        for quant in args.quants:
            llm = LLM(args.model, loaded=loaded, dtype=dtype_name, quant=quant, block_size=args.block_size,
                      kv_cache_memory=int(1.2 * longest * per_token) + (64 << 20), max_num_seqs=max(args.batches),
                      max_num_batched_tokens=max(b * c for b, c in cells))
            kv_token = llm.engine.bytes_per_block / args.block_size
            for b, c in cells:
                prompts = [torch.randint(3, vocab, (c,), generator=g).tolist() for _ in range(b)]
                log(f"{dtype_name} {quant} batch {b} context {c}: kvlab")
                now = roof()
                rows += rows_of("kvlab", dtype_name, quant, b, c, kvlab_cell(llm, prompts, blocks, args, variants, kernels),
                                weights, kv_token, now)
                quantized = quant != "auto"
                if hf is None or (quantized and (quant != "int4" or not quanto_installed())):
                    continue
                log(f"{dtype_name} {quant} batch {b} context {c}: hf-generate")
                now = roof()
                rows += rows_of("hf-generate", dtype_name, quant, b, c, hf_cell(hf, prompts, args, quantized),
                                weights, hf_kv_bytes_per_token(hf.config, dtype, 4 if quantized else None), now)
            del llm
    add_derived(rows)
    return roofs, rows


def quanto_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None


def report(roofs: list[dict], rows: list[dict], meta: dict, args) -> str:
    sums, mvs = [r["sum_gb_s"] for r in roofs], [r["matvec_gb_s"] for r in roofs]
    return "\n".join([
        f"# Decode at the memory roof ({args.model})", "",
        *provenance(meta, "the machine is shared with other jobs: timings are indicative only"),
        f"Roof, this run, {args.threads} torch thread(s), measured before every cell (each row uses its own): "
        f"streaming read (torch.sum over {args.roof_mib} MiB of random float32) median **{statistics.median(sums):.1f} "
        f"GB/s** (range {min(sums):.1f}-{max(sums):.1f}); float32 matrix-vector product over as many bytes median "
        f"{statistics.median(mvs):.1f} GB/s (range {min(mvs):.1f}-{max(mvs):.1f}).", "",
        f"Per cell: one prefill of random prompts, {args.warmup} warm-up steps, then {args.repeats} x {args.steps} "
        f"timed decode steps per kvlab layout ({', '.join(args.layouts)}) x linear backend "
        f"({', '.join(args.linear_backends)}) x forward ({', '.join(args.forwards)}; lean: "
        "kvlab/engine/lean_forward.py, hf: transformers' module forward) x attention kernel (this: this checkout's"
        f"{'; ' + args.kernel_baseline + ': that revision' if args.kernel_baseline else ''}) (blocks interleaved) "
        "and for Hugging Face "
        "`generate` (its default sdpa attention and dynamic cache; int4: its quantised cache, quanto, 4 bits). "
        "Bytes per step = unique weights + the batch's cached K/V at the format's size (mean context over the "
        "block); 'of roof' = (bytes / step time) / the streaming roof measured just before the cell. 'K/V GB/s': "
        "extra K/V bytes over extra time against the row's shortest context; 'attention ms': a step's wall time in "
        "the CPU attention launcher (all layers), 'attention K/V of roof': K/V bytes over that time / the roof. "
        f"Block size {args.block_size}; cells "
        f"with batch x context > {args.max_prompt_tokens} skipped (prefill time).", "",
        table(rows, COLUMNS), ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[32, 512, 2048])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--quants", nargs="+", default=["auto", "int4"], help="kvlab cache formats (auto: the dtype's)")
    p.add_argument("--layouts", nargs="+", default=["none", "auto"], choices=["none", "auto"],
                   help="kvlab engine.linear_layout values, interleaved per block")
    p.add_argument("--linear-backends", nargs="+", default=["torch"], choices=["torch", "cpu"],
                   help="kvlab engine.linear_backend values, interleaved per block (with every layout)")
    p.add_argument("--forwards", nargs="+", default=["lean"], choices=["lean", "hf"],
                   help="kvlab's forward: lean (kvlab/engine/lean_forward.py, where the model takes it) or "
                        "transformers' module forward, interleaved per block")
    p.add_argument("--kernel-baseline", default=None,
                   help="git revision whose CPU decode-attention kernel takes turns with this checkout's, per block")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed block")
    p.add_argument("--repeats", type=int, default=3, help="timed blocks per layout (and for HF)")
    p.add_argument("--warmup", type=int, default=2, help="decode steps before the first timed block")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=16384, help="skip cells whose prefill is larger")
    p.add_argument("--roof-mib", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-hf", action="store_true", help="kvlab only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "decode_roof_smollm2"))
    return p.parse_args(argv)


def main(argv=None) -> tuple[list[dict], list[dict]]:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # before the metadata, which quotes it
    meta = metadata(args)
    roofs, rows = run(args)
    save(args.out, report(roofs, rows, meta, args), {**meta, "roofs": roofs}, rows)
    return roofs, rows


if __name__ == "__main__":
    main()
