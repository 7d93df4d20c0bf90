"""The user-facing API, in vLLM's shape: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Sequence as Seq

from kvlab.engine_config import EngineConfig
from kvlab.engine.llm_engine import LLMEngine, as_token_ids
from kvlab.models import LoadedModel
from kvlab.outputs import RequestOutput, ScoreOutput, merge_samples
from kvlab.sampling_params import SamplingParams, as_sampling_params
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
        """Generate for every prompt; outputs come back in input order, one RequestOutput per prompt, its
        `outputs` the prompt's n completions (by index; `out.text` / `out.token_ids` read the first).

        A prompt is a string or token ids (a list, tuple, 1-D tensor or numpy array of integers).
        All or nothing: every request is validated before any is queued, so a bad one raises
        (naming it) and nothing runs; if a step fails, this call's requests are aborted, their
        pages freed, and the engine stays usable.
        """
        self._check_idle()
        prompts = self._as_list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                seqs.append(self.engine.make_sequence(self._encode(prompt), p))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"prompt {i}: {exc}") from None
        return self._run(seqs, use_tqdm)

    def score(self, contexts: Prompt | Seq[Prompt], continuations: Prompt | Seq[Prompt],
              return_dists: bool = False, use_tqdm: bool = False) -> list[ScoreOutput]:
        """Log-probability of each continuation token given its context, teacher-forced.

        The context is prefilled first (the cache policy sees all of it), then the continuation
        is computed and scored: exactly one log-prob (and, with `return_dists`, one [vocab]
        log-prob row) per continuation token, whatever preemption happens on the way. An empty
        context is scored from the model's BOS token (an error if the model has none).
        """
        self._check_idle()
        contexts, continuations = self._as_list(contexts), self._as_list(continuations)
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
        seqs = []
        for i, (ctx, cont) in enumerate(zip(contexts, continuations)):
            try:
                seqs.append(self.engine.make_scoring_sequence(self._encode(ctx), self._encode(cont, special=False)))
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"request {i}: {exc}") from None
        return self._run(seqs, use_tqdm, return_dists)

    def _check_idle(self) -> None:
        n = self.engine.num_unfinished()
        if n:
            raise RuntimeError(
                f"the engine has {n} unfinished request(s) queued through llm.engine.add_request; finish them "
                f"with llm.engine.step() (or llm.engine.abort(id)) before calling generate/score, whose outputs "
                f"would otherwise be mixed with theirs"
            )

    def _run(self, seqs: list[Sequence], use_tqdm: bool, return_dists: bool = False) -> list:
        """Queue `seqs`, step the engine until every one is done; their outputs in order.

        On any failure (an exception in a step, KeyboardInterrupt) the requests of this call
        that have not finished are aborted, so their pages go back to the pool.
        """
        done: dict[int, RequestOutput | ScoreOutput] = {}
        ns = [seq.params.n for seq in seqs]  # parallel sampling: n outputs per request
        expected = sum(ns)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=expected, desc="requests")
        try:
            for seq in seqs:
                self.engine.add_sequence(seq, return_dists=return_dists)
            while len(done) < expected:
                for out in self.engine.step():
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            for seq in seqs:  # also when its first sample finished: abort() stops the samples still running
                self.engine.abort(seq.seq_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        groups: dict[int, list] = {}
        for out in done.values():
            if isinstance(out, RequestOutput):
                groups.setdefault(out.group_id, []).append(out)
        return [merge_samples(s.seq_id, groups[s.seq_id]) if isinstance(done[s.seq_id], RequestOutput)
                else done[s.seq_id] for s in seqs]

    # -- metrics -------------------------------------------------------------
    def stats(self) -> dict:
        """Throughput, TTFT/TPOT, KV blocks used and the waste breakdown since the last reset."""
        return self.engine.stats()

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    def close(self) -> None:
        """Drain and close the tiers below the pool (a disk tier's files go); see LLMEngine.close."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------
    @staticmethod
    def _as_list(prompts) -> list:
        """One prompt (a string or token ids) or a sequence of them -> a list of prompts."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        if isinstance(prompts, (bytes, Mapping)) or not hasattr(prompts, "__iter__"):
            raise TypeError(f"prompts must be a string, token ids, or a list of them, got {type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given: pass at least one string or list of token ids")
        return prompts

    @staticmethod
    def _params_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, (SamplingParams, Mapping, str, bytes)) or not hasattr(params, "__iter__"):
            return [as_sampling_params(params)] * n  # a dict or anything else: a TypeError saying what it is
        params = list(params)
        if len(params) != n:
            raise ValueError(f"{n} prompts but {len(params)} sampling params")
        return params

    def _encode(self, prompt: Prompt, special: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (random weights): pass token ids")
            return self.tokenizer(prompt, add_special_tokens=special)["input_ids"]
        return as_token_ids(prompt)


def _is_token_ids(x) -> bool:
    """One prompt of token ids: a 1-D tensor / array, or a non-empty list / tuple of numbers
    (non-integers among them are then rejected by `as_token_ids`, never truncated)."""
    if hasattr(x, "ndim") and hasattr(x, "tolist"):
        return x.ndim == 1
    return isinstance(x, (list, tuple)) and bool(x) and isinstance(x[0], numbers.Number)
