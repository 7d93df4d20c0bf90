"""Speculative decoding around the engine's one packed forward pass: propose -> verify -> accept.

    propose   before scheduling, the draft proposes up to k tokens for every running decoding
              sequence (`seq.draft_token_ids`); the scheduler counts them against the token budget
              (and drops them rather than preempt anyone for their slots)
    compute   the runner computes the last committed token plus the drafts in tentative slots
              appended through the block manager, keeping the k + 1 logits rows (`verify_rows`)
    verify    speculative rejection sampling (kvlab/speculation/verifier.py) accepts a prefix of a <= k drafts
              and draws one corrected or bonus token: a + 1 tokens to emit
    accept    `Scheduler.advance` counts 1 + a tokens as computed and rolls back the k - a
              rejected slots (`BlockManager.rollback`: pages that became empty go back to the pool);
              the engine appends the emitted tokens one by one, so EOS, stop tokens and max_tokens
              inside an accepted run cut it where plain decoding would have stopped

Drafted tokens never enter `token_ids` before they are verified, so nothing that hashes or scores
committed tokens ever sees them; a preempted sequence drops its drafts with its pages.

Token trees (SpecInfer; kvlab/speculation/drafts/tree.py, kvlab/speculation/tree_verifier.py): the drafts are a tree's
nodes in preorder (`seq.draft_parents`), computed at their depth's position under a tree mask, in
tentative slots one after another. Verification walks the tree; the accepted path's K/V are moved
to the slots right after the last committed token (`PagedKV.move_path`; nothing to move when the
first-child chain is accepted), then every other slot is rolled back as for a chain. On a model
with sliding-window layers a tree is cut to its first-child chain once its slots could reach past
the window (the window is measured in cache indices, which a tree's side branches inflate).
"""

from __future__ import annotations

import time

import torch

from kvlab.speculation.drafts.base import DraftModel
from kvlab.sampler import probabilities
from kvlab.sequence import Sequence
from kvlab.speculation.tree_verifier import tree_depths, tree_speculative_sample
from kvlab.speculation.verifier import acceptance_histogram, point_masses, speculative_sample


def greedy_accept(argmax: list[int], seqs: list[Sequence]) -> tuple[list[int], list[int]]:
    """Greedy chains: the target's argmax after the last committed token and after each draft (k + 1 a sequence,
    end to end) -> (drafts accepted, the token emitted after them). What `speculative_sample` gives with point
    masses on both sides and u = 0 (accept iff the draft is the argmax; then the argmax at the first miss, or the
    bonus one), without its [B, k + 1, V] tensors."""
    accepted, final, offset = [], [], 0
    for seq in seqs:
        drafts = seq.draft_token_ids
        a = 0
        while a < len(drafts) and drafts[a] == argmax[offset + a]:
            a += 1
        accepted.append(a)
        final.append(argmax[offset + a])
        offset += len(drafts) + 1
    return accepted, final


class Speculator:
    """Drives one draft for the engine and keeps the acceptance statistics."""

    def __init__(self, draft: DraftModel, vocab_size: int, kv=None):
        self.draft = draft
        self.vocab_size = vocab_size
        self.kv = kv  # kvlab.cache.paged_kv.PagedKV: token trees move the accepted path's K/V, chains seal through it
        block_manager = kv.block_manager if kv is not None else None
        windows = [g.sliding_window for g in block_manager.groups if g.sliding_window] if block_manager else []
        self.window = min(windows, default=None)
        self._lengths: dict[int, int] = {}  # seq_id -> current draft length (adaptive)
        self._probs: dict[int, torch.Tensor | None] = {}  # seq_id -> q [k, V] of this step's drafts
        self._capped: set[int] = set()  # seq_ids whose draft this step was cut short by max_tokens (adaptive)
        self.kept_rows: dict[int, list[int]] = {}  # seq_id -> rows of its chunk the last verify kept (the cache policy's)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.num_verified = 0  # sequence-steps that verified at least one draft token
        self.num_drafted = 0  # draft tokens verified
        self.num_accepted = 0
        self.num_emitted = 0  # tokens emitted by verification (accepted + corrected / bonus)
        self.num_tree_nodes = 0  # token trees: nodes verified (their depth counts as drafted tokens)
        self.tried: list[int] = []  # per draft position: verified, accepted
        self.took: list[int] = []
        self.draft_s = 0.0  # seconds spent proposing
        self.draft.reset_stats()

    # -- propose ---------------------------------------------------------------
    def length(self, seq: Sequence) -> int:
        return self._lengths.get(seq.seq_id, self.draft.num_tokens)

    def propose(self, running: list[Sequence], generators: dict[int, torch.Generator]) -> None:
        """Set `draft_token_ids` of every running decoding sequence (at most one token short of
        max_tokens, so the bonus token still fits); every other running sequence gets none."""
        t0 = time.perf_counter()
        live = {s.seq_id for s in running}
        for table in (self._lengths, self._probs):
            for seq_id in [k for k in table if k not in live]:
                del table[seq_id]
        for seq in running:
            seq.draft_token_ids, seq.draft_parents = [], []
        chosen = [(s, min(self.length(s), s.max_len - s.num_tokens - 1)) for s in running
                  if not s.is_scoring and s.num_uncomputed_tokens == 1]
        self._capped = {s.seq_id for s, n in chosen if n < self.length(s)}
        chosen = [(s, n) for s, n in chosen if n > 0]
        if not chosen:
            return
        try:
            proposals = self.draft.propose([s for s, _ in chosen], [n for _, n in chosen],
                                           [generators.get(s.seq_id) for s, _ in chosen])
            for (seq, n), proposal in zip(chosen, proposals):
                tokens = [int(t) for t in proposal.tokens[:n]]
                if any(not 0 <= t < self.vocab_size for t in tokens):
                    raise ValueError(f"draft {self.draft.registry_name!r} proposed token ids outside the "
                                     f"target's vocabulary [0, {self.vocab_size})")
                parents = self._tree(seq, tokens, proposal.parents)
                seq.draft_token_ids = tokens = tokens[:len(parents)] if parents else tokens
                seq.draft_parents = parents if parents and any(p != i - 1 for i, p in enumerate(parents)) else []
                self._probs[seq.seq_id] = None if proposal.probs is None else proposal.probs[:len(tokens)]
        except BaseException:
            for seq, _ in chosen:
                seq.draft_token_ids = []
            raise
        finally:
            self.draft_s += time.perf_counter() - t0

    def _tree(self, seq: Sequence, tokens: list[int], parents: list[int] | None) -> list[int]:
        """The parents of a tree proposal cut to `tokens` (a preorder prefix), or to its first-child
        chain where a sliding window could cut the side branches' view short; [] for a chain."""
        if parents is None:
            return []
        parents = [int(p) for p in parents[:len(tokens)]]
        if len(parents) != len(tokens):
            raise ValueError(f"draft {self.draft.registry_name!r} gave {len(parents)} parents for {len(tokens)} tokens")
        tree_depths([-1] + [p + 1 for p in parents])  # each parent before its child
        if self.window is not None and seq.num_tokens + len(tokens) > self.window:
            chain = next((i for i, p in enumerate(parents) if p != i - 1), len(parents))
            parents = parents[:chain]
        return parents

    def forget(self, seq: Sequence) -> None:
        """`seq` finished or was aborted."""
        self._lengths.pop(seq.seq_id, None)
        self._probs.pop(seq.seq_id, None)
        self.kept_rows.pop(seq.seq_id, None)
        self.draft.forget(seq.seq_id)

    def on_sequence(self, event: str, seq: Sequence) -> None:
        """A finished or aborted sequence is forgotten; a dropped one keeps its draft length (a recompute
        resyncs the draft's shadow with its tokens)."""
        if event in ("finished", "aborted"):
            self.forget(seq)

    def num_tracked(self) -> int:
        return len(self._lengths.keys() | self._probs.keys()) + self.draft.num_tracked()

    # -- the target's queries, for a draft that reads them ------------------------------
    def query_rows(self, seqs: list[Sequence], num_new: list[int]) -> list[int] | None:
        """Trailing rows of each sequence's chunk whose queries the draft reads (None: none)."""
        rows = [self.draft.query_rows(s, n) for s, n in zip(seqs, num_new)]
        return rows if any(rows) else None

    def observe(self, seqs: list[Sequence], num_new: list[int], rows: list[int],
                queries: dict[int, list[torch.Tensor]]) -> None:
        """After verification: the draft's `rows[i]` trailing rows of each chunk (`queries`: layer -> per sequence
        the trailing rows the runner kept, at least as many), those of a verify step's kept rows only, with
        their positions (the chunk starts at the sequence's computed tokens)."""
        for i, (seq, n, r) in enumerate(zip(seqs, num_new, rows)):
            if not r:
                continue
            chunk = range(n - r, n)  # the rows' indices in the chunk
            kept = set(self.kept_rows.get(seq.seq_id, chunk)) if seq.draft_token_ids else set(chunk)
            pick = [j for j, row in enumerate(chunk) if row in kept]
            got = {layer: qs[i][len(qs[i]) - r:][pick] for layer, qs in queries.items()}
            self.draft.observe(seq, [seq.num_computed_tokens + chunk[j] for j in pick], got)

    # -- verify ----------------------------------------------------------------
    def verify(self, out, generators: dict[int, torch.Generator]) -> tuple[list[tuple[Sequence, list[int]]],
                                                                          dict[int, int]]:
        """The runner's `verify_rows` -> ([(seq, tokens to emit)], {seq_id: draft tokens rejected})."""
        chains = [(s, rows) for s, rows in out.verify_rows if not s.draft_parents]
        emitted, rejected = self._verify_chains(out, chains, generators)
        self.kept_rows = {s.seq_id: list(range(len(run))) for s, run in emitted}  # the committed token + a prefix
        for seq, rows in out.verify_rows:
            if seq.draft_parents:
                emitted.append(self._verify_tree(out, seq, rows, generators.get(seq.seq_id)))
                rejected[seq.seq_id] = len(seq.draft_token_ids) + 1 - len(emitted[-1][1])
        return emitted, rejected

    def _verify_chains(self, out, verify_rows, generators):
        if not verify_rows:
            return [], {}
        seqs = [s for s, _ in verify_rows]
        ks = [len(s.draft_token_ids) for s in seqs]
        B, K, V = len(seqs), max(ks), out.logits.shape[-1]
        rows = torch.tensor([r for _, rs in verify_rows for r in rs])
        if all(s.params.greedy for s in seqs):
            accepted, final = greedy_accept(out.logits[rows].argmax(dim=-1).tolist(), seqs)
            for seq in seqs:
                self._probs.pop(seq.seq_id, None)
            return self._accepted(seqs, ks, accepted, final)
        target = probabilities(out.logits[rows], [s.params for s, k in zip(seqs, ks) for _ in range(k + 1)])
        p = out.logits.new_zeros(B, K + 1, V)  # [B, K+1, V]
        q = out.logits.new_zeros(B, K, V)  # [B, K, V]
        draft = torch.zeros(B, K, dtype=torch.int64)  # [B, K]
        u_accept, u_final = torch.ones(B, K), torch.zeros(B)  # greedy rows: u = 0, the rule is then exact
        offset = 0
        for b, (seq, k) in enumerate(zip(seqs, ks)):
            p[b, :k + 1] = target[offset:offset + k + 1]
            offset += k + 1
            tokens = torch.tensor(seq.draft_token_ids)
            draft[b, :k] = tokens
            qb = self._probs.pop(seq.seq_id, None)
            q[b, :k] = point_masses(tokens, V) if qb is None or seq.params.greedy else qb.to(q)
            if seq.params.greedy:
                u_accept[b, :k] = 0.0
            else:  # k + 1 draws from the request's own stream, whatever else is in the batch
                u = torch.rand(k + 1, generator=generators.get(seq.seq_id))
                u_accept[b, :k], u_final[b] = u[:k], u[k]
        accepted, final = speculative_sample(p, q, draft, torch.tensor(ks), u_accept, u_final)
        return self._accepted(seqs, ks, accepted.tolist(), final.tolist())

    def _accepted(self, seqs, ks: list[int], accepted: list[int], final: list[int]):
        """Each chain's accepted prefix and its corrected / bonus token -> (emitted runs, rejected counts)."""
        emitted = [(s, s.draft_token_ids[:a] + [t]) for s, a, t in zip(seqs, accepted, final)]
        for seq, k, a in zip(seqs, ks, accepted):  # the pages the accepted run pushed out of the window
            if self.kv is not None:
                self.kv.seal_accepted(seq, k, a)
        self._record(seqs, ks, accepted)
        return emitted, {s.seq_id: k - a for s, k, a in zip(seqs, ks, accepted)}

    def _verify_tree(self, out, seq: Sequence, rows: list[int], generator) -> tuple[Sequence, list[int]]:
        """Multi-step speculative sampling down `seq`'s token tree; the accepted path's K/V moved into place."""
        k, V = len(seq.draft_token_ids), out.logits.shape[-1]
        parents = [-1] + [i + 1 for i in seq.draft_parents]  # node 0: the last committed token
        p = probabilities(out.logits[torch.tensor(rows)], [seq.params] * (k + 1))[None]  # [1, k+1, V]
        tokens = torch.tensor([0] + seq.draft_token_ids)[None]  # [1, k+1]
        q = p.new_zeros(1, k + 1, V)  # [1, k+1, V]
        qs = self._probs.pop(seq.seq_id, None)
        q[0, 1:] = point_masses(tokens[0, 1:], V) if qs is None or seq.params.greedy else qs.to(q)
        u = torch.zeros(k + 2) if seq.params.greedy else torch.rand(k + 2, generator=generator)
        path, accepted, final = tree_speculative_sample(p, q, tokens, parents, torch.ones(1, k + 1, dtype=torch.bool),
                                                        u[None, :k + 1], u[k + 1:])
        nodes = path[0, :int(accepted[0])].tolist()
        self.kept_rows[seq.seq_id] = [0] + nodes  # the root's row, then the accepted path's (node i: row i)
        self._move_path(seq, nodes)
        depth = max(tree_depths(parents))
        self.num_tree_nodes += k
        self._record([seq], [depth], [len(nodes)])
        return seq, [seq.draft_token_ids[n - 1] for n in nodes] + [int(final[0])]

    def _move_path(self, seq: Sequence, nodes: list[int]) -> None:
        """The accepted nodes' K/V to the cache indices right after the last committed token's."""
        self.kv.move_path(seq, len(seq.draft_token_ids), nodes)

    def _record(self, seqs: list[Sequence], ks: list[int], accepted: list[int]) -> None:
        self.num_verified += len(seqs)
        self.num_drafted += sum(ks)
        self.num_accepted += sum(accepted)
        self.num_emitted += sum(accepted) + len(seqs)
        tried, took = acceptance_histogram(accepted, ks)
        for i, (t, a) in enumerate(zip(tried, took)):
            if i == len(self.tried):
                self.tried.append(0)
                self.took.append(0)
            self.tried[i] += t
            self.took[i] += a
        if self.draft.adaptive:
            # every proposed token accepted grows the length, even when the draft proposed fewer than asked (slem:
            # n draft tokens re-tokenise into fewer target tokens; a confidence stop); not when max_tokens cut it
            d = self.draft
            for seq, k, a in zip(seqs, ks, accepted):
                self._lengths[seq.seq_id] = d.rule.next_length(self.length(seq), k, a, seq.seq_id in self._capped,
                                                               d.max_num_tokens)

    # -- metrics ---------------------------------------------------------------
    def stats(self, busy_s: float) -> dict:
        """Acceptance rate (accepted / drafted), per-position acceptance (position i accepted when
        verified, i.e. when drafts 0..i-1 were accepted), mean accepted length (tokens emitted per
        verification: accepted drafts + the corrected or bonus token), the share of step time spent
        drafting. `spec_verifications` counts sequence-steps that verified a draft (drafted / verifications:
        the mean chain length, which adaptive lengths and confidence stops move)."""
        nan = float("nan")
        return {
            "spec_verifications": self.num_verified,
            "spec_drafted_tokens": self.num_drafted,
            "spec_accepted_tokens": self.num_accepted,
            "spec_acceptance_rate": self.num_accepted / self.num_drafted if self.num_drafted else nan,
            "spec_per_position_acceptance": [a / t if t else nan for a, t in zip(self.took, self.tried)],
            "spec_mean_accepted_length": self.num_emitted / self.num_verified if self.num_verified else nan,
            "spec_draft_time_share": self.draft_s / busy_s if busy_s > 0 else nan,
            "spec_tree_nodes": self.num_tree_nodes,
            **self.draft.stats(),
        }
