"""What the batch-invariant mode costs, and what it buys, on SmolLM2 (EngineConfig.batch_invariant).

For each cache format (--quants): greedy decoding of the speculation benchmark's prompts (edit task,
EOS ignored) with the mode off and on, at batch 1 (prompts one at a time) and batch 8. Reported:
tokens/s of engine time (median of --repeats), the mode's ratio, and whether the outputs stay the same
when the schedule changes: the step budget cut to 32 tokens (prefill chunked), and an ngram draft.
Off, a rounding format (int4) may change with either; on, it must not.

    python experiments/bench_batch_invariant.py --out experiments/results/batch_invariant_cost
    python experiments/bench_batch_invariant.py --model random:llama-tiny --max-tokens 8 --repeats 1 --out /tmp/bi
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_speculation import prompts, run  # noqa: E402
from kvlab.study.bench_io import log, metadata, provenance, table  # noqa: E402

COLUMNS = [("quant", "quant"), ("batch", "batch"), ("off_tok_s", "default tok/s"), ("on_tok_s", "batch-invariant tok/s"),
           ("ratio", "on / off"), ("off_chunked", "off: same with 32-token steps"),
           ("off_draft", "off: same with ngram"), ("on_chunked", "on: same with 32-token steps"),
           ("on_draft", "on: same with ngram")]


def main(argv=None) -> dict:
    args = parse_args(argv)
    import copy

    import torch

    from kvlab import LLM
    from kvlab.models import load_model
    from kvlab.study.loggers.local import write_report

    torch.set_num_threads(args.threads)
    meta = metadata(args)
    loaded = load_model(args.model)
    rows = []
    for quant in args.quants:
        def llm(**extra):
            engine = dict(block_size=16, kv_cache_memory="512MiB", max_num_batched_tokens=512, quant=quant)
            return LLM(args.model, loaded=copy.deepcopy(loaded), **{**engine, **extra})

        engines = {(mode, kind): llm(batch_invariant=mode, **extra)
                   for mode in (False, True)
                   for kind, extra in (("plain", {}), ("chunked", {"max_num_batched_tokens": 32}),
                                       ("draft", {"draft": "ngram", "draft_args": {"num_tokens": 4}}))}
        ps = prompts(engines[(False, "plain")].tokenizer, "edit") if args.model != "random:llama-tiny" \
            else [[5, 6, 7, 8] * 8 + [i] for i in range(8)]
        for batch in args.batches:
            batches = [[p] for p in ps[:args.batch1]] if batch == 1 else [ps[:batch]]
            row = {"quant": quant, "batch": batch}
            for mode, name in ((False, "off"), (True, "on")):
                speeds, outs = [], None
                for r in range(args.repeats):
                    stats, outs = run(engines[(mode, "plain")], batches, args.max_tokens)
                    speeds.append(stats["tokens_per_s"])
                    log(f"{quant} batch {batch} {name} round {r}: {stats['tokens_per_s']:.2f} tok/s")
                row[f"{name}_tok_s"] = statistics.median(speeds)
                row[f"{name}_runs"] = speeds
                for kind in ("chunked", "draft"):
                    row[f"{name}_{kind}"] = "yes" if run(engines[(mode, kind)], batches, args.max_tokens)[1] == outs \
                        else "no"
            row["ratio"] = row["on_tok_s"] / row["off_tok_s"]
            rows.append(row)
    text = "\n".join([
        f"# The batch-invariant mode on {args.model}: cost and exactness", "",
        *provenance(meta),
        f"Greedy, {args.max_tokens} tokens, EOS ignored, the edit task's prompts (batch 1: {args.batch1} prompts one at "
        f"a time); tok/s of engine time, median of {args.repeats}. 'same' columns: token-identical to the same mode's "
        f"plain run.", "",
        table(rows, COLUMNS), ""])
    print(text)
    md, _ = write_report(args.out, text, {"meta": meta, "rows": rows})
    log(f"wrote {md}")
    return {"rows": rows}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quants", nargs="+", default=["auto", "int4", "fp8_e4m3"])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--batch1", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "batch_invariant_cost"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
