"""Which kernel computes the linear layers (`EngineConfig.linear_backend`): torch's, or kvlab's CPU kernel.

A decode step at small batch reads every weight once and does little else with it; on this machine torch's
fp32 matrix-vector product (MKL) streams about a third of what memory delivers. With `cpu`, a pass of at
most MAX_ROWS rows (a decode step, a verification pass of batch x (k + 1) rows, a short prefill chunk) runs
kvlab.kernels.cpu.linear instead: the weight
packed once into 64-row k-major blocks (one stream each, prefetched ahead), each weight vector met once
by every row of the batch (in tiles of 6 rows, each tile summing in the same order), bf16 multiplied pairwise
with VDPBF16PS. Larger passes (long prefill chunks) stay on torch.
The packed copy is held beside the original weight (prefill, the tied embedding and anything that reads
the module's weight keep the original): the backend costs one more copy of the linear weights in memory.
With `torch` (the default) the model's modules are untouched. `auto` is `cpu` for a model on the CPU and `torch`
elsewhere; where the kernel cannot run (no compiler or AVX-512: one warning; other dtypes) the layers stay on torch
either way.

Both layouts of kvlab/engine/linear_layout.py take it: a plain `nn.Linear` is replaced by a `SmallBatchLinear`
holding the same weight, a fused product (`FusedProduct`) gets the kernel as its matrix product.
`apply_linear(model, layout, backend)` sets both, in that order, and can be called again to change either.

Exactness: the kernel sums each output element in one order fixed by K alone, so a row's result does not
depend on how many rows share the pass (batch-invariant by construction); it differs from F.linear's in the
last bits (another summation order). Under the batch-invariant mode (kvlab/engine/batch_invariant.py) the
kernel therefore runs for every pass, prefill included (`max_rows=None`): a row's projection is then the
same whether it is decoded alone or prefilled among 500 rows, without the mode's 16-row tiles.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.engine.linear_layout import FusedPart, LinearLayout, apply_linear_layout, rewired
from kvlab.kernels.cpu import linear as cpu_linear

LinearBackend = Literal["auto", "torch", "cpu"]
MAX_ROWS = 256  # passes of at most this many rows run the kernel (decode, verification); larger ones torch (prefill)
# 256 = batch 32 x (k + 1 = 8). On SmolLM2's fp32 shapes (1 thread, load ~6) the kernel took 0.37-0.5 of
# F.linear's time at 32-256 rows (experiments/results/linear_verification_rows_smollm2.md); longer prefill chunks
# stay on torch so as not to move prefill's rounding further than verification needs.


class SmallBatchProduct:
    """F.linear's signature over one weight, packed once (kvlab.kernels.cpu.linear.pack: a copy in the
    kernel's layout, held beside the original, which prefill and the embedding keep reading): the kernel
    for passes of <= max_rows rows (None: every pass), F.linear above."""

    def __init__(self, weight: torch.Tensor, max_rows: int | None):
        self.packed, self.max_rows = cpu_linear.pack(weight), max_rows

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.max_rows is not None and x.numel() > self.max_rows * x.shape[-1]:
            return F.linear(x, weight, bias)
        return cpu_linear.linear(x, weight, bias, self.packed)  # x [..., K] -> [..., N]


def takes(weight: torch.Tensor) -> bool:
    """Whether the kernel reads this weight (a CPU float32 / bfloat16 matrix; other layers stay on torch)."""
    return weight.device.type == "cpu" and weight.dtype in cpu_linear.KINDS and weight.dim() == 2


class SmallBatchLinear(nn.Module):
    """Stands where an `nn.Linear` stood; the same weight and bias parameters (the same state_dict keys)."""

    def __init__(self, original: nn.Linear, matmul: SmallBatchProduct):
        super().__init__()
        self._original = (original,)  # not a submodule: its parameters are this module's
        self.matmul = matmul
        self.in_features, self.out_features = original.in_features, original.out_features
        self.weight, self.bias = original.weight, original.bias

    @property
    def original(self) -> nn.Linear:
        return self._original[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        return self.matmul(x, self.weight, self.bias)


def apply_linear_backend(model: nn.Module, backend: LinearBackend, max_rows: int | None = MAX_ROWS) -> int:
    """Route `model`'s linear layers through `backend` (in place; `torch` undoes `cpu`); returns how many
    products run on the kernel now. Apply the layout first (apply_linear: a wrapped layer is not fused)."""
    if backend not in ("auto", "torch", "cpu"):
        raise ValueError(f"linear_backend {backend!r}: choose 'auto', 'torch' or 'cpu'")
    backend = resolve(model, backend)
    rewired(model)
    restore(model)
    if backend == "torch":
        return 0
    if not cpu_linear.available():
        return 0  # the library did not build (one warning said why): torch it is
    count = 0
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if type(child) is nn.Linear and takes(child.weight):
                setattr(owner, name, SmallBatchLinear(child, SmallBatchProduct(child.weight, max_rows)))
                count += 1
            elif isinstance(child, FusedPart) and child.product.matmul is F.linear and takes(child.product.weight):
                child.product.matmul = SmallBatchProduct(child.product.weight, max_rows)
                count += 1
    return count


def resolve(model: nn.Module, backend: LinearBackend) -> Literal["torch", "cpu"]:
    """`auto`: `cpu` when the model's parameters are on the CPU, else `torch`; the others as they are."""
    if backend != "auto":
        return backend
    return "cpu" if all(p.device.type == "cpu" for p in model.parameters()) else "torch"


def restore(model: nn.Module) -> None:
    """The original nn.Linear modules back in place, fused products on F.linear."""
    for owner in list(model.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, SmallBatchLinear):
                setattr(owner, name, child.original)
            elif isinstance(child, FusedPart):
                child.product.matmul = F.linear


def apply_linear(model: nn.Module, layout: LinearLayout, backend: LinearBackend, max_rows: int | None = MAX_ROWS):
    """The weight layout, then the backend over it (either can change on a later call)."""
    apply_linear_backend(model, "torch")
    apply_linear_layout(model, layout)
    return apply_linear_backend(model, backend, max_rows)


def backend_of(model: nn.Module) -> LinearBackend:
    for m in model.modules():
        if isinstance(m, SmallBatchLinear) or (isinstance(m, FusedPart) and m.product.matmul is not F.linear):
            return "cpu"
    return "torch"
