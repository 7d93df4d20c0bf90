"""Verification of a token tree: multi-step speculative sampling over siblings, batched, torch only.

Based on SpecInfer (Miao et al. 2024, arXiv:2305.09781), "multi-step speculative sampling". The
tree's root is the last committed token; every other node n carries a drafted token x_n, drawn
from q_n (the draft's distribution after its parent, or a point mass for a deterministic branch
such as a top-k child). Starting at the root with r = p(root):

    for each child c of the current node, in order:
        accept c with probability min(1, r(x_c) / q_c(x_c)):  move to c, r = p(c), start over at c
        otherwise:                                              r = normalize(max(0, r - q_c))
    no child accepted (or a leaf):  emit one token drawn from r

The emitted tokens (the accepted path, then the final token) are distributed exactly as tokens drawn
from p one at a time (lossless) when the siblings are drawn i.i.d. from q (SpecInfer, Theorem 4.2),
and also when they are distinct point masses (each rejection then removes one token from r:
sampling from p by elimination). Greedy decoding is the same rule with p the point mass on the
target's argmax and u = 0: the child equal to the argmax is accepted, else the argmax is emitted.

Nodes are laid out in a topological order with the siblings of a node in their drafting order
(kvlab uses depth-first preorder, so the first-child chain sits at indices 1..depth); one pass over
the nodes in that order visits the children of every node a row reaches, in order.
"""

from __future__ import annotations

import torch

from kvlab.speculation.verifier import inverse_cdf


def tree_depths(parents: list[int]) -> list[int]:
    """parents[n] of every node (parents[0] = -1: the root) -> depth of every node (the root's is 0);
    an error unless each parent comes before its child."""
    if not parents or parents[0] != -1:
        raise ValueError(f"node 0 must be the root (parent -1), got parents {parents!r}")
    depths = [0]
    for n, parent in enumerate(parents[1:], start=1):
        if not 0 <= parent < n:
            raise ValueError(f"node {n}'s parent {parent} must be an earlier node (topological order)")
        depths.append(depths[parent] + 1)
    return depths


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N+1, N+1] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
    tree_depths(parents)
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


def tree_speculative_sample(
    p: torch.Tensor,  # [B, N+1, V] target probabilities after the root (row 0) and after each node
    q: torch.Tensor,  # [B, N+1, V] row n: the distribution x_n was drawn from (row 0 unused)
    tokens: torch.Tensor,  # [B, N+1] int64 drafted token of each node (column 0 unused)
    parents: list[int],  # [N+1] parent of each node, parents[0] = -1; one topology for the batch
    valid: torch.Tensor,  # [B, N+1] bool: the node is in this row's tree (closed under ancestors)
    u_accept: torch.Tensor,  # [B, N+1] uniforms in [0, 1): node n's acceptance test uses column n
    u_final: torch.Tensor,  # [B] uniforms in [0, 1) for the corrected / bonus token
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (path [B, D] int64: accepted nodes, root's child first, -1 past the end; accepted [B] int64:
    path length; final [B] int64: the token emitted after the path)."""
    B, N1, V = p.shape
    if q.shape != (B, N1, V) or tokens.shape != (B, N1) or valid.shape != (B, N1) or len(parents) != N1:
        raise ValueError(f"shapes disagree: p {tuple(p.shape)}, q {tuple(q.shape)}, tokens {tuple(tokens.shape)}, "
                         f"valid {tuple(valid.shape)}, {len(parents)} parents")
    depths = tree_depths(parents)
    D = max(depths)
    rows = torch.arange(B, device=p.device)
    cur = torch.zeros(B, dtype=torch.int64, device=p.device)  # [B] node each row stands on
    r = p[:, 0].clone()  # [B, V] what the current node's next token must follow (residual after rejections)
    path = torch.full((B, max(D, 1)), -1, dtype=torch.int64, device=p.device)
    for n in range(1, N1):
        here = valid[:, n] & (cur == parents[n])  # [B] rows testing child n now
        if not here.any():
            continue
        x = tokens[:, n]  # [B]
        qn = q[:, n]  # [B, V]
        ok = here & (u_accept[:, n] * qn[rows, x] < r[rows, x])  # accept with probability min(1, r/q)
        no = here & ~ok
        if no.any():  # r <- normalize(max(0, r - q_n)); unchanged when that is empty (r == q: p(accept) ~ 1)
            rest = (r[no] - qn[no]).clamp_min(0)  # [b, V]
            total = rest.sum(-1, keepdim=True)
            r[no] = torch.where(total > 0, rest / total.clamp_min(1e-30), r[no])
        if ok.any():
            cur[ok] = n
            r[ok] = p[ok, n]
            path[ok, depths[n] - 1] = n
    accepted = torch.tensor(depths, device=p.device)[cur]  # [B]
    return path, accepted, inverse_cdf(r, u_final)
