"""Quality of every KV-cache format on one model: WikiText-2 perplexity and agreement with fp32.

For each format (fp32, bf16, fp8_e4m3, int8, int4, int2; KIVI formats with their defaults,
group_size 32 and a 32-token residual, and again with --residual-zero: residual 0, the whole
prompt quantised), kvlab's own tasks run on the same engine settings:
  - kvlab.study.tasks.perplexity.Perplexity: --num-windows windows of --context + --continuation tokens,
    the continuation scored teacher-forced;
  - kvlab.study.tasks.agreement.Agreement against the full-cache fp32 engine (greedy match, top-1 match,
    KL of next-token distributions), --num-prompts prompts of --prompt-length tokens.
Also the pool's bytes per token (scales and zero points included) and the residual area's bytes.
--residual-bf16 adds int4 / int2 with their residual rows in bfloat16; --variant NAME:key=value,...
adds a format with those arguments (e.g. fp8_e4m3:scaling=fixed); --policy NAME[:JSON] (repeatable: the
policy's other arguments as a JSON object) with --budgets adds format x policy rows (agreement only: the
policy compresses each prompt once, at the end of prefill, to each budget; the reference stays the full-cache
fp32 engine). Hugging Face's QuantizedCache beside
kvlab's int4 / int2: experiments/bench_quant_anchor.py.

    python experiments/bench_quant_quality.py                        # SmolLM2-135M, ~10 minutes on 2 busy cores
    python experiments/bench_quant_quality.py --num-windows 2 --num-prompts 2 --out /tmp/q
    python experiments/bench_quant_quality.py --policy snapkv --budgets 64 128 --formats fp32 int8 int4 int2
    python experiments/bench_quant_quality.py --formats fp32 fp8_e4m3 --variant fp8_e4m3:scaling=fixed
    python experiments/bench_quant_quality.py --formats fp32 --prompt-length 256 --budgets 128 --policy h2o \
        --policy 'adakv:{"scorer": "h2o"}' --policy adakv      # AdaKV over H2O vs over SnapKV vs H2O, at 0.5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

from kvlab.study.bench_io import REPO, log, metadata, provenance, save, table
from kvlab.study.quality_args import add_quality_args, quality_sizes

FORMATS = [("fp32", {}), ("bf16", {}), ("fp16", {}), ("fp8_e4m3", {}), ("fp8_e5m2", {}), ("int8", {}), ("int4", {}),
           ("int2", {})]
COLUMNS = [("format", "format"), ("args", "args"), ("policy", "policy"), ("bytes_per_token", "pool B/token/layer"),
           ("vs_bf16", "vs bf16"), ("leased_mib", "residual rows MiB (peak)"), ("ppl", "perplexity"),
           ("greedy_match", "greedy match"), ("top1_match", "top-1 match"), ("kl", "KL (nats)"),
           ("kl_max", "KL max"), ("seconds", "s")]


def run(args) -> list[dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvlab import LLM
    from kvlab.models import load_model
    from kvlab.study.tasks.agreement import Agreement
    from kvlab.study.tasks.base import RunContext
    from kvlab.study.tasks.data import default_data_dir
    from kvlab.study.tasks.perplexity import Perplexity

    loaded = load_model(args.model)
    engine = dict(block_size=32, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs)
    reference: list = []

    def build_reference():
        if not reference:
            reference.append(LLM(args.model, loaded=copy.deepcopy(loaded), quant="fp32", **engine))
        return reference[0]

    ctx = RunContext(data_dir=default_data_dir(), reference=build_reference)
    ppl = Perplexity(context_lengths=[args.context], continuation_length=args.continuation,
                     num_windows=args.num_windows, batch_size=args.num_windows)
    agree = Agreement(num_prompts=args.num_prompts, prompt_length=args.prompt_length,
                      max_new_tokens=args.max_new_tokens)
    chosen = [(n, q) for n, q in FORMATS if n in args.formats]
    kivi = [n for n in ("int4", "int2") if n in args.formats]
    formats = [(n, q, None) for n, q in chosen]
    formats += [(n, {"residual": 0}, None) for n in kivi] if args.residual_zero else []
    formats += [(n, {"residual_dtype": "bfloat16"}, None) for n in kivi] if args.residual_bf16 else []
    formats += [(n, q, None) for n, q in args.variant]
    with_policy = [(n, q) for n, q in chosen if n in (args.policy_formats or args.formats)]
    formats += [(n, q, (pol, pargs, b)) for pol, pargs in args.policy for b in args.budgets for n, q in with_policy]
    rows = []
    for name, qargs, compressed in formats:
        t0 = time.perf_counter()
        qargs = {"group_size": args.group_size, **qargs} if name in ("int4", "int2") else qargs
        policy = {} if compressed is None else {"policy": compressed[0],
                                                "policy_args": {**compressed[1], "budget": compressed[2]}}
        log(f"{name} {qargs} {policy}")
        llm = LLM(args.model, loaded=copy.deepcopy(loaded), quant=name, quant_args=qargs, **engine, **policy)
        cache = llm.engine.cache
        per_token = cache.pool_nbytes() / ((cache.null_page + 1) * 32) / len(cache.groups[0].layers)
        p = ppl.run(llm, ctx).metrics if compressed is None else {"perplexity/ppl": None}
        a = agree.run(llm, ctx).metrics
        rows.append({"format": name, "args": ",".join(f"{k}={v}" for k, v in qargs.items()) or "-",
                     "policy": "full" if compressed is None else policy_label(*compressed),
                     "bytes_per_token": per_token, "residual_mib": cache.residual_nbytes() / 2**20,
                     "leased_mib": leased_mib(llm),
                     "ppl": p["perplexity/ppl"], "greedy_match": a["agreement/greedy_match"],
                     "top1_match": a["agreement/top1_match"], "kl": a["agreement/kl"],
                     "kl_max": a["agreement/kl_max"], "seconds": time.perf_counter() - t0})
        del llm
        Path(f"{args.out}.partial.json").write_text(json.dumps(rows, indent=1))  # what a killed run leaves
    bf16 = next(r["bytes_per_token"] for r in rows if r["format"] == "fp32") / 2  # bf16: half of fp32 per element
    for r in rows:
        r["vs_bf16"] = r["bytes_per_token"] / bf16
    return rows


def policy_label(name: str, policy_args: dict, budget: int) -> str:
    """("adakv", {"scorer": "h2o"}, 128) -> 'adakv scorer=h2o budget=128' (values as JSON, strings bare)."""
    shown = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in policy_args.items()]
    return " ".join([name, *shown, f"budget={budget}"])


def leased_mib(llm) -> float:
    """The most bytes residual rows held at once (pool pages leased while a window is open)."""
    area = llm.engine.cache.area
    if area is None or area.lessor is None:
        return llm.engine.cache.residual_nbytes() / 2**20
    return area.leased_peak * area.k * llm.engine.bytes_per_block / 2**20


def report(rows: list[dict], meta: dict, args) -> str:
    return "\n".join([
        f"# KV-cache format quality on {args.model}",
        "",
        *provenance(meta, "other jobs were running on the machine; timings are indicative only"),
        quality_sizes(args, "against the full-cache fp32 engine (kvlab.study.tasks.agreement)") +
        "Block size 32; KIVI formats "
        "with group_size 32 (and the residual given in args, default 32 tokens in full precision).",
        "Bytes per token are counted from the pool tensors (one layer, K and V, scales and zero points included); "
        "KIVI's full-precision residual rows are leased from the pool's pages while a window is open "
        "(kvlab.cache.quant.lease): the column gives the most they held at once.",
        "",
        table(rows, COLUMNS),
        "",
        "Policy rows: agreement only (perplexity `-`), the prompt compressed once at the end of prefill to the "
        "budget, then stored in the format; KL and matches against the full-cache fp32 engine, so they add the "
        "policy's loss to the format's. Not measured here: LongBench tasks; Hugging Face's `QuantizedCache`: "
        "experiments/bench_quant_anchor.py.",
        "",
    ])


def variant(spec: str) -> tuple[str, dict]:
    """"fp8_e4m3:scaling=fixed,scale=1.0" -> ("fp8_e4m3", {"scaling": "fixed", "scale": 1.0})."""
    name, _, items = spec.partition(":")
    if name not in [n for n, _ in FORMATS]:
        raise argparse.ArgumentTypeError(f"unknown format {name!r}; choose one of {', '.join(n for n, _ in FORMATS)}")
    args = {}
    for item in filter(None, items.split(",")):
        key, _, value = item.partition("=")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value  # a bare word: a string
    return name, args


def policy_spec(spec: str) -> tuple[str, dict]:
    """'adakv:{"scorer": "h2o"}' -> ("adakv", {"scorer": "h2o"}); "snapkv" -> ("snapkv", {})."""
    name, _, items = spec.partition(":")
    try:
        args = json.loads(items) if items else {}
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{spec!r}: the policy's arguments are not JSON ({exc})") from None
    if not isinstance(args, dict) or "budget" in args:
        raise argparse.ArgumentTypeError(f"{spec!r}: give the arguments as a JSON object, without budget (--budgets)")
    return name, args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    add_quality_args(p, context=256, num_windows=8, prompt_length=128)
    p.add_argument("--kv-cache-memory", default="64MiB")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--formats", nargs="+", default=[n for n, _ in FORMATS], choices=[n for n, _ in FORMATS],
                   help="fp32 is always needed (the bytes baseline)")
    p.add_argument("--group-size", type=int, default=32, help="int4 / int2 group size (KIVI's default 32)")
    p.add_argument("--residual-zero", action="store_true", help="also int4 / int2 with residual 0")
    p.add_argument("--residual-bf16", action="store_true", help="also int4 / int2 with the residual rows in bfloat16")
    p.add_argument("--variant", action="append", default=[], type=variant, metavar="NAME:KEY=VALUE,...",
                   help="also this format with these arguments (values as JSON: scale=1.0, scaling=fixed)")
    p.add_argument("--policy", action="append", default=[], type=policy_spec, metavar="NAME[:JSON]",
                   help="also every format x this policy (its other arguments as a JSON object) at each of "
                        "--budgets; repeatable")
    p.add_argument("--budgets", nargs="+", type=int, default=[128, 256])
    p.add_argument("--policy-formats", nargs="+", default=None, choices=[n for n, _ in FORMATS],
                   help="the formats run with --policy (default: every one of --formats)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "quant_quality_smollm2"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "fp32" not in args.formats:
        raise SystemExit("--formats must include fp32 (the bytes baseline)")
    meta = metadata(args)
    rows = run(args)
    text = report(rows, meta, args)
    save(args.out, text, meta, rows)
    Path(f"{args.out}.partial.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
