"""Agreement with the full cache: does the policy change what the model says?

The same prompts run through the LLM under test and a reference LLM (same model
and engine, `policy=full`, `quant=auto`, no draft). Reported per prompt and on
average:
  - greedy_match: fraction of positions where the free-running greedy outputs agree;
  - prefix_match: length of the common prefix of the two greedy outputs / max_new_tokens;
  - top1_match:   teacher-forced on the reference's continuation, how often the test
                  model's argmax equals the reference token;
  - kl:           KL(reference || test) of the next-token distributions, teacher-forced,
                  in nats, mean (and max) over positions.
Works even for random tiny models: it measures the cache, not the model.

The reference's outputs are kept for the next run in the same process (a Hydra sweep runs its
jobs in one process): when the reference settings (`RunContext.reference_key`), the prompts and
`max_new_tokens` are the same, the reference is neither built nor run again. A leaderboard sweep
of 44 cells computes its reference once instead of 44 times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvlab.study.tasks.base import Result, RunContext, Task, check_positive
from kvlab.study.tasks.data import corpus_tokens, evenly_spaced_windows, get_tokenizer
from kvlab.study.tasks.perplexity import check_fits

_REFERENCE_MEMO: dict = {}  # {key: (greedy token ids, teacher-forced log-prob rows)}; the last key only


@dataclass
class Agreement(Task):
    METRICS: ClassVar[tuple[str, ...]] = ("agreement/greedy_match", "agreement/prefix_match",
                                          "agreement/top1_match", "agreement/kl", "agreement/kl_max")

    source: str = "wikitext-2-raw/wiki.test.raw"  # prompt text
    num_prompts: int = 8                          # prompts
    prompt_length: int = 128                      # tokens per prompt
    max_new_tokens: int = 32                      # tokens compared per prompt

    def __post_init__(self) -> None:
        check_positive(self, "num_prompts", "prompt_length", "max_new_tokens")

    def run(self, llm, ctx: RunContext) -> Result:
        import pandas as pd

        from kvlab import SamplingParams

        check_fits(llm, self.prompt_length + self.max_new_tokens, "prompt_length + max_new_tokens")
        tokens = corpus_tokens(self.source, ctx.data_dir, get_tokenizer(llm))
        prompts = evenly_spaced_windows(tokens, self.prompt_length, self.num_prompts)
        params = SamplingParams(max_tokens=self.max_new_tokens, temperature=0.0, ignore_eos=True)
        continuations, ref_dists = self.reference_outputs(llm, ctx, prompts, params)
        test_out = llm.generate(prompts, params)
        test_scores = llm.score(prompts, continuations, return_dists=True)
        rows = [compare(i, cont, test.token_ids, cont, rd, ts.dists, self.max_new_tokens)
                for i, (test, cont, rd, ts) in enumerate(zip(test_out, continuations, ref_dists, test_scores))]
        table = pd.DataFrame(rows)
        metrics = {f"agreement/{k}": float(table[k].mean())
                   for k in ("greedy_match", "prefix_match", "top1_match", "kl")}
        metrics["agreement/kl_max"] = float(table["kl_max"].max())
        return Result(metrics, {"agreement": table})

    def reference_outputs(self, llm, ctx: RunContext, prompts, params) -> tuple[list, list]:
        """The reference's greedy continuations and their teacher-forced log-prob rows (memoised)."""
        key = None if ctx.reference_key is None else (ctx.reference_key, tuple(map(tuple, prompts)),
                                                      self.max_new_tokens)
        if key is not None and key in _REFERENCE_MEMO:
            return _REFERENCE_MEMO[key]
        reference = ctx.reference() if ctx.reference is not None else llm
        continuations = [list(o.token_ids) for o in reference.generate(prompts, params)]
        dists = [s.dists for s in reference.score(prompts, continuations, return_dists=True)]
        if key is not None:
            _REFERENCE_MEMO.clear()
            _REFERENCE_MEMO[key] = (continuations, dists)
        return continuations, dists


def compare(index, ref_ids, test_ids, continuation, ref_dists, test_dists, max_new_tokens) -> dict:
    """One prompt's agreement numbers; dists are log-probabilities [len(continuation), vocab]."""
    import torch

    ref_ids, test_ids = list(ref_ids), list(test_ids)
    same = [a == b for a, b in zip(ref_ids, test_ids)]
    prefix = next((i for i, s in enumerate(same) if not s), len(same))
    lr, lt = as_tensor(ref_dists), as_tensor(test_dists)               # [T, V] log p
    lr, lt = lr - lr.logsumexp(-1, keepdim=True), lt - lt.logsumexp(-1, keepdim=True)  # renormalise in fp64
    kl = torch.where(lr.isfinite(), lr.exp() * (lr - lt), torch.zeros_like(lr)).sum(-1).clamp_min(0)  # [T]
    target = torch.tensor(continuation)
    return {
        "prompt": index,
        "tokens": len(continuation),
        "greedy_match": sum(same) / max_new_tokens,
        "prefix_match": prefix / max_new_tokens,
        "top1_match": float((lt.argmax(-1) == target).double().mean()) if len(continuation) else 1.0,
        "kl": float(kl.mean()) if len(continuation) else 0.0,
        "kl_max": float(kl.max()) if len(continuation) else 0.0,
    }


def as_tensor(dists):
    """[T, V] float64 log-probs from a tensor or a list of [V] rows."""
    import torch

    if isinstance(dists, torch.Tensor):
        return dists.double()
    return torch.stack([torch.as_tensor(row) for row in dists]).double()
