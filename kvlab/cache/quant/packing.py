"""Bit packing of small unsigned integers into uint8 storage (int4: two per byte, int2: four per byte).

Values along the last dimension are packed little-end first: element `i` of a group of
`8 // bits` lands in bits [i * bits, (i + 1) * bits) of its byte. Shifts and masks on uint8
tensors only, no per-element Python.
"""

from __future__ import annotations

import torch

PACKABLE_BITS = (1, 2, 4, 8)


def per_byte(bits: int) -> int:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"can pack {PACKABLE_BITS} bits per value, got {bits}")
    return 8 // bits


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [..., D] uint8 with values < 2**bits -> [..., D * bits // 8] uint8."""
    n = per_byte(bits)
    if q.shape[-1] % n:
        raise ValueError(f"last dimension {q.shape[-1]} is not a multiple of {n} ({bits}-bit values per byte)")
    q = q.to(torch.uint8).view(*q.shape[:-1], q.shape[-1] // n, n)  # [..., D / n, n]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)  # [n]
    return (q << shifts).sum(dim=-1, dtype=torch.uint8)  # disjoint bits: sum == bitwise or


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """p [..., D * bits // 8] uint8 -> [..., D] uint8 values < 2**bits."""
    n = per_byte(bits)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=p.device)  # [n]
    mask = (1 << bits) - 1
    return ((p.unsqueeze(-1) >> shifts) & mask).reshape(*p.shape[:-1], p.shape[-1] * n)
