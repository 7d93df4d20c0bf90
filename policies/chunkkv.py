"""ChunkKV (Liu et al. 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context
LLM Inference", arXiv:2502.00299): keep whole chunks of consecutive tokens, ranked by the attention the
observation window pays them, so kept tokens keep their neighbours."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.policies.base import with_protected
from kvlab.policies.snapkv import SnapKV, snap_scores
from kvlab.registry import POLICIES


@POLICIES.register("chunkkv")
@dataclass
class ChunkKV(SnapKV):
    """chunk_size: tokens per chunk (the paper's 10); window_size / kernel_size: SnapKV's scoring (64 / 5);
    reuse_layers: layer-wise index reuse (the paper's section 3.3): layers are taken in runs of this many
    and every layer of a run keeps the chunks the run's first layer chose (1 = every layer chooses).

    The budget is filled with whole chunks, best first (a last partial chunk where the budget ends);
    the observation window is always kept. One set per layer, shared by its KV heads (chunks are
    scored over all heads, as the paper does).
    """

    chunk_size: int = 10
    reuse_layers: int = 1
    _chosen: tuple | None = field(default=None, init=False, repr=False, compare=False)  # (first layer, n, kept)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("chunk_size", "reuse_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def select(self, layer_idx, num_layers, keys, values, queries, attn_stats, protected=0):
        n = keys.shape[0]
        keep = self.num_kept(layer_idx, num_layers, n, protected)
        if keep >= n - protected:
            return None
        first = layer_idx - layer_idx % self.reuse_layers
        if self._chosen is not None and self._chosen[:2] == (first, (n, protected)) and layer_idx != first:
            return self._chosen[2]  # the engine compresses a sequence's layers in order: the run's first chose
        token = snap_scores(queries, keys, self.kernel_size).sum(dim=-1)[protected:]  # [L - protected]
        n -= protected  # chunks are cut after the protected tokens (kept whole: prefix caching)
        pad = (-n) % self.chunk_size
        chunk = token.new_zeros(n + pad)
        chunk[:n] = token
        order = chunk.view(-1, self.chunk_size).sum(dim=-1).argsort(descending=True).tolist()  # best chunks first
        kept: list[int] = []
        for c in order:
            span = list(range(c * self.chunk_size, min((c + 1) * self.chunk_size, n)))
            kept.extend(span[: keep - len(kept)])
            if len(kept) == keep:
                break
        kept = with_protected(sorted(kept), protected)
        self._chosen = (first, (n + protected, protected), kept) if layer_idx == first else None
        return kept
