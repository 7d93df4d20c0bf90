"""The user-facing API, in vLLM's shape: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from typing import Sequence as Seq

from kvlab.engine_config import EngineConfig
from kvlab.llm_engine import LLMEngine
from kvlab.models import LoadedModel
from kvlab.outputs import RequestOutput, ScoreOutput
from kvlab.sampling_params import SamplingParams
from kvlab.sequence import Sequence

Prompt = str | list[int]


class LLM:
    """A model behind the paged engine.

    >>> llm = LLM(model="smollm2-135m", block_size=16, allocator="paged", kv_cache_memory="256MiB")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    >>> out[0].text, llm.stats()["tokens_per_s"]
    """

    def __init__(self, model: str = "smollm2-135m", *, loaded: LoadedModel | None = None, **engine_args):
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(self.config, loaded)
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config

    # -- generation ----------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Every request is validated before any runs, so a bad one raises (naming
        it) without leaving the batch half done.
        """
        prompts = self._as_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                seqs.append(self.engine.make_sequence(self._encode(prompt), p))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompt {i}: {exc}") from None
        for seq in seqs:
            self.engine.add_sequence(seq)
        return self._run(seqs, use_tqdm)

    def score(self, contexts: Prompt | Seq[Prompt], continuations: Prompt | Seq[Prompt],
              return_dists: bool = False, use_tqdm: bool = False) -> list[ScoreOutput]:
        """Log-probability of each continuation token given its context, teacher-forced.

        The context is prefilled first (the cache policy sees all of it), then
        the continuation is computed and scored.
        """
        contexts, continuations = self._as_list(contexts), self._as_list(continuations)
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
        seqs = []
        for i, (ctx, cont) in enumerate(zip(contexts, continuations)):
            ctx_ids, cont_ids = self._encode(ctx), self._encode(cont, special=False)
            if not cont_ids:
                raise ValueError(f"continuation {i} is empty")
            try:
                seqs.append(self.engine.make_sequence(ctx_ids + cont_ids, SamplingParams(max_tokens=1),
                                                      score_from=len(ctx_ids)))
            except ValueError as exc:
                raise ValueError(f"context {i}: {exc}") from None
        for seq in seqs:
            self.engine.add_sequence(seq, return_dists=return_dists)
        return self._run(seqs, use_tqdm)

    def _run(self, seqs: list[Sequence], use_tqdm: bool) -> list:
        """Step the engine until every one of `seqs` is done; their outputs in order."""
        wanted = {s.seq_id for s in seqs}
        done: dict[int, RequestOutput | ScoreOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="requests")
        while len(done) < len(seqs):
            for out in self.engine.step():
                if out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[s.seq_id] for s in seqs]

    # -- metrics -------------------------------------------------------------
    def stats(self) -> dict:
        """Throughput, TTFT/TPOT, KV blocks used and the waste breakdown since the last reset."""
        return self.engine.stats()

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    # -- helpers -------------------------------------------------------------
    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given: pass at least one string or list of token ids")
        return prompts

    @staticmethod
    def _params_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"{n} prompts but {len(params)} sampling params")
        return params

    def _encode(self, prompt: Prompt, special: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (random weights): pass token ids")
            return self.tokenizer(prompt, add_special_tokens=special)["input_ids"]
        return list(prompt)
