"""Applies the cache policy: after a step, gather a sequence's cached K/V per layer, keep what the
policy selects, compact the survivors into fewer pages and free the rest (through the block manager).

With a compressing policy the engine gives every layer its own group (its own table), so each layer
keeps its own tokens and frees its own pages. Sliding-window groups are left alone (their window
already bounds them, and the window is applied in cache-index space).

Policies that read recent queries (an observation window of `query_window` tokens) get the queries
of the last `query_window` prompt tokens whatever the chunking, collected over as many prefill
chunks as they span (and, with `when="decode"`, of the latest decode steps): the kept set never
depends on what else was in the batch.

When a sequence is compressed (its *compression points*, defined in token time: by how many tokens
it has computed, never by steps, so a recompute after a preemption or a failed step compresses where
the first pass did; the scheduler ends every chunk at the next point, `Compressor.next_point`):
- `when="prefill"`: once, when the last token of its prompt is computed (a scoring request: of its
  context);
- `when="chunk"`: every `chunk` prompt tokens (tokens C, 2C, ... for C = `chunk`, the engine's
  `max_prefill_chunk`, 512 when unset: never the step's token budget, so a budget that cuts a chunk in two
  steps compresses where one step would) and at the prompt's end, the observation window being the last
  queries before the point (those of earlier chunks are dropped once a compression has run: their keys
  may be gone);
- `when="decode"`: at the prompt's end, then each time `every` more tokens are computed (tokens
  p + every, p + 2 every, ... for a prompt of p: after every `every` decode steps when decoding one
  token a step, and at the same tokens when a recompute computes them in chunks).

A sequence's state here (recorded queries, accumulated attention) is dropped when it finishes, is
aborted, preempted or put back after a failed step (`forget`); a fork (parallel samples) copies it
(`fork`), so each sample goes on as a separate request would.

With prefix caching, the leading pages a sequence shares (held by another table, or taken from the
prefix cache: `BlockManager.protected_slots`) are protected: the policy keeps them and its budget
applies to the rest, so they stay in place, shared. Pages a sequence computed itself are compressed
as without caching: the allocator copies their survivors into fresh pages and leaves the cached
originals findable. The block manager stops registering a sequence once it was compacted.

A policy ranking keys by accumulated attention (H2O) reads running totals kept per table (`_mass[seq][group]`,
[cached, the group's KV heads]), as the attention layers return them (`stats[group]`): a layer's, or with
per-head budgets (adakv) each (layer, KV head)'s, so each head's totals cover exactly the tokens it holds and
follow them through its own compaction.

With kept compressed turns (EngineConfig.reuse_compressed, kvlab/cache/kept_turns.py) a policy ranking keys
by accumulated attention goes on accumulating after a sequence's last compression, so that when it
finishes its totals for the kept keys (`turn_state`) are kept with its tables; a request admitted onto
them starts from those totals (`seed_turn`), as a prefix hit starts from a prefix's (`_seed`).
"""

from __future__ import annotations

import time

import torch

from kvlab.cache.paged_kv import PagedKV
from kvlab.policies.base import Policy
from kvlab.policies.prefix_mass import PrefixMass
from kvlab.policies.verify_rows import add_rows, attention_scales, kept_queries, row_mass
from kvlab.sequence import Sequence

DEFAULT_CHUNK = 512  # with when="chunk" and no max_prefill_chunk: prompt tokens between compression points


class Compressor:
    def __init__(self, policy: Policy, kv: PagedKV, compute_dtype: torch.dtype, chunk: int = DEFAULT_CHUNK):
        self.policy = policy
        self.chunk = chunk  # with when="chunk": prompt tokens between compression points
        self.kv = kv  # compaction goes through it (tables and tensors together); reads through bm and cache
        self.bm = kv.block_manager
        self.cache = kv.cache
        self.dtype = compute_dtype
        self.num_layers = sum(len(g.layers) for g in self.bm.groups)
        self.groups = [g for g, group in enumerate(self.bm.groups) if group.sliding_window is None]
        self.layers: dict[int, list[int]] = {}  # full-attention layer -> its groups (one per KV head with head_budgets)
        for g in self.groups:
            self.layers.setdefault(self.bm.groups[g].layers[0], []).append(g)
        self._queries: dict[int, dict[int, torch.Tensor]] = {}  # seq -> layer -> [<= W, Hq, D] latest queries
        self._mass: dict[int, dict[int, torch.Tensor]] = {}  # seq -> group -> [cached, its KV heads] attention
        # received: one running total per table, so per-head tables (KV heads holding different tokens) keep theirs
        self.prefix_mass: PrefixMass | None = None  # with prefix caching: what a prefix's own queries paid its keys
        if self.bm.prefix_cache is not None and policy.needs_attention_stats:
            self._keep_prefix_mass()
        self.scales: dict[int, tuple[float | None, float | None]] = {}  # layer -> (scale, softcap), from `bind`
        self.keep_turns = False  # kept compressed turns: accumulate to the end, `turn_state` at finish
        self.reset_stats()

    def bind(self, model: torch.nn.Module) -> None:
        """The model served: the policy reads what it needs, and a verify step's attention mass is recomputed
        with each layer's scale and softcap (verify_rows.py)."""
        self.policy.bind(model)
        self.scales = attention_scales(model)

    def reset_stats(self) -> None:
        self.calls = 0  # sequences compressed
        self.seconds = 0.0  # spent scoring, selecting and compacting
        self.pages_freed = 0  # the pool's pages in use before a compression less after it, summed
        self.tokens_evicted = 0.0  # cache slots removed per full-attention table, averaged over the tables

    def stats(self) -> dict:
        """`policy_pages_freed` counts pages of this engine's pool, whose size depends on the layer grouping
        (a compressing policy gives every layer, or KV head, its own table): compare bytes
        (`policy_bytes_freed`, added by the engine) or `policy_tokens_evicted` (tokens removed per layer,
        per KV head with per-head tables, summed over compressions) across configurations."""
        return {"policy_compressions": self.calls, "policy_s": self.seconds, "policy_pages_freed": self.pages_freed,
                "policy_tokens_evicted": self.tokens_evicted}

    # -- compression points (torch-free: the scheduler asks them) ------------------
    def next_point(self, seq: Sequence) -> int | None:
        """The computed-token count at which `seq` is next compressed (a chunk must not run past it), or
        None: its prompt's end while in prefill, then with when="decode" every `every` tokens after it."""
        return self._point(_prompt_end(seq), seq.num_computed_tokens)

    def _point(self, prompt_end: int, done: int) -> int | None:
        if done < prompt_end:
            if self.policy.when == "chunk":
                return min(prompt_end, (done // self.chunk + 1) * self.chunk)
            return prompt_end
        if self.policy.when != "decode":
            return None
        every = self.policy.every
        return prompt_end + every * ((done - prompt_end) // every + 1)

    def query_rows(self, seq: Sequence, num_new_tokens: int) -> int:
        """How many trailing tokens of this step's chunk of `seq` have queries the policy will read."""
        w = self.policy.query_window
        if seq.draft_token_ids:  # a verify step: which rows count is known after verification (verify_rows.py)
            decoding = self.policy.when == "decode"  # (kept turns keep accumulating H2O's mass to their end)
            mass = self.policy.needs_attention_stats and (decoding or self.keep_turns)
            return num_new_tokens if (decoding and w) or mass else 0
        if not w:
            return 0
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens
        prompt_end = _prompt_end(seq)
        if start < prompt_end:  # the window ends at the next point (the prompt's end, or with when="chunk" the chunk's)
            window_end = self._point(prompt_end, start)
            return max(0, end - max(start, window_end - w))
        return min(num_new_tokens, w) if self.policy.when == "decode" else 0

    def due(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Will `seq` be compressed after computing `num_new_tokens` more tokens this step? (When the chunk
        reaches the sequence's next compression point.)"""
        start = seq.num_computed_tokens
        point = self.next_point(seq)
        return point is not None and start + num_new_tokens >= point

    @torch.inference_mode()
    def after_step(self, seqs: list[Sequence], num_new_tokens: list[int], due: list[bool],
                   queries: dict[int, list[torch.Tensor]], stats: dict[int, torch.Tensor] | None = None,
                   kept: dict[int, list[int]] | None = None) -> None:
        """Keep the step's recorded queries (`queries[layer][i]`: [n_i, Hq, D] of seqs[i]) and attention
        mass (`stats[group]`: [B, the group's KV heads, max cached]), then compress the sequences that were due.

        `kept`: of each sequence that verified drafts this step, the rows of its chunk verification kept
        (kvlab.speculation.Speculator.kept_rows; the rest were rolled back): only they count, and it is
        compressed only if they reached its compression point (`due` assumed every row would be kept)."""
        kept = kept or {}
        done = [len(kept[s.seq_id]) if s.seq_id in kept else n for s, n in zip(seqs, num_new_tokens)]
        rows = [{layer: q[i] if s.seq_id not in kept else kept_queries(q[i], kept[s.seq_id])
                 for layer, q in queries.items()} for i, s in enumerate(seqs)]  # per seq: layer -> [n_i, Hq, D]
        if stats:
            self._accumulate(seqs, done, stats, {s.seq_id: q for s, q in zip(seqs, rows) if s.seq_id in kept})
            if self.prefix_mass is not None:
                self._publish_prefix_mass(seqs)
        for seq, n, is_due, q in zip(seqs, done, due, rows):
            if seq.seq_id in kept:
                is_due = self._reached(seq, n)
            if self.policy.query_window and q:
                self._record_queries(seq, n, list(q.items()))
            if is_due:
                self.compress(seq, self._queries.get(seq.seq_id, {}), self._mass.get(seq.seq_id, {}))
            if self.next_point(seq) is None:  # compressed for the last time: nothing here is read again
                self._done(seq)

    def _reached(self, seq: Sequence, n: int) -> bool:
        """Did the `n` tokens `seq` computed this step (its kept rows) reach its compression point?"""
        point = self._point(_prompt_end(seq), seq.num_computed_tokens - n)
        return point is not None and seq.num_computed_tokens >= point

    def _record_queries(self, seq: Sequence, n: int, queries: list[tuple[int, torch.Tensor]]) -> None:
        """Keep the latest `query_window` queries of every layer ([n_i, Hq, D] each, this step's rows)."""
        w = self.policy.query_window
        if seq.num_computed_tokens - n == self.bm.num_hit_tokens(seq):  # a first chunk (also after a
            # preemption, or after a prefix-cache hit): start afresh
            self._queries.pop(seq.seq_id, None)
        elif self.policy.when == "chunk" and (start := seq.num_computed_tokens - n) < _prompt_end(seq) \
                and start % self.chunk == 0:
            self._queries.pop(seq.seq_id, None)  # the last chunk was compressed: its window is stale
        for layer, q in queries:
            if q.shape[0]:
                kept = self._queries.setdefault(seq.seq_id, {})
                kept[layer] = torch.cat([kept[layer], q])[-w:] if layer in kept else q[-w:]

    def _accumulate(self, seqs: list[Sequence], num_new_tokens: list[int], stats: dict[int, torch.Tensor],
                    verified: dict[int, dict[int, torch.Tensor]]) -> None:
        """Add the step's attention mass to each cached key's running total (H2O's accumulated attention); a
        verify step's kept rows' mass is recomputed row by row from their queries (`verified`: seq id -> layer ->
        [kept, Hq, D]; verify_rows.py: the step's statistics sum every row). One total per table (group): a
        layer's, or with per-head tables each KV head's, over the tokens that head holds."""
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            if seq.num_computed_tokens == n:  # a first chunk (also after a preemption): start afresh
                self._mass.pop(seq.seq_id, None)
            if self._point(_prompt_end(seq), seq.num_computed_tokens - n) is None and not self.keep_turns:
                continue  # compressed for good (a kept turn's totals are kept to its end)
            mass = self._mass.setdefault(seq.seq_id, {})
            for g in self.groups:
                length = self.bm.cached_lens([seq], g)[0]
                if seq.seq_id in verified:
                    mass[g] = self._verified_mass(seq, g, length, verified[seq.seq_id], mass.get(g))
                    continue
                step = stats[g][i, :, :length].T.float().clone()  # [cached, heads] (not a view of the batch's)
                old = mass.get(g)
                if old is not None:
                    step[: old.shape[0]] += old
                mass[g] = step

    def _verified_mass(self, seq: Sequence, g: int, length: int, queries: dict[int, torch.Tensor],
                       old: torch.Tensor | None) -> torch.Tensor:
        """`old` plus the mass of the kept rows of `seq`'s verify step in group `g`'s table, each row as its decode
        step saw the cache (a per-head table: the query heads of its KV head only)."""
        layer, head = self.bm.groups[g].layers[0], self.bm.groups[g].head
        queries = queries.get(layer)
        if queries is None:
            raise RuntimeError(f"layer {layer}: a verify step's queries were not recorded for the attention statistics")
        if head is not None:  # [kept, Hq, D] -> [kept, Hq / Hkv, D]: the query heads reading KV head `head`
            queries = queries.unflatten(1, (len(self.layers[layer]), -1))[:, head]
        scale, softcap = self.scales.get(layer, (None, None))
        rows = row_mass(self.cache, layer, self.bm.block_tables([seq], g)[0], length, queries, self.bm.block_size,
                        scale, softcap, head)
        return add_rows(old, rows, length)

    # -- accumulated attention of cached prefixes (prefix caching; kvlab.policies.prefix_mass) ------------
    def _keep_prefix_mass(self) -> None:
        """Keep each registered prefix's own attention mass beside its pages: a hit ends only where some is kept
        (the block manager's `hit_ends`), starts from it (`on_hit`), and it goes when a page of it is evicted."""
        self.prefix_mass = PrefixMass()
        self.bm.hit_ends = self.prefix_mass.has
        self.bm.on_hit = self._seed
        self.bm.prefix_cache.on_unregister.append(self.prefix_mass.drop)

    def stats_point(self, seq: Sequence) -> int | None:
        """With kept prefix statistics, the page boundary before the prompt's last token (where a later request
        with this prompt hits: `lookup` never takes the last token), at which a chunk must end so the running
        totals there can be kept; None once past it, without prefix statistics, or with when="chunk" (a chunk
        end is a compression there: the totals are kept only where a chunk ends on a page boundary anyway), or
        for a sequence that registers nothing (admitted onto a kept turn; the scheduler asks no point for its
        first chunk either: kvlab.engine.scheduler.Scheduler.stats_at)."""
        if self.prefix_mass is None or self.policy.when == "chunk" or not self.bm.registers(seq):
            return None
        point = (_prompt_end(seq) - 1) // self.bm.block_size * self.bm.block_size
        return point if seq.num_computed_tokens < point else None

    def _publish_prefix_mass(self, seqs: list[Sequence]) -> None:
        """A sequence whose step ended on a page boundary of its prompt, its pages still registered (never
        compacted): its running totals are what the prefix's own queries paid its keys, kept for its node."""
        for seq in seqs:
            done = seq.num_computed_tokens
            node = self.bm.registered_node(seq, done) if done <= _prompt_end(seq) else None
            mass = self._mass.get(seq.seq_id, {})
            if node is None or self.prefix_mass.has(node) or set(mass) != set(self.groups):
                continue
            if all(m.shape[0] == done for m in mass.values()):
                self.prefix_mass.put(node, mass)

    def _seed(self, seq: Sequence, node) -> None:
        """`seq` was admitted with a hit ending after `node`: its running totals start from what the prefix's
        own queries paid its keys (the queries after the hit add theirs in `_accumulate`)."""
        self._mass[seq.seq_id] = self.prefix_mass.get(node)

    def compress(self, seq: Sequence, queries: dict[int, torch.Tensor],
                 mass: dict[int, torch.Tensor] | None = None) -> int:
        """Compress every full-attention layer of `seq`; returns the pages freed."""
        mass = mass if mass is not None else {}
        t0 = time.perf_counter()
        before = self.bm.num_used_blocks()
        cached = self._cached_slots(seq)
        self.policy.begin(seq.num_computed_tokens)
        for layer, groups in self.layers.items():
            if len(groups) > 1:  # a table per KV head: each head keeps its own number of tokens
                self._compress_heads(seq, layer, groups, queries, mass)
                continue
            g = groups[0]
            keys, values = self.gather(seq, g, layer)
            protected = self.bm.protected_slots(seq, g)
            keep = self.policy.select(layer, self.num_layers, keys, values, queries.get(layer), mass.get(g),
                                      **_protect(protected))
            if keep is None:
                continue
            if keep and isinstance(keep[0], list):  # a kept list per KV head
                self._compact_per_head(seq, g, keep, protected)
            else:
                self.kv.compact(seq, g, keep)
            if g in mass:  # the running totals follow their keys
                index = torch.tensor(keep, dtype=torch.long, device=mass[g].device)
                mass[g] = mass[g].gather(0, index.T) if index.ndim == 2 else mass[g][index]
        freed = before - self.bm.num_used_blocks()
        self.calls += 1
        self.pages_freed += freed
        self.tokens_evicted += (cached - self._cached_slots(seq)) / len(self.groups)
        self.seconds += time.perf_counter() - t0
        return freed

    def _compress_heads(self, seq: Sequence, layer: int, groups: list[int], queries: dict[int, torch.Tensor],
                        mass: dict[int, torch.Tensor]) -> None:
        """One layer whose KV heads have tables of their own (groups[h] holds head h). With accumulated attention
        the policy reads the heads' totals side by side ([L, Hkv]), and each head's total follows its kept keys.
        Heads holding different numbers of tokens (a request continuing a kept turn, compressed again at its
        prompt's end) go to the policy's `select_heads`, one head's tokens (and totals) apart from another's."""
        parts = [self.gather(seq, g, layer) for g in groups]  # per head ([L_h, 1, D], [L_h, 1, D])
        protected = min(self.bm.protected_slots(seq, g) for g in groups)
        if len({k.shape[0] for k, _ in parts}) != 1:  # a continuation of a kept turn: each head its own tokens
            keep = self.policy.select_heads(layer, self.num_layers, [k for k, _ in parts], [v for _, v in parts],
                                            queries.get(layer), [mass[g] for g in groups]
                                            if all(g in mass for g in groups) else None, **_protect(protected))
        else:
            keys, values = torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)
            stats = torch.cat([mass[g] for g in groups], dim=1) if all(g in mass for g in groups) else None
            keep = self.policy.select(layer, self.num_layers, keys, values, queries.get(layer), stats,  # [L, Hkv]
                                      **_protect(protected))
        if keep is None:
            return
        per_head = keep if keep and isinstance(keep[0], list) else [keep] * len(groups)
        for g, kept in zip(groups, per_head):
            self.kv.compact(seq, g, kept)
            if g in mass:  # head g's running total follows its kept keys
                mass[g] = mass[g][torch.tensor(kept, dtype=torch.long, device=mass[g].device)]

    def _compact_per_head(self, seq: Sequence, group: int, keep: list[list[int]], protected: int = 0) -> None:
        """KV head h keeps cache indices keep[h] (every head as many): the table shrinks to that many
        slots (the pages after them are freed) and head h's survivors move into them, in order. The first
        `protected` indices (every head keeps them in place) are not moved."""
        m = len(keep[0])
        if any(len(k) != m for k in keep):
            raise ValueError(f"{type(self.policy).__name__}.select kept {[len(k) for k in keep]} tokens per KV head: "
                             f"a layer's heads must keep as many (per-head budgets need head_budgets = True)")
        self.kv.compact_heads(seq, group, keep, protected)

    def gather(self, seq: Sequence, group: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached keys and values of `seq` in `layer`: ([L, Hkv, D], [L, Hkv, D]) in the compute dtype."""
        n = self.bm.cached_lens([seq], group)[0]
        slots = torch.tensor(self.bm.slot_ids(seq, group, 0, n), dtype=torch.long, device=self.cache.k(layer).device)
        return self.cache.read_slots(layer, slots, self.dtype)  # dequantised, whatever the format

    def _cached_slots(self, seq: Sequence) -> int:
        """Slots `seq` caches over the compressed (full-attention) tables."""
        return sum(self.bm.cached_lens([seq], g)[0] for g in self.groups)

    # -- per-sequence state ----------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` was forked from `parent` (sharing its pages): it starts from the parent's recorded queries
        and accumulated attention (the tensors are never written in place, so they are shared)."""
        if parent.seq_id in self._queries:
            self._queries[child.seq_id] = dict(self._queries[parent.seq_id])
        if parent.seq_id in self._mass:
            self._mass[child.seq_id] = dict(self._mass[parent.seq_id])

    def _done(self, seq: Sequence) -> None:
        """`seq` was compressed for the last time: its state goes, but for the totals a kept turn keeps."""
        if self.keep_turns:
            self._queries.pop(seq.seq_id, None)
        else:
            self.forget(seq)

    def turn_state(self, seq: Sequence) -> dict[int, torch.Tensor] | None:
        """What a request continuing finished `seq` from its kept tables needs: the accumulated attention of every
        kept key (group -> [cached, its KV heads]), if it covers every table's cache; else None (nothing to keep)."""
        mass = self._mass.get(seq.seq_id)
        if not mass or set(mass) != set(self.groups):
            return None
        lens = {g: self.bm.cached_lens([seq], g)[0] for g in self.groups}
        return dict(mass) if all(m.shape[0] == lens[g] for g, m in mass.items()) else None

    def seed_turn(self, seq: Sequence, state: dict[int, torch.Tensor] | None) -> None:
        """`seq` was admitted onto a kept turn: its running totals start from the turn's (never written in place)."""
        if state:
            self._mass[seq.seq_id] = dict(state)

    def forget(self, seq: Sequence) -> None:
        """`seq` finished, was aborted, preempted or put back after a failed step: drop its state."""
        self._queries.pop(seq.seq_id, None)
        self._mass.pop(seq.seq_id, None)

    def on_sequence(self, event: str, seq: Sequence) -> None:
        """Every lifecycle event (dropped, finished, aborted) ends what was recorded for `seq`."""
        self.forget(seq)

    def num_tracked(self) -> int:
        """Sequences this compressor keeps state for (a test that nothing leaks reads it)."""
        return len(self._queries.keys() | self._mass.keys())


def _prompt_end(seq: Sequence) -> int:
    """Tokens before the first compression point: the prompt (a scoring request: its context)."""
    return seq.score_from if seq.is_scoring else seq.num_prompt_tokens


def _protect(protected: int) -> dict:
    """select()'s `protected` keyword, passed only when some pages are shared (prefix caching), so policies
    and wrappers written before it keep working without prefix caching."""
    return {"protected": protected} if protected else {}
