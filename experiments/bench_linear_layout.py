"""The fused weight layout alone (engine.linear_layout, kvlab/engine/linear_layout.py): bytes/s of a model's
projection groups as separate products and as one fused product, at decode batch sizes.

For each group that reads one input (q/k/v, gate/up) at the model's shapes, random weights and inputs:
the separate `F.linear` calls and the one product over the weights end to end take turns --rounds times
(load drifts hit both alike); quoted: the median over rounds of each's mean time over --calls calls,
the weight bytes over it, and whether the fused output equals the separate ones to the bit.

    python experiments/bench_linear_layout.py --batches 1 16 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvlab.study.bench_io import REPO, bench_main, provenance, table

COLUMNS = [("group", "group"), ("shape", "fused weight"), ("dtype", "dtype"), ("batch", "batch"),
           ("separate_us", "separate us"), ("fused_us", "fused us"), ("separate_gb_s", "separate GB/s"),
           ("fused_gb_s", "fused GB/s"), ("speedup", "fused speed-up"), ("exact", "same bits")]


def groups_of(config) -> dict[str, list[int]]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    return {"q/k/v": [config.num_attention_heads * head_dim, kv, kv],
            "gate/up": [config.intermediate_size, config.intermediate_size]}


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def run(args) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kvlab.models import load_model

    config = load_model(args.model).model.config
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for group, sizes in groups_of(config).items():
            ws = [torch.randn(n, config.hidden_size, generator=g).to(dtype) for n in sizes]
            fused = torch.cat(ws)  # [sum N, K]
            for b in args.batches:
                x = torch.randn(b, config.hidden_size, generator=g).to(dtype)
                separate = lambda: [F.linear(x, w) for w in ws]  # noqa: E731
                one = lambda: F.linear(x, fused)  # noqa: E731
                exact = torch.equal(torch.cat(separate(), dim=-1), one())
                times = {"separate": [], "fused": []}
                for _ in range(args.rounds):
                    for name, fn in (("separate", separate), ("fused", one)):
                        fn()
                        times[name].append(timed(fn, args.calls))
                sep, fus = statistics.median(times["separate"]), statistics.median(times["fused"])
                nbytes = fused.numel() * fused.element_size()
                rows.append({"group": group, "shape": f"{fused.shape[0]} x {fused.shape[1]}", "dtype": dtype_name,
                             "batch": b, "separate_us": 1e6 * sep, "fused_us": 1e6 * fus,
                             "separate_gb_s": nbytes / sep / 1e9, "fused_gb_s": nbytes / fus / 1e9,
                             "speedup": sep / fus, "exact": exact, "rounds_s": times})
    return rows


def report(rows: list[dict], meta: dict, args) -> str:
    return "\n".join([f"# Fused projections alone ({args.model} shapes)", "",
                      *provenance(meta, "the machine is shared with other jobs: timings are indicative only"),
                      f"{args.threads} torch thread(s); median over {args.rounds} rounds (separate and fused "
                      f"alternating) of the mean over {args.calls} calls; GB/s = the group's weight bytes / time.",
                      "", table(rows, COLUMNS), ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="whose shapes (its config; weights are random)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "linear_layout_smollm2"))
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    return bench_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
