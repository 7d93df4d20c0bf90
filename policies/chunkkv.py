"""ChunkKV (Liu et al. 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context
LLM Inference", arXiv:2502.00299): keep whole chunks of consecutive tokens, ranked by the attention the
observation window pays them, so kept tokens keep their neighbours."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.policies.snapkv import SnapKV, snap_scores
from kvlab.registry import POLICIES


@POLICIES.register("chunkkv")
@dataclass
class ChunkKV(SnapKV):
    """chunk_size: tokens per chunk (the paper's 10); window_size / kernel_size: SnapKV's scoring (64 / 5).

    The budget is filled with whole chunks, best first (a last partial chunk where the budget ends);
    the observation window is always kept. The paper's layer-wise index reuse (adjacent layers sharing
    one selection) is not built: every layer selects its own chunks.
    """

    chunk_size: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {self.chunk_size!r}")

    def select(self, layer_idx, num_layers, keys, values, queries, attn_stats):
        n = keys.shape[0]
        keep = self.layer_budget(layer_idx, num_layers, n)
        if keep >= n:
            return None
        token = snap_scores(queries, keys, self.kernel_size).sum(dim=-1)  # [L]; the window scores highest
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
        return sorted(kept)
