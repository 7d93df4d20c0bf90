"""The regime map: where self-speculation pays. Speed-up over plain decoding of the target drafting for itself
through a compressed view of its own cache (`self_compressed`, MagicDec / TriForce / QuantSpec: a StreamingLLM page
view, a SnapKV token view, an int4-stored view), of its early exit (`layerskip`), of a separate draft model
(`model`) and of prompt lookup (`ngram`), over a grid of dtype x context length x batch, each beside what memory
traffic predicts (kvlab/speculation/cost_model.py, bytes read off the built engine by
kvlab/speculation/engine_traffic.py); at batch 1 also Hugging Face's assisted generation (`assistant_early_exit`,
prompt lookup) against Hugging Face's plain `generate` in the same cell.

One cell (`--cell dtype,ctx,batch`) loads the model once (every engine of the cell shares its modules), builds one
engine per decoder (plain, each draft), all with `linear_backend` (default `cpu`: kvlab's small-batch linear kernel)
and the default decode attention (kvlab's native kernel on CPU), prefix caching on, then alternates timed runs of
plain and each draft, `--repeats` times. Decode speed is batch / median time per output token (TPOT: prefill
excluded), greedy, EOS ignored; fp32 outputs must be token-identical to plain decoding.

Workload (`--workload`): `shared` (default, SCBench-style shared context): one document of `ctx` tokens (Paul
Graham's essays, $KVLAB_DATA) shared by every sequence through prefix caching, then `--suffix` distinct tokens per
sequence (windows of another essay), so the sequences differ. Each sequence's block table points at the shared
pages and the attention kernel reads them per sequence, so the bytes read per step are those of `batch` distinct
contexts (the cost model counts them so), while the pool holds one document (a 7k-token x 32 fp32 cell needs ~0.4 GB
of KV instead of 10 GB) and each engine prefills the document once (untimed). `distinct`: `batch` different
`ctx`-token windows. Drafts with a pool of their own (layerskip, model) hold a full copy of every sequence's context
there (no prefix sharing in a draft pool): they run only while that copy fits `--own-pool-gib`.

The prediction is S = E * T(B, c) / (k * D(B, c) + T(B, c + k)) with the measured tokens per verification E, drafted
tokens per verification k, and c = prompt + max_tokens / 2, corrected for the steps that verified nothing
(`run_speedup`); `KV/W` is the target pass's KV bytes over its weight bytes. Beside it, `predicted (bytes +
compute)` prices each pass in seconds (`PassTimes`, `timed_speedup`): the plain engine's step parts measured by
one run with timers (linear, attention, per-pass and per-step overhead), a draft pass's linear and attention parts
scaled by its weight and KV bytes over the target's, a verification's by its linear and attention costs over a
decode pass's measured at start-up (kvlab/speculation/pass_costs.py: k + 1 queries a sequence, B (k + 1) rows),
and a copied view's refresh time as the draft measured it. `--profile` adds one run of every engine with timers
around its parts: the cell file's `profile`, and a table of ms per step by part (kvlab/study/round_profile.py).

    python experiments/bench_self_speculation_regime.py --cell fp32,4096,16 --threads 2   # one cell -> <out>.cells/
    python experiments/bench_self_speculation_regime.py --all --contexts 4096 7168 --batches 16 32
    python experiments/bench_self_speculation_regime.py --aggregate                     # the table from the cells
    python experiments/bench_self_speculation_regime.py --all --dtypes fp32 --contexts 64 --batches 1 \\
        --model random:llama-tiny --max-tokens 8 --repeats 1 --out /tmp/regime          # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvlab.study.bench_io import commit_line, load_average, log, metadata, table

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
COLUMNS = [("dtype", "dtype"), ("ctx", "context"), ("batch", "batch"), ("draft", "draft"),
           ("kv_over_weights", "KV/W"), ("plain_tok_s", "plain decode tok/s"), ("spec_tok_s", "draft decode tok/s"),
           ("speedup", "measured speed-up"), ("predicted_time", "predicted (bytes + compute)"),
           ("predicted", "predicted (memory traffic)"), ("ceiling", "at the roof (measured E)"),
           ("ceiling_all", "at the roof, all accepted"),
           ("acceptance", "acceptance a"), ("accepted_len", "tokens per verification"),
           ("drafted_len", "drafted per verification"), ("identical", "outputs identical"), ("load", "load 1-min")]
HF_COLUMNS = [("dtype", "dtype"), ("ctx", "context"), ("batch", "batch"), ("hf", "Hugging Face generate"),
              ("tok_s", "decode tok/s"), ("speedup", "speed-up vs HF plain"), ("vs_kvlab", "tok/s / kvlab plain"),
              ("identical", "output = kvlab plain"), ("load", "load 1-min")]
DRAFT_CHOICES = ("streaming", "snapkv", "int4", "layerskip", "model", "ngram", "hf_early_exit", "hf_prompt_lookup",
                 "streaming_k2", "streaming_k3", "streaming_adaptive")  # the last three: the page view with k = 2,
# k = 3, or an adaptive length (from --num-tokens, up to 8: kvlab/speculation/draft_length.py), in one cell
OWN_POOL = ("layerskip", "model")  # drafts whose KV lives in a pool of their own (a copy of each context)


def draft_spec(args, key: str) -> tuple[str, str, dict]:
    """(label, draft name, draft_args) of one kvlab draft named by its --drafts key."""
    k = args.num_tokens
    view = {"num_tokens": k, "max_batch": 32}
    if key == "streaming":
        return (f"self_compressed(streaming_llm {args.budget})", "self_compressed",
                {**view, "policy": "streaming_llm", "policy_args": {"budget": args.budget}})
    if key.startswith("streaming_"):
        label, name, dargs = draft_spec(args, "streaming")
        if key == "streaming_adaptive":
            return f"{label}, adaptive from {k}", name, {**dargs, "adaptive": True}
        k = int(key.removeprefix("streaming_k"))
        return f"{label}, k = {k}", name, {**dargs, "num_tokens": k}
    if key == "snapkv":
        return (f"self_compressed(snapkv {args.snapkv_budget}, refresh {args.snapkv_refresh}"
                f"{', rescore all' if args.snapkv_rescore == 'all' else ''})", "self_compressed",
                {**view, "policy": "snapkv", "policy_args": {"budget": args.snapkv_budget, "window_size": 16},
                 "refresh": args.snapkv_refresh, **({"rescore": "all"} if args.snapkv_rescore == "all" else {})})
    if key == "int4":
        return (f"self_compressed(streaming_llm {args.int4_budget}, int4, refresh {args.refresh})", "self_compressed",
                {**view, "policy": "streaming_llm", "policy_args": {"budget": args.int4_budget}, "quant": "int4",
                 "refresh": args.refresh})
    if key == "layerskip":
        return f"layerskip({args.layers} layers)", "layerskip", {"layers": args.layers, "num_tokens": k}
    if key == "model":
        return f"model({args.draft_model or args.model})", "model", {"model": args.draft_model or args.model,
                                                                     "num_tokens": k}
    if key == "ngram":
        return "ngram", "ngram", {"num_tokens": k}
    raise ValueError(f"--drafts: unknown kvlab draft {key!r}; one of {DRAFT_CHOICES}")


def essay_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The essays' tokens: all but the last essay (the documents), and the last (the suffixes)."""
    from kvlab.study.tasks.data import data_path

    files = sorted(data_path("paul-graham-essays").glob("*.txt"))
    body = tokenizer("\n\n".join(p.read_text() for p in files[:-1]))["input_ids"]
    return body, tokenizer("\n\n" + files[-1].read_text())["input_ids"]


def cell_prompts(tokenizer, ctx: int, batch: int, vocab: int, workload: str = "distinct",
                 suffix: int = 24) -> tuple[list[list[int]], list[int] | None]:
    """(prompts, shared document or None). `distinct`: `batch` different windows of `ctx` tokens; `shared`: one
    `ctx`-token document + `suffix` different tokens per sequence. Random tokens without a tokenizer."""
    if tokenizer is None:
        import torch

        g = torch.Generator().manual_seed(ctx * 1000 + batch)
        body = torch.randint(3, vocab, (batch * ctx + ctx,), generator=g).tolist()
        tail = torch.randint(3, vocab, (batch * suffix + 1,), generator=g).tolist()
    else:
        body, tail = essay_tokens(tokenizer)
    if workload == "shared":
        if len(body) < ctx or len(tail) < batch * suffix:
            raise ValueError(f"the essays hold {len(body)} + {len(tail)} tokens, too few for a {ctx}-token document "
                             f"and {batch} suffixes of {suffix}")
        doc = body[:ctx]
        return [doc + tail[i * suffix:(i + 1) * suffix] for i in range(batch)], doc
    stride = max(ctx, (len(body) - ctx) // max(batch, 1))
    out = [body[i * stride:i * stride + ctx] for i in range(batch)]
    if any(len(p) < ctx for p in out):
        raise ValueError(f"the essays hold {len(body)} tokens, too few for {batch} prompts of {ctx}")
    return out, None


def timed(llm, batch, max_tokens: int) -> tuple[dict, list[list[int]]]:
    """One run: decode tok/s (batch / median TPOT), the draft's stats, the outputs."""
    from kvlab import SamplingParams

    llm.reset_stats()
    outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    stats = llm.stats()
    stats["decode_tok_s"] = len(batch) / stats["tpot_median_s"]
    return stats, [o.token_ids for o in outs]


def kv_bytes_per_token(model, dtype: str) -> int:
    """K and V of one token over every layer, in the compute dtype (the cache's format auto)."""
    mc = model.config
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * head_dim * (4 if dtype == "fp32" else 2)


def pool_bytes(args, key: str | None, dargs: dict, ctx: int, batch: int, prompt: int, per_token: int,
               shared: bool) -> int:
    """kv_cache_memory of one engine: the cell's pages (the shared document once, or every context), plus a copied
    view's slots (taken from the pool), or, for a draft with a pool of its own, every context (its pool is as
    large as the engine's)."""
    tail = args.max_tokens + args.num_tokens + 32
    tokens = (ctx + batch * (prompt - ctx + tail)) if shared and key not in OWN_POOL else batch * (prompt + tail)
    extra = 0
    if key in ("snapkv", "int4"):
        budget = dargs["policy_args"]["budget"]
        share = 0.35 if dargs.get("quant") else 1.0  # int4 codes + scales, ~27 % of the decoded bytes
        extra = int(min(batch, 32) * (budget + dargs["refresh"] + args.num_tokens + 32) * per_token * share)
    return int(tokens * per_token * 1.15) + extra + (16 << 20)


def run_cell(args, dtype: str, ctx: int, batch: int) -> dict:
    import torch

    from kvlab import LLM, SamplingParams
    from kvlab.models import load_model
    from kvlab.speculation.cost_model import run_speedup, timed_speedup
    from kvlab.speculation.engine_traffic import draft_pass, draft_shares, target_traffic

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    shared = args.workload == "shared"
    loaded = load_model(args.model, dtype=getattr(torch, DTYPES[dtype]), seed=args.seed)
    per_token = kv_bytes_per_token(loaded.model, dtype)
    vocab = loaded.model.config.vocab_size
    ps, doc = cell_prompts(loaded.tokenizer, ctx, batch, vocab, args.workload, args.suffix)
    prompt = len(ps[0])
    engine = dict(dtype=DTYPES[dtype], block_size=16, enable_prefix_caching=True, max_num_seqs=max(batch, 1),
                  max_num_batched_tokens=min(max(512, batch * prompt + 64), args.max_batched_tokens),
                  linear_backend=args.linear_backend, seed=args.seed)
    kvlab_keys = [k for k in args.drafts if not k.startswith("hf_")]
    skipped = []
    own_limit = args.own_pool_gib * (1 << 30)
    if any(k in OWN_POOL for k in kvlab_keys) and batch * (prompt + args.max_tokens) * per_token > own_limit:
        skipped = [k for k in kvlab_keys if k in OWN_POOL]
        log(f"cell {dtype},{ctx},{batch}: {skipped} skipped: their own pool would hold {batch} full contexts "
            f"({batch * (prompt + args.max_tokens) * per_token / 2**30:.1f} GiB > --own-pool-gib {args.own_pool_gib})")
    kvlab_keys = [k for k in kvlab_keys if k not in skipped]

    def build(key):
        label, name, dargs = draft_spec(args, key) if key else ("plain", None, {})
        memory = args.kv_memory or pool_bytes(args, key, dargs, ctx, batch, prompt, per_token, shared)
        if name == "self_compressed":
            dargs = {**dargs, "max_batch": min(max(batch, 1), 32)}  # the copy's slots: one a sequence
        draft = dict(draft=name, draft_args=dargs) if name else {}
        try:
            return label, LLM(args.model, loaded=loaded, kv_cache_memory=memory, **draft, **engine)
        except ValueError as e:  # a copied view's slots took more than estimated: the pool plus what they take
            found = re.search(r"after the draft's view copy \((\d+) bytes\)", str(e))
            if found is None or args.kv_memory:
                raise
            return label, LLM(args.model, loaded=loaded, kv_cache_memory=memory + int(found.group(1)), **draft, **engine)

    _, plain = build(None)
    specs = [build(k) for k in kvlab_keys]
    t0 = time.perf_counter()
    for llm in [plain] + [s for _, s in specs]:  # prefill once (cached pages from then on), untimed
        if doc is not None and batch > 1:
            llm.generate([doc], SamplingParams(max_tokens=1, ignore_eos=True))  # the shared document, once
        llm.generate(ps, SamplingParams(max_tokens=2, ignore_eos=True))
    log(f"cell {dtype},{ctx},{batch}: prefills took {time.perf_counter() - t0:.1f} s")
    runs = {label: [] for label, _ in specs}
    base_out, hit = None, None
    for r in range(args.repeats):
        base, base_out = timed(plain, ps, args.max_tokens)
        hit = base.get("prefix_hit_rate_tokens")
        for label, llm in specs:
            sp, out = timed(llm, ps, args.max_tokens)
            runs[label].append({"plain_tok_s": base["decode_tok_s"], "spec_tok_s": sp["decode_tok_s"],
                                "speedup": sp["decode_tok_s"] / base["decode_tok_s"],
                                "acceptance": sp["spec_acceptance_rate"], "accepted_len": sp["spec_mean_accepted_length"],
                                "verifications": sp["spec_verifications"], "drafted": sp["spec_drafted_tokens"],
                                "refresh_s": sp.get("spec_view_refresh_s", 0.0),
                                "identical": out == base_out})
            log(f"cell {dtype},{ctx},{batch} round {r}: plain {base['decode_tok_s']:.2f} tok/s, {label} "
                f"{sp['decode_tok_s']:.2f} tok/s, a={sp['spec_acceptance_rate']:.2f}, identical {out == base_out}")
        partial = cell_file(args, dtype, ctx, batch).with_suffix(".partial")  # the rounds so far, should a cell
        partial.parent.mkdir(parents=True, exist_ok=True)  # be stopped before its end (removed at the end)
        partial.write_text(json.dumps({"rounds": r + 1, "runs": runs, "load": os.getloadavg()[0]}, indent=1))
    profile = profile_engines(args, [("plain", plain)] + specs, ps) if args.profile else None
    target = target_traffic(plain.engine)
    c = prompt + args.max_tokens / 2
    times = calibrate(args, loaded.model, plain, ps, batch, int(c), profile) if specs and args.repeats else None
    t_plain = target.pass_bytes(batch, c)
    load_end = os.getloadavg()[0]
    load = f"{load_start:.1f}/{load_end:.1f}"
    rows = []
    for label, llm in specs:
        rs = runs[label]
        if not rs:
            continue
        row = {"dtype": dtype, "ctx": ctx, "batch": batch, "draft": label, "runs": rs, "load": load,
               "kv_over_weights": batch * target.kv_bytes(c) / target.weight_bytes(),
               "identical": "yes" if all(x["identical"] for x in rs) else "NO"}
        for key in ("plain_tok_s", "spec_tok_s", "speedup", "acceptance", "accepted_len"):
            row[key] = statistics.median(x[key] for x in rs)
        last = rs[-1]
        verifications = max(last["verifications"], 1)
        k, emitted = last["drafted"] / verifications, row["accepted_len"]
        decode_tokens = batch * (args.max_tokens - 1)  # the first token comes from the prefill
        share = min(1.0, emitted * last["verifications"] / decode_tokens) if decode_tokens else 0.0
        row["drafted_len"] = k
        row["predicted"] = run_speedup(t_plain, target.pass_bytes(batch, c + k), draft_pass(llm.engine)(batch, c), k,
                                       emitted, share) if last["verifications"] else 1.0
        shares = draft_shares(llm.engine, batch, c)
        rounds = max(last["verifications"] / batch, 1.0)  # speculative steps (each verifies the batch)
        row["pass_times"] = dataclasses.asdict(times(k))
        row["predicted_time"] = timed_speedup(
            times(k), *(shares or (0.0, 0.0)), target.kv_bytes(c + k) / target.kv_bytes(c), k if shares else 0.0,
            emitted, share, last.get("refresh_s", 0.0) / rounds) if last["verifications"] else 1.0
        rows.append(row)
    plain_tok_s = statistics.median(r["plain_tok_s"] for r in next(iter(runs.values()))) if args.repeats and runs \
        else None
    hf_keys = [k for k in args.drafts if k.startswith("hf_")]
    hf = []
    if hf_keys and batch == 1:
        del specs, plain
        hf = hf_rows(args, dtype, ctx, ps[0], base_out[0] if base_out else None, hf_keys, plain_tok_s)
        for row in hf:
            row["load"] = f"{load_end:.1f}/{os.getloadavg()[0]:.1f}"
    from kvlab.engine.linear_backend import backend_of

    return {"dtype": dtype, "ctx": ctx, "batch": batch, "rows": rows, "hf": hf, "skipped": skipped, "profile": profile,
            "pass_times": {q: dataclasses.asdict(t) for q, t in times.made.items()} if times else None,
            "linear_backend": backend_of(loaded.model),
            "prompt_tokens": prompt, "workload": args.workload, "prefix_hit_rate_tokens": hit,
            "weight_bytes": target.weight_bytes(), "kv_bytes_per_token": sum(target.kv_bytes_per_token)}


def profile_engines(args, engines, ps) -> list[dict]:
    """One timed run of each engine with timers around its parts (kvlab/study/round_profile.py): ms per decode
    step (a speculative round), per part; steps and tokens emitted."""
    from kvlab.study.round_profile import instrument

    rows = []
    for label, llm in engines:
        timers = instrument(llm.engine)
        try:
            stats, _ = timed(llm, ps, args.max_tokens)
        finally:
            timers.remove()
        ms = timers.ms_per_step()
        tokens = len(ps) * (args.max_tokens - 1)
        rows.append({"engine": label, "steps": timers.steps, "ms": ms, "decode_tok_s": stats["decode_tok_s"],
                     "ms_per_token": ms["step"] * timers.steps / tokens * len(ps),
                     "accepted_len": stats.get("spec_mean_accepted_length")})
        log(f"profile {label}: {timers.steps} decode steps, {ms['step']:.1f} ms a step: "
            + ", ".join(f"{k} {v:.1f}" for k, v in ms.items() if v >= 0.5))
    return rows


def calibrate(args, model, plain, ps, batch: int, context: int, profile):
    """The cost model's compute side (kvlab/speculation/cost_model.py PassTimes): the plain engine's step parts
    (its --profile run, else one timed run with timers), and the verification pass's attention and linear costs
    over a decode pass's, measured now (kvlab/speculation/pass_costs.py)."""
    from kvlab.speculation.pass_costs import pass_times, verify_attention_ratio, verify_linear_ratio

    parts = (profile or profile_engines(args, [("plain", plain)], ps))[0]["ms"]
    mc = model.config
    dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    dtype = next(model.parameters()).dtype
    made = {}

    def times(k: float):
        """PassTimes for verifications of k drafts a sequence (k rounded: the chunk's queries)."""
        q = max(2, round(k) + 1)
        if q not in made:
            attention = verify_attention_ratio(batch, context, q, mc.num_attention_heads, mc.num_key_value_heads,
                                               dim, dtype)
            made[q] = pass_times(parts, attention, verify_linear_ratio(model, batch, batch * q))
            t = made[q]
            log(f"calibration: plain step {1e3 * t.plain():.1f} ms (linear {1e3 * t.linear_s:.1f}, attention "
                f"{1e3 * t.attention_s:.1f}, per pass {1e3 * t.pass_overhead_s:.1f}, per step "
                f"{1e3 * t.step_overhead_s:.1f}); a verification of {q} queries a sequence over a decode pass: "
                f"attention x{t.verify_attention:.2f}, linear x{t.verify_linear:.2f}")
        return made[q]

    times.made = made
    return times


def profile_table(profile: list[dict]) -> str:
    """The profile's parts (rows) by engine (columns), ms per decode step; then steps, ms per token, tok/s."""
    from kvlab.study.round_profile import PARTS

    cols = [("part", "part")] + [(str(i), p["engine"]) for i, p in enumerate(profile)]
    keys = ["step", "draft: total", *PARTS]
    rows = [{"part": k, **{str(i): p["ms"].get(k, 0.0) for i, p in enumerate(profile)}} for k in keys]
    rows += [{"part": "decode steps", **{str(i): p["steps"] for i, p in enumerate(profile)}},
             {"part": "tokens per verification", **{str(i): p["accepted_len"] for i, p in enumerate(profile)}},
             {"part": "ms per output token (one sequence)", **{str(i): p["ms_per_token"] for i, p in enumerate(profile)}},
             {"part": "decode tok/s (this run)", **{str(i): p["decode_tok_s"] for i, p in enumerate(profile)}}]
    return "ms per decode step (a speculative round) by part:\n\n" + table(rows, cols)


def hf_rows(args, dtype: str, ctx: int, prompt: list[int], kvlab_out, keys, kvlab_tok_s) -> list[dict]:
    """Hugging Face `generate` (sdpa, torch's linear layers) at batch 1 on the cell's prompt: plain, then assisted
    generation with `assistant_early_exit` (the draft length and a constant schedule set on the model's own
    generation_config, kvlab/study/hf_assistant.py) and prompt lookup. Decode time = time(max_tokens) - time(1)
    for the same mode (the prefill, and an assistant's own prefill, out), medians of --repeats."""
    import torch

    from kvlab.models import load_model
    from kvlab.study.hf_assistant import set_assistant_options

    model = load_model(args.model, dtype=getattr(torch, DTYPES[dtype]), attn_implementation="sdpa",
                       seed=args.seed).model.eval()
    k = args.num_tokens
    modes = [("plain generate", {}, False)]
    if "hf_early_exit" in keys:
        modes.append((f"assistant_early_exit={args.layers}, num_assistant_tokens={k}, constant, threshold 0",
                      {"assistant_early_exit": args.layers}, True))
    if "hf_prompt_lookup" in keys:
        modes.append((f"prompt_lookup_num_tokens={k}, max_matching_ngram_size=3",
                      {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 3}, False))
    ids = torch.tensor([prompt])

    def gen(extra, assisted, n):
        if assisted:
            set_assistant_options(model, num_tokens=k, schedule="constant", threshold=0.0)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, **extra)
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    gen({}, False, 2)  # warm-up
    rows, plain = [], None
    for label, extra, assisted in modes:
        try:
            first, _ = gen(extra, assisted, 1)
            times, out = [], None
            for _ in range(args.repeats):
                s, out = gen(extra, assisted, args.max_tokens)
                times.append(s)
        except Exception as e:  # an option this transformers version refuses: say so in the table
            rows.append({"dtype": dtype, "ctx": ctx, "batch": 1, "hf": label, "tok_s": float("nan"),
                         "speedup": float("nan"), "identical": f"failed: {type(e).__name__}: {str(e)[:80]}"})
            continue
        tok_s = (args.max_tokens - 1) / max(statistics.median(times) - first, 1e-9)
        plain = plain or tok_s
        rows.append({"dtype": dtype, "ctx": ctx, "batch": 1, "hf": label, "tok_s": tok_s, "speedup": tok_s / plain,
                     "vs_kvlab": tok_s / kvlab_tok_s if kvlab_tok_s else None, "times": times, "first_s": first,
                     "identical": "yes" if out == kvlab_out else "NO"})
        log(f"HF {dtype},{ctx},1 {label}: {tok_s:.2f} decode tok/s")
    return rows


def cells(args) -> list[tuple[str, int, int]]:
    return [(d, c, b) for d in args.dtypes for c in args.contexts for b in args.batches]


def cell_file(args, dtype: str, ctx: int, batch: int) -> Path:
    return Path(f"{args.out}.cells") / f"{dtype}_{ctx}_{batch}.json"


def passthrough(args) -> list[str]:
    """The options a cell's process gets from --all."""
    out = ["--model", args.model, "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
           "--num-tokens", str(args.num_tokens), "--budget", str(args.budget), "--threads", str(args.threads),
           "--snapkv-budget", str(args.snapkv_budget), "--int4-budget", str(args.int4_budget),
           "--refresh", str(args.refresh), "--snapkv-refresh", str(args.snapkv_refresh), "--snapkv-rescore", args.snapkv_rescore, "--layers", str(args.layers), "--workload", args.workload,
           "--suffix", str(args.suffix), "--linear-backend", args.linear_backend,
           "--own-pool-gib", str(args.own_pool_gib), "--max-batched-tokens", str(args.max_batched_tokens),
           "--out", args.out, "--drafts", *args.drafts]
    out += ["--kv-memory", args.kv_memory] if args.kv_memory else []
    return out + (["--draft-model", args.draft_model] if args.draft_model else [])


def run_all(args) -> None:
    """Each cell in a process of its own (a fresh allocator and no model state carried between cells)."""
    for dtype, ctx, batch in cells(args):
        log(f"cell {dtype},{ctx},{batch}")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--cell", f"{dtype},{ctx},{batch}",
                        *passthrough(args)], check=True)


def partial_cell(path: Path, finished: list[dict]) -> dict:
    """A cell stopped before its end, from its .partial file: the medians of its finished rounds, a prediction only
    where one was added to the file by hand (it needs the built engines), KV/W from a finished cell of the same
    dtype (the same model), if any."""
    dtype, ctx, batch = path.stem.split("_")
    ctx, batch = int(ctx), int(batch)
    saved = json.loads(path.read_text())
    same = [d for d in finished if d["dtype"] == dtype]
    rows = []
    for label, rs in saved["runs"].items():
        if not rs:
            continue
        row = {"dtype": dtype, "ctx": ctx, "batch": batch, "draft": f"{label} [{len(rs)} round(s), cell stopped]",
               "runs": rs, "load": f"-/{saved['load']:.1f}", "predicted": saved.get("predicted", {}).get(label),
               "identical": "yes" if all(x["identical"] for x in rs) else "NO"}
        for key in ("plain_tok_s", "spec_tok_s", "speedup", "acceptance", "accepted_len"):
            got = [x[key] for x in rs if x.get(key) is not None]
            row[key] = statistics.median(got) if got else None
        last = rs[-1]
        row["drafted_len"] = last["drafted"] / max(last["verifications"], 1) if last.get("verifications") else None
        if same:  # prompt = ctx + the suffix; KV/W at the mean context during decoding
            d = same[0]
            c = d["prompt_tokens"] - d["ctx"] + ctx + (d.get("max_tokens") or 24) / 2
            row["kv_over_weights"] = batch * c * d["kv_bytes_per_token"] / d["weight_bytes"]
        rows.append(row)
    return {"dtype": dtype, "ctx": ctx, "batch": batch, "rows": rows, "hf": [], "skipped": [],
            "command": f"(stopped) {saved.get('command', '')}".strip(), "model": finished[0]["model"] if finished else "",
            "weight_bytes": same[0]["weight_bytes"] if same else 0, "kv_bytes_per_token": same[0]["kv_bytes_per_token"]
            if same else 0, "workload": same[0].get("workload") if same else None}


def model_shape(model: str, dtype: str, cell: dict):
    """kvlab/speculation/roofline.py's ModelShape of `model` in `dtype`, from its config and the cell's bytes; and
    (layers, one decoder layer's parameters, the head's, KV heads, head_dim)."""
    from kvlab.models import model_config
    from kvlab.speculation.roofline import ModelShape

    mc = model_config(model)
    dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    hq, hkv, h, layers = mc.num_attention_heads, mc.num_key_value_heads, mc.hidden_size, mc.num_hidden_layers
    per_layer = h * (2 * hq * dim + 2 * hkv * dim) + 3 * h * mc.intermediate_size  # q, o, k, v; gate, up, down
    head = mc.vocab_size * h
    elem = 4 if dtype == "fp32" else 2
    shape = ModelShape(cell["weight_bytes"], layers * per_layer + head, cell["kv_bytes_per_token"],
                       4.0 * dim * hq * layers)
    return shape, (layers, per_layer, head, hkv, dim, elem)


def draft_reads(cell_args, label: str, dtype: str, parts):
    """DraftReads of the kvlab draft `label` as the cell's command built it (draft_spec); None where the ceiling
    has no model of it (a draft model other than the target)."""
    from kvlab.registry import QUANT_FORMATS
    from kvlab.speculation.roofline import DraftReads

    keys = {draft_spec(cell_args, k)[0]: k for k in cell_args.drafts if not k.startswith("hf_")}
    key = keys.get(label)
    layers, per_layer, head, hkv, dim, _ = parts
    if key is None:
        return None
    if key == "ngram":
        return DraftReads(free=True)
    if key.startswith("streaming"):
        return DraftReads(view_tokens=cell_args.budget)
    if key == "snapkv":
        return DraftReads(view_tokens=cell_args.snapkv_budget + (cell_args.snapkv_refresh - 1) / 2)
    if key == "int4":
        import torch

        per_token = QUANT_FORMATS.build("int4").bytes_per_token(hkv, dim, 16, getattr(torch, DTYPES[dtype]))
        return DraftReads(view_tokens=cell_args.int4_budget, kv_bytes_per_token=per_token * layers)
    if key == "layerskip":
        share = cell_args.layers / layers
        return DraftReads(weight_share=(cell_args.layers * per_layer + head) / (layers * per_layer + head),
                          layer_share=share)
    if key == "model" and (cell_args.draft_model or cell_args.model) == cell_args.model:
        return DraftReads()
    return None


def ceilings(data: list[dict], machines: dict) -> None:
    """Each row's speed-up with every pass at this machine's roof (kvlab/speculation/roofline.py), at its measured
    tokens per verification and with every draft accepted: the rows' `ceiling`, `ceiling_all`."""
    import shlex

    from kvlab.speculation.roofline import ceiling_speedup

    for cell in data:
        if cell["dtype"] not in machines or not cell.get("weight_bytes"):
            continue
        if "args" in cell:
            cargs = argparse.Namespace(**cell["args"])
        elif "--cell" in cell.get("command", ""):  # a cell from before the args were kept: its command line
            cargs = parse_args(shlex.split(cell["command"])[2:])
        else:
            continue
        shape, parts = model_shape(cell.get("model") or cargs.model, cell["dtype"], cell)
        m, batch = machines[cell["dtype"]], cell["batch"]
        c = cell["prompt_tokens"] + cargs.max_tokens / 2
        for row in cell["rows"]:
            reads = draft_reads(cargs, row["draft"], cell["dtype"], parts)
            last = row["runs"][-1] if row.get("runs") else None
            if reads is None or last is None or not last["verifications"]:
                continue
            k, emitted = row["drafted_len"], row["accepted_len"]
            share = min(1.0, emitted * last["verifications"] / (batch * (cargs.max_tokens - 1)))
            row["ceiling"] = ceiling_speedup(shape, m, reads, batch, c, k, emitted, share)
            row["ceiling_all"] = ceiling_speedup(shape, m, reads, batch, c, k, k + 1.0)


def aggregate(args) -> str:
    from kvlab.study.loggers.local import write_report

    meta = metadata(args)
    found = sorted(Path(f"{args.out}.cells").glob("*.json"))
    data = [json.loads(p.read_text()) for p in found]
    data += [partial_cell(p, data) for p in sorted(Path(f"{args.out}.cells").glob("*.partial"))
             if not p.with_suffix(".json").exists()]
    data.sort(key=lambda d: (list(DTYPES).index(d["dtype"]), d["ctx"], d["batch"]))
    machines = {}
    if args.ceiling:
        import torch

        from kvlab.study.machine_ceiling import describe, measure_machine

        torch.set_num_threads(args.threads)
        machines = {d: measure_machine(getattr(torch, DTYPES[d]), args.ceiling_mib)
                    for d in sorted({c["dtype"] for c in data})}
        ceilings(data, machines)
    rows = [r for d in data for r in d["rows"]]
    hf = [r for d in data for r in d.get("hf", [])]
    skipped = [f"{d['dtype']},{d['ctx']},{d['batch']}: {', '.join(d['skipped'])}" for d in data if d.get("skipped")]
    commands = sorted({d["command"] for d in data})
    weights = "; ".join(sorted({f"{d['dtype']}: weights {d['weight_bytes'] / 1e6:.0f} MB, KV "
                                f"{d['kv_bytes_per_token'] / 1e3:.1f} kB a token" for d in data if d["weight_bytes"]}))
    workloads = sorted({d.get("workload", "distinct") for d in data})
    text = "\n".join([
        f"# The regime map: self-speculation, layerskip, a draft model and prompt lookup against plain decoding on "
        f"{data[0]['model'] if data else args.model}",
        "", f"Aggregated by: `{meta['command']}`  ", f"Cells run by: {', '.join(f'`{c}`' for c in commands)}  ",
        f"Date: {meta['started_at']}  ", f"Commit: {commit_line(meta)}  ",
        f"Load average at the end (1/5/15 min): {load_average()}; each cell's 1-min load at its start/end is in the "
        f"table. The machine (2 cores) is shared with other jobs; each speed-up is a median of per-round ratios "
        f"against plain decoding measured in the same round.", "",
        f"{weights}. The cache is in the compute dtype (format auto). Workload: {', '.join(workloads)} (see the "
        f"script's docstring). Greedy, EOS ignored, block size 16, prefix caching on (each engine prefills once, "
        f"untimed); decode tok/s = batch / median time per output token.", "",
        table(rows, COLUMNS), "",
        *(["Hugging Face at batch 1, same prompt and token count (decode time = time of max_tokens minus time of one "
           "token, same mode; sdpa, torch linear layers); speed-up against Hugging Face's plain generate in the same "
           "cell, and tok/s over kvlab's plain decoding of that cell:", "", table(hf, HF_COLUMNS), ""] if hf else []),
        *([f"Not run (a draft pool of their own would hold every full context): {'; '.join(skipped)}.", ""]
          if skipped else []),
        "The memory-traffic prediction counts bytes only (weights once a pass, each sequence's KV per layer; the "
        "view's tokens for the self_compressed draft, in the copy's format for int4; nothing for ngram). The bytes + "
        "compute one prices each pass in seconds from the plain engine's measured step parts, the verification "
        "pass's measured attention and linear costs over a decode pass's, and the view's measured refresh time "
        "(the script's docstring).", "",
        *([f"The roof columns price every pass at this machine's limits, measured by the aggregation now "
           f"({'; '.join(f'{d}: {describe(m)}' for d, m in machines.items())}; kvlab/study/machine_ceiling.py, best of "
           f"repeats, {args.threads} threads): each part of a pass costs the larger of its bytes over the bandwidth "
           f"and its FLOPs over the FLOP rate, a verification B (k + 1) rows and k + 1 queries a sequence "
           f"(kvlab/speculation/roofline.py). 'measured E' uses the row's tokens per verification and drafts per "
           f"verification; 'all accepted' every draft accepted: no draft of that cost does better on this machine "
           f"with passes at the roof.", ""] if machines else []),
        *([f"Outputs not identical (NO) in bf16 rows: a verification pass (k + 1 rows a sequence) rounds "
           f"differently from a plain one-row pass, and a bf16 cache stores those last bits: the declared deviation "
           f"'a rounding format under a changing schedule' (docs/design.md); batch_invariant=True makes it exact, "
           f"at a cost, and was not run here. fp32 rows must read yes.", ""]
          if any(r["identical"] != "yes" for r in rows) else [])])
    print(text)
    md, _ = write_report(args.out, text, {"meta": meta, "cells": data})
    log(f"wrote {md}")
    return text


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.cell:
        dtype, ctx, batch = args.cell.split(",")
        if dtype not in DTYPES:
            raise SystemExit(f"--cell: dtype must be one of {list(DTYPES)}, got {dtype!r}")
        result = run_cell(args, dtype, int(ctx), int(batch))
        result.update(command=metadata(args)["command"], model=args.model, args=vars(args))
        path = cell_file(args, dtype, int(ctx), int(batch))
        path.parent.mkdir(parents=True, exist_ok=True)
        from kvlab.study.loggers.local import to_json

        path.write_text(json.dumps(to_json(result), indent=2))
        if result.get("profile"):
            print(profile_table(result["profile"]))
        path.with_suffix(".partial").unlink(missing_ok=True)
        log(f"wrote {path}")
        return result
    if args.all:
        run_all(args)
    if args.all or args.aggregate:
        aggregate(args)
    return None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cell", help="dtype,ctx,batch: run one cell (e.g. fp32,2048,4)")
    mode.add_argument("--all", action="store_true", help="run every cell of the grid, then aggregate")
    mode.add_argument("--aggregate", action="store_true", help="the table from the cells already run")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 7168])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    p.add_argument("--drafts", nargs="+", default=list(DRAFT_CHOICES), choices=DRAFT_CHOICES,
                   help="decoders compared with plain decoding (hf_*: Hugging Face, batch-1 cells only)")
    p.add_argument("--workload", choices=["shared", "distinct"], default="shared",
                   help="shared: one ctx-token document + --suffix distinct tokens a sequence; distinct: windows")
    p.add_argument("--suffix", type=int, default=24, help="distinct tokens after the shared document")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--num-tokens", type=int, default=4, help="draft length k")
    p.add_argument("--budget", type=int, default=256, help="tokens of the StreamingLLM page view")
    p.add_argument("--snapkv-budget", type=int, default=512, help="tokens of the SnapKV token view")
    p.add_argument("--int4-budget", type=int, default=1024, help="tokens of the int4-stored StreamingLLM view")
    p.add_argument("--refresh", type=int, default=64, help="the int4 view is re-copied every this many tokens")
    p.add_argument("--snapkv-refresh", type=int, default=8,
                   help="the SnapKV view is reselected every this many tokens: its 16 query rows before the refresh "
                        "point must have been computed, not prefix hits (after the prompt's cached pages)")
    p.add_argument("--snapkv-rescore", choices=["kept", "all"], default="kept",
                   help="what a SnapKV refresh scores: the kept set and the tokens since (kept) or all of [0, P)")
    p.add_argument("--layers", type=int, default=24, help="layerskip's (and HF assistant_early_exit's) exit layer")
    p.add_argument("--draft-model", default=None, help="the model draft (default: --model, the suite's SmolLM2)")
    p.add_argument("--own-pool-gib", type=float, default=1.0,
                   help="run layerskip / model only where every context fits this many GiB of their own pool")
    p.add_argument("--linear-backend", choices=["cpu", "torch"], default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true",
                   help="after the timed rounds, one run of each engine with timers around its parts "
                        "(kvlab/study/round_profile.py): the cell file's `profile`, a table on stdout")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                   help="--aggregate: leave out the roof columns (they measure the machine: ~30 s, quiet cores)")
    p.add_argument("--ceiling-mib", type=int, default=1024, help="MiB of random data the bandwidth reads")
    p.add_argument("--max-batched-tokens", type=int, default=2048,
                   help="prefill chunk cap (the reference attention's score matrix grows with the chunk)")
    p.add_argument("--kv-memory", default=None, help="KV pool per engine (default: what the cell needs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "self_speculation_regime_smollm2"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
