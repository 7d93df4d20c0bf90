"""A captured forward (torch.compile) against the eager one for kvlab's decode steps on the CPU (issue 27 item 3).

The same engine setup runs its model eager and through `torch.compile(model, backend=B)` for each --backends
entry, in that order, and eager once more at the end (so load drifts show); kvlab's attention hook is left out
of the capture (`torch.compiler.disable`: it calls the C++ kernel and reads the step's plan), so every layer
breaks the graph once. Quoted per run: the median decode-step time over --steps steps after a prefill and
--warmup steps (compilation happens there, its time quoted too), and whether the greedy tokens equal the first
eager run's.

    python experiments/bench_captured_forward.py --batches 1 --context 128 --steps 8
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvlab.study.bench_io import REPO, bench_main, provenance, table

COLUMNS = [("batch", "batch"), ("run", "forward"), ("step_ms", "decode step ms (median)"),
           ("vs_eager", "first eager / this"), ("setup_s", "prefill + warm-up s (compiling)"),
           ("same_tokens", "same tokens as eager")]


def cell(args, loaded, backend: str, batch: int) -> dict:
    import torch

    from kvlab import LLM, SamplingParams

    llm = LLM(args.model, loaded=loaded, dtype="float32", kv_cache_memory=args.kv_cache_memory, max_num_seqs=batch,
              max_num_batched_tokens=batch * args.context)
    engine = llm.engine
    eager = engine.runner.model
    if backend != "eager":
        engine.runner.model = torch.compile(eager, backend=backend, dynamic=False)
    g = torch.Generator().manual_seed(args.seed)
    new = 1 + args.warmup + args.steps
    for _ in range(batch):
        engine.add_request(torch.randint(3, eager.config.vocab_size, (args.context,), generator=g).tolist(),
                           SamplingParams(max_tokens=new + 1, ignore_eos=True))  # still running when read
    t0 = time.perf_counter()
    for _ in range(1 + args.warmup):
        engine.step()
    setup = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    tokens = [list(s.token_ids[-new:]) for s in engine.scheduler.running]  # the `new` tokens it generated
    assert len(tokens) == batch, "a sequence finished before its tokens were read"
    while engine.has_unfinished():
        engine.step()
    engine.runner.model = eager
    return {"batch": batch, "backend": backend, "step_ms": 1e3 * statistics.median(times), "setup_s": setup,
            "steps_s": times, "tokens": tokens}


def run(args) -> list[dict]:
    import torch

    from kvlab.engine import attention
    from kvlab.models import load_model

    attention.paged_attention_forward = torch.compiler.disable(attention.paged_attention_forward)
    attention.register()  # the hook, left out of the capture
    loaded = load_model(args.model, dtype=torch.float32)
    rows = []
    for batch in args.batches:
        cells = [cell(args, loaded, b, batch) for b in ["eager", *args.backends, "eager"]]
        for i, c in enumerate(cells):
            c["run"] = c["backend"] + (" (again)" if i == len(cells) - 1 else "")
            c["vs_eager"] = cells[0]["step_ms"] / c["step_ms"]
            c["same_tokens"] = c["tokens"] == cells[0]["tokens"]
        rows += cells
    return rows


def report(rows: list[dict], meta: dict, args) -> str:
    return "\n".join([f"# Captured vs eager forward, kvlab decode steps ({args.model}, float32, CPU)", "",
                      *provenance(meta, "the machine is shared with other jobs: timings are indicative only"),
                      f"Context {args.context} random tokens per sequence, {args.threads} torch thread(s); "
                      f"{args.warmup} warm-up decode steps after the prefill, then {args.steps} timed. The attention "
                      "hook runs outside the capture (one graph break per layer).", "", table(rows, COLUMNS), ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    p.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "captured_forward_cpu"))
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    return bench_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
