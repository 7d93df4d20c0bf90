"""Where a decode step's time goes, plain or speculative, from wall-clock timers wrapped around an engine's parts.

Nothing in kvlab is changed: the timers are instance attributes (and two module attributes) set by `instrument`
and taken off by `Timers.remove`. Torch ops on the CPU are synchronous, so a part's wall time is its cost. Parts,
each in ms per decode step (steps that admit waiting requests, prefills, are left out; one step = one speculative round: k draft passes and one verification):

    draft: view            the draft's views (a page view's tables and scratch copy, a copied view's refresh and
                           the tokens since it; `draft: refresh` is the selection share of it)
    draft: plan            the draft passes' attention plans (kvlab.engine.attention.plan_view)
    draft: linear / lm_head / attention   inside the draft passes' forwards
    draft: forward rest    the rest of those forwards (norms, RoPE, Python between the ops)
    draft: sample          probabilities and draws of the drafted tokens, and the rest of the draft loop
    schedule               the scheduler (tentative slots appended through the block manager)
    verify: plan           the runner's `prepare` (the step's plan)
    verify: linear / lm_head / attention / forward rest   the target's pass
    acceptance             speculative rejection sampling (Speculator.verify), the plain sampler
    commit                 Scheduler.advance (rejected slots rolled back) and the step's bookkeeping
    postprocess            appending the emitted tokens
    step rest              the rest of the engine step

    timers = instrument(engine)   # then run the engine; timers.ms_per_step(); timers.remove()
"""

from __future__ import annotations

import time
from collections import defaultdict

PARTS = ["draft: view", "draft: refresh", "draft: plan", "draft: linear", "draft: lm_head", "draft: attention",
         "draft: forward rest", "draft: sample", "schedule", "verify: plan", "verify: linear", "verify: lm_head",
         "verify: attention", "verify: forward rest", "acceptance", "commit", "postprocess", "step rest"]


class Timers:
    """Inclusive wall time per label, and the phase (draft / verify) the inner timers count under."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.phase = "verify"
        self.stack: list[str] = []
        self._undo: list = []

    def wrap(self, label, fn, phased: bool = False, outer: tuple[str, ...] = ()):
        """fn timed under `label` (`phased`: under '<phase>: label'; not counted inside any of `outer`)."""
        def timed(*args, **kwargs):
            name = f"{self.phase}: {label}" if phased else label
            if any(o in self.stack for o in outer):
                return fn(*args, **kwargs)
            self.stack.append(label)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.stack.pop()
        return timed

    def patch(self, obj, attr: str, label: str, wrapper=None, **kw) -> None:
        """obj.attr timed under `label` (then passed through `wrapper`), undone by `remove`."""
        had, old = attr in vars(obj), getattr(obj, attr)
        timed = self.wrap(label, old, **kw)
        setattr(obj, attr, wrapper(timed) if wrapper else timed)
        self._undo.append((obj, attr, old, had))

    def in_phase(self, phase: str, fn):
        def run(*args, **kwargs):
            before, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = before
        return run

    def remove(self) -> None:
        for obj, attr, old, had in reversed(self._undo):
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)
        self._undo.clear()

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

    def ms_per_step(self) -> dict[str, float]:
        """Each part's ms per engine step (PARTS, plus 'step' and 'draft: total')."""
        s, n = self.seconds, max(self.steps, 1)
        ms = {k: 1000 * v / n for k, v in s.items()}
        out = {p: 0.0 for p in PARTS}
        for phase in ("draft", "verify"):
            for key in ("linear", "lm_head", "attention"):
                out[f"{phase}: {key}"] = ms.get(f"{phase}: {key}", 0.0)
        out["draft: view"] = ms.get("draft: view", 0.0) - ms.get("draft: refresh", 0.0)
        out["draft: refresh"] = ms.get("draft: refresh", 0.0)
        out["draft: plan"] = ms.get("draft: plan", 0.0)
        inner = sum(out[f"draft: {k}"] for k in ("linear", "lm_head", "attention"))
        out["draft: forward rest"] = ms.get("draft: forward", 0.0) - out["draft: plan"] - inner
        out["draft: sample"] = ms.get("propose", 0.0) - ms.get("draft: forward", 0.0) - ms.get("draft: view", 0.0)
        out["schedule"] = ms.get("schedule", 0.0)
        out["verify: plan"] = ms.get("verify: plan", 0.0)
        inner = sum(out[f"verify: {k}"] for k in ("linear", "lm_head", "attention"))
        out["verify: forward rest"] = ms.get("run", 0.0) - out["verify: plan"] - inner
        out["acceptance"] = ms.get("acceptance", 0.0) + ms.get("sampler", 0.0)
        out["commit"], out["postprocess"] = ms.get("commit", 0.0), ms.get("postprocess", 0.0)
        named = sum(v for k, v in out.items())
        out["step rest"] = ms.get("step", 0.0) - named
        out["step"] = ms.get("step", 0.0)
        out["draft: total"] = ms.get("propose", 0.0)
        return out


def instrument(engine) -> Timers:
    """Timers around `engine`'s parts (module docstring); every engine step counts one step."""
    from kvlab.engine import attention, lean_forward
    from kvlab.kernels.cpu import linear as cpu_linear

    t = Timers()
    step = t.wrap("step", engine.step)

    def counted(*args, **kwargs):  # a step that admits waiting requests (a prefill) is not counted
        before = dict(t.seconds) if engine.scheduler.waiting else None
        out = step(*args, **kwargs)
        if before is None:
            t.steps += 1
        else:
            t.seconds.clear()
            t.seconds.update(before)
        return out

    t._undo.append((engine, "step", engine.step, "step" in vars(engine)))
    engine.step = counted
    t.patch(engine, "_schedule", "schedule")
    t.patch(engine, "_sample", "sampler")
    t.patch(engine, "_commit", "commit")
    t.patch(engine, "_postprocess", "postprocess")
    t.patch(engine.runner, "run", "run")
    t.patch(engine.runner, "prepare", "plan", phased=True)
    t.patch(engine.model.lm_head, "forward", "lm_head", phased=True)
    t.patch(cpu_linear, "linear", "linear", phased=True, outer=("lm_head",))
    t.patch(attention, "paged_attention", "attention", phased=True)
    t.patch(lean_forward, "paged_attention", "attention", phased=True)
    spec = engine.speculator
    if spec is not None:
        t.patch(spec, "propose", "propose", wrapper=lambda fn: t.in_phase("draft", fn))
        t.patch(spec, "verify", "acceptance")
        draft = spec.draft
        for attr in ("_views", "_copied"):
            if hasattr(draft, attr):
                t.patch(draft, attr, "draft: view")
        if hasattr(draft, "_select"):
            t.patch(draft, "_select", "draft: refresh")
        if hasattr(draft, "_forward"):
            t.patch(draft, "_forward", "draft: forward")
        if hasattr(draft, "_plan_view"):
            t.patch(draft, "_plan_view", "draft: plan")
    return t
