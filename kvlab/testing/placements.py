"""The placement conformance suite: a placement decides where an offloaded page lives, never what it holds.

    from kvlab.testing import check_placement

    def test_my_placement_conforms():
        check_placement("my_placement")

Each check raises AssertionError naming what failed:
- bookkeeping (model-free, `Places` over a host and a disk tier of a few pages, driven by seeded random
  demotions, hits and discards): every page is in exactly one place (the pool, one tier, or reported
  dropped), no tier holds more than its budget, a restored page carries what was demoted (through any
  spills), and the placement only names pages of the tier it is asked about;
- outputs: greedy tokens with the placement over `host_disk` tiers equal those without offloading, on a pool
  small enough that prefix-cache pages are evicted and hit again, and after `close` no tier holds a page.
"""

from __future__ import annotations

import random

from kvlab.cache.tiers.places import Places
from kvlab.llm import LLM
from kvlab.registry import PLACEMENTS, load_plugins
from kvlab.sampling_params import SamplingParams
from kvlab.testing.policies import prompts


class FakeMover:
    """Tiers as dicts: key -> the payload of the page it was demoted from (a page's contents are its id)."""

    def __init__(self, num_tiers: int, pool: dict):
        self.tiers = [dict() for _ in range(num_tiers)]
        self.pool = pool  # page -> payload

    def movable(self, page):
        return True

    def demote(self, page, tier, key):
        assert key not in self.tiers[tier], f"key {key} demoted into tier {tier}, which holds it already"
        self.tiers[tier][key] = self.pool[page]

    def behind_seconds(self, tier):
        return 0.0

    def restore_many(self, items):
        for key, tier, page in items:
            self.pool[page] = self.tiers[tier].pop(key)
        return {tier: 0.0 for _, tier, _ in items}

    def spill(self, key, src, dst):
        assert dst != src and key not in self.tiers[dst], f"key {key} spilled from tier {src} into {dst} twice"
        self.tiers[dst][key] = self.tiers[src].pop(key)

    def discard(self, key, tier):
        self.tiers[tier].pop(key)

    def tier_len(self, tier):
        return len(self.tiers[tier])

    def ready(self, key, tier):
        return True

    def start_read(self, key, tier):
        raise AssertionError(f"key {key} is in memory: nothing to read")

    def poll(self):
        return []

    def wait(self):
        pass


def check_bookkeeping(name: str, args: dict | None = None, steps: int = 3000, seed: int = 0,
                      capacities: tuple[int, int] = (3, 5)) -> None:
    """Drive `Places` with placement `name` through seeded random events; check the invariants after each."""
    load_plugins()
    rng = random.Random(seed)
    pool: dict = {}
    mover = FakeMover(len(capacities), pool)
    places = Places(["host", "disk"], list(capacities), PLACEMENTS.build(name, **(args or {})), 4096, 16, mover)
    dropped: set = set()
    places.on_drop = dropped.add
    payload: dict = {}  # key -> what it held when it left the pool
    in_pool: dict = {}  # key -> page holding it
    next_page = 0
    for step in range(steps):
        op = rng.random()
        if op < 0.5 or not places.tier_of:  # a page (an old block back in the pool, or a new one) is evicted
            key = rng.choice(list(in_pool)) if in_pool and rng.random() < 0.5 else ("k", step)
            page = in_pool.pop(key, None)
            if page is None:
                page, next_page = next_page, next_page + 1
                pool[page] = payload[key] = (key, step)
            if not places.demote(key, page):
                dropped.add(key)
        elif op < 0.85:  # a hit restores a few held pages
            keys = rng.sample(list(places.tier_of), min(len(places.tier_of), rng.randint(1, 3)))
            places.claim(keys)
            for key in keys:
                page, next_page = next_page, next_page + 1
                places.restore(key, page)
                assert pool[page] == payload[key], f"placement {name!r}: page {key} came back holding {pool[page]}"
                in_pool[key] = page
        else:  # the pool holds a block again (registered anew): its tier copy goes
            places.discard(rng.choice(list(places.tier_of)))
        try:
            places.check()
        except AssertionError as exc:
            raise AssertionError(f"placement {name!r}, step {step}: {exc}") from None
        for key in places.tier_of:
            assert key not in dropped and key not in in_pool, f"placement {name!r}: page {key} is in two places"


def check_outputs(name: str, args: dict | None = None, model: str = "random:llama-tiny", max_tokens: int = 8) -> None:
    """Greedy outputs with placement `name` over host_disk tiers equal outputs without tiers; close drains."""
    load_plugins()
    engine = dict(block_size=4, max_model_len=128, kv_cache_memory="24KiB", max_num_batched_tokens=32,
                  enable_prefix_caching=True)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ref = LLM(model, **engine)
    system = prompts(ref.model_config.vocab_size, lengths=(23,))[0]
    batch = [system + p for p in prompts(ref.model_config.vocab_size, lengths=(5, 6, 7, 8, 9, 10), seed=1)]
    want = [[o.token_ids for o in ref.generate(b, params)] for b in (batch[:3], batch[3:], batch)]
    llm = LLM(model, offload="host_disk", offload_args={"memory": "4KiB", "disk_memory": "16KiB"},
              offload_placement=name, offload_placement_args=args or {}, **engine)
    got = [[o.token_ids for o in llm.generate(b, params)] for b in (batch[:3], batch[3:], batch)]
    stats = llm.stats()
    assert stats["tier_demoted"] > 0, f"placement {name!r}: no page went down a tier, so the check did not run"
    assert got == want, f"placement {name!r}: tokens with tiers differ from tokens without"
    folder = llm.engine.kv.tiers[1].folder
    llm.close()
    assert llm.stats()["tier_pages_held"] == 0 and not folder.exists(), f"placement {name!r}: tiers not drained"


def check_placement(name: str, args: dict | None = None, **engine_args) -> None:
    """Both checks for placement `name` with `args`."""
    check_bookkeeping(name, args)
    check_outputs(name, args, **engine_args)
