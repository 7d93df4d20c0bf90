"""Does a compressing policy keep kvlab_niah's needle? Per document of the lm-eval task: where the needle's value
sits, in how many of the model's (layer, KV head) caches each of its tokens survives the prefill compression,
and the greedy answer (kvlab issue 26: the attention-scored policies found the needle in at most 3 of 10).

    python experiments/niah_kept_needle.py --policy snapkv --ratio 0.25
    python experiments/niah_kept_needle.py --policy snapkv --ratio 0.25 --policy-args '{"kernel_size": 15}'

The prompts are kvlab_niah's first --limit documents as lm-eval hands them to the `kvlab` model (the task's text,
encoded by the model's tokenizer, no chat template), generated as the task does (greedy, 12 tokens, cut at a
newline). Prints a table and writes experiments/results/niah_kept_needle_<model>_<policy>_<ratio>[_<tag>].md/.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
NIAH = {"variants": ["needle", "passkey", "multikey"], "context_lengths": [256, 512], "depths": [0.0, 0.5, 1.0],
        "samples_per_cell": 2, "num_keys": 4, "seed": 0}  # kvlab_niah.yaml's metadata


def niah_documents(model: str, limit: int) -> list[dict]:
    """kvlab_niah's documents (kvlab.study.lm_eval.local_data.niah_rows with the task's defaults), the first `limit`."""
    from kvlab.study.lm_eval import local_data
    from kvlab.study.tasks.data import corpus_tokens

    tok = local_data.model_tokenizer(model)
    return local_data.niah_rows(tok, corpus_tokens(local_data.ESSAYS, None, tok), **NIAH)[:limit]


def record_kept(policy_cls) -> list[tuple[int, list[list[int]] | None]]:
    """Wrap the policy's `select`: every (layer, kept indices per KV head) of the next generate call lands in the list."""
    log: list = []
    select = policy_cls.select

    def recording(self, layer_idx, num_layers, keys, *args, **kwargs):
        kept = select(self, layer_idx, num_layers, keys, *args, **kwargs)
        heads = keys.shape[1]
        log.append((layer_idx, None if kept is None else kept if kept and isinstance(kept[0], list) else [kept] * heads,
                    heads))
        return kept

    policy_cls.select = recording
    return log


def needle_span(tok, text: str, value: str) -> list[int]:
    """Token indices of the needle's value in the encoded prompt."""
    start = text.index(value)
    offsets = tok(text, return_offsets_mapping=True)["offset_mapping"]
    return [i for i, (a, b) in enumerate(offsets) if b > start and a < start + len(value)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--policy", default="snapkv")
    p.add_argument("--ratio", type=float, default=0.25)
    p.add_argument("--policy-args", default="{}", help="extra policy parameters (JSON)")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--tag", default="", help="suffix of the results file names")
    args = p.parse_args()

    from kvlab import LLM, SamplingParams
    from kvlab.policies.base import Policy
    from kvlab.study.bench_io import uptime

    extra = json.loads(args.policy_args)
    log = record_kept(Policy)
    llm = LLM(args.model, max_model_len=1025, kv_cache_memory="1GiB", policy=args.policy,
              policy_args={"compression_ratio": args.ratio, "when": "prefill", **extra})
    tok, rows = llm.tokenizer, []
    for i, doc in enumerate(niah_documents(args.model, args.limit)):
        ids, span = list(tok.encode(doc["input"])), needle_span(tok, doc["input"], doc["answer"])
        log.clear()
        out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0]
        answer = tok.decode(list(out.token_ids), skip_special_tokens=True).split("\n")[0]
        caches = [(set(h) if h is not None else None) for _, heads, n in log for h in (heads or [None] * n)]
        per_token = [sum(1 for c in caches if c is None or t in c) for t in span]
        every = sum(1 for c in caches if c is None or all(t in c for t in span))
        rows.append({"doc": i, "variant": doc["variant"], "tokens": len(ids), "depth": doc["depth"],
                     "needle tokens": f"{span[0]}-{span[-1]}", "caches": len(caches),
                     "caches keeping each needle token": per_token, "caches keeping all": every,
                     "answer": answer, "expected": doc["answer"], "correct": doc["answer"] in answer})
    hits = sum(r["correct"] for r in rows)
    load = uptime()
    lines = [f"| {' | '.join(rows[0])} |", "|" + "---|" * len(rows[0])]
    lines += [f"| {' | '.join(str(v).replace('|', '/') for v in r.values())} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    print(f"{args.policy} ratio {args.ratio} {extra or ''}: {hits}/{len(rows)} correct")
    stem = f"niah_kept_needle_{args.model}_{args.policy}_{args.ratio:g}" + (f"_{args.tag}" if args.tag else "")
    command = ("python experiments/niah_kept_needle.py " + " ".join(
        [f"--model {args.model}", f"--policy {args.policy}", f"--ratio {args.ratio:g}", f"--limit {args.limit}"]
        + ([f"--policy-args '{args.policy_args}'"] if extra else []) + ([f"--tag {args.tag}"] if args.tag else [])))
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (RESULTS / f"{stem}.md").write_text(
        f"# Is kvlab_niah's needle kept? {args.model}, {args.policy} ratio {args.ratio:g} {extra or ''}\n\n"
        f"Command: `{command}`\n\nDate: {date}; load: {load}\n\n"
        f"A cache is one (layer, KV head); `caches keeping each needle token` counts, for each token of the needle's "
        f"value, the caches where it survived the prefill compression.\n\n{table}\n\n{hits}/{len(rows)} correct\n")
    (RESULTS / f"{stem}.json").write_text(json.dumps({"command": command, "date": date, "load": load,
                                                      "policy_args": extra, "rows": rows, "correct": hits}, indent=1))


if __name__ == "__main__":
    main()
