"""The same-run anchor for the integer cache formats: Hugging Face's quantised cache against kvlab's.

Hugging Face's `QuantizedCache` (quanto backend, `optimum-quanto`; KIVI-style, int4 and int2) and kvlab's
`int4` / `int2` (KIVI: keys per channel, values per token, group 32, residual 32 tokens in full precision)
run on the same prompts through the same task code (kvlab.study.tasks.perplexity and kvlab.study.tasks.agreement:
Hugging Face is wrapped in a small adapter giving it `generate` and `score`), each system against its own
fp32 cache:
  - WikiText-2 perplexity: --num-windows windows, --context tokens prefilled, --continuation scored
    teacher-forced (one forward pass over the continuation, which reads the quantised context);
  - agreement with fp32: greedy match over --max-new-tokens tokens, and teacher-forced top-1 match and
    KL(fp32 || quantised) of the next-token distributions on fp32's continuation;
  - KV bytes held by one sequence of --prompt-length + --max-new-tokens tokens, per token per layer (K and
    V, scales and zero points included): Hugging Face's counted from the tensors its cache holds (quanto's
    packed data, scales and shifts, and the full-precision residual); kvlab's from its pool pages and its
    residual slot.

Hugging Face's cache runs with q_group_size 32 and residual_length 32 (kvlab's KIVI defaults; its own defaults
are 64 and 128) and its default axes (axis 0 for keys and values). Differences by design: after a prefill
Hugging Face quantises the whole prompt (its residual starts empty) and re-quantises everything, from the
dequantised values, whenever the residual fills; kvlab quantises each group once, when it fills, and keeps the
prompt's last partial group in full precision.

    python experiments/bench_quant_anchor.py --model smollm2-135m
    python experiments/bench_quant_anchor.py --model gemma3-270m --out experiments/results/quant_anchor_gemma3
    python experiments/bench_quant_anchor.py --model random:llama-tiny --num-windows 1 --num-prompts 1 --out /tmp/a
    python experiments/bench_quant_anchor.py --bytes-only --out experiments/results/quant_anchor_smollm2_bytes
"""

from __future__ import annotations

import argparse
import copy
import os
import time

from kvlab.study.bench_io import REPO, log, metadata, provenance, save, table
from kvlab.study.quality_args import add_quality_args, quality_sizes

COLUMNS = [("system", "system"), ("format", "format"), ("bytes_per_token", "KV B/token/layer held"),
           ("vs_fp32", "vs fp32"), ("ppl", "perplexity"), ("greedy_match", "greedy match"),
           ("top1_match", "top-1 match"), ("kl", "KL (nats)"), ("kl_max", "KL max"), ("seconds", "s")]


refused: list[str] = []  # formats a system refused on this model, with its error


def tensor_bytes(t) -> int:
    """Bytes of a tensor, looking inside tensor subclasses (quanto's packed tensors, scales, shifts)."""
    import torch

    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def cache_bytes(cache) -> int:
    """Bytes a transformers cache holds: every tensor attribute of every layer."""
    total = 0
    for layer in cache.layers:
        for value in vars(layer).values():
            total += tensor_bytes(value)
    return total


class HFCache:
    """Hugging Face model + one cache kind, with the `generate` / `score` kvlab's tasks call (batch 1 each)."""

    def __init__(self, loaded, nbits: int | None, group_size: int, residual: int):
        self.model = loaded.model.eval()
        self.tokenizer = loaded.tokenizer
        self.model_config = self.model.config
        self.nbits, self.group_size, self.residual = nbits, group_size, residual
        self.last_cache = None

    def new_cache(self):
        from transformers import DynamicCache, QuantizedCache

        if self.nbits is None:
            return DynamicCache(config=self.model.config)
        return QuantizedCache(backend="quanto", config=self.model.config, nbits=self.nbits,
                              q_group_size=self.group_size, residual_length=self.residual)

    def _forward(self, ids: list[int], cache):
        import torch

        return self.model(torch.tensor([ids]), cache=cache, use_cache=True).logits[0].float()

    def generate(self, prompts, params):
        import torch

        from kvlab.outputs import CompletionOutput, RequestOutput

        outs = []
        with torch.inference_mode():
            for i, prompt in enumerate(prompts):
                cache = self.new_cache()
                logits, new = self._forward(prompt, cache), []
                for _ in range(params.max_tokens):
                    new.append(int(logits[-1].argmax()))
                    logits = self._forward(new[-1:], cache)
                outs.append(RequestOutput(i, list(prompt), [CompletionOutput(0, None, new, "length")]))
        return outs

    def score(self, prompts, continuations, return_dists: bool = False):
        import torch

        from kvlab.outputs import ScoreOutput

        outs = []
        with torch.inference_mode():
            for i, (context, cont) in enumerate(zip(prompts, continuations)):
                cache = self.new_cache()
                first = self._forward(list(context), cache)[-1:]
                rest = self._forward(list(cont[:-1]), cache) if len(cont) > 1 else first[:0]
                logp = torch.cat([first, rest]).log_softmax(-1)  # [T, V]
                target = torch.tensor(list(cont))
                outs.append(ScoreOutput(i, logp.gather(1, target[:, None])[:, 0].tolist(),
                                        logp if return_dists else None))
                self.last_cache = cache
        return outs

    def held_bytes(self, prompt: list[int], num_new: int) -> int:
        """Bytes the cache holds after `prompt` and `num_new` more tokens fed one at a time."""
        import torch

        with torch.inference_mode():
            cache = self.new_cache()
            self._forward(prompt, cache)
            for t in prompt[:num_new]:
                self._forward([t], cache)
        return cache_bytes(cache)


def kvlab_held_bytes(llm, prompt: list[int], num_new: int) -> int:
    """Bytes one sequence holds in kvlab after `prompt` and `num_new` generated tokens: its pages at their
    peak (every layer, scales included) and its share of the full-precision residual area."""
    from kvlab import SamplingParams

    llm.reset_stats()
    llm.generate([prompt], SamplingParams(max_tokens=num_new, ignore_eos=True))
    return int(llm.stats()["kv_bytes_peak"] + llm.engine.cache.residual_nbytes() / llm.engine.config.max_num_seqs)


def run(args) -> list[dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvlab import LLM
    from kvlab.models import load_model
    from kvlab.study.tasks.agreement import Agreement
    from kvlab.study.tasks.base import RunContext
    from kvlab.study.tasks.data import corpus_tokens, default_data_dir, evenly_spaced_windows, get_tokenizer
    from kvlab.study.tasks.perplexity import Perplexity

    loaded = load_model(args.model)
    num_layers = loaded.model.config.num_hidden_layers
    held_len = args.prompt_length + args.max_new_tokens
    ppl = Perplexity(context_lengths=[args.context], continuation_length=args.continuation,
                     num_windows=args.num_windows, batch_size=args.num_windows)
    agree = Agreement(num_prompts=args.num_prompts, prompt_length=args.prompt_length,
                      max_new_tokens=args.max_new_tokens)
    engine = dict(block_size=args.group_size, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs)
    rows = []
    refused.clear()
    for system in args.systems:
        reference: list = []
        if system == "hf":
            def make(fmt):
                return HFCache(loaded, {"fp32": None, "int4": 4, "int2": 2}[fmt], args.group_size, args.residual)
        else:
            def make(fmt):
                qargs = {} if fmt == "fp32" else {"group_size": args.group_size, "residual": args.residual}
                return LLM(args.model, loaded=copy.deepcopy(loaded), quant=fmt, quant_args=qargs, **engine)

        def build_reference(make=make):
            if not reference:
                reference.append(make("fp32"))
            return reference[0]

        ctx = RunContext(data_dir=default_data_dir(), reference=build_reference)
        done = []
        for fmt in args.formats:
            log(f"{system} {fmt}")
            t0 = time.perf_counter()
            lm = build_reference() if fmt == "fp32" else make(fmt)
            try:
                p = {} if args.bytes_only else ppl.run(lm, ctx).metrics
            except ValueError as e:  # transformers refuses QuantizedCache on a model with sliding-window layers
                if system != "hf":
                    raise
                refused.append(f"Hugging Face QuantizedCache {fmt} on {args.model}: {e}")
                continue
            a = {} if args.bytes_only else agree.run(lm, ctx).metrics
            prompt = evenly_spaced_windows(corpus_tokens(agree.source, ctx.data_dir, get_tokenizer(lm)),
                                           args.prompt_length, 1)[0]
            held = (lm.held_bytes(prompt, args.max_new_tokens) if system == "hf"
                    else kvlab_held_bytes(lm, prompt, args.max_new_tokens))
            done.append({"system": "Hugging Face QuantizedCache (quanto)" if system == "hf" else "kvlab",
                         "format": fmt if system == "kvlab" or fmt != "fp32" else "fp32 (DynamicCache)",
                         "bytes_per_token": held / held_len / num_layers, "ppl": p.get("perplexity/ppl"),
                         "greedy_match": a.get("agreement/greedy_match"), "top1_match": a.get("agreement/top1_match"),
                         "kl": a.get("agreement/kl"), "kl_max": a.get("agreement/kl_max"),
                         "seconds": time.perf_counter() - t0})
        for r in done:
            r["vs_fp32"] = r["bytes_per_token"] / done[0]["bytes_per_token"]
        rows += done
    return rows


def report(rows: list[dict], meta: dict, args) -> str:
    return "\n".join([
        f"# Integer KV-cache formats: Hugging Face's quantised cache against kvlab's ({args.model})",
        "",
        *provenance(meta, "other jobs were running on the machine; seconds are indicative only"),
        quality_sizes(args, "each system against its own fp32 cache (kvlab.study.tasks.agreement definitions)") +
        f"Both systems: group size {args.group_size}, residual {args.residual} tokens in full precision. "
        f"KV bytes: one sequence of {args.prompt_length + args.max_new_tokens} tokens, per token per layer, K and V, "
        "scales and zero points included.",
        "",
        table(rows, COLUMNS),
        "",
        *(["Refused (no row):", "", *[f"- {r}" for r in refused], ""] if refused else []),
    ])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--systems", nargs="+", default=["hf", "kvlab"], choices=["hf", "kvlab"])
    p.add_argument("--formats", nargs="+", default=["fp32", "int4", "int2"], choices=["fp32", "int4", "int2"])
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--residual", type=int, default=32)
    add_quality_args(p, context=512, num_windows=4, prompt_length=512)
    p.add_argument("--kv-cache-memory", default="128MiB")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bytes-only", action="store_true",
                   help="only the KV bytes one sequence holds (no perplexity or agreement: minutes, not an hour)")
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "quant_anchor_smollm2"))
    args = p.parse_args(argv)
    if args.formats[0] != "fp32":
        p.error("--formats must start with fp32 (the reference each system is measured against)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    meta = metadata(args)
    rows = run(args)
    text = report(rows, meta, args)
    save(args.out, text, meta, rows)


if __name__ == "__main__":
    main()
