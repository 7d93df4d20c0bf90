"""The weight layout of the model's linear layers (`EngineConfig.linear_layout`): fused projections.

Decoding at small batch is a weight-streaming problem: every step reads every weight once, and a
matrix-vector product over a 576 x 576 matrix (SmolLM2's q projection) spends a noticeable part of its
time starting up, not streaming. With `auto`, the projections that read the same input become one
matrix product over their weights laid end to end (the "fused QKV" / "gate-up" layout of vLLM and
gpt-fast):

    q_proj, k_proj, v_proj       [Nq + Nk + Nv, K]  one product per attention layer
    gate_proj, up_proj           [2 * I, K]         one product per MLP

The fused weight is the storage: the original `nn.Linear` weights become row views of it (row slices of a
contiguous matrix are contiguous), so nothing is held twice and `none` restores the original modules
unchanged. transformers' forward is untouched: `q_proj` (whichever projection comes first) computes the
fused product and the others return their column slice of it for the same input tensor.

Exactness: each output element is the same dot product, but a BLAS may pick another kernel (and so another
summation order) for a wider matrix. On this machine's MKL the fused and separate products agree to the bit
at batch 1 and 16 (tests/engine/test_linear_layout.py checks the engine's greedy tokens and logits against
`none`); elsewhere they agree to rounding. Batch invariance is kept: under `BatchInvariantMode` the fused
product is one `F.linear`, tiled like every other (kvlab/engine/batch_invariant.py).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

LinearLayout = Literal["none", "auto"]
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # modules reading one input
_STATE = "_kvlab_linear_layout"  # model attribute: [(owner module, names, original Linear modules)]
_REWIRED = "_kvlab_linear_rewired"  # model attribute: how many times its linear modules were changed


class FusedProduct:
    """One `F.linear` over several projections' weights end to end; part i is its i-th column block."""

    def __init__(self, linears: list[nn.Linear]):
        self.sizes = [m.out_features for m in linears]
        self.weight = torch.cat([m.weight.detach() for m in linears])  # [sum N, K]
        biases = [m.bias for m in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else self.weight.new_zeros(n) for b, n in zip(biases, self.sizes)])
        self.matmul = F.linear  # F.linear's signature (kvlab/engine/linear_backend.py may put a kernel here)
        self._x: torch.Tensor | None = None  # the input of the product held in _parts
        self._parts: list[torch.Tensor] = []
        self._unread: set[int] = set()

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """x [..., K] -> [..., N_i]: the product is computed once per input and each part handed out once."""
        if x is not self._x or i not in self._unread:
            out = self.matmul(x, self.weight, self.bias)  # [..., sum N]
            self._x, self._parts, self._unread = x, list(out.split(self.sizes, dim=-1)), set(range(len(self.sizes)))
        self._unread.discard(i)
        y = self._parts[i]
        if not self._unread:  # every part read: hold no tensor between steps
            self._x, self._parts = None, []
        return y


class FusedPart(nn.Module):
    """Stands where projection i of a fused group stood."""

    def __init__(self, product: FusedProduct, i: int, original: nn.Linear):
        super().__init__()
        self.product, self.i = product, i
        self.in_features, self.out_features = original.in_features, original.out_features
        self.weight = original.weight  # a row view of the fused weight (read by code that inspects the module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product.part(x, self.i)


def rewired(model: nn.Module) -> None:
    """Count a change of `model`'s linear modules (layout or backend): kvlab/engine/lean_forward.py rebuilds
    what it holds of them when the count moves."""
    model.__dict__[_REWIRED] = model.__dict__.get(_REWIRED, 0) + 1


def rewirings(model: nn.Module) -> int:
    return model.__dict__.get(_REWIRED, 0)


def apply_linear_layout(model: nn.Module, layout: LinearLayout) -> int:
    """Lay `model`'s linear layers out as `layout` (in place; `none` undoes `auto`); returns how many groups
    are fused now."""
    if layout not in ("none", "auto"):
        raise ValueError(f"linear_layout {layout!r}: choose 'none' or 'auto'")
    rewired(model)
    restore(model)
    if layout == "none":
        return 0
    fused = []
    for owner in model.modules():
        for names in FUSED_GROUPS:
            linears = [getattr(owner, n, None) for n in names]
            if fusable(linears):
                fuse(owner, names, linears)
                fused.append((owner, names, linears))
    setattr(model, _STATE, fused)
    return len(fused)


def fusable(linears: list) -> bool:
    """Plain nn.Linear layers over one input size, on one device and dtype."""
    if not all(type(m) is nn.Linear for m in linears):
        return False
    w = [m.weight for m in linears]
    return len({(x.shape[1], x.dtype, x.device) for x in w}) == 1


def fuse(owner: nn.Module, names: tuple[str, ...], linears: list[nn.Linear]) -> None:
    product = FusedProduct(linears)
    start = 0
    for i, (name, m) in enumerate(zip(names, linears)):
        m.weight.data = product.weight[start:start + m.out_features]  # [N_i, K] view, contiguous
        if m.bias is not None:
            m.bias.data = product.bias[start:start + m.out_features]
        start += m.out_features
        setattr(owner, name, FusedPart(product, i, m))


def restore(model: nn.Module) -> None:
    """The original nn.Linear modules back in place (their weights stay views of the fused storage)."""
    for owner, names, linears in getattr(model, _STATE, []):
        for name, m in zip(names, linears):
            setattr(owner, name, m)
    setattr(model, _STATE, [])


def layout_of(model: nn.Module) -> LinearLayout:
    return "auto" if getattr(model, _STATE, []) else "none"
