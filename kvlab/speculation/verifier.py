"""Verification of drafted tokens: speculative rejection sampling, batched, torch only.

Based on Leviathan et al. 2023 (arXiv:2211.17192) and Chen et al. 2023 (arXiv:2302.01318). For
draft token x_i proposed with probability q_i(x_i), the target accepts it with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection it emits one token drawn from
normalize(max(0, p_i - q_i)), and when every draft is accepted one bonus token from p_k. The
emitted tokens are distributed exactly as if drawn from p one at a time (lossless).

Greedy decoding is the same rule with p the point mass on the target's argmax and q the point
mass on the draft token: accept iff they agree, else emit the argmax. Drafts without
probabilities (n-gram lookup) are point masses q = one_hot(x).

Every random number is passed in (`u_accept`, `u_final`), so a request's own generator drives
its draws and a test can feed 10^5 rows from one generator.
"""

from __future__ import annotations

import torch


def speculative_sample(
    p: torch.Tensor,  # [B, K+1, V] target probabilities after the last committed token and each draft token
    q: torch.Tensor,  # [B, K, V] draft probabilities each draft token was drawn from
    draft: torch.Tensor,  # [B, K] int64 drafted tokens (anything beyond num_draft is padding)
    num_draft: torch.Tensor,  # [B] int64 drafts per row, 0..K
    u_accept: torch.Tensor,  # [B, K] uniforms in [0, 1) for the acceptance tests
    u_final: torch.Tensor,  # [B] uniforms in [0, 1) for the corrected / bonus token
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (accepted [B] int64: drafts accepted, a prefix; final [B] int64: the corrected or bonus token)."""
    B, K1, V = p.shape
    K = K1 - 1
    if q.shape != (B, K, V) or draft.shape != (B, K) or num_draft.shape != (B,):
        raise ValueError(f"shapes disagree: p {tuple(p.shape)}, q {tuple(q.shape)}, draft {tuple(draft.shape)}, "
                         f"num_draft {tuple(num_draft.shape)}")
    px = p[:, :K].gather(-1, draft[..., None])[..., 0]  # [B, K] p_i(x_i)
    qx = q.gather(-1, draft[..., None])[..., 0]  # [B, K] q_i(x_i)
    valid = torch.arange(K, device=p.device)[None, :] < num_draft[:, None]  # [B, K]
    ok = (u_accept * qx < px) & valid  # u < p/q, i.e. accept with probability min(1, p/q)
    accepted = ok.long().cumprod(dim=-1).sum(dim=-1)  # [B] length of the accepted prefix
    rows = torch.arange(B, device=p.device)
    p_at = p[rows, accepted]  # [B, V]
    q_pad = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)  # [B, K+1, V]: no draft after the last one
    rejected = (accepted < num_draft).to(p.dtype)[:, None]  # [B, 1]
    residual = (p_at - q_pad[rows, accepted] * rejected).clamp_min(0)  # [B, V] bonus rows: p itself
    empty = residual.sum(dim=-1) <= 0  # p == q up to rounding (then rejection had probability ~0)
    residual = torch.where(empty[:, None], p_at, residual)
    return accepted, inverse_cdf(residual, u_final)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [B, V] >= 0 (not normalised), u [B] in [0, 1) -> [B] int64 token j with probability
    weights[j] / sum(weights); a zero-weight token is never drawn."""
    cdf = weights.double().cumsum(dim=-1)  # [B, V]
    target = (u.double() * cdf[:, -1])[:, None]  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]  # first j with cdf[j] > target
    return idx.clamp_max(weights.shape[-1] - 1)


def point_masses(tokens: torch.Tensor, vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """tokens [...] int64 -> [..., V] one-hot probabilities (a draft or a greedy target as a distribution)."""
    return torch.nn.functional.one_hot(tokens, vocab).to(dtype)


def acceptance_histogram(accepted: list[int], num_draft: list[int]) -> tuple[list[int], list[int]]:
    """Per draft position i: (times it was verified, times it was accepted) -- position i is verified
    when every draft before it was accepted."""
    k = max(num_draft, default=0)
    tried, took = [0] * k, [0] * k
    for a, n in zip(accepted, num_draft):
        for i in range(min(a + 1, n)):
            tried[i] += 1
            took[i] += i < a
    return tried, took
