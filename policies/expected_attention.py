"""Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention
from Future Queries Distribution", arXiv:2510.00636): score every cached key by the attention the *future*
queries are expected to pay it.

Queries are modelled as Gaussian: the mean mu and covariance Sigma of the prompt's pre-RoPE queries (per
query head, the sink tokens left out). Future queries sit at positions n .. n + n_future_positions - 1,
so their RoPE rotation is averaged over those positions (R); the expected logit of key k is then
    E[q . k] / sqrt(d) + k^T Sigma' k / (2 d),   mu' = R mu,  Sigma' = R Sigma R^T
(the second term from the moment-generating function of the Gaussian). A softmax over the keys per query
head, the mean over the query heads of each KV head, times the value norm ||v|| (+ epsilon), is the score.
The `n_sink` first tokens are always kept.

The engine hands the policy post-RoPE queries (it records them as the attention layers compute them):
they are rotated back to pre-RoPE with the model's own rotary embedding (`bind`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvlab.policies.base import Policy
from kvlab.registry import POLICIES

QUERY_WINDOW_ALL = 1 << 30  # "every prompt query": the engine clips the window to what was computed


@POLICIES.register("expected_attention")
@dataclass
class ExpectedAttention(Policy):
    """n_future_positions: future positions the RoPE rotation is averaged over (kvpress's 512);
    n_sink: first tokens always kept and left out of the query statistics (4);
    use_covariance: add the covariance term (True); use_vnorm: multiply by ||v|| (True);
    epsilon: added to the value norm (0)."""

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    _rope: Callable | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, low in (("n_future_positions", 1), ("n_sink", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not self.epsilon >= 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon!r}")

    @property
    def query_window(self) -> int:
        return QUERY_WINDOW_ALL

    def bind(self, model: torch.nn.Module) -> None:
        self._rope = rotary_of(model)

    def score(self, layer_idx, keys, values, queries, attn_stats):
        if self._rope is None or self._seq_len is None:
            raise RuntimeError("expected_attention needs the model's rotary embedding: the engine calls bind() "
                               "and begin() before scoring")
        L, Hkv, D = keys.shape
        W, Hq, _ = queries.shape
        n = self._seq_len
        positions = torch.arange(n - W, n, device=keys.device)  # the recorded queries are the latest W tokens
        q = unrotate(queries.float(), *self._rope(positions))[positions >= self.n_sink]  # [N, Hq, D] pre-RoPE
        if q.shape[0] == 0:
            return None
        mean = q.mean(dim=0)  # [Hq, D]
        rot = mean_rotation(*self._rope(torch.arange(n, n + self.n_future_positions, device=keys.device)))  # [D, D]
        mu = mean @ rot.T  # [Hq, D]
        g = Hq // Hkv
        k = keys.float()[self.n_sink:]  # [L', Hkv, D]
        kh = k.repeat_interleave(g, dim=1)  # [L', Hq, D]
        logits = (kh * mu).sum(-1) / D ** 0.5  # [L', Hq]
        if self.use_covariance:
            centred = q - mean
            cov = torch.einsum("nhd,nhe->hde", centred, centred) / q.shape[0]  # [Hq, D, D]
            cov = rot @ cov @ rot.T
            logits = logits + torch.einsum("lhd,hde,lhe->lh", kh, cov, kh) / (2 * D)
        probs = logits.softmax(dim=0).view(-1, Hkv, g).mean(dim=-1)  # [L', Hkv]
        if self.use_vnorm:
            probs = probs * (values.float()[self.n_sink:].norm(dim=-1) + self.epsilon)
        top = probs.max() + 1.0
        return torch.cat([top.expand(min(self.n_sink, L), Hkv), probs])  # [L, Hkv]


def rotary_of(model: torch.nn.Module) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """positions [P] -> (cos, sin) [P, D] of the model's full-attention RoPE (HF's rotary_emb)."""
    inner = getattr(model, "model", model)
    rope = getattr(inner, "rotary_emb", None)
    if rope is None:
        raise ValueError(f"{type(model).__name__} has no rotary embedding (model.rotary_emb): expected_attention "
                         f"needs RoPE")
    takes_type = "layer_type" in inspect.signature(rope.forward).parameters  # Gemma 3: local / global RoPE

    def cos_sin(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(1, dtype=torch.float32, device=positions.device)
        args = (x, positions[None]) + (("full_attention",) if takes_type else ())
        cos, sin = rope(*args)
        return cos[0].float(), sin[0].float()

    return cos_sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def unrotate(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: q [P, H, D] rotated at positions with cos/sin [P, D] (any attention scaling folded in)."""
    cos, sin = cos[:, None], sin[:, None]
    return (q * cos - rotate_half(q) * sin) / (cos * cos + sin * sin)


def mean_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The RoPE rotation averaged over positions, as a matrix [D, D]: x -> mean_p (x cos_p + rotate_half(x) sin_p)."""
    D = cos.shape[-1]
    half = D // 2
    rh = torch.zeros(D, D, dtype=cos.dtype, device=cos.device)  # rotate_half(x) = rh @ x
    rh[:half, half:] = -torch.eye(half, device=cos.device)
    rh[half:, :half] = torch.eye(half, device=cos.device)
    return torch.diag(cos.mean(dim=0)) + torch.diag(sin.mean(dim=0)) @ rh
