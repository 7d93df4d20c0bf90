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
