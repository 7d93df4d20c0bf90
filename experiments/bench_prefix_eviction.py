"""Prefix-cache eviction policies when the pool cannot keep every prefix: token hit rate per policy and per
prefix cache (`hash`: chained block hashes, whole pages; `hash-token`: the same, plus the first tokens of one
more cached page; `radix`: the radix tree, token-granular, keeping partly filled last pages).

The hit rate is a property of the page bookkeeping alone (which pages stay findable), not of the
model, so this drives kvlab's own BlockManager + PagedAllocator + PrefixCache (torch-free) with
synthetic token ids, exactly as the scheduler does (admit with the cached prefix, compute the rest,
commit, decode one token a step, free), for every registered policy at several pool sizes.

Workloads:
  shared-prefix  --num-prefixes system prompts of 200-1000 tokens, chosen by a Zipf(--zipf) law, each
                 followed by a unique 16-64-token question; --decode new tokens per request
  multi-turn     --num-prefixes conversations, each turn's prompt = the previous turn's prompt + its
                 answer + a new 16-64-token message (turns of random conversations interleave)

    python experiments/bench_prefix_eviction.py            # about a minute
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import deque
from pathlib import Path

from kvlab.cache.allocators import PagedAllocator
from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.cache.prefix_cache import PrefixCache
from kvlab.cache.prefix_index import prefix_index
from kvlab.registry import PREFIX_EVICTIONS
from kvlab.sampling_params import SamplingParams
from kvlab.sequence import Sequence

REPO = Path(__file__).resolve().parents[1]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50000) for _ in range(n)]


def shared_prefix(args, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) pairs: a Zipf-chosen system prompt + a unique question."""
    prefixes = [tokens(rng, rng.randint(200, 1000)) for _ in range(args.num_prefixes)]
    weights = [1 / (i + 1) ** args.zipf for i in range(args.num_prefixes)]
    return [(rng.choices(prefixes, weights)[0] + tokens(rng, rng.randint(16, 64)), tokens(rng, args.decode))
            for _ in range(args.num_requests)]


def multi_turn(args, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) pairs: a turn of a random conversation; its answer joins that conversation's history."""
    system = tokens(rng, 300)
    history = [list(system) for _ in range(args.num_prefixes)]
    pairs = []
    for _ in range(args.num_requests):
        c = rng.randrange(args.num_prefixes)
        history[c] += tokens(rng, rng.randint(16, 64))
        pairs.append((list(history[c]), tokens(rng, args.decode)))
        history[c] += pairs[-1][1]
    return pairs


def make_cache(kind: str, policy: str, block_size: int) -> tuple[PrefixCache, str]:
    """A prefix cache by name and the block manager's prefix_match for it."""
    return prefix_index("hash" if kind == "hash-token" else kind, PREFIX_EVICTIONS.build(policy), block_size, b"sim",
                        "token" if kind == "hash-token" else "page")


def simulate(policy: str, num_blocks: int, pairs: list[tuple[list[int], list[int]]], args,
             kind: str = "hash") -> float:
    """Token hit rate of one run: requests admitted in order, at most --concurrency at a time."""
    cache, match = make_cache(kind, policy, args.block_size)
    bm = BlockManager([LayerGroup((0,))], PagedAllocator(), num_blocks, args.block_size, 1 << 20, 1 << 20, cache,
                      match)
    waiting = deque(Sequence(i, p, SamplingParams(max_tokens=args.decode), len(p) + args.decode, 0.0)
                    for i, (p, _) in enumerate(pairs))
    running: list[Sequence] = []
    while waiting or running:
        while waiting and len(running) < args.concurrency:
            hit = bm.lookup(waiting[0])
            if not bm.can_allocate(waiting[0], hit):
                break
            seq = waiting.popleft()
            seq.num_computed_tokens = hit.tokens
            bm.allocate(seq, seq.num_uncomputed_tokens, hit)
            seq.num_computed_tokens = seq.num_tokens
            bm.commit(seq)
            running.append(seq)
        for seq in list(running):  # one decode step: the next answer token
            if seq.num_output_tokens == args.decode:
                bm.free(seq)
                running.remove(seq)
                continue
            seq.token_ids.append(pairs[seq.seq_id][1][seq.num_output_tokens])  # "decoded" token
            if not bm.can_append(seq, 1):
                bm.free(seq)  # preempted: recomputed later (and may hit its own pages)
                running.remove(seq)
                seq.num_computed_tokens = 0
                waiting.appendleft(seq)
                continue
            bm.append(seq, 1)
            seq.num_computed_tokens += 1
            bm.commit(seq)
        if not running and waiting and not bm.can_allocate(waiting[0]):
            raise RuntimeError(f"pool of {num_blocks} pages cannot hold request {waiting[0].seq_id}")
    st = cache.stats
    return st.hit_tokens / st.queried_tokens


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = []
    for workload in ("shared-prefix", "multi-turn"):
        rng = random.Random(args.seed)
        pairs = (shared_prefix if workload == "shared-prefix" else multi_turn)(args, rng)
        prompts = [p for p, _ in pairs]
        distinct = len({tuple(p[:i]) for p in prompts for i in range(args.block_size, len(p) + 1, args.block_size)})
        need = max(-(-(len(p) + args.decode) // args.block_size) for p in prompts) * args.concurrency
        for fraction in args.pool_multiples:
            blocks = int(fraction * need)
            rates = {f"{p}/{c}": simulate(p, blocks, pairs, args, c) for c in args.caches
                     for p in PREFIX_EVICTIONS.names()}
            rows.append((workload, fraction, blocks, distinct, rates))
            print(workload, fraction, blocks, {k: round(v, 3) for k, v in rates.items()}, flush=True)
    write_report(rows, args)


def write_report(rows, args) -> None:
    names = [f"{p}/{c}" for c in args.caches for p in PREFIX_EVICTIONS.names()]
    lines = ["# Prefix-cache eviction policies: token hit rate when the pool cannot keep every prefix", "",
             "Command: `" + " ".join(["python experiments/bench_prefix_eviction.py", *sys.argv[1:]]) + "`  ",
             "Pure bookkeeping (kvlab's BlockManager, PagedAllocator and PrefixCache / RadixCache driven with synthetic token ids; "
             "no model): hit rates do not depend on the machine's load.", "",
             f"{args.num_requests} requests, block {args.block_size}, at most {args.concurrency} running, "
             f"{args.decode} new tokens each; seed {args.seed}. Pool = multiple x the pages the running requests "
             "can need at most (concurrency x the longest request); all policies see the same requests. Columns: "
             "`policy/cache` (hash: whole pages; hash-token: + one partly matched cached page; radix: radix tree, "
             "also keeping partly filled last pages).", "",
             "| workload | pool multiple | pages | distinct prompt pages | " + " | ".join(names) + " |",
             "|" + "---|" * (4 + len(names))]
    for workload, fraction, blocks, distinct, rates in rows:
        lines.append(f"| {workload} | {fraction} | {blocks} | {distinct} | "
                     + " | ".join(f"{rates[n]:.3f}" for n in names) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prefixes", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=600)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-multiples", type=float, nargs="+", default=[1.0, 1.5, 2.0, 3.0],
                   help="pool sizes, in multiples of the pages the running requests can need at most")
    p.add_argument("--caches", nargs="+", default=["hash", "hash-token", "radix"],
                   choices=["hash", "hash-token", "radix"], help="prefix caches compared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "experiments" / "results" / "prefix_eviction.md"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
