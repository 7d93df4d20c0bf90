"""A token-granular view of the target's cache for a self-speculating draft: which tokens its copy keeps.

Based on MagicDec (Chen et al. 2024, arXiv:2408.11049), which drafts through a StreamingLLM or SnapKV
compressed cache, and TriForce (Sun et al. 2024, arXiv:2404.11912). Any registered token-level policy
(snapkv, h2o, tova, knorm, expected_attention, ...) chooses, at each refresh point P (every `refresh`
tokens of the sequence, by position, never by step), the tokens of [0, P) the draft's copy keeps
(kvlab/speculation/drafts/view_copy.py): the policy's own `select` over the target's keys and values, at its
`budget` (per KV head where the policy keeps per-head sets). The view never evicts anything of the target's.

What the policy's scores read:
- queries: those the *target* computed for the latest `window` tokens before P (`QueryLog`: the engine hands
  the draft the rows each pass computed; a verify step's kept rows only), as the policy reads its
  observation window when compressing the target's own cache. A policy that asks for every query
  (expected_attention) gets the latest `MAX_WINDOW`.
- accumulated attention (H2O): the mass the recorded window's queries paid each key (`window_mass`), not the
  mass of every query since the key was cached -- an approximation the draft may make (it changes
  acceptance, never output), stated here.
Where a prefix hit skipped computing a prompt's window, fewer queries are recorded: acceptance may then
differ from a run without the hit.

What a refresh rescores (the draft's `rescore`): `all` runs the policy over every token of [0, P), reading the
whole context each refresh (at 4096 tokens x 16 sequences, ~1.2 s a refresh on two cores: more than the
speculative round it serves). `kept` (the default) runs it over the candidates only: the tokens the view kept at
the previous refresh point P' of the same sequence and the `refresh` tokens of [P', P) (`candidates`), read at
their positions in the target's cache, so a refresh costs budget + refresh tokens, not the context. The policy
then scores its window against those keys only (SnapKV's softmax over the candidates, its pooling over
candidate neighbours) and a token it dropped never comes back, as in an eviction policy (H2O, StreamingLLM):
a different view, hence a different acceptance, never a different output. The first refresh of a sequence (or
one after its slot of the copy was lost) reads all of [0, P).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.policies.observation import window_attention

MAX_WINDOW = 128  # queries recorded at most per layer (expected_attention asks for all of them)
STATS_WINDOW = 32  # queries whose attention mass stands in for H2O's accumulated statistics


def indices(kept, num_tokens: int, num_kv_heads: int) -> torch.Tensor:
    """A policy's `select` result (None: all; one sorted list; one list per KV head) -> [Hkv, S] int64."""
    if kept is None:
        return torch.arange(num_tokens).expand(num_kv_heads, num_tokens)
    if kept and isinstance(kept[0], list):
        return torch.tensor(kept, dtype=torch.int64)
    return torch.tensor(kept, dtype=torch.int64).expand(num_kv_heads, len(kept))


def gather_heads(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [L, Hkv, D], idx [Hkv, S] -> [S, Hkv, D]: head h's rows idx[h]."""
    index = idx.T.to(x.device)[..., None].expand(-1, -1, x.shape[-1])  # [S, Hkv, D]
    return x.gather(0, index)


def window_mass(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """queries [W, Hq, D] of the latest W tokens, keys [L, Hkv, D] -> [L, Hkv] attention mass they paid."""
    return window_attention(queries, keys).sum(dim=(1, 2)).T  # [Hkv, g, W, L] -> [L, Hkv]


@dataclass
class TokenView:
    """The tokens of [0, P) a built token-level `policy` keeps, per layer and KV head."""

    policy: object  # a built kvlab.policies.base.Policy with an integer budget
    num_layers: int

    @property
    def window(self) -> int:
        """Queries per layer the scores read (0: none)."""
        w = min(self.policy.query_window, MAX_WINDOW)
        return max(w, STATS_WINDOW) if self.policy.needs_attention_stats else w

    def select(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
               queries: torch.Tensor | None, seq_len: int | None = None) -> torch.Tensor:
        """keys/values [P, Hkv, D] of [0, P), queries [W, Hq, D] of the latest W of them -> [Hkv, S] indices.
        `seq_len`: the sequence's P where keys/values are candidates only (`candidates`), in position order."""
        P, Hkv, _ = keys.shape
        self.policy.begin(P if seq_len is None else seq_len)
        stats = window_mass(queries, keys) if self.policy.needs_attention_stats and queries is not None else None
        if self.policy.query_window == 0:
            queries = None
        kept = self.policy.select(layer, self.num_layers, keys, values, queries, stats)
        return indices(kept, P, Hkv)


def candidates(kept: torch.Tensor, since: int, P: int) -> torch.Tensor:
    """A refresh that rescores only what it can keep: the positions each KV head kept at the last refresh point
    (kept [Hkv, S], sorted, all < since) and every position of [since, P) -> [Hkv, S + P - since], sorted."""
    new = torch.arange(since, P, dtype=kept.dtype).expand(kept.shape[0], P - since)  # [Hkv, P - since]
    return torch.cat([kept, new], dim=1)


@dataclass
class QueryLog:
    """Per sequence, the target's queries of its latest tokens, by position: {layer: [Hq, D]} per position."""

    keep: int  # positions kept behind the newest recorded one
    _rows: dict[int, dict[int, dict[int, torch.Tensor]]] = field(default_factory=dict)  # seq -> pos -> layer -> q

    def record(self, seq_id: int, positions: list[int], queries: dict[int, torch.Tensor]) -> None:
        """queries: layer -> [len(positions), Hq, D], row i at positions[i]."""
        if not positions:
            return
        rows = self._rows.setdefault(seq_id, {})
        for i, pos in enumerate(positions):
            rows[pos] = {layer: q[i].clone() for layer, q in queries.items()}  # not a view of the step's queries
        newest = max(rows)
        for pos in [p for p in rows if p <= newest - self.keep]:
            del rows[pos]

    def window(self, seq_id: int, layer: int, end: int, width: int) -> torch.Tensor | None:
        """[w, Hq, D]: the recorded queries of positions end - width .. end - 1 (those recorded), or None."""
        rows = self._rows.get(seq_id, {})
        got = [rows[p][layer] for p in range(max(0, end - width), end) if p in rows and layer in rows[p]]
        return torch.stack(got) if got else None

    def forget(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)

    def num_tracked(self) -> int:
        return len(self._rows)
