"""One timed run of a system over a list of requests: Hugging Face `generate` in static batches, transformers'
continuous batching (`generate_batch`'s machinery), kvlab's `LLM.generate`; what each computed and how long it took.

    run = kvlab_generate(llm, requests)     # requests: kvlab.study.workloads.replay.Request (prompt ids, max_tokens)
    run.tokens_per_s, run.wall_s, run.cpu_s, run.extra
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Run:
    """What one system did on one list of requests."""

    useful_tokens: int  # tokens the requests asked for
    generated_tokens: int  # tokens the system computed (static batches pad to the batch's longest)
    wall_s: float  # timed region
    cpu_s: float = float("nan")  # CPU seconds of this process (all threads) in the timed region
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s


def hf_generate(model, requests, batch_size: int, pad_token_id: int) -> Run:
    """Static batches of `batch_size` consecutive requests, left-padded, each run to the batch's longest request."""
    import torch

    useful = generated = padded_prompt = 0
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        new = max(r.max_tokens for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # [b, width], left-padded
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[row, width - n:] = torch.tensor(r.prompt_token_ids)
            mask[row, width - n:] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad_token_id)
        if out.shape[1] - width != new:
            raise RuntimeError(f"generate returned {out.shape[1] - width} new tokens, asked for {new}")
        useful += sum(r.max_tokens for r in batch)
        generated += len(batch) * new
        padded_prompt += ids.numel()
    return Run(useful, generated, time.perf_counter() - start, time.process_time() - cpu,
               {"padded_prompt_tokens": padded_prompt})


def hf_cb_config(kv_bytes: int, max_batch_tokens: int, model_config):
    """generate_batch's config at kvlab's KV byte budget and batch-token limit.

    Left to itself on CPU, transformers sizes the paged cache from free host RAM (60% of it: several GB
    here) and batches up to 8192 tokens, which made the first token wait ~30 s here; matching kvlab's
    budget is the fair comparison and the faster setting for transformers too (--hf-cb-auto restores
    transformers' own sizing).
    """
    from transformers import ContinuousBatchingConfig

    page = ContinuousBatchingConfig().page_size
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    per_page = page * model_config.num_hidden_layers * 2 * model_config.num_key_value_heads * head_dim * 4  # fp32
    return ContinuousBatchingConfig(num_blocks=max(1, kv_bytes // per_page), max_batch_tokens=max_batch_tokens)


def hf_generate_batch(model, requests, cb_config, force_min: bool = False) -> Run:
    """transformers' continuous batching; eos_token_id=-1 so every request runs to its own max_new_tokens.

    The timed region is the whole context manager (cache allocation, generation thread, teardown), as a
    `generate_batch` call would be; `extra["generation_s"]` is first request in to last result out.
    """
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    longest = max(r.max_tokens for r in requests)
    gen = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest if force_min else None, do_sample=False,
                           eos_token_id=-1)
    hints = WorkloadHints(max(len(r.prompt_token_ids) for r in requests), longest, len(requests))
    results = {}
    start, cpu = time.perf_counter(), time.process_time()
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb_config,
                                                   warmup=False, workload_hints=hints, block=True) as manager:
        first_in = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
        while len(results) < len(requests):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError(f"generate_batch's thread stopped with {len(results)}/{len(requests)} done")
        last_out = time.perf_counter()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    failed = [k for k, v in results.items() if v.error is not None]
    if failed:
        raise RuntimeError(f"generate_batch failed requests {failed[:5]}: {results[failed[0]].error}")
    lengths = [len(results[f"r{i}"].generated_tokens) for i in range(len(requests))]
    useful = sum(min(n, r.max_tokens) for n, r in zip(lengths, requests))
    short = sum(n < r.max_tokens for n, r in zip(lengths, requests))
    return Run(useful, sum(lengths), wall, cpu, {"generation_s": last_out - first_in, "short_requests": short,
                                            "setup_s": first_in - start, "teardown_s": wall - (last_out - start)})


def kvlab_generate(llm, requests) -> Run:
    """All requests queued at once through `LLM.generate`, each with its own max_tokens, EOS ignored."""
    from kvlab import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    llm.reset_stats()
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    lengths = [len(o.token_ids) for o in outputs]
    useful = sum(min(n, r.max_tokens) for n, r in zip(lengths, requests))
    return Run(useful, sum(lengths), wall, cpu, llm.stats())
