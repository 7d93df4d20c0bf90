"""The cache-policy interface: which cached tokens a sequence keeps.

kvpress's `ScorerPress` shape: the narrowest hook is `score` (one number per cached token per KV
head, higher = keep); the base class owns the budget (`budget` tokens kept per sequence per layer,
or kvpress's `compression_ratio`, the fraction removed), the top-k and the schedule (`when`). The
engine (kvlab.policies.compressor) gathers a layer's cached keys and values, asks the policy which cache
indices to keep, and compacts the survivors into fewer pages through the block manager, so the
pages freed go back to the shared pool. Positions are untouched: kept tokens keep their RoPE
positions.

Lower-level hooks for policies that need more: `select` (the kept indices of one layer; override
for chunk-level or structured selection) and `layer_budget` (per-layer budget schedules, e.g.
PyramidKV). Wrappers compose by holding another policy.

The budget counts the whole sequence so far, never what an earlier compression left: after any
compression (the end of prefill, every prefill chunk with `when="chunk"`, every `every` decode steps
with `when="decode"`) a layer keeps `layer_budget(n)` tokens, n being the tokens the sequence has
computed so far (`begin`'s seq_len), or all it still caches if that is fewer. With a ratio r a
prompt compressed chunk by chunk therefore holds int(n * (1 - r)) tokens after each chunk -- what
kvpress keeps of a prompt of that length -- and never (1 - r)^k of it after k chunks.

Per KV head (`per_head=True`, the default, as kvpress): every KV head of a layer keeps its own
`budget` tokens (top-k of its own column of scores). Each head's survivors are packed into the
first `budget` slots of the layer's table for that head, so all heads hold the same number of slots
and the pages after them are freed: the memory saved is real. `per_head=False` keeps one set per
layer (scores summed over heads). Per-head budgets that differ between heads (AdaKV) give each
(layer, KV head) a table of its own (`head_budgets`, kvlab.policies.adakv).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Union

import torch

from kvlab.registry import POLICIES
from kvlab.schema import fields_of, fits, type_problem

WHEN = ("prefill", "chunk", "decode")


@dataclass
class Policy(ABC):
    """Base class of eviction / compression policies; subclasses are dataclasses of their parameters."""

    budget: int | None = None  # tokens kept per sequence per layer (None: use compression_ratio)
    compression_ratio: float | None = None  # fraction of cached tokens removed (kvpress's convention); the engine's
    # policy needs one of the two (EngineConfig refuses neither); a wrapped scorer (adakv's) needs none
    when: str = "prefill"  # "prefill": once the prompt is in; "chunk": after every prefill chunk (the budget of
    # the prompt so far, never compounded); "decode": also while decoding
    every: int = 64  # with when="decode": compress again after this many decode steps
    per_head: bool = True  # every KV head keeps its own tokens (kvpress); False: one set per layer (scores summed)

    _seq_len: int | None = field(default=None, init=False, repr=False, compare=False)  # set by `begin`

    compresses: ClassVar[bool] = True  # False: the engine never calls the policy (full cache)
    head_budgets: ClassVar[bool] = False  # True: KV heads keep different numbers of tokens (a table per head)
    needs_attention_stats: ClassVar[bool] = False  # True: the engine accumulates, per cached key, the attention
    # mass it received from every query since it was cached, and passes it to `score` as `attn_stats`

    @property
    def query_window(self) -> int:
        """Recent queries per layer `score` needs (0: none); the engine records them while computing."""
        return 0

    def __post_init__(self) -> None:
        for name, (annotation, _) in fields_of(type(self)).items():  # every field's type, a subclass's too
            ok, _ = fits(getattr(self, name), annotation)
            if not ok:
                raise ValueError(f"{name}: {type_problem(getattr(self, name), annotation)}")
        if not self.compresses:
            return
        if self.budget is not None and self.compression_ratio is not None:
            raise ValueError(f"{type(self).__name__}: give a budget or a compression_ratio, not both")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 1):
            raise ValueError(f"budget must be an integer >= 1 (tokens kept per layer), got {self.budget!r}")
        if self.compression_ratio is not None and not 0.0 <= self.compression_ratio < 1.0:
            raise ValueError(f"compression_ratio must be in [0, 1) (fraction removed), got {self.compression_ratio!r}")
        if self.when not in WHEN:
            raise ValueError(f"when must be one of {', '.join(WHEN)}, got {self.when!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be an integer >= 1 (decode steps), got {self.every!r}")
        if not isinstance(self.per_head, bool):
            raise ValueError(f"per_head must be true or false, got {self.per_head!r}")

    # -- lifecycle -------------------------------------------------------------
    def bind(self, model: torch.nn.Module) -> None:
        """Called once by the engine with the model it serves (e.g. to read its rotary embedding)."""

    def begin(self, seq_len: int) -> None:
        """Called before a sequence is compressed: `seq_len` tokens have KV (the queries handed to
        `score` are those of the latest of them, at positions seq_len - W .. seq_len - 1). Overrides
        call it: the budget of every layer is that of a sequence of `seq_len` tokens."""
        self._seq_len = seq_len

    # -- the budget --------------------------------------------------------------
    def layer_budget(self, layer_idx: int, num_layers: int, num_tokens: int) -> int:
        """Tokens one layer keeps of a sequence of `num_tokens` tokens (kvpress: max(1, int(n * (1 - ratio))))."""
        if self.budget is not None:
            return min(num_tokens, self.budget)
        return min(num_tokens, max(1, int(num_tokens * (1.0 - (self.compression_ratio or 0.0)))))

    def num_kept(self, layer_idx: int, num_layers: int, num_cached: int, protected: int = 0) -> int:
        """Unprotected tokens one layer keeps now, holding `num_cached` of which the first `protected` are
        shared (kept apart): the budget of the whole sequence so far less its protected tokens (`begin`'s
        seq_len; `num_cached` if never called), never more than it caches."""
        seq_len = max(self._seq_len or 0, num_cached)
        return min(num_cached - protected, self.layer_budget(layer_idx, num_layers, seq_len - protected))

    # -- the hooks ---------------------------------------------------------------
    @abstractmethod
    def score(
        self,
        layer_idx: int,
        keys: torch.Tensor,  # [L, Hkv, D] cached keys of one sequence (RoPE applied)
        values: torch.Tensor,  # [L, Hkv, D]
        queries: torch.Tensor | None,  # [W, Hq, D] the last `query_window` queries of this layer, if asked for
        attn_stats: torch.Tensor | None,  # [L, Hkv] attention mass each key received, if collected
    ) -> torch.Tensor | None:  # [L, Hkv] importance, or None to keep everything
        """Importance of every cached token per KV head."""

    def select(self, layer_idx: int, num_layers: int, keys: torch.Tensor, values: torch.Tensor,
               queries: torch.Tensor | None, attn_stats: torch.Tensor | None, protected: int = 0) -> Kept:
        """The cache indices one layer keeps: None (all), one sorted list shared by the KV heads, or one
        sorted list per KV head, all of one length (default: top-k of the scores, per head or summed).

        `protected`: the first `protected` cache indices sit in pages other owners share (prefix caching):
        they are kept, and the budget applies to the rest (scores still see every key)."""
        n = keys.shape[0]
        keep = self.num_kept(layer_idx, num_layers, n, protected)
        if keep >= n - protected:
            return None
        scores = self.score(layer_idx, keys, values, queries, attn_stats)  # [L, Hkv]
        if scores is None:
            return None
        return with_protected(self.choose(scores[protected:], keep), protected)

    def choose(self, scores: torch.Tensor, keep: int) -> list[int] | list[list[int]]:
        """From scores [L, Hkv], the cache indices kept with a budget of `keep` per KV head (default: top-k
        per head, or of the scores summed over heads with per_head=False)."""
        return top_k(scores, keep, self.per_head)


Kept = Union[list[int], list[list[int]], None]


def top_k(scores: torch.Tensor, keep: int, per_head: bool) -> list[int] | list[list[int]]:
    """The `keep` best cache indices of scores [L, Hkv], sorted: per KV head ([Hkv][keep], as kvpress: top-k
    along each head's row) or one list for the layer (scores summed over heads). Heads that agree give
    one list."""
    scores = scores.float()
    if not per_head or scores.shape[1] == 1:
        return sorted(scores.sum(dim=-1).topk(keep).indices.tolist())
    heads = scores.T.contiguous().topk(keep, dim=-1).indices.sort(dim=-1).values.tolist()  # [Hkv][keep]
    return heads[0] if all(h == heads[0] for h in heads[1:]) else heads


def with_protected(kept: list[int] | list[list[int]], protected: int) -> list[int] | list[list[int]]:
    """Indices chosen among cache indices protected.. (counted from `protected`) as whole-cache indices,
    after the protected ones 0 .. protected - 1 (per KV head when `kept` is a list per head)."""
    if not protected:
        return kept
    if kept and isinstance(kept[0], list):
        return [with_protected(head, protected) for head in kept]
    return list(range(protected)) + [protected + i for i in kept]


POLICIES.base = Policy
