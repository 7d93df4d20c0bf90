"""What a cache policy reads of a verify step: only the rows verification kept, as plain decoding computed them.

A verify step (kvlab/speculation) computes the last committed token and k drafted ones in one pass;
verification keeps a prefix of them (a chain) or a root-to-node path (a token tree), and the other rows
are rolled back. A policy compressing during decode (when="decode") reads the sequence's recorded
queries and accumulated attention at its next compression point, and each must be what plain
decoding, one token a step, would have left:
- the queries (the observation window): the kept rows' only, in token order (`kept_queries`);
- the accumulated attention (H2O): the step's own statistics sum every row, the rejected ones too, so
  the kept rows' mass is recomputed one row at a time (`row_mass`) and added in token order
  (`add_rows`), as plain decoding adds one step's mass after another. After the rollback (and a
  tree path's move) the cache holds exactly the committed and kept tokens, so kept row r of a cache of
  M slots, a rows kept, sits at cache index M - a + r and saw indices 0 .. M - a + r, as its decode
  step would have.
The scheduler never lets a verify step run past the sequence's next compression point (`stop_at`: the
drafts are cut so its last row is at most the point), so no kept row needed a cache compressed in the
middle of the step; the compressor compresses only if the kept rows reached the point.
"""

from __future__ import annotations

import torch

from kvlab.kernels import ops
from kvlab.kernels.attention_plan import plan_paged_attention


def attention_scales(model: torch.nn.Module) -> dict[int, tuple[float | None, float | None]]:
    """layer -> (scale, logit softcap) of every attention module of `model`, as transformers hands them to the
    paged attention (None: the attention's default, head_dim ** -0.5 / no softcap)."""
    scales = {}
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if layer is not None and hasattr(module, "scaling"):
            scales[layer] = (module.scaling, getattr(module, "attn_logit_softcapping", None))
    return scales


def kept_queries(queries: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The kept rows of a verify step's queries [n, Hq, D] (every row of its chunk) -> [len(rows), Hq, D]."""
    if not queries.shape[0]:  # none recorded: the policy reads no query of this step
        return queries
    if queries.shape[0] <= max(rows):
        raise ValueError(f"a verify step recorded {queries.shape[0]} query rows, fewer than its kept rows {rows}")
    return queries[torch.tensor(rows, dtype=torch.long, device=queries.device)]


def row_mass(cache, layer: int, table: list[int], length: int, queries: torch.Tensor, block_size: int,
             scale: float | None, softcap: float | None, head: int | None = None) -> torch.Tensor:
    """Attention mass each cached key of one sequence received from each kept row -> [r, Hkv, length] float32
    (row i counted over cache indices < length - r + 1 + i, zero after). `queries` [r, Hq, D]: the kept rows'
    queries (RoPE applied), the last r tokens of the `length` cached (`table`: the sequence's pages). `head`: a
    per-head table of that KV head (its pages hold one head; `queries` [r, Hq / Hkv, D] its query heads) -> [r, 1,
    length]."""
    r = queries.shape[0]
    lens = [length - r + 1 + i for i in range(r)]  # row i as its own one-query step
    plan = plan_paged_attention(list(range(r + 1)), lens, [table] * r, block_size, None, queries.device,
                                null_block=cache.null_page)
    scale = scale if scale is not None else queries.shape[-1] ** -0.5
    _, stats = ops.run_paged_attention(queries, cache.k(layer), cache.v(layer), plan, scale, softcap,
                                       *cache.head_scales(layer, head), return_stats=True)
    return stats[:, :, :length]  # [r, Hkv, length]


def add_rows(mass: torch.Tensor | None, rows: torch.Tensor, length: int) -> torch.Tensor:
    """`mass` [cached before, Hkv] plus each row of `rows` [r, Hkv, length] in order (row i over the first
    length - r + 1 + i keys), as plain decoding adds one step's mass after another -> [length, Hkv]."""
    r = rows.shape[0]
    for i in range(r):
        step = rows[i, :, :length - r + 1 + i].T.float().clone()  # [cached then, Hkv]
        if mass is not None:
            step[: mass.shape[0]] += mass
        mass = step
    return mass
