"""Does preemption change an answer under a compressing policy? Every compressing built-in (and quest, which
reads selected pages at decode), a tiny pool against a big one, greedy: the outputs must be identical,
request by request.

A preempted request is recomputed from its tokens (prompt plus what it generated). Compression points
are defined in token time (the prompt's end; with when="decode" every `every` tokens after it) and no
chunk runs past one, so the recompute compresses at the tokens the first pass did and rebuilds exactly
what it kept; under sparse reading its generated tokens are recomputed one a step, as the decode rows
they were (docs/design.md, "Admission under per-chunk compression"). The issue's case (issue 21, item 2): random:llama-tiny,
random prompts of 10-60 tokens, max_tokens 16, EOS ignored, ratio 0.5, a 96 KiB pool against 16 MiB.

    python experiments/check_preemption_policies.py                     # 200 requests, every policy
    python experiments/check_preemption_policies.py --num-requests 20 --policies snapkv h2o --out /tmp/p

Writes <out>.md (the table, the command that made it) and <out>.json (per configuration: preempted and
differing request ids); exits 1 if any request differs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from kvlab.testing.builtin_args import RATIO_ARGS

REPO = Path(__file__).resolve().parent.parent
# policy -> arguments at ratio 0.5 (rocketkv's budget is tokens read per decode step: no ratio)
ARGS = {**RATIO_ARGS,  # and quest: evicts nothing, reads selected pages at decode (as rocketkv)
        "quest": {"budget": 32, "dense_layers": 0}}
PREFILL_ONLY = ("adakv", "rocketkv", "quest")  # compress once, at the end of prefill (quest: never)
DECODE = {"when": "decode", "every": 4}


def configurations(policies: list[str]) -> list[tuple[str, str, dict]]:
    """(label, policy, arguments): each policy as given, and compressing while decoding where it can."""
    out = []
    for name in policies:
        out.append((name, name, ARGS[name]))
        if name not in PREFILL_ONLY:
            out.append((f"{name} (decode, every 4)", name, {**ARGS[name], **DECODE}))
    return out


def make_prompts(n: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, 61, (n,), generator=g).tolist()
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in lengths]


def run(policy: str, args: dict, memory: str, prompts, max_tokens: int, max_prefill_chunk: int | None):
    from kvlab import LLM, SamplingParams

    llm = LLM("random:llama-tiny", policy=policy, policy_args=args, kv_cache_memory=memory,
              max_prefill_chunk=max_prefill_chunk)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs], [o.num_preemptions for o in outs], llm.stats()["preemptions"]


def check(label: str, policy: str, args: dict, prompts, opts) -> dict:
    t0 = time.perf_counter()
    want, _, _ = run(policy, args, opts.big_pool, prompts, opts.max_tokens, opts.max_prefill_chunk)
    got, preemptions, total = run(policy, args, opts.tiny_pool, prompts, opts.max_tokens, opts.max_prefill_chunk)
    return {"configuration": label, "policy": policy, "policy_args": args,
            "preempted": [i for i, p in enumerate(preemptions) if p],
            "differing": [i for i, (a, b) in enumerate(zip(got, want)) if a != b],
            "preemptions": total, "seconds": round(time.perf_counter() - t0, 1)}


def report(rows: list[dict], command: str, opts) -> str:
    lines = ["# Preemption under every compressing policy (and quest)", "",
             f"Command: `{command}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d')}.", "",
             f"random:llama-tiny, {opts.num_requests} random prompts of 10-60 tokens (seed {opts.seed}), "
             f"max_tokens {opts.max_tokens}, greedy, EOS ignored; kv_cache_memory {opts.tiny_pool} against "
             f"{opts.big_pool}; max_prefill_chunk {opts.max_prefill_chunk}. A request *differs* when its tokens "
             f"in the tiny pool are not those of the big pool.", "",
             "| configuration | preempted requests | preemptions | differing requests |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['configuration']} | {len(r['preempted'])} | {r['preemptions']} | {len(r['differing'])} |")
    bad = sum(len(r["differing"]) for r in rows)
    lines += ["", f"Differing requests in all: {bad}" + (" (every preempted request recomputed what it kept)."
                                                       if not bad else ".")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tiny-pool", default="96KiB")
    p.add_argument("--big-pool", default="16MiB")
    p.add_argument("--max-prefill-chunk", type=int, default=None)
    p.add_argument("--policies", nargs="+", default=list(ARGS), choices=list(ARGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="experiments/results/preemption_policies", help="relative to the repository")
    opts = p.parse_args(argv)
    env = "".join(f"{k}={os.environ[k]} " for k in ("OMP_NUM_THREADS",) if k in os.environ)
    command = env + "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])
    prompts = make_prompts(opts.num_requests, opts.seed)
    rows = []
    for label, policy, args in configurations(opts.policies):
        rows.append(check(label, policy, args, prompts, opts))
        r = rows[-1]
        print(f"{label:36s} preempted {len(r['preempted']):4d}  differing {len(r['differing']):4d}  "
              f"({r['seconds']} s)", flush=True)
    out = REPO / opts.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(report(rows, command, opts))
    out.with_suffix(".json").write_text(json.dumps({"command": command, "options": vars(opts), "rows": rows},
                                                   indent=1) + "\n")
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return 1 if any(r["differing"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
