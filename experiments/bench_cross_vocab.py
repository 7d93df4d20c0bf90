"""Heterogeneous-vocabulary speculative decoding: SmolLM2-135M drafting for Gemma3-270M (or the reverse).

Same run, same prompts: plain kvlab decoding of Gemma 3, the `slem` and `tli` drafts (Timor et
al. 2025, arXiv:2502.05202) with SmolLM2-135M as the draft model (another tokenizer), and the
anchor, Hugging Face assisted generation with `assistant_model` + `assistant_tokenizer` (greedy:
its string-level re-tokenisation path, i.e. SLEM) against plain Hugging Face `generate`, batch 1
only (what it supports). `slrs` is not run: it refuses this pair (its exact sum is exponential in
the draft length; see kvlab/speculation/drafts/slrs.py).

Two tasks as in experiments/bench_speculation.py: `edit` (copy a passage with its spelling
corrected: repetition-heavy) and `free` (a short story). Greedy, EOS ignored; kvlab at batch 1
(--batch1 prompts one at a time) and batch 8 (--batches). Reports tokens/s, speedup over plain in the same
run, acceptance rate a, mean accepted length against (1 - a^(g+1)) / (1 - a), the draft's share of
step time, and whether outputs are token-identical to plain (they must be). Medians over --repeats.

    nice -n 5 python experiments/bench_cross_vocab.py          # ~15-30 minutes on 2 busy cores
    nice -n 10 python experiments/bench_cross_vocab.py --target smollm2-135m --draft gemma3-270m --batches 1 \
        --out experiments/results/cross_vocab_smollm2     # the reverse pair, batch 1 only
    python experiments/bench_cross_vocab.py --max-tokens 8 --batch1 1 --tasks free --out /tmp/xv   # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_speculation import prompts  # noqa: E402
from kvlab.study.bench_io import commit_line, load_average, log, metadata, table  # noqa: E402

COLUMNS = [("task", "task"), ("batch", "batch"), ("method", "method"), ("plain_tok_s", "plain tok/s"),
           ("spec_tok_s", "speculative tok/s"), ("speedup", "speedup"), ("acceptance", "acceptance a"),
           ("accepted_len", "mean accepted length"), ("predicted_len", "(1-a^(g+1))/(1-a)"),
           ("draft_share", "draft share of step time"), ("identical", "identical to plain")]


def run(llm, batches, max_tokens) -> tuple[dict, list[list[int]]]:
    from kvlab import SamplingParams

    llm.reset_stats()
    outs = []
    for batch in batches:
        outs += [o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    return llm.stats(), outs


def hf_generate(target, ids, max_tokens, **assist) -> tuple[float, list[int]]:
    """One Hugging Face greedy generation -> (seconds, new tokens)."""
    import torch

    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, **assist)
    return time.perf_counter() - t0, out[0, len(ids):].tolist()


def main(argv=None) -> dict:
    args = parse_args(argv)
    import copy

    import torch

    from kvlab import LLM
    from kvlab.study.loggers.local import write_report
    from kvlab.models import load_model

    torch.set_num_threads(args.threads)
    args.model = f"{args.target} (draft {args.draft})"  # what the shared report metadata names
    meta = metadata(args)
    target, draft = load_model(args.target), load_model(args.draft)
    engine = dict(block_size=16, kv_cache_memory="128MiB", max_num_batched_tokens=512)
    # one copy of the target for every kvlab engine (they re-wire its attention alike; memory is short
    # here: a first run with a copy per engine was killed by the out-of-memory killer), the original
    # for Hugging Face
    shared = copy.deepcopy(target)
    plain = LLM(args.target, loaded=shared, **engine)
    draft_args = {"model": args.draft, "num_tokens": args.num_tokens}
    specs = {m: LLM(args.target, loaded=shared, draft=m, draft_args=draft_args, **engine) for m in args.methods}
    rows = []
    for task in args.tasks:
        ps = prompts(target.tokenizer, task)
        for batch in args.batches:
            batches = [[p] for p in ps[:args.batch1]] if batch == 1 else [ps[:batch]]
            runs: dict[str, list] = {m: [] for m in args.methods}
            hf_runs = []
            for r in range(args.repeats):
                base, base_out = run(plain, batches, args.max_tokens)
                for m, llm in specs.items():
                    sp, sp_out = run(llm, batches, args.max_tokens)
                    runs[m].append({"plain_tok_s": base["tokens_per_s"], "spec_tok_s": sp["tokens_per_s"],
                                    "speedup": sp["tokens_per_s"] / base["tokens_per_s"],
                                    "acceptance": sp["spec_acceptance_rate"],
                                    "accepted_len": sp["spec_mean_accepted_length"],
                                    "draft_share": sp["spec_draft_time_share"], "identical": sp_out == base_out})
                    log(f"{task} batch {batch} round {r}: plain {base['tokens_per_s']:.2f} tok/s, {m} "
                        f"{sp['tokens_per_s']:.2f} tok/s, a={sp['spec_acceptance_rate']:.2f}")
                if batch == 1 and args.hf:
                    t_plain = t_asst = 0.0
                    same = True
                    for (p,) in batches:
                        s, ref = hf_generate(target.model, p, args.max_tokens)
                        a, got = hf_generate(target.model, p, args.max_tokens, assistant_model=draft.model,
                                             tokenizer=target.tokenizer, assistant_tokenizer=draft.tokenizer,
                                             num_assistant_tokens=args.num_tokens,
                                             num_assistant_tokens_schedule="constant")
                        t_plain, t_asst, same = t_plain + s, t_asst + a, same and got == ref
                    n = args.max_tokens * len(batches)
                    hf_runs.append({"plain_tok_s": n / t_plain, "spec_tok_s": n / t_asst,
                                    "speedup": t_plain / t_asst, "identical": same})
                    log(f"{task} batch 1 round {r}: HF plain {n / t_plain:.2f} tok/s, HF assisted {n / t_asst:.2f}")
            for m, rs in [*runs.items(), *([("HF assisted (assistant_tokenizer)", hf_runs)] if hf_runs else [])]:
                row = {"task": task, "batch": batch, "method": m, "runs": rs}
                for k in ("plain_tok_s", "spec_tok_s", "speedup", "acceptance", "accepted_len", "draft_share"):
                    vals = [x[k] for x in rs if k in x]
                    row[k] = statistics.median(vals) if vals else float("nan")
                a, g = row["acceptance"], args.num_tokens
                row["predicted_len"] = ((1 - a ** (g + 1)) / (1 - a) if a < 1 else g + 1.0) if a == a else float("nan")
                row["identical"] = "yes" if all(x["identical"] for x in rs) else "NO"
                rows.append(row)
    text = report(rows, meta, args, sizes={args.target: parameters(target.model),
                                           args.draft: parameters(draft.model)})
    print(text)
    md, _ = write_report(args.out, text, {"meta": meta, "rows": rows})
    log(f"wrote {md}")
    return {"rows": rows}


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def report(rows: list[dict], meta: dict, args, sizes: dict) -> str:
    ratio = sizes[args.draft] / sizes[args.target]
    batches = ", ".join(f"batch {b} = {args.batch1 if b == 1 else b} prompts {'one at a time' if b == 1 else 'together'}"
                        for b in args.batches)
    return "\n".join([
        f"# Heterogeneous-vocabulary speculative decoding: {args.draft} drafting for {args.target}", "",
        f"Command: `{meta['command']}`  ", f"Date: {meta['started_at']}  ", f"Commit: {commit_line(meta)}  ",
        f"Load average at the end (1/5/15 min): {load_average()} -- the machine (2 cores) ran other agents' "
        f"jobs at the same time, so absolute figures are noisy; ratios come from the same run.", "",
        f"Greedy, EOS ignored, {args.max_tokens} new tokens per request, g = {args.num_tokens} draft tokens per "
        f"step, block size 16, {args.threads} torch threads; {batches}; medians of {args.repeats} round(s). kvlab tok/s are generated tokens per "
        f"second of engine time; the `plain tok/s` of a kvlab row is plain kvlab decoding in the same round. The "
        f"Hugging Face row compares `generate` with and without `assistant_model` + `assistant_tokenizer` "
        f"(greedy: Hugging Face's string-level re-tokenisation, the same idea as `slem`), wall time per "
        f"prompt, batch 1 only; its `identical` column compares Hugging Face's two outputs. `edit` copies a "
        f"given passage with its spelling corrected (repetition-heavy); `free` writes a short story.", "",
        table(rows, COLUMNS), "",
        "For slem, a counts target tokens: g draft-model tokens are drafted and re-tokenised, and at most g "
        "target tokens proposed (fewer where the target's tokens are longer than the draft's), so the i.i.d. "
        "prediction is only a reference. The draft has "
        f"{sizes[args.draft] / 1e6:.0f}M parameters, {ratio:.2f}x the target's {sizes[args.target] / 1e6:.0f}M: "
        "on two CPU cores a draft step costs "
        f"{'about as much as' if ratio < 0.8 else 'more than'} the target's verification of several tokens, so a "
        "speedup needs long accepted runs; where the table shows a speedup below 1, speculation does not pay on "
        "this machine for this pair.", ""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="gemma3-270m")
    p.add_argument("--draft", default="smollm2-135m")
    p.add_argument("--methods", nargs="+", default=["slem", "tli"])
    p.add_argument("--tasks", nargs="+", default=["edit", "free"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-tokens", type=int, default=4, help="draft length g")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (1: prompts one at a time)")
    p.add_argument("--batch1", type=int, default=2, help="prompts run one at a time for batch 1")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the Hugging Face anchor")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "cross_vocab_gemma3"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
