"""What memory traffic predicts a draft's speed-up to be. Torch-free.

Based on the roofline argument of MagicDec (Chen et al. 2024, arXiv:2408.11049) and TriForce (Sun et al. 2024,
arXiv:2404.11912): a decode pass is bound by the bytes it reads -- the weights once, and every sequence's KV
for every layer it runs -- so a pass over `batch` sequences of `context` tokens costs

    T(B, c) = W + B * sum_l min(c, window_l, view) * kv_l                (bytes)

Plain decoding emits one token per sequence per pass. A speculative step runs `k` draft passes D(B, c) and one
verification T(B, c + k) (the tentative tokens are read too) and emits E tokens per sequence (accepted drafts +
the corrected or bonus token; for i.i.d. acceptance a, E = (1 - a^(k+1)) / (1 - a)). Its speed-up is

    S = E * T(B, c) / (k * D(B, c) + T(B, c + k))

Weights dominate at small batch and short context: a draft is worth it only if it reads far fewer weight bytes
(a small model) or none (n-gram lookup). Once B * c * kv exceeds W, a draft reading a small view of the KV (the
target itself through StreamingLLM's pages: `self_compressed`) costs little next to the target's pass even with
all its weights. This ignores compute, Python overhead and caches, which on a CPU can dominate: the benchmark
tables put it beside a measured speed-up rather than instead of one.

`PassTimes` / `timed_speedup` add the compute side, in seconds: a plain pass's measured parts (linear layers,
attention, the per-pass and per-step overheads), a verification pass's linear and attention costs over a decode
pass's (B (k + 1) rows; k + 1 queries a sequence, which the CPU kernel scores one by one), and a copied view's
refresh time, so a prediction can explain a measured speed-up the bytes alone do not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traffic:
    """Bytes a model's decode pass reads: per decoder layer its weights and one token's K and V; the rest
    (the final norm and the LM head, read whole every pass)."""

    layer_weight_bytes: tuple[float, ...]  # per decoder layer
    other_weight_bytes: float  # the head (the embedding matrix when tied) and the final norm
    kv_bytes_per_token: tuple[float, ...]  # per decoder layer: K and V of one token, scales included
    windows: tuple[int | None, ...] = ()  # per decoder layer: its sliding window (None or absent: full attention)

    @property
    def num_layers(self) -> int:
        return len(self.layer_weight_bytes)

    def weight_bytes(self, layers: int | None = None) -> float:
        """Weights one pass through the first `layers` decoder layers (None: all) and the head reads."""
        return sum(self.layer_weight_bytes[:layers]) + self.other_weight_bytes

    def kv_bytes(self, context: float, layers: int | None = None, view: float | None = None) -> float:
        """KV one sequence of `context` cached tokens reads in one pass through the first `layers` layers,
        each layer reading at most `view` tokens (None: all) and at most its window."""
        total = 0.0
        for i, per_token in enumerate(self.kv_bytes_per_token[:layers]):
            window = self.windows[i] if i < len(self.windows) else None
            total += min([context] + [x for x in (window, view) if x is not None]) * per_token
        return total

    def pass_bytes(self, batch: int, context: float, layers: int | None = None, view: float | None = None) -> float:
        """T(B, c): bytes one packed decode pass over `batch` sequences of `context` tokens reads."""
        return self.weight_bytes(layers) + batch * self.kv_bytes(context, layers, view)


def expected_accepted_length(acceptance: float, k: int) -> float:
    """E: tokens a verification of k drafts emits when each is accepted independently with probability a."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def step_speedup(plain_pass: float, verify_pass: float, draft_pass: float, drafted: float, emitted: float) -> float:
    """S = E * T / (k * D + T_verify): one speculative step against the plain passes emitting the same tokens."""
    return emitted * plain_pass / (drafted * draft_pass + verify_pass)


def run_speedup(plain_pass: float, verify_pass: float, draft_pass: float, drafted: float, emitted: float,
                verified_share: float = 1.0) -> float:
    """The speed-up of a whole decode where a share `verified_share` of the emitted tokens came from speculative
    steps (drafted / emitted per such step) and the rest from plain steps (an n-gram draft with no match
    drafts nothing): plain time over spec time, per emitted token."""
    if not 0.0 <= verified_share <= 1.0:
        raise ValueError(f"verified_share must be in [0, 1], got {verified_share}")
    spec_per_token = verified_share * (drafted * draft_pass + verify_pass) / emitted + (1 - verified_share) * plain_pass
    return plain_pass / spec_per_token


def predict(target: Traffic, batch: int, context: float, k: int, acceptance: float, draft_pass: float) -> float:
    """The speed-up a draft costing `draft_pass` bytes a pass (at this batch and context) gives at i.i.d.
    acceptance a with k drafts a step."""
    return step_speedup(target.pass_bytes(batch, context), target.pass_bytes(batch, context + k), draft_pass, k,
                        expected_accepted_length(acceptance, k))


@dataclass(frozen=True)
class PassTimes:
    """The compute side the byte count omits: what one plain decode pass at (B, c) spends, by part, measured on
    this machine (kvlab/speculation/pass_costs.py), and what a verification pass costs over it. A draft or a
    verification pass is then priced part by part:

        plain    linear + attention + pass overhead + step overhead
        draft    linear x (its weight bytes / the target's) + attention x (its KV bytes / the target's)
                 + pass overhead                              (a draft pass is a forward, not an engine step)
        verify   linear x verify_linear + attention x verify_attention x (KV bytes at c + k / at c)
                 + pass overhead + step overhead

    verify_linear: linear layers at B (k + 1) rows over B rows (the weights are read once either way, the
    multiply-adds grow); verify_attention: a (k + 1)-query chunk's attention over one query's at the same context
    (the CPU kernel computes each query's scores, whatever the bytes): both measured at start-up."""

    linear_s: float  # linear layers and the head, one plain pass (B rows)
    attention_s: float  # attention, one plain pass (one query a sequence over c tokens)
    pass_overhead_s: float  # the rest of a forward (norms, RoPE, the plan, Python between the ops): every pass
    step_overhead_s: float  # the rest of an engine step (schedule, sampling, bookkeeping): once a step
    verify_linear: float = 1.0
    verify_attention: float = 1.0

    def plain(self) -> float:
        return self.linear_s + self.attention_s + self.pass_overhead_s + self.step_overhead_s

    def draft(self, weight_share: float, kv_share: float) -> float:
        """One draft pass reading `weight_share` of the target's weight bytes and `kv_share` of its KV bytes."""
        return self.linear_s * weight_share + self.attention_s * kv_share + self.pass_overhead_s

    def verify(self, kv_share: float = 1.0) -> float:
        """One verification pass (`kv_share`: its KV bytes over a plain pass's, the k tentative tokens')."""
        return (self.linear_s * self.verify_linear + self.attention_s * self.verify_attention * kv_share
                + self.pass_overhead_s + self.step_overhead_s)


def timed_speedup(times: PassTimes, draft_weight_share: float, draft_kv_share: float, verify_kv_share: float,
                  drafted: float, emitted: float, verified_share: float = 1.0, round_extra_s: float = 0.0) -> float:
    """run_speedup in seconds instead of bytes: a speculative round is `drafted` draft passes, one verification
    and `round_extra_s` (a copied view's refresh, measured by the draft), emitting `emitted` tokens a sequence."""
    if not 0.0 <= verified_share <= 1.0:
        raise ValueError(f"verified_share must be in [0, 1], got {verified_share}")
    spec_round = drafted * times.draft(draft_weight_share, draft_kv_share) + times.verify(verify_kv_share)
    spec_per_token = verified_share * (spec_round + round_extra_s) / emitted + (1 - verified_share) * times.plain()
    return times.plain() / spec_per_token
