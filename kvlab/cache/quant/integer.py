"""Integer quantisation grids with float16 scales and zero points, rounded so the bound holds.

Symmetric (int8): scale = amax / qmax rounded *up* to float16, codes round(x / scale) in
[-qmax, qmax]; |x - code * scale| <= scale / 2 for every element.
Asymmetric (int4 / int2, KIVI arXiv:2402.02750): zero = min rounded *down* to float16,
scale = (max - zero) / (2**bits - 1) rounded up; codes round((x - zero) / scale) in
[0, 2**bits - 1] need no clamping, and |x - (code * scale + zero)| <= scale / 2.
"""

from __future__ import annotations

import torch

_INF = float("inf")


def fp16_up(x: torch.Tensor) -> torch.Tensor:
    """x float32 -> the smallest float16 >= x."""
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, h.new_tensor(_INF)), h)


def fp16_down(x: torch.Tensor) -> torch.Tensor:
    """x float32 -> the largest float16 <= x."""
    h = x.half()
    return torch.where(h.float() > x, torch.nextafter(h, h.new_tensor(-_INF)), h)


def symmetric(x: torch.Tensor, dim: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 -> (codes int8 like x, scale float16 with `dim` reduced)."""
    scale = fp16_up(x.abs().amax(dim=dim) / qmax)
    s = scale.float().unsqueeze(dim)
    codes = torch.where(s > 0, torch.round(x / s.clamp_min(1e-30)), torch.zeros_like(x))
    return codes.clamp(-qmax, qmax).to(torch.int8), scale


def asymmetric(x: torch.Tensor, dim: int, bits: int,
               valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 -> (codes uint8 like x, scale float16, zero float16 with `dim` reduced).

    `valid` (broadcastable to x, bool) leaves elements out of the min / max (their codes clamp)."""
    qmax = (1 << bits) - 1
    lo_src = x if valid is None else torch.where(valid, x, x.new_tensor(_INF))
    hi_src = x if valid is None else torch.where(valid, x, x.new_tensor(-_INF))
    lo, hi = lo_src.amin(dim=dim), hi_src.amax(dim=dim)
    empty = ~torch.isfinite(lo)  # a group with no valid element
    lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    zero = fp16_down(lo)
    scale = fp16_up((hi - zero.float()) / qmax)
    s, z = scale.float().unsqueeze(dim), zero.float().unsqueeze(dim)
    codes = torch.where(s > 0, torch.round((x - z) / s.clamp_min(1e-30)), torch.zeros_like(x))
    return codes.clamp(0, qmax).to(torch.uint8), scale, zero
