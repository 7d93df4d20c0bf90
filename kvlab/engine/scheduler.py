"""Continuous batching: which sequences compute how many tokens this step. Torch-free.

One rule covers prefill, chunked prefill, decode and recompute (vLLM v1): each
scheduled sequence computes the next `n` of its uncomputed tokens, with the
step's token budget shared first by running sequences (decodes and unfinished
prefills, in admission order), then by waiting ones (FCFS). When the pool
cannot grow a running sequence, the most recently admitted one is preempted:
its blocks are freed and it goes back to the front of the queue to be
recomputed later, so no request is lost or corrupted.

With tiers below the pool, a waiting sequence whose prefix hit needs pages still being read from a slow tier
(kvlab.cache.tiers: a disk read on the tier's worker thread) is passed over, as if those pages were not
allocated yet: the sequences behind it may be admitted, and it is looked at again next step. No step ever
reads a page that has not arrived. A page still being written to disk (written behind) is not waited for: its
row is in memory, and the tier serves the hit from it.

`max_prefill_chunk` caps the tokens one sequence computes in a step while it has more than one
to compute (a prompt, or a recompute), so that several prompts share a step and, with a policy
that compresses after every chunk, a prompt never holds more than its compressed past plus one
chunk (the block manager admits it on that footprint).

`stop_at` (`kvlab.engine.build.chunk_end`, from a compressing policy's `Compressor.next_point`): no chunk
runs past a sequence's next compression point (its prompt's end; with when="decode" every `every`
tokens after it), so a recompute compresses at the tokens the first pass did and rebuilds exactly
what it kept; under sparse reading a recompute's generated tokens are computed one a step, as decodes.
`stats_at` (`Compressor.stats_point`, with accumulated attention kept beside the prefix cache's pages): a
prompt's chunk also ends at the page boundary where its prefix's statistics are kept, unless it was admitted
onto a kept compressed turn (it registers nothing: its chunks are those it gets without prefix caching).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvlab.cache.block_manager import BlockManager, PrefixHit
from kvlab.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    num_preempted: int = 0
    preempted: list[Sequence] = field(default_factory=list)  # the sequences preempted while scheduling it

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_chunk: int | None = None, stop_at: Callable[[Sequence], int | None] | None = None):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk  # None: a prompt's chunk is bounded by the step's budget only
        self.stop_at = stop_at  # seq -> computed-token count its chunk must not pass (None: no limit)
        self.stats_at: Callable[[Sequence], int | None] | None = None  # seq -> where its prefix statistics are kept
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """The step's batch; if scheduling raises, the sequences it had scheduled are put back (unschedule)."""
        batch = ScheduledBatch()
        self.block_manager.begin_step()
        try:
            self._schedule(batch)
        except BaseException:
            self.unschedule(batch)
            raise
        return batch

    def _schedule(self, batch: ScheduledBatch) -> None:
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n > seq.num_uncomputed_tokens and not self.block_manager.can_append(seq, n):
                n = seq.num_uncomputed_tokens  # no room for tentative draft slots: decode plainly, preempt no one
            seq.keep_draft_tokens(n)  # draft tokens count against the token budget
            n = self._make_room(seq, n, batch)
            if not n:
                continue  # seq itself was preempted; running[i] is now the next one
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            self.block_manager.append(seq, n)
            budget -= n
            i += 1
        w = 0  # the first waiting sequence not passed over
        while w < len(self.waiting) and budget > 0 and not batch.num_preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[w]
            hit = self.block_manager.lookup(seq)  # a prefix-cache hit (none without prefix caching)
            if hit.turn is not None and not self.block_manager.can_allocate(seq, hit):
                hit = self.block_manager.lookup_prefix(seq)  # a kept compressed turn that does not fit: the prefix
                # index's hit, or compute it all (its pages count as free, the pool drops kept turns for room),
                # rather than wait on the turn
            hit = self.block_manager.tier_ready(seq, hit)  # tiers below the pool: its pages read into memory
            if hit is None:  # a page of its hit is still being read: it waits (as for a page not yet
                w += 1  # allocated), the sequences behind it may run
                continue
            n, hit = self._first_chunk(seq, hit, budget)
            if not n:
                break
            self.block_manager.allocate(seq, n, hit)
            del self.waiting[w]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n

    def _chunk(self, seq: Sequence, budget: int, hit: PrefixHit | None = None) -> int:
        """Tokens `seq` computes this step: its chunk limit within the step's budget; with
        `max_prefill_chunk`, at most that many when it has a prompt (or a recompute) to compute, never
        past the prompt's end (a recompute chunks its prompt as the first pass did), and any decode;
        never past the sequence's next compression point (`stop_at`), nor, unless it is being admitted onto a
        kept turn (`hit`), past where its prefix statistics are kept (`stats_at`)."""
        n = min(seq.chunk_limit(), budget)
        if self.max_prefill_chunk is not None and seq.num_uncomputed_tokens > 1:
            n = min(n, self.max_prefill_chunk)
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                n = min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
        points = [self.stop_at(seq) if self.stop_at is not None else None]
        if self.stats_at is not None and (hit is None or hit.turn is None):
            points.append(self.stats_at(seq))
        for point in points:
            if point is not None:
                n = min(n, point - seq.num_computed_tokens)
        return n

    def _first_chunk(self, seq: Sequence, hit: PrefixHit, budget: int) -> tuple[int, PrefixHit]:
        """(tokens waiting `seq` computes in its first chunk if the pool admits it now, its computed tokens set
        to the hit's; 0 if it waits, and the hit it is admitted on). Into an empty pool a chunk whose residual
        rows do not fit is halved until they do (kvlab.cache.quant.lease: what the rows of a chunk take depends
        on its length), and a hit that does not fit even so is dropped: in an empty pool every cached page is
        parked, so taking a hit costs at least the fresh pages computing it does (more where its pages are
        copied: prefix_keep_shared=False, a partly used page), and a hit changes nothing a request computes."""
        n = self._fit(seq, hit, budget)
        if not n and not self.running and (hit.tokens or hit.turn is not None):
            hit = PrefixHit(seq.seq_id)
            n = self._fit(seq, hit, budget)
        return n, hit

    def _fit(self, seq: Sequence, hit: PrefixHit, budget: int) -> int:
        """`_first_chunk` on `hit`: the first chunk's tokens (halved into an empty pool), 0 if it does not fit."""
        before, seq.num_computed_tokens = seq.num_computed_tokens, hit.tokens
        n = self._chunk(seq, budget, hit)
        while not self.block_manager.can_allocate(seq, hit, n):
            if self.running or n <= 1:
                seq.num_computed_tokens = before
                return 0
            n //= 2
        return n

    def _make_room(self, seq: Sequence, n: int, batch: ScheduledBatch) -> int:
        """Preempt from the back of `running` until `seq` can grow by `n`, or, once it runs alone, halve `n` (a
        chunk's residual rows may not fit where its tokens one at a time do: the block manager's capacity_error
        counts those); the tokens it computes, 0 if `seq` went itself."""
        while not self.block_manager.can_append(seq, n):
            if n > 1 and len(self.running) == 1 and self.running[0] is seq:
                n //= 2
                continue
            victim = self.running[-1]
            self.preempt(victim)
            batch.num_preempted += 1
            batch.preempted.append(victim)
            if victim is seq:
                return 0
        return n

    def defer(self, seq: Sequence) -> None:
        """A sample whose tables could not be forked now: it waits first in line and computes its tokens
        itself, as a preempted sequence is recomputed (the same tokens, so the same cache)."""
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)

    def admit_forked(self, seq: Sequence, num_computed_tokens: int) -> None:
        """A sequence forked from a running one (its pages already shared by the block manager)."""
        seq.num_computed_tokens = num_computed_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def advance(self, batch: ScheduledBatch, num_rejected: dict[int, int] | None = None) -> None:
        """The step ran: each scheduled sequence now has its `n` new tokens in the cache, less the
        `num_rejected[seq_id]` draft tokens verification rejected, whose tentative slots are rolled back."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            rejected = num_rejected.get(seq.seq_id, 0) if num_rejected else 0
            if rejected:
                self.block_manager.rollback(seq, rejected)
            seq.num_computed_tokens += n - rejected
            seq.draft_token_ids, seq.draft_parents = [], []
            self.block_manager.commit(seq)  # full pages of computed tokens become findable (prefix caching)

    def preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        seq.num_preemptions += 1

    def unschedule(self, batch: ScheduledBatch) -> None:
        """The step failed before its results were kept: every scheduled sequence gives its pages back
        and waits to be recomputed from scratch (its tokens and scores so far are kept)."""
        for seq in reversed(batch.seqs):
            if seq.status is SequenceStatus.RUNNING:
                self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.draft_token_ids, seq.draft_parents = [], []  # tentative state goes with the pages
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.WAITING:  # a deferred sample that stopped at its first token
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.draft_token_ids, seq.draft_parents = [], []

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop an unfinished request wherever it is, freeing its pages; the sequence, or None if unknown."""
        for seq in self.running:
            if seq.seq_id == seq_id:
                self.finish(seq, "abort")
                return seq
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
                return seq
        return None
