"""The roofline ceiling on a draft's speed-up: every pass run at this machine's limits. Torch-free.

The byte model (cost_model.py, MagicDec / TriForce's argument) prices a pass by the bytes it reads. That holds
while a pass does little arithmetic per byte. A verification pass multiplies it: B (k + 1) rows meet every
weight, and k + 1 queries a sequence meet every cached key and value. Past the machine's ridge point (its peak
FLOP/s over its streaming bytes/s: Williams, Waterman & Patterson 2009, "Roofline") the pass is bound by
arithmetic, and verifying k tokens costs more than one decode pass. On a GPU the ridge is a few hundred FLOP a
byte and verification is nearly free; on two CPU cores it is a few FLOP a byte (experiments/results/
self_speculation_regime_smollm2.md measures it), so the same draft is worth far less.

Each part of a pass costs the larger of its bytes over the bandwidth and its FLOPs over the FLOP rate:

    linear      max(weight bytes / BW, 2 * params * rows / F_linear)             (one multiply-add a weight a row)
    attention   max(KV bytes / BW, 4 * head_dim * query heads * keys * queries / F_attention)   (QK^T and PV)

(summed over the parts, which run one after another). A speculative round is k draft passes and one
verification of B (k + 1) rows, k + 1 queries a sequence over c + k keys; it emits E tokens a sequence.

    ceiling(E) = E * T_plain / (k * T_draft + T_verify)        (run_speedup: steps that verified nothing too)

This is what an implementation at the roof on both sides would get, not a bound on a real one (a slow plain
path makes any draft look better): set beside a measured speed-up it says how much of the gap is the machine's.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.speculation.cost_model import run_speedup


@dataclass(frozen=True)
class Machine:
    """What one decode pass can use: streaming read bandwidth and the arithmetic rates, measured on random data
    (kvlab/study/machine_ceiling.py)."""

    bandwidth: float  # bytes / s
    linear_flops: float  # FLOP / s of the linear layers at many rows (the model's dtype)
    attention_flops: float  # FLOP / s of attention's arithmetic

    def ridge(self) -> float:
        """FLOP a byte above which the linear layers are bound by arithmetic."""
        return self.linear_flops / self.bandwidth


@dataclass(frozen=True)
class ModelShape:
    """What a decode pass of one model computes and reads, per row and per cached token."""

    weight_bytes: float  # every parameter once (the head included)
    params: float  # parameters the linear layers multiply (~ weight_bytes / element size)
    kv_bytes_per_token: float  # K and V of one token over all layers, in the cache's format
    attention_flops_per_key: float  # one query meeting one cached token, all layers: 4 * head_dim * query heads * L

    def linear_s(self, m: Machine, rows: float, weight_share: float = 1.0) -> float:
        return max(self.weight_bytes * weight_share / m.bandwidth, 2.0 * self.params * weight_share * rows
                   / m.linear_flops)

    def attention_s(self, m: Machine, batch: int, keys: float, queries: float,
                    kv_bytes_per_token: float | None = None, layer_share: float = 1.0) -> float:
        """`batch` sequences, each `queries` queries over `keys` cached tokens, read at `kv_bytes_per_token`
        (None: this cache's format; a draft's int4 copy reads fewer bytes for the same arithmetic)."""
        per_token = self.kv_bytes_per_token if kv_bytes_per_token is None else kv_bytes_per_token
        return max(batch * keys * per_token * layer_share / m.bandwidth,
                   batch * keys * queries * self.attention_flops_per_key * layer_share / m.attention_flops)

    def pass_s(self, m: Machine, batch: int, keys: float, queries: float = 1) -> float:
        """One target pass: `batch` sequences, `queries` rows each, over `keys` cached tokens."""
        return self.linear_s(m, batch * queries) + self.attention_s(m, batch, keys, queries)


@dataclass(frozen=True)
class DraftReads:
    """What one draft pass reads and computes, next to the target's pass (the regime bench fills it per draft)."""

    weight_share: float = 1.0  # of the target's weights and linear arithmetic (an early exit: its layers' share)
    view_tokens: float | None = None  # tokens a sequence the draft attends to (None: the whole context)
    kv_bytes_per_token: float | None = None  # the view's bytes a token (None: the target's format)
    layer_share: float = 1.0  # of the target's layers the draft's attention runs
    free: bool = False  # reads nothing (prompt lookup)

    def pass_s(self, shape: ModelShape, m: Machine, batch: int, context: float) -> float:
        if self.free:
            return 0.0
        keys = context if self.view_tokens is None else min(context, self.view_tokens)
        return (shape.linear_s(m, batch, self.weight_share)
                + shape.attention_s(m, batch, keys, 1, self.kv_bytes_per_token, self.layer_share))


def ceiling_speedup(shape: ModelShape, m: Machine, draft: DraftReads, batch: int, context: float, drafted: float,
                    emitted: float, verified_share: float = 1.0) -> float:
    """The speed-up with every pass at the roof: `drafted` draft passes and one verification a round emitting
    `emitted` tokens a sequence, on a share `verified_share` of the tokens (run_speedup's meaning)."""
    plain = shape.pass_s(m, batch, context)
    verify = shape.linear_s(m, batch * (drafted + 1)) + shape.attention_s(m, batch, context + drafted, drafted + 1)
    return run_speedup(plain, verify, draft.pass_s(shape, m, batch, context), drafted, emitted, verified_share)
