"""Random paged batches and tolerances shared by the kernel tests and kvlab.kernels.bench.

Inputs are random normal (never zeros); pools hold blocks in shuffled order;
with a sliding window the blocks no query can see are released (-1 in the
block table) so a kernel that reads them fails loudly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 = released / padding
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    k_scale: torch.Tensor | None  # [Hkv] float32 (fp8 caches)
    v_scale: torch.Tensor | None
    tree_mask: torch.Tensor | None  # [T, max q_len] bool ([T, max(seq_len - tree_starts)] with tree_starts)
    scale: float
    tree_starts: list[int] | None = None  # [B] cache index of each row's mask column 0 (None: its first new token)

    def args(self) -> tuple:
        """Positional arguments of paged_attention / paged_attention_ref up to `scale`."""
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q, self.seq_lens, self.scale)


def random_scales(num_kv_heads: int, gen: torch.Generator, device) -> torch.Tensor:
    return (0.5 + torch.rand(num_kv_heads, generator=gen)).to(device)  # [Hkv] in [0.5, 1.5)


def random_pool(num_blocks, block_size, hkv, d, cache_dtype, scale, gen, device) -> torch.Tensor:
    x = torch.randn(num_blocks, block_size, hkv, d, generator=gen)  # [num_blocks, block_size, Hkv, D]
    if scale is not None:
        x = x / scale.cpu().view(1, 1, -1, 1)
    return x.to(cache_dtype).to(device)


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, n] bool ancestor mask of a random tree in topological order (node 0 is the root)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        a = i
        while a >= 0:
            mask[i, a] = True
            a = parents[a]
    return mask


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,  # query heads per KV head
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    sliding_window: int | None = None,
    tree: bool = False,
    seed: int = 0,
    tree_starts: bool = False,  # with `tree`: each row's mask starts at a random cache index (a sparse tree read)
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    n_blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(n_blocks) + 2  # spare blocks nobody owns
    fp8 = cache_dtype in FP8
    k_scale = random_scales(num_kv_heads, gen, device) if fp8 else None
    v_scale = random_scales(num_kv_heads, gen, device) if fp8 else None
    k_cache = random_pool(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, k_scale, gen, device)
    v_cache = random_pool(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, v_scale, gen, device)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((B, max(n_blocks, default=0) + 1), -1, dtype=torch.int32)  # one padding column
    used = 0
    for b, (nb, n, ql) in enumerate(zip(n_blocks, seq_lens, q_lens)):
        tables[b, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
        if sliding_window is not None:  # release blocks older than the first query's window
            first_visible = max(0, n - ql - sliding_window + 1)
            tables[b, : first_visible // block_size] = -1
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    T = int(cu[-1])
    q = torch.randn(T, num_kv_heads * group, head_dim, generator=gen).to(q_dtype).to(device)  # [T, Hq, D]
    tree_mask, starts = None, None
    if tree and tree_starts:
        starts, tree_mask = random_tree_starts(q_lens, seq_lens, cu.tolist(), gen)
        tree_mask = tree_mask.to(device)
    elif tree:
        width = max(q_lens)
        tree_mask = torch.zeros(T, width, dtype=torch.bool)
        for b, ql in enumerate(q_lens):
            tree_mask[int(cu[b]) : int(cu[b + 1]), :ql] = random_tree(ql, gen)
        tree_mask = tree_mask.to(device)
    return PagedBatch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables.to(device),
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        k_scale=k_scale,
        v_scale=v_scale,
        tree_mask=tree_mask,
        scale=1.0 / math.sqrt(head_dim),
        tree_starts=starts,
    )


def random_tree_starts(q_lens: list[int], seq_lens: list[int], cu: list[int], gen: torch.Generator):
    """([B] tree_starts, [T, W] bool mask): row b's mask starts at a random cache index at or before its first
    query and covers every key from there (random bits; each query sees itself, so no row is empty)."""
    starts = [int(torch.randint(0, n - ql + 1, (1,), generator=gen)) for n, ql in zip(seq_lens, q_lens)]
    width = max(n - s for n, s in zip(seq_lens, starts))
    mask = torch.rand(cu[-1], width, generator=gen) < 0.5  # [T, W]
    for b, (n, ql, s) in enumerate(zip(seq_lens, q_lens, starts)):
        for i in range(ql):
            mask[cu[b] + i, n - ql + i - s] = True
    return starts, mask


def attention_tolerance(q_dtype: torch.dtype) -> dict[str, float]:
    """Output tolerance: float32 accumulation bounds, or the half-precision compute dtype's."""
    if q_dtype == torch.float32:
        return dict(atol=2e-5, rtol=1e-4)
    return dict(atol=2e-2, rtol=2e-2)


def max_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max(|ref|) (one number per comparison, for reports)."""
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def storage_close(stored: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal within one unit in the last place of the storage dtype.

    A float cast can round either way at a tie-break or (Triton's interpreter)
    truncate, so the kernel may differ from torch by one ulp of the storage type.
    """
    finfo = torch.finfo(stored.dtype)
    a, b = stored.float(), expected.float()
    return (a - b).abs() <= finfo.eps * b.abs() + finfo.smallest_normal * finfo.eps
