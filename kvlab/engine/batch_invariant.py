"""The batch-invariant mode (`EngineConfig.batch_invariant`): every row of a forward pass computes alike.

With it on, a token's hidden states, keys, values and logits are the same to the bit whether its pass
computes 1 row or 500, and wherever in the pass the row sits: so a format that rounds K/V (int4 codes, fp8,
bf16 storage) stores the same values whatever the batching, prefill chunking, preemption or the rows a
draft adds, and a draft (or a changed `max_num_batched_tokens`) cannot change the output. vLLM and
Thinking Machines call it batch invariance ("Defeating Nondeterminism in LLM Inference", 2025).

What varies with a pass's shape on the CPU path, and what this mode does about it:
- linear layers: a BLAS matrix product picks its kernel (and so its summation order) by the number of rows,
  and a 1-row product (a matrix-vector kernel) differs from a 16-row one in the last bits. Here every
  `torch.nn.functional.linear` inside the forward runs in fixed tiles of `TILE` rows (the last zero-padded),
  so a row always meets the same kernel; which rows share its tile does not change its result (tested in
  tests/engine/test_batch_invariant.py on this machine's BLAS). With `linear_backend='cpu'` the linear layers run
  kvlab's CPU kernel for every pass instead (batch-invariant by construction, kvlab/engine/linear_backend.py),
  which calls no F.linear and needs no tiles;
- attention: each query row alone over its own visible keys (kvlab.kernels.reference.row_attention), with a
  quantised format's residual window read in token time;
- norms, activations, RoPE and residual adds are row-wise already (a norm's reduction runs over one row).

The cost is speed: a 1-row pass pays a 16-row product (about 5x the matrix-vector time of one linear
here) and attention runs a call per query row; experiments/bench_batch_invariant.py measures it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

TILE = 16  # rows per matrix product


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with every product over exactly TILE rows (x [..., K] -> [..., N])."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    pad = (-n) % TILE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.cat([F.linear(tile, weight, bias) for tile in rows.split(TILE)])
    return out[:n].reshape(*x.shape[:-1], weight.shape[0])


class BatchInvariantMode(TorchFunctionMode):
    """Inside it, `F.linear` runs as `tiled_linear` (nn.Linear calls it): `with BatchInvariantMode(): model(...)`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return tiled_linear(*args, **kwargs)
        return func(*args, **kwargs)
