"""Every logits row a run computes, keyed by its context: the batch-invariant mode's runs, shared by its tests."""

from __future__ import annotations

import random

import torch

from kvlab.engine.model_runner import ModelRunner
from kvlab.llm import LLM
from kvlab.sampling_params import SamplingParams
from kvlab.testing.builtin_args import DRAFT_ARGS, TINY


def record_logits(llm: LLM) -> dict[tuple[int, ...], torch.Tensor]:
    """Every logits row the engine's runner computes for a sampled or verified position, keyed by the
    context it follows (a draft's verification rows: the context plus the drafted tokens before the row)."""
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    runner: ModelRunner = llm.engine.runner
    run = runner.run

    def recording(batch, *args, **kwargs):
        drafts = {seq.seq_id: drafted_paths(seq) for seq in batch.seqs}
        out = run(batch, *args, **kwargs)
        for seq, row in out.sample_rows:
            rows[tuple(seq.token_ids)] = out.logits[row].clone()
        for seq, verify in out.verify_rows:
            context = list(seq.token_ids)  # the verified tokens are appended after the run
            for i, row in enumerate(verify):
                rows[tuple(context + drafts[seq.seq_id][i])] = out.logits[row].clone()
        return out

    runner.run = recording
    return rows


def drafted_paths(seq) -> list[list[int]]:
    """The drafted tokens each verify row follows: a chain's row i the first i drafts, a token tree's node row its
    path from the root (the nodes are in preorder, `draft_parents`)."""
    tokens, parents = list(seq.draft_token_ids), list(seq.draft_parents)
    paths = [[]]
    for i, token in enumerate(tokens):
        paths.append(paths[parents[i] + 1 if parents else i] + [token])
    return paths


def prompts(seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(3, 250) for _ in range(k)] for k in (23, 41, 58, 70)]


def run(schedule: dict, max_tokens: int = 10, **engine_args) -> tuple[list[list[int]], dict]:
    """Generate greedily over `prompts()`; schedule: {'solo': True} one request at a time, else engine args."""
    solo = schedule.pop("solo", False)
    llm = LLM(model=TINY, kv_cache_memory="4MiB", **schedule, **engine_args)
    seen = record_logits(llm)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ps = prompts()
    outs = [llm.generate([p], sp)[0] for p in ps] if solo else llm.generate(ps, sp)
    return [o.outputs[0].token_ids for o in outs], seen


def same_bits(a: dict, b: dict) -> tuple[int, int]:
    """(contexts both runs computed, how many of them with other bits)."""
    common = a.keys() & b.keys()
    return len(common), sum(not torch.equal(a[c], b[c]) for c in common)


SCHEDULES = {  # each against the batched, one-chunk run
    "solo": {"solo": True},
    "chunked": {"max_num_batched_tokens": 16},
    "ngram draft": {"draft": "ngram", "draft_args": DRAFT_ARGS["ngram"]},
    "layerskip draft": {"draft": "layerskip", "draft_args": DRAFT_ARGS["layerskip"]},
}
