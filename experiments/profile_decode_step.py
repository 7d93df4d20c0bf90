"""Where a kvlab decode step's time goes (issue 27 item 2), from torch.profiler over --steps decode steps.

Scopes are added from outside (nothing in kvlab is changed): the engine step, the runner's `prepare` (the
step's plan: kvlab.engine.attention.plan_step), the model's forward, its lm_head, kvlab's attention hook (the
`kvlab_paged` function re-registered wrapped) and the sampler. Inside the forward, time is split into

    linear     aten::linear outside the lm_head (q/k/v/o, gate/up/down; fused ones with --layout auto)
    lm_head    the vocabulary projection
    attention  the hook: storing K/V into the pool and reading it through the plan
    small ops  the self time of every other aten op (norms, RoPE, activations, residual adds, embedding)
    module overhead  the rest of the forward: transformers' Python between the ops (modules, hooks, views)

and outside it into the plan (`prepare`), the sampler and the rest of the engine step. The profiler adds
overhead of its own per op (quoted: the unprofiled step time is measured first).

    python experiments/profile_decode_step.py --batches 1 16 --context 512
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvlab.study.bench_io import REPO, bench_main, log, provenance, table

PARTS = ["linear", "lm_head", "attention", "small ops", "module overhead", "plan (prepare)", "sampler", "engine rest"]
SUBPARTS = ["attention: K/V store", "attention: kernel", "attention: rest"]  # of attention


class Scope:
    """record_function(name) opened by a pre-hook and closed by a post-hook (or around a call)."""

    def __init__(self, name: str):
        self.name, self.stack = name, []

    def enter(self, *_):
        import torch

        self.stack.append(torch.autograd.profiler.record_function(self.name))
        self.stack[-1].__enter__()

    def exit(self, *_):
        self.stack.pop().__exit__(None, None, None)

    def wrap(self, fn):
        def wrapped(*args, **kwargs):
            self.enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()
        return wrapped


def instrument(engine) -> list:
    """Scopes around the engine's parts; returns the modules whose forward is wrapped (unwrap them after)."""
    from kvlab.cache.kv_cache import KVCache
    from kvlab.engine import attention, lean_forward
    from kvlab.kernels.cpu import decode_attention, linear

    for name, obj, attr in (("kv::step", engine, "step"), ("kv::prepare", engine.runner, "prepare"),
                            ("kv::sampler", engine, "_sample")):
        setattr(obj, attr, Scope(name).wrap(getattr(obj, attr)))
    handles = []  # not forward hooks: a hooked model runs transformers' forward, never the lean one
    for name, module in (("kv::forward", engine.model), ("kv::lm_head", engine.model.lm_head)):
        module.forward = Scope(name).wrap(module.forward)  # an instance attribute: __call__ and the lean forward
        handles.append(module)
    if engine.runner.lean is not None:
        engine.runner.lean = Scope("kv::forward").wrap(engine.runner.lean)

    if not getattr(attention.paged_attention, "kv_scoped", False):  # both forwards call it, by module attribute
        attention.paged_attention = lean_forward.paged_attention = Scope("kv::attention").wrap(attention.paged_attention)
        attention.paged_attention.kv_scoped = True

    if getattr(KVCache.store, "kv_scoped", False):  # a later cell: the functions are wrapped already
        return handles
    linear.linear = Scope("kv::linear").wrap(linear.linear)  # linear_backend cpu: the kernel's calls
    KVCache.store = Scope("kv::store").wrap(KVCache.store)
    KVCache.store.kv_scoped = True
    if decode_attention._kernel() is not None:
        kernel = Scope("kv::attention kernel").wrap(decode_attention._kernel())
        decode_attention._kernel = lambda: kernel
    return handles


def breakdown(events, steps: int) -> tuple[dict, list[tuple[str, float]]]:
    """ms per step of each part, and the attention hook's heaviest ops by self time."""
    total = {k: 0.0 for k in ("kv::step", "kv::prepare", "kv::forward", "kv::lm_head", "kv::attention", "kv::sampler",
                              "kv::store", "kv::attention kernel")}
    linear = small = 0.0
    in_attention: dict[str, float] = {}
    for e in events:
        labels = ancestors(e)
        if e.name in total:
            total[e.name] += e.cpu_time_total
        elif (e.name in ("aten::linear", "kv::linear") and "kv::lm_head" not in labels
              and not labels & {"aten::linear", "kv::linear"}):
            linear += e.cpu_time_total
        if "kv::attention" in labels and e.name.startswith("aten::"):
            in_attention[e.name] = in_attention.get(e.name, 0.0) + e.self_cpu_time_total
        elif ("kv::forward" in labels and e.name.startswith("aten::")
              and not labels & {"kv::lm_head", "aten::linear", "kv::linear", "kv::attention"}
              and e.name != "aten::linear"):
            small += e.self_cpu_time_total
    ms = {k: v / 1000 / steps for k, v in total.items()}
    parts = {"linear": linear / 1000 / steps, "lm_head": ms["kv::lm_head"], "attention": ms["kv::attention"],
             "small ops": small / 1000 / steps}
    parts["module overhead"] = ms["kv::forward"] - sum(parts.values())
    parts["attention: K/V store"], parts["attention: kernel"] = ms["kv::store"], ms["kv::attention kernel"]
    parts["attention: rest"] = ms["kv::attention"] - ms["kv::store"] - ms["kv::attention kernel"]
    parts["plan (prepare)"], parts["sampler"] = ms["kv::prepare"], ms["kv::sampler"]
    parts["engine rest"] = ms["kv::step"] - ms["kv::forward"] - ms["kv::prepare"] - ms["kv::sampler"]
    top = sorted(((k, v / 1000 / steps) for k, v in in_attention.items()), key=lambda kv: -kv[1])[:8]
    return {"step": ms["kv::step"], **parts}, top


def ancestors(e) -> set[str]:
    out, p = set(), e.cpu_parent
    while p is not None:
        out.add(p.name)
        p = p.cpu_parent
    return out


def profile_cell(args, loaded, batch: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvlab import LLM, SamplingParams

    total = 1 + args.warmup + args.plain_steps + args.steps
    llm = LLM(args.model, loaded=loaded, dtype=args.dtype, quant=args.quant, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=batch, max_num_batched_tokens=batch * args.context, linear_layout=args.layout,
              linear_backend=args.linear_backend)
    engine = llm.engine
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(batch):
        engine.add_request(torch.randint(3, loaded.model.config.vocab_size, (args.context,), generator=g).tolist(),
                           SamplingParams(max_tokens=total, ignore_eos=True))
    for _ in range(1 + args.warmup):  # the prefill, then warm-up decode steps
        engine.step()
    plain = []
    for _ in range(args.plain_steps):
        t0 = time.perf_counter()
        engine.step()
        plain.append(time.perf_counter() - t0)
    handles = instrument(engine)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    for module in handles:
        del module.forward
    parts, top = breakdown(prof.events(), args.steps)
    while engine.has_unfinished():
        engine.step()
    return {"batch": batch, "plain_step_ms": 1000 * statistics.median(plain), **parts, "attention_top": top}


def run(args) -> list[dict]:
    import torch

    from kvlab.models import load_model

    loaded = load_model(args.model, dtype=getattr(torch, args.dtype))
    rows = []
    for b in args.batches:
        log(f"batch {b}")
        rows.append(profile_cell(args, loaded, b))
    return rows


def report(rows: list[dict], meta: dict, args) -> str:
    lines = [f"# Where a decode step's time goes ({args.model}, {args.dtype}, cache {args.quant}, layout "
             f"{args.layout}, linear {args.linear_backend})", "", *provenance(meta, "the machine is shared with other jobs: timings are indicative"),
             f"Context {args.context} random tokens per sequence, {args.threads} torch thread(s); {args.plain_steps} "
             f"unprofiled decode steps (median quoted), then {args.steps} profiled; ms per step, share of the "
             "profiled step in brackets.", ""]
    cols = [("part", "part")] + [(f"b{r['batch']}", f"batch {r['batch']} ms (share)") for r in rows]
    table_rows = [{"part": "step, unprofiled", **{f"b{r['batch']}": f"{r['plain_step_ms']:.1f}" for r in rows}},
                  {"part": "step, profiled", **{f"b{r['batch']}": f"{r['step']:.1f}" for r in rows}}]
    for part in PARTS + SUBPARTS:
        table_rows.append({"part": part, **{f"b{r['batch']}": f"{r[part]:.2f} ({100 * r[part] / r['step']:.0f}%)"
                                            for r in rows}})
    lines += [table(table_rows, cols), ""]
    for r in rows:
        lines.append(f"Inside the attention hook at batch {r['batch']} (self ms per step): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in r["attention_top"]) + "  ")
    return "\n".join(lines + [""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quant", default="auto")
    p.add_argument("--layout", default="none", choices=["none", "auto"], help="engine.linear_layout")
    p.add_argument("--linear-backend", default="torch", choices=["torch", "cpu"], help="engine.linear_backend")
    p.add_argument("--steps", type=int, default=8, help="profiled decode steps")
    p.add_argument("--plain-steps", type=int, default=8, help="unprofiled decode steps timed first")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "decode_profile_smollm2"))
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    return bench_main(parse_args, run, report, argv)


if __name__ == "__main__":
    main()
