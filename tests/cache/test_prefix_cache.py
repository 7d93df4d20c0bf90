"""Prefix caching, torch-free: the hashed page index, the paged allocator's cached-free pages, the block
manager's sharing (full and sliding-window groups), and a property-based run over
random allocate / append / fork / free sequences that hit and evict, with and without a compressing
policy's compactions in the mix, under every eviction policy (their order alone:
tests/cache/test_prefix_eviction.py).

The property test keeps a shadow of every page's contents: a slot written for token i of a sequence
holds that sequence's tokens[: i + 1] (what its KV depends on). Every slot a live sequence can still
attend to must hold its own prefix, so a stale hit (a page reused for other content), a false hit
(a colliding hash), or a write seen through a shared page (copy-on-write broken) all fail it. After a
compaction a table's cache index i holds the token the policy kept there (`Shadow.positions`).

With kept compressed turns beside the index (EngineConfig.reuse_compressed), a third property run finishes
compacted sequences into kept turns and continues conversations from them (one lookup: a kept turn wins, else
the index); a turn's tables are checked as a sequence's are, and no page a continuation computed after a
compressed history may be registered (every registered page must hold its block's uncompressed prefix).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.cache.allocators import NULL_BLOCK, PagedAllocator
from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.cache.kept_turns import KeptTurns
from kvlab.cache.prefix_cache import PrefixCache, chain_hash, request_salt
from kvlab.cache.radix_cache import RadixCache
from kvlab.registry import PREFIX_EVICTIONS
from kvlab.sampling_params import SamplingParams
from kvlab.sequence import Sequence


# The property runs are derandomised (the same examples every run, from the test's name): a bug one run
# catches, every run catches; enough examples that each case reaches hits, forks, evictions and compactions.
PROPERTY_EXAMPLES = 150
PROPERTY = settings(max_examples=PROPERTY_EXAMPLES, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def collide(salt, parent, tokens) -> int:
    return 0  # every block has the same hash: only the token / parent comparison keeps them apart


def make_manager(groups, num_blocks=16, block_size=2, eviction="lru", hash_fn=chain_hash, max_chunk=4, match="page",
                 radix=False):
    if radix:  # the radix tree: no hash, always token-granular
        cache, match = RadixCache(block_size, PREFIX_EVICTIONS.build(eviction), b"model"), "token"
    else:
        cache = PrefixCache(block_size, PREFIX_EVICTIONS.build(eviction), b"model", hash_fn)
    return BlockManager(groups, PagedAllocator(), num_blocks, block_size, 64, max_chunk, cache, match)


class Shadow:
    """Drives a block manager as the scheduler and engine do, and mirrors each page's contents."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.content: dict[int, list] = {}  # page -> per slot: the token prefix whose KV it holds
        self.live: list[Sequence] = []
        self.next_id = 0
        self.hits = 0
        self.positions: dict[int, list[int]] = {}  # compacted table -> token index held at each cache index

    def new_seq(self, tokens, salt=None) -> Sequence:
        seq = Sequence(self.next_id, tokens, SamplingParams(max_tokens=16, cache_salt=salt), len(tokens) + 16, 0.0)
        self.next_id += 1
        return seq

    def admit(self, seq: Sequence, chunk: int) -> bool:
        hit = self.bm.lookup(seq)
        if hit.turn is not None and not self.bm.can_allocate(seq, hit):
            hit = self.bm.lookup_prefix(seq)  # as the scheduler does: a kept turn that does not fit
        if not self.bm.can_allocate(seq, hit):
            return False
        seq.num_computed_tokens = hit.tokens
        self.hits += seq.num_computed_tokens
        n = min(chunk, seq.num_uncomputed_tokens)
        assert n >= 1  # the last prompt token is always computed
        self.bm.allocate(seq, n, hit)
        if hit.turn is not None:  # the turn's compacted tables: cache index i holds the turn's positions[i]
            turn = self.bm.kept_turns.entries[hit.turn]
            for g in self.bm.full_groups:
                self.positions[self.bm.key(seq, g)] = list(self.turn_positions(turn, g))
        self.live.append(seq)
        self._compute(seq, n)
        return True

    def turn_positions(self, turn, g: int) -> list[int]:
        return self.positions.get(turn.keys[g], range(self.bm.allocator.num_tokens(turn.keys[g])))

    def finish(self, seq: Sequence) -> None:
        """`seq` finished: its compacted tables kept as a turn (LLMEngine._finish), then freed."""
        if self.bm.keep_turn(seq):
            turn = next(reversed(self.bm.kept_turns.entries.values()))
            for g in self.bm.full_groups:
                if self.bm.key(seq, g) in self.positions:
                    self.positions[turn.keys[g]] = list(self.positions[self.bm.key(seq, g)])
        self.free(seq)

    def step(self, seq: Sequence, chunk: int, token: int) -> bool:
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(token)
        n = min(chunk, seq.num_uncomputed_tokens)
        if not self.bm.can_append(seq, n):
            self.free(seq)  # preempted
            return False
        self.bm.append(seq, n)
        self._compute(seq, n)
        return True

    def _compute(self, seq: Sequence, n: int) -> None:
        bs = self.bm.block_size
        for src, dst in self.bm.take_copies():
            self.content[dst] = list(self.content[src])
        start = seq.num_computed_tokens
        for g in range(len(self.bm.groups)):
            cached = self.bm.allocator.num_tokens(self.bm.key(seq, g))
            for i, slot in zip(range(start, start + n), self.bm.slot_ids(seq, g, cached - n, cached)):
                self.content.setdefault(slot // bs, [None] * bs)[slot % bs] = tuple(seq.token_ids[: i + 1])
            if self.bm.key(seq, g) in self.positions:
                self.positions[self.bm.key(seq, g)] += list(range(start, start + n))
        seq.num_computed_tokens += n
        self.bm.commit(seq)
        self.bm.release_out_of_window(seq)

    def fork(self, seq: Sequence) -> Sequence:
        child = self.new_seq(seq.token_ids)
        child.num_computed_tokens = seq.num_computed_tokens
        self.bm.fork(seq, child)
        for g in range(len(self.bm.groups)):
            if self.bm.key(seq, g) in self.positions:
                self.positions[self.bm.key(child, g)] = list(self.positions[self.bm.key(seq, g)])
        self.live.append(child)
        return child

    def compact(self, seq: Sequence, drop: list[int]) -> None:
        """What the compressor does with a policy's choice: in every full-attention group keep the protected
        cache indices and drop the `drop`-th (modulo) of the others; no write may reach a shared or cached page."""
        bm, a, bs = self.bm, self.bm.allocator, self.bm.block_size
        for g in bm.full_groups:
            key, protected = bm.key(seq, g), bm.protected_slots(seq, g)
            n, table = a.num_tokens(key), list(a.block_table(key))
            held = {p for p in table if a.num_owners(p) > 1 or bm.prefix_cache.is_registered(p)}
            rest = list(range(protected, n))
            gone = {rest[d % len(rest)] for d in drop} if rest else set()
            keep = [i for i in range(n) if i not in gone]
            if len(keep) == n:
                continue
            evictions = bm.prefix_cache.stats.evictions
            moves = bm.compact(seq, g, keep)
            assert a.block_table(key)[: protected // bs] == table[: protected // bs]  # shared pages stay in place
            values = [self.content[src // bs][src % bs] for src, _ in moves]  # every read before any write
            # a cached page only this table held may be let go, evicted and taken again as a destination (unregistered)
            evicted = bm.prefix_cache.stats.evictions > evictions
            for (_, dst), value in zip(moves, values):
                assert (dst // bs not in held or evicted) and a.num_owners(dst // bs) == 1
                assert not bm.prefix_cache.is_registered(dst // bs)
                self.content.setdefault(dst // bs, [None] * bs)[dst % bs] = value
            old = self.positions.get(key, list(range(n)))
            self.positions[key] = [old[j] for j in keep]

    def free(self, seq: Sequence) -> None:
        self.bm.free(seq)
        for g in range(len(self.bm.groups)):
            self.positions.pop(self.bm.key(seq, g), None)
        self.live.remove(seq)

    # -- invariants --------------------------------------------------------------
    def check(self) -> None:
        bm, a = self.bm, self.bm.allocator
        pc = bm.prefix_cache
        owners = [0] * bm.num_blocks
        for table in a.tables.values():
            for page in table:
                if page != NULL_BLOCK:
                    owners[page] += 1
        assert owners == a.ref_counts  # every reference count equals its owners
        free = list(a.free_blocks)
        assert len(set(free)) == len(free)  # never freed twice
        parked = [p for p in range(bm.num_blocks) if owners[p] == 0 and pc.is_registered(p)]
        assert pc.num_parked == len(parked)
        assert sorted(free + parked) == [p for p in range(bm.num_blocks) if owners[p] == 0]  # nothing leaked
        assert not set(free) & set(pc.page_node)  # a free page is never findable
        bs = bm.block_size
        for seq in self.live:  # every slot a sequence can still read holds its own prefix
            for g, group in enumerate(bm.groups):
                table = a.block_table(bm.key(seq, g))
                if bm.key(seq, g) in self.positions:  # compacted: cache index i holds token positions[i]
                    for i, pos in enumerate(self.positions[bm.key(seq, g)]):
                        assert self.content[table[i // bs]][i % bs] == tuple(seq.token_ids[: pos + 1]), (seq, g, i)
                    continue
                lo = 0 if group.sliding_window is None else max(0, seq.num_computed_tokens - group.sliding_window + 1)
                for i in range(lo, seq.num_computed_tokens):
                    page = table[i // bs]
                    assert page != NULL_BLOCK
                    assert self.content[page][i % bs] == tuple(seq.token_ids[: i + 1]), (seq, g, i)
        for turn in (bm.kept_turns.entries.values() if bm.kept_turns is not None else ()):
            for g in bm.full_groups:  # a kept turn's table holds the tokens it kept, in the pages it holds
                table = a.block_table(turn.keys[g])
                for i, pos in enumerate(self.turn_positions(turn, g)):
                    assert self.content[table[i // bs]][i % bs] == turn.tokens[: pos + 1], (turn.keys[g], i)
        for page, (node, _) in pc.page_node.items():  # every registered page holds its block's prefix
            prefix, n = [], node
            while n is not None:
                prefix[:0] = n.tokens
                n = n.parent
            start = len(prefix) - len(node.tokens)  # a radix leaf may hold a partly filled page
            assert start % bs == 0 and 0 < len(node.tokens) <= bs
            for j in range(len(node.tokens)):
                assert self.content[page][j] == tuple(prefix[: start + j + 1])


GROUPS = [LayerGroup((0,)), LayerGroup((1,), sliding_window=5)]
TEMPLATES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 2, 2, 2, 2], [5, 6, 5, 6, 5, 6, 5, 6],
             [1, 2, 3, 4, 5, 6, 1, 1, 2, 2, 3, 3]]

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 12), st.lists(st.integers(1, 3), max_size=3),
              st.integers(1, 4)),
    st.tuples(st.just("step"), st.integers(0, 99), st.integers(1, 4), st.integers(1, 3)),
    st.tuples(st.just("fork"), st.integers(0, 99), st.integers(1, 3), st.integers(1, 3)),
    st.tuples(st.just("free"), st.integers(0, 99)),
)


CASES = [pytest.param(e, m, h, id=f"{e}-{m}-{name}") for e, m in [("lru", "page"), ("lfu", "page"), ("slru", "page"),
                                                                    ("arc", "page"), ("lru", "token"), ("arc", "token")]
         for h, name in [(chain_hash, "blake2b"), (collide, "colliding")]]
CASES += [pytest.param(e, "radix", None, id=f"{e}-radix") for e in ("lru", "lfu", "slru", "arc")]  # hashes nothing


@pytest.mark.parametrize("eviction, match, hash_fn", CASES)
@PROPERTY
@given(ops=st.lists(op, max_size=40))
def test_random_operations_keep_pages_and_contents_consistent(eviction, match, hash_fn, ops):
    radix = match == "radix"
    shadow = Shadow(make_manager(GROUPS, num_blocks=14, eviction=eviction, hash_fn=hash_fn, match=match, block_size=4,
                                 radix=radix)
                    if match in ("token", "radix") else make_manager(GROUPS, num_blocks=14, eviction=eviction,
                                                                     hash_fn=hash_fn))
    for kind, *args in ops:
        if kind == "add":
            t, length, extra, chunk = args
            shadow.admit(shadow.new_seq(TEMPLATES[t][:length] + extra), chunk)
        elif shadow.live:
            seq = shadow.live[args[0] % len(shadow.live)]
            if kind == "step":
                shadow.step(seq, args[1], args[2])
            elif kind == "fork" and seq.num_uncomputed_tokens == 0:
                child = shadow.fork(seq)  # then both decode (into a shared page: copy-on-write)
                if shadow.step(child, 1, args[2]) and seq in shadow.live:
                    shadow.step(seq, 1, args[1])
            elif kind == "free":
                shadow.free(seq)
        shadow.check()
    for seq in list(shadow.live):
        shadow.free(seq)
    shadow.check()
    assert shadow.bm.allocator.num_free_blocks == shadow.bm.num_blocks


compact_op = st.tuples(st.just("compact"), st.integers(0, 99), st.lists(st.integers(0, 20), min_size=1, max_size=6))


@pytest.mark.parametrize("match", ["page", "token", "radix"])
@PROPERTY
@given(ops=st.lists(st.one_of(op, compact_op), max_size=40), tail=st.integers(0, 3))
def test_random_operations_with_compactions_keep_pages_and_contents_consistent(match, ops, tail):
    """A compressing policy's compactions mixed in (the protected pages kept, any other tokens dropped):
    reference counts, no leak, no write into a shared or cached page, every cached page still holding
    its block, every sequence reading the tokens its policy kept."""
    shadow = Shadow(make_manager(GROUPS, num_blocks=14, match="token" if match == "token" else "page",
                                 block_size=4, radix=match == "radix"))
    shadow.bm.recompute_tail = tail  # a policy's observation window: hits stop before it
    for kind, *args in ops:
        if kind == "add":
            t, length, extra, chunk = args
            seq = shadow.new_seq(TEMPLATES[t][:length] + extra)
            if shadow.admit(seq, chunk):
                assert seq.num_computed_tokens - min(chunk, seq.num_tokens) <= max(0, seq.num_tokens - tail)
        elif shadow.live:
            seq = shadow.live[args[0] % len(shadow.live)]
            if kind == "step":
                shadow.step(seq, args[1], args[2])
            elif kind == "compact":
                shadow.compact(seq, args[1])
            elif kind == "fork" and seq.num_uncomputed_tokens == 0:
                child = shadow.fork(seq)
                if shadow.step(child, 1, args[2]) and seq in shadow.live:
                    shadow.step(seq, 1, args[1])
            elif kind == "free":
                shadow.free(seq)
        shadow.check()
    for seq in list(shadow.live):
        shadow.free(seq)
    shadow.check()
    assert shadow.bm.allocator.num_free_blocks == shadow.bm.num_blocks


turn_ops = st.one_of(
    op, compact_op,
    st.tuples(st.just("finish"), st.integers(0, 99), st.lists(st.integers(0, 20), min_size=1, max_size=6)),
    st.tuples(st.just("continue"), st.integers(0, 99), st.lists(st.integers(1, 3), min_size=1, max_size=4),
              st.integers(1, 4)),
)


@pytest.mark.parametrize("match", ["page", "radix"])
@PROPERTY
@given(ops=st.lists(turn_ops, max_size=40), tail=st.integers(0, 3))
def test_random_operations_with_kept_turns_keep_pages_and_contents_consistent(match, ops, tail):
    """Kept compressed turns beside the prefix index (reuse_compressed with prefix caching): compacted sequences
    finish into kept turns, conversations continue from them (a kept turn wins the lookup, else the index; a turn
    that does not fit gives way to the index's hit), the pool drops turns under pressure. Reference counts, no
    leak, no write into a shared or cached page, every kept turn and sequence reading what it kept, and every
    registered page holding its block's uncompressed prefix (a continuation registers nothing); dropping every
    turn leaves only free and cached-free pages."""
    shadow = Shadow(make_manager(GROUPS, num_blocks=14, block_size=4, radix=match == "radix"))
    bm = shadow.bm
    bm.allocator.kept_turns = KeptTurns(len(GROUPS), capacity=3)
    bm.recompute_tail = bm.turn_tail = tail
    for kind, *args in ops:
        if kind == "add":
            t, length, extra, chunk = args
            shadow.admit(shadow.new_seq(TEMPLATES[t][:length] + extra), chunk)
        elif kind == "continue":
            turns = list(bm.kept_turns.entries.values())
            if turns:
                turn, extra, chunk = turns[args[0] % len(turns)], args[1], args[2]
                shadow.admit(shadow.new_seq(list(turn.tokens) + extra), chunk)
        elif shadow.live:
            seq = shadow.live[args[0] % len(shadow.live)]
            if kind == "step":
                shadow.step(seq, args[1], args[2])
            elif kind == "compact":
                shadow.compact(seq, args[1])
            elif kind == "finish":  # compressed (at its prompt's end, say), then finished: kept
                shadow.compact(seq, args[1])
                shadow.finish(seq)
            elif kind == "fork" and seq.num_uncomputed_tokens == 0:
                child = shadow.fork(seq)
                if shadow.step(child, 1, args[2]) and seq in shadow.live:
                    shadow.step(seq, 1, args[1])
            elif kind == "free":
                shadow.free(seq)
        shadow.check()
    for seq in list(shadow.live):
        shadow.finish(seq)
    shadow.check()
    assert bm.allocator.num_free_blocks == bm.num_blocks
    while bm.kept_turns:
        bm.allocator.drop_kept_turn()
    shadow.check()
    assert not bm.allocator.tables and len(bm.allocator.free_blocks) + bm.prefix_cache.num_parked == bm.num_blocks


def test_a_kept_turn_holds_cached_pages_a_prefix_hit_counts_and_a_continuation_recompresses():
    """A finished compacted sequence whose leading pages stayed registered (its compaction left them as they were)
    is kept: the turn holds those pages, so they are neither parked nor evictable, and count as free. A prefix hit
    on them takes them out of the free count (admission counts them); a continuation of the turn protects nothing
    (its history is recompressed) and registers nothing."""
    shadow = Shadow(make_manager([LayerGroup((0,))], num_blocks=8, block_size=4))
    bm, a = shadow.bm, shadow.bm.allocator
    bm.allocator.kept_turns = KeptTurns(1, capacity=1)
    first = shadow.new_seq(list(range(1, 11)))
    shadow.admit(first, 10)  # registers [1..4] [5..8]
    shadow.compact(first, [9])  # drops token 10: pages 0 and 1 stay in place, registered
    shadow.step(first, 1, 11)
    cached = dict(bm.prefix_cache.page_node)
    shadow.finish(first)
    (turn,) = bm.kept_turns.entries.values()
    held = a.block_table(turn.keys[0])
    assert set(cached) == set(held[:2]) and all(a.num_owners(p) == 1 for p in held)
    assert bm.prefix_cache.num_parked == 0 and a.num_free_blocks == 8  # held by the turn alone: free, not parked
    long = shadow.new_seq(list(range(1, 9)) + [20] * 26)  # 34 tokens: 9 pages, 2 of them the turn's cached ones
    hit = bm.lookup(long)
    assert hit.turn is None and hit.tokens == 8
    assert not bm.can_allocate(long, hit)  # 7 fresh pages + the 2 cached ones (no longer free once taken) > 8
    third = shadow.new_seq(list(turn.tokens) + [30, 31])
    hit = bm.lookup(third)
    assert hit.turn is not None and hit.tokens == len(turn.tokens)  # the kept turn wins the lookup
    assert shadow.admit(third, 2) and bm.num_hit_tokens(third) == len(turn.tokens)
    assert bm.protected_slots(third, 0) == 0  # every page is shared with the turn, none is protected
    shadow.step(third, 1, 32)
    assert bm.prefix_cache.page_node == cached  # a continuation registers nothing
    shadow.check()
    shadow.finish(third)  # its own turn replaces the first (capacity 1), holding the cached pages still
    assert set(cached) <= set(a.block_table(next(iter(bm.kept_turns.entries.values())).keys[0]))
    second = shadow.new_seq(list(range(1, 9)) + [20] * 10)  # 18 tokens: 3 fresh pages
    assert shadow.admit(second, 10) and bm.num_hit_tokens(second) == 8
    assert bm.protected_slots(second, 0) == 8  # a prefix hit's pages are protected
    shadow.check()
    shadow.free(second)
    while bm.kept_turns:
        a.drop_kept_turn()
    shadow.check()
    assert not a.tables and len(a.free_blocks) + bm.prefix_cache.num_parked == 8


def test_the_property_runs_are_derandomised_with_enough_examples():
    for test in (test_random_operations_keep_pages_and_contents_consistent,
                 test_random_operations_with_compactions_keep_pages_and_contents_consistent,
                 test_random_operations_with_kept_turns_keep_pages_and_contents_consistent):

        used = test._hypothesis_internal_use_settings  # the settings hypothesis runs the test with
        assert used.derandomize and used.max_examples >= PROPERTY_EXAMPLES, test.__name__


def test_a_compacted_sequence_registers_nothing_more_and_its_cached_pages_survive():
    shadow = Shadow(make_manager([LayerGroup((0,))], num_blocks=16, block_size=2))
    first = shadow.new_seq([1, 2, 3, 4, 5, 6, 7])
    shadow.admit(first, 8)  # registers [1 2] [3 4] [5 6]
    cached = dict(shadow.bm.prefix_cache.page_node)
    shadow.compact(first, [0, 2])  # drops tokens 1 and 3: every page is written, so each is copied out first
    assert shadow.bm.protected_slots(first, 0) == 0 and shadow.bm.prefix_cache.page_node == cached
    for token in (8, 9, 10):
        shadow.step(first, 1, token)
    assert shadow.bm.prefix_cache.page_node == cached  # nothing registered after the compaction
    shadow.check()
    second = shadow.new_seq([1, 2, 3, 4, 5, 6, 9, 9])
    shadow.admit(second, 8)
    assert second.num_computed_tokens - 2 == 6  # the three cached pages, still holding their blocks
    assert shadow.bm.protected_slots(second, 0) == 6
    shadow.compact(second, [0])  # the hit pages are protected: the policy drops token 6 (the first after them)
    assert shadow.positions[shadow.bm.key(second, 0)] == [0, 1, 2, 3, 4, 5, 7]
    shadow.check()


def test_copy_on_write_keeps_a_forks_writes_private():
    shadow = Shadow(make_manager([LayerGroup((0,))], block_size=4))
    parent = shadow.new_seq([1, 2, 3, 4, 5])
    shadow.admit(parent, 8)
    child = shadow.fork(parent)
    shadow.step(parent, 1, 7)
    shadow.step(child, 1, 8)
    assert shadow.bm.num_cow_copies == 1
    shadow.check()


def test_a_finished_prefix_is_hit_then_evicted_without_a_stale_hit():
    shadow = Shadow(make_manager([LayerGroup((0,))], num_blocks=6, block_size=2))
    first = shadow.new_seq([1, 2, 3, 4, 5])
    assert shadow.admit(first, 8)
    shadow.free(first)  # pages [1 2] [3 4] stay cached-free
    again = shadow.new_seq([1, 2, 3, 4, 7])
    assert shadow.admit(again, 8) and again.num_computed_tokens - 1 == 4  # hit both full pages, computed 1
    shadow.check()
    shadow.free(again)
    filler = shadow.new_seq([9] * 11)  # needs all 6 pages: every cached-free page is evicted
    assert shadow.admit(filler, 11)
    assert shadow.bm.prefix_cache.stats.evictions >= 2
    shadow.check()
    shadow.free(filler)
    late = shadow.new_seq([1, 2, 3, 4, 5])
    assert shadow.admit(late, 8) and shadow.hits == 4  # only the one earlier hit: nothing stale
    shadow.check()


def test_a_whole_cached_prompt_still_computes_its_last_token():
    shadow = Shadow(make_manager([LayerGroup((0,))], block_size=2))
    first = shadow.new_seq([1, 2, 3, 4])
    shadow.admit(first, 8)
    shadow.free(first)
    same = shadow.new_seq([1, 2, 3, 4])
    shadow.admit(same, 8)
    assert shadow.hits == 2  # [1 2] reused; [3 4] holds the last token, so it is computed again


def test_salts_keep_requests_apart():
    shadow = Shadow(make_manager([LayerGroup((0,))], block_size=2))
    for salt, hits in [("a", 0), ("a", 4), (b"a", 4), (None, 4), ("b", 4), ("a", 8), (b"a", 12)]:
        seq = shadow.new_seq([1, 2, 3, 4, 5], salt)
        shadow.admit(seq, 8)
        shadow.free(seq)
        assert shadow.hits == hits, salt
    with pytest.raises(TypeError, match="cache_salt must be None, a str or bytes, got int"):
        request_salt(3)


def test_colliding_hashes_never_hit_other_content():
    shadow = Shadow(make_manager([LayerGroup((0,))], block_size=2, hash_fn=collide))
    a = shadow.new_seq([1, 2, 3, 4, 5])
    shadow.admit(a, 8)
    b = shadow.new_seq([1, 3, 3, 4, 5])  # second page's tokens equal a's, parent differs
    shadow.admit(b, 8)
    assert shadow.hits == 0
    c = shadow.new_seq([1, 2, 3, 4, 6])
    shadow.admit(c, 8)
    assert shadow.hits == 4
    shadow.check()


def test_sliding_window_group_shares_only_the_window():
    groups = [LayerGroup((0,)), LayerGroup((1,), sliding_window=3)]
    shadow = Shadow(make_manager(groups, num_blocks=20, block_size=2))
    first = shadow.new_seq(list(range(1, 12)))
    shadow.admit(first, 11)
    shadow.free(first)
    again = shadow.new_seq(list(range(1, 12)) + [50])
    shadow.admit(again, 12)
    assert again.num_computed_tokens - 2 == 10  # 5 pages hit; the window needs only the last 2 of them
    # the full group reused 5 pages; the window group (a query at 10 sees 8..10) only page [8 9]
    assert shadow.bm.prefix_cache.stats.hit_pages == 5 + 1
    shadow.check()


def test_token_granularity_shares_a_cached_page_up_to_the_divergence_then_copies_it():
    shadow = Shadow(make_manager([LayerGroup((0,))], block_size=4, match="token"))
    first = shadow.new_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    shadow.admit(first, 16)
    shadow.free(first)
    other = shadow.new_seq([1, 2, 3, 4, 5, 6, 0, 0, 0])  # diverges inside the second page
    shadow.admit(other, 16)
    assert shadow.hits == 6 and shadow.bm.num_cow_copies == 1  # [1 2 3 4] + [5 6 of 5 6 7 8], copied
    shadow.check()
    again = shadow.new_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    shadow.admit(again, 16)
    assert shadow.hits == 6 + 8  # the cached page was never written by `other`
    shadow.check()


def test_radix_keeps_a_finished_sequences_partly_filled_page_and_shares_it_up_to_the_divergence():
    shadow = Shadow(make_manager([LayerGroup((0,))], block_size=4, radix=True))
    turn1 = shadow.new_seq([1, 2, 3, 4, 5, 6])  # one full page + [5 6] in a partly filled one
    shadow.admit(turn1, 16)
    shadow.step(turn1, 1, 7)  # decodes 7: 7 tokens computed, the last page holds [5 6 7]
    shadow.free(turn1)
    shadow.check()
    turn2 = shadow.new_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])  # the next turn: the conversation so far + more
    shadow.admit(turn2, 16)
    assert shadow.hits == 7 and shadow.bm.num_cow_copies == 1  # the partial page, shared then copied
    shadow.check()
    hashed = Shadow(make_manager([LayerGroup((0,))], block_size=4, match="token"))  # the hashed cache keeps
    first = hashed.new_seq([1, 2, 3, 4, 5, 6])                                      # full pages only
    hashed.admit(first, 16)
    hashed.step(first, 1, 7)
    hashed.free(first)
    hashed.admit(hashed.new_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]), 16)
    assert hashed.hits == 4


def test_radix_partial_page_is_never_a_stale_hit_after_eviction():
    shadow = Shadow(make_manager([LayerGroup((0,))], num_blocks=3, block_size=4, radix=True))
    first = shadow.new_seq([1, 2, 3, 4, 5, 6])
    shadow.admit(first, 16)
    shadow.free(first)  # pages [1 2 3 4] and [5 6] cached-free
    other = shadow.new_seq([9, 9, 9, 9, 9, 9, 9, 9, 9, 9])  # needs all 3 pages: both cached ones evicted
    shadow.admit(other, 16)
    shadow.free(other)
    shadow.check()
    again = shadow.new_seq([1, 2, 3, 4, 5, 6, 7])
    shadow.admit(again, 16)
    assert shadow.hits == 0  # nothing of the first request survived: no stale hit
    shadow.check()


def test_radix_pages_of_a_failed_step_are_not_kept():
    shadow = Shadow(make_manager([LayerGroup((0,))], block_size=4, radix=True))
    seq = shadow.new_seq([1, 2, 3, 4, 5, 6])
    shadow.admit(seq, 16)
    shadow.bm.append(seq, 1)  # a step that never completes: its count is not what commit recorded
    seq.token_ids.append(7)
    seq.num_computed_tokens += 1
    shadow.bm.free(seq)
    shadow.live.remove(seq)
    assert not any(len(node.tokens) < 4 for node, _ in shadow.bm.prefix_cache.page_node.values())


@pytest.mark.parametrize("length", [9, 24, 27])
def test_a_repeated_prompt_hits_every_full_page_before_its_last_token(length):
    """Nothing evicted: the second of two identical prompts reuses every full page of its first length - 1
    tokens (the last token is computed for its logits). A match one block short loses sharing without a
    wrong answer, so only a count can catch it."""
    from kvlab import LLM, SamplingParams

    llm = LLM("random:llama-tiny", block_size=4, kv_cache_memory="1MiB", enable_prefix_caching=True)
    prompt = list(range(3, 3 + length))
    first = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    llm.reset_stats()
    again = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    assert again == first
    assert llm.engine.stats()["prefix_hit_tokens"] == (length - 1) // 4 * 4


def test_a_prefix_hit_is_passed_to_allocate_and_belongs_to_its_sequence():
    bm = make_manager([LayerGroup((0,))])
    sim = Shadow(bm)
    first = sim.new_seq([1, 2, 3, 4, 5, 6, 7])
    assert sim.admit(first, 8)  # computes and commits its pages
    second, third = sim.new_seq([1, 2, 3, 4, 5, 6, 9]), sim.new_seq([1, 2, 3, 4, 8, 8, 8])
    hit = bm.lookup(second)
    assert hit.tokens == 6 and bm.lookup(third).tokens == 4  # a lookup changes nothing: look up others between
    with pytest.raises(ValueError, match="prefix hit of sequence 1 was given for sequence 2"):
        bm.can_allocate(third, hit)
    second.num_computed_tokens = hit.tokens
    bm.allocate(second, 1, hit)
    assert bm.block_tables([second], 0)[0][:3] == bm.block_tables([first], 0)[0][:3]  # the hit's pages shared
    fourth = sim.new_seq([1, 2, 3, 4, 5, 6, 7, 1])
    with pytest.raises(ValueError, match="starts at token 0 but its prefix hit holds 6"):
        bm.allocate(fourth, 1, bm.lookup(fourth))
