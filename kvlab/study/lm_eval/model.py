"""The `kvlab` model of lm-evaluation-harness: every request kind through kvlab's paged engine.

    lm_eval.simple_evaluate(model="kvlab", model_args="pretrained=smollm2-135m,policy=snapkv,"
                            "compression_ratio=0.5", tasks=[...])      # after `import kvlab.study.lm_eval`
    KvlabLM(llm=LLM(...))                                              # an engine already built

- `loglikelihood`: `LLM.score` (the context prefilled and compressed by the policy, the continuation
  teacher-forced), many requests per call; `is_greedy` from the returned next-token distributions,
  held a bounded number at a time (`dists_memory`) and dropped once their argmax is compared.
- `loglikelihood_rolling`: lm-eval's own windows (`get_rolling_token_windows` + `make_disjoint_window`,
  as its `hf` backend), every window of every document scored in the same batched calls.
- `generate_until`: `LLM.generate` with the requests of one gen_kwargs group together; the engine stops at
  the stop strings (`SamplingParams.stop`) and the decoded text is cut at the first one as the `hf` backend
  does; the chat template is the tokenizer's.

Lengths follow the `hf` backend with `max_length` = the engine's `max_model_len - 1` (a scoring sequence
holds its last token without computing it): contexts too long are truncated from the left with a warning.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from kvlab.engine_config import parse_bytes
from kvlab.study.lm_eval.args import ModelArgsError, split_model_args
from kvlab.study.lm_eval.generation import cut_at_stop, left_truncate, parse_gen_kwargs

log = logging.getLogger("kvlab.study.lm_eval")


@register_model("kvlab")
class KvlabLM(TemplateLM):
    """lm-eval's LM over a `kvlab.LLM`; `model_args` are routed by `kvlab.study.lm_eval.args.split_model_args`."""

    def __init__(self, llm: Any = None, **model_args: Any) -> None:
        super().__init__()
        engine_args, harness = split_model_args(model_args)
        if llm is None:
            from kvlab import LLM

            llm = LLM(**engine_args)
        elif engine_args:
            raise ModelArgsError(f"an LLM was given; model_args may then hold only harness options, not "
                                 f"{', '.join(sorted(engine_args))}")
        self.llm = llm
        self.tokenizer = llm.tokenizer if llm.tokenizer is not None else _byte_tokenizer(llm)
        self.batch_size = int(harness["batch_size"])
        self._max_gen_toks = int(harness["max_gen_toks"])
        self.add_bos_token = harness["add_bos_token"]
        self.custom_prefix_token_id = harness["prefix_token_id"]
        self.dists_memory = parse_bytes(harness["dists_memory"])
        if self.batch_size < 1:
            raise ModelArgsError(f"batch_size must be >= 1, got {self.batch_size}")

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "KvlabLM":
        from lm_eval._cli.utils import key_val_to_dict

        return cls.create_from_arg_obj(key_val_to_dict(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "KvlabLM":
        """lm-eval's own options (--batch_size, --device; --max_batch_size is unused) under the model_args."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k != "max_batch_size"}
        if extra.get("batch_size") == "auto" or str(extra.get("batch_size", "")).startswith("auto:"):
            extra.pop("batch_size")  # the engine batches continuously: the default run length serves
        if "device" in extra and str(extra["device"]).startswith("cuda") and not torch.cuda.is_available():
            log.warning("device %s is not available; using cpu", extra.pop("device"))
        return cls(**{**extra, **arg_dict})

    # -- what lm-eval asks of a model ---------------------------------------------------------------
    @property
    def engine(self):
        return self.llm.engine

    @property
    def eot_token_id(self) -> int:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos if eos is not None else min(self.engine.eos_token_ids)

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.engine.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        """Tokens fed to the model per request (lm-eval's max_length): the sequence, its unfed last token
        included, is the engine's max_model_len."""
        return self.engine.max_model_len - 1

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "kvlab")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As lm-eval's hf backend: the tokenizer's default special tokens unless told (or the text
        already starts with the BOS text)."""
        special = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if special is None and self._starts_with_bos(string):
            special = False
        return list(self.tokenizer.encode(string, **({} if special is None else {"add_special_tokens": special})))

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"{self.tokenizer_name} has no chat template: run without --apply_chat_template")
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def get_model_info(self) -> dict:
        c = self.llm.config
        return {"kvlab_model": c.model, "kvlab_policy": c.policy, "kvlab_policy_args": c.policy_args,
                "kvlab_quant": c.quant, "kvlab_quant_args": c.quant_args, "kvlab_draft": c.draft,
                "kvlab_block_size": c.block_size, "kvlab_kv_cache_memory": c.kv_cache_memory}

    # -- loglikelihood ------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        self._check_can_score()
        pairs = [self._fit(ctx, cont) for _, ctx, cont in requests]
        results = self._score(pairs, greedy=True, disable_tqdm=disable_tqdm)
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        self._check_can_score()
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in rolling_windows(self.tok_encode(string), self.prefix_token_id, self.max_length):
                windows.append((ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._score(windows, greedy=False, disable_tqdm=disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """(context, continuation) within max_length + 1 tokens: the context truncated from the left."""
        if len(cont) > self.max_length:
            raise ValueError(f"a continuation of {len(cont)} tokens does not fit max_length={self.max_length} "
                             f"(max_model_len={self.engine.max_model_len}): raise max_model_len")
        whole = left_truncate(ctx + cont, self.max_length + 1, "context + continuation")
        return whole[:len(whole) - len(cont)], cont

    def _score(self, pairs: list[tuple[list[int], list[int]]], greedy: bool,
               disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, greedy?) per pair, through batched LLM.score calls."""
        out: list[tuple[float, bool]] = []
        with tqdm(total=len(pairs), disable=disable_tqdm, desc="kvlab loglikelihood") as bar:
            for batch in self._batches(pairs, greedy):
                scores = self.llm.score([c for c, _ in batch], [t for _, t in batch], return_dists=greedy)
                for (_, cont), s in zip(batch, scores):
                    out.append((float(sum(s.logprobs)), is_greedy(s.dists, cont) if greedy else False))
                    s.dists = None  # one request's [len(cont), vocab] rows: dropped once compared
                bar.update(len(batch))
        return out

    def _batches(self, pairs: list, greedy: bool):
        """Runs of at most batch_size pairs; with greedy, also at most dists_memory bytes of distributions."""
        row_bytes = 4 * self.engine.model_config.vocab_size
        batch, held = [], 0
        for pair in pairs:
            need = row_bytes * len(pair[1]) if greedy else 0
            if batch and (len(batch) == self.batch_size or held + need > self.dists_memory):
                yield batch
                batch, held = [], 0
            batch.append(pair)
            held += need
        if batch:
            yield batch

    def _check_can_score(self) -> None:
        """A policy that acts only while decoding cannot change a teacher-forced score: refuse, clearly."""
        from kvlab.policies.sparse_read import SparseReadPolicy

        policy = self.engine.policy
        if isinstance(policy, SparseReadPolicy):
            name = self.llm.config.policy
            raise ValueError(f"policy {name!r} reads a subset of pages only while decoding; loglikelihood and "
                             f"loglikelihood_rolling requests never decode (the continuation is teacher-forced), "
                             f"so they would score the full cache. Use generate_until tasks with {name!r}, or a "
                             f"compressing policy (snapkv, pyramidkv, streaming_llm, ...) for likelihood tasks")

    # -- generation ---------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their gen_kwargs, each group through LLM.generate in runs of batch_size."""
        from kvlab import SamplingParams

        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        results: list[str] = [""] * len(requests)
        eos_text = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="kvlab generate_until") as bar:
            for members in groups.values():
                gen = parse_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks, eos_text)
                params = SamplingParams(max_tokens=gen.max_gen_toks, stop_token_ids=self._stop_ids(),
                                        **self._engine_stops(gen.until), **gen.sampling)
                room = self.max_length - gen.max_gen_toks
                if room < 1:
                    raise ValueError(f"max_gen_toks={gen.max_gen_toks} leaves no room for a prompt in "
                                     f"max_length={self.max_length}: raise max_model_len or lower max_gen_toks")
                for start in range(0, len(members), self.batch_size):
                    run = members[start:start + self.batch_size]
                    prompts = [left_truncate(self.tok_encode(requests[i].args[0]), room, "prompt") for i in run]
                    for i, output in zip(run, self.llm.generate(prompts, params)):
                        results[i] = cut_at_stop(self.tok_decode(generated_ids(output)), gen.until)
                        self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
                    bar.update(len(run))
        return results

    def _engine_stops(self, until: list[str]) -> dict:
        """`stop=` for SamplingParams when the engine matches stop strings (it then stops early; the text is
        still cut by cut_at_stop, on this decoding, as hf does); {} for a model without a tokenizer or an
        engine without stop strings (it generates up to max_gen_toks and the text is cut alone)."""
        from dataclasses import fields

        from kvlab import SamplingParams

        if self.llm.tokenizer is None or "stop" not in {f.name for f in fields(SamplingParams)}:
            return {}
        return {"stop": tuple(s for s in until if s)}

    def _stop_ids(self) -> tuple[int, ...]:
        """The model's generation-config EOS ids (Gemma 3 ends a turn with <end_of_turn>), as hf's generate stops."""
        config = getattr(self.engine.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        ids = eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
        return tuple(int(i) for i in ids)

    def _starts_with_bos(self, string: str) -> bool:
        bos = getattr(self.tokenizer, "bos_token", None)
        return bool(bos) and string.startswith(bos)


def rolling_windows(tokens: list[int], prefix_token: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's disjoint rolling windows of a document (as its hf backend: context_len=1)."""
    return [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
        token_list=tokens, prefix_token=prefix_token, max_seq_len=max_length, context_len=1)]


def is_greedy(dists: torch.Tensor, cont: list[int]) -> bool:
    """Is every continuation token the argmax of its next-token distribution? dists: [len(cont), vocab]."""
    return bool((dists.argmax(dim=-1) == torch.tensor(cont, device=dists.device)).all())


def generated_ids(output) -> list[int]:
    """A generation's token ids (RequestOutput.token_ids; `.outputs[0]` when outputs are per sample)."""
    outputs = getattr(output, "outputs", None)
    return list(outputs[0].token_ids if outputs else output.token_ids)


def _byte_tokenizer(llm):
    from kvlab.study.tasks.data import ByteTokenizer

    return ByteTokenizer(getattr(llm.model_config, "vocab_size", 256))
