"""What each plugin needs and supports, and the one table of combinations the engine refuses.

A plugin declares its capabilities as attributes of its own class (a policy's `compresses`,
`needs_attention_stats`, `head_budgets`, a `select` taking `protected`, the `SparseReadPolicy` mix-in;
a format's `packed` and `backends`; an allocator's `compact` and `allocate_cached`; a draft's
`moves_kv_slots`). `capabilities(...)` reads them into named flags, and `REFUSED` is every combination
that cannot run yet, each with the reason and the way out; `check(...)` raises the first that applies,
before the model loads (the `request` ones when a request is made). The design note's list of refused
combinations is `refused_markdown()` (tests/engine/test_capabilities.py holds them equal).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from kvlab.cache.allocators.base import Allocator
from kvlab.policies.sparse_read import SparseReadPolicy


@dataclass(frozen=True)
class Capabilities:
    """A configuration's plugins, as flags (and the names to quote in an error)."""

    policy: str
    quant: str
    allocator: str
    draft: str | None
    compacts: bool  # the policy compacts block tables (it evicts or compresses tokens)
    compresses_at_decode: bool  # the policy compresses again while decoding (when="decode")
    accumulated_attention: bool  # the policy ranks keys by the attention every query paid them
    head_budgets: bool  # the policy keeps a budget per KV head
    protects_shared_pages: bool  # the policy's select() takes `protected` (leading indices in shared pages)
    sparse_read: bool  # the policy reads only selected pages at decode
    packed: bool  # the format packs several tokens' codes and scales into a page
    rounds: bool  # the format stores K/V coarser than the model computes them (packed, or a narrower dtype)
    residual_window: bool  # the format keeps its newest tokens (more than one) in full precision before sealing
    backends: tuple[str, ...]  # kernel backends that read the format
    allocator_compacts: bool  # the allocator has compact()
    allocator_shares_cached: bool  # the allocator shares cached pages (allocate_cached)
    moves_kv_slots: bool  # the draft moves an accepted path's KV into place slot by slot (token trees)
    reads_target_cache: bool  # the draft reads the target's own cache (pages or a copy of them), writing none of it
    prefix_caching: bool
    keeps_shared_pages: bool  # prefix caching shares a hit's pages, kept whole when the request is compacted
    token_granular_prefix: bool  # a hit may end inside a cached page (radix, or prefix_match='token')
    backend: str  # the kernel backend this configuration runs: 'triton' or 'torch'
    batch_invariant: bool = False  # every row of a pass computed alike (EngineConfig.batch_invariant)
    reuses_compressed_turns: bool = False  # finished compressed turns kept for the next (EngineConfig.reuse_compressed)
    samples: int = 1  # a request's SamplingParams.n (the request-time rows)
    offload: str | None = None  # tiers below the pool (EngineConfig.offload)


def capabilities(config, policy, quant, allocator_cls: type, draft) -> Capabilities:
    cuda = torch.device(config.device).type == "cuda"
    compute = getattr(torch, config.dtype)
    backend = "triton" if config.kernel_backend == "triton" or (config.kernel_backend == "auto" and cuda) else "torch"
    return Capabilities(
        policy=config.policy, quant=config.quant, allocator=config.allocator, draft=config.draft,
        compacts=bool(policy.compresses),
        compresses_at_decode=bool(policy.compresses) and getattr(policy, "when", None) == "decode",
        accumulated_attention=bool(policy.needs_attention_stats),
        head_budgets=bool(policy.head_budgets),
        protects_shared_pages="protected" in inspect.signature(policy.select).parameters,
        sparse_read=isinstance(policy, SparseReadPolicy),
        packed=bool(getattr(quant, "packed", False)),
        rounds=bool(getattr(quant, "packed", False)) or quant.storage_dtype(compute) != compute,
        residual_window=(getattr(quant, "residual", None) or 0) > 1,
        backends=tuple(quant.backends),
        allocator_compacts=allocator_cls.compact is not Allocator.compact,
        allocator_shares_cached=hasattr(allocator_cls, "allocate_cached"),
        moves_kv_slots=bool(getattr(draft, "moves_kv_slots", False)),
        reads_target_cache=bool(getattr(draft, "reads_target_cache", False)),
        prefix_caching=bool(config.enable_prefix_caching),
        keeps_shared_pages=bool(config.enable_prefix_caching) and bool(config.prefix_keep_shared),
        token_granular_prefix=bool(config.enable_prefix_caching) and (config.prefix_cache == "radix"
                                                                     or config.prefix_match == "token"),
        backend=backend,
        batch_invariant=bool(getattr(config, "batch_invariant", False)),
        reuses_compressed_turns=bool(getattr(config, "reuse_compressed", False)),
        offload=getattr(config, "offload", None),
    )


@dataclass(frozen=True)
class Refusal:
    """A combination that cannot run yet: when it `applies`, `error` says why and what to do instead."""

    name: str  # the combination, as the design note lists it
    why: str  # the reason, in a few words, for the design note
    applies: Callable[[Capabilities], bool]
    message: Callable[[Capabilities], str]
    kind: type[Exception] = ValueError
    when: str = "build"  # 'build': before the model loads; 'request': when a request asks for it (n > 1)


REFUSED: list[Refusal] = [
    Refusal("offloading without prefix caching", "tiers hold pages the prefix cache evicts",
            lambda c: c.offload is not None and not c.prefix_caching,
            lambda c: f"offload={c.offload!r} keeps pages evicted from the prefix cache in tiers below the pool (a "
                      f"preempted request's pages reach them through it too); set enable_prefix_caching=True"),
    Refusal("sparse reading with accumulated attention statistics",
            "the statistics of a reduced read are not collected",
            lambda c: c.sparse_read and c.accumulated_attention,
            lambda c: f"policy {c.policy!r} reads selected pages at decode and asks for attention statistics; the "
                      f"statistics of a reduced read are not collected yet",
            NotImplementedError),
    Refusal("a compressing policy with an allocator that cannot compact", "compaction rewrites block tables",
            lambda c: c.compacts and not c.allocator_compacts,
            lambda c: f"policy {c.policy!r} compacts block tables, which the {c.allocator!r} allocator cannot do "
                      f"(it has no compact()); use allocator 'paged' or 'contiguous'"),
    Refusal("prefix caching with a policy whose select cannot protect shared pages",
            "shared pages must be kept as they are",
            lambda c: c.keeps_shared_pages and c.compacts and not c.protects_shared_pages,
            lambda c: f"enable_prefix_caching with policy {c.policy!r} is not supported yet: its select() takes no "
                      f"`protected` argument (the leading cache indices in shared pages, which it must keep); set "
                      f"prefix_keep_shared=False (a hit's pages copied, compressed as without caching), or see "
                      f"kvlab.policies.base.Policy.select"),
    Refusal("prefix caching with a non-paged allocator", "only the paged allocator shares cached pages",
            lambda c: c.prefix_caching and not c.allocator_shares_cached,
            lambda c: f"enable_prefix_caching with allocator {c.allocator!r} is not supported yet; use "
                      f"allocator='paged'"),
    Refusal("a format the kernel backend cannot read", "each format names the backends that read it",
            lambda c: c.backend not in c.backends,
            lambda c: f"quant={c.quant!r}: the {c.backend} kernel backend cannot read this cache format (it is "
                      f"read by: {', '.join(c.backends)}); set kernel_backend='torch'"),
    Refusal("reusing compressed turns without a compressing policy", "nothing is compressed to keep",
            lambda c: c.reuses_compressed_turns and not c.compacts,
            lambda c: f"reuse_compressed keeps the compressed cache of a finished request, and policy {c.policy!r} "
                      f"compresses nothing: use enable_prefix_caching to reuse uncompressed pages"),
    Refusal("reusing compressed turns with a non-paged allocator", "a kept turn's pages are shared by reference",
            lambda c: c.reuses_compressed_turns and not c.allocator_shares_cached,
            lambda c: f"reuse_compressed with allocator {c.allocator!r} is not supported: a kept turn's pages are "
                      f"shared copy-on-write, which only allocator='paged' does"),
]


@dataclass(frozen=True)
class Deviation:
    """A combination that runs but whose cache depends on more than its tokens and the configuration: the
    contract's exception, declared here so the combination suite (kvlab.testing.check_combination) and the
    design note say so instead of a silent difference."""

    name: str
    why: str
    applies: Callable[[Capabilities], bool]
    excuses: tuple[str, ...]  # what may then change the output: 'prefix hits', 'schedule', 'draft'


DEVIATIONS: list[Deviation] = [
    Deviation("prefix caching with a compressing policy keeping shared pages whole",
              "with prefix_keep_shared (the default) a sequence keeps the pages its prefix hit shared whole "
              "(select's `protected`) and compresses the rest, so what it keeps depends on what the cache held "
              "when it was admitted (a second pass, or a preempted request readmitted onto its own cached pages, "
              "may keep more); prefix_keep_shared=False copies a hit's pages and compresses as without caching",
              lambda c: c.keeps_shared_pages and c.compacts, ("prefix hits", "schedule")),
    Deviation("reusing compressed turns",
              "with reuse_compressed a request whose prompt starts with a finished request's prompt + output "
              "continues from that request's compressed cache (its kept slots and the policy's totals; with a packed "
              "format its codes and its open pages' residual rows, with sparse reading its page summaries, as "
              "they were when it finished) and computes only its new tokens, where without the kept turn it computes "
              "and compresses its whole prompt (with prefix caching, after the prefix index's hit): what it keeps, "
              "and so its output, depends on whether the turn was still kept when it was admitted (evicted under pool "
              "pressure, or past reuse_compressed_max_turns, or not fitting the pool then)",
              lambda c: c.reuses_compressed_turns and c.compacts, ("prefix hits", "schedule")),
    Deviation("a rounding format under a changing schedule",
              "K/V computed in a pass of another shape differ in their last bits, which the format's rounding "
              "(codes, scales, a narrower dtype) can turn into a different stored value: outputs may change with "
              "batching, prefill chunking, preemption and the rows a draft adds; batch_invariant=True computes "
              "every row alike (and reads a residual window in token time), which makes it exact",
              lambda c: c.rounds and not c.batch_invariant, ("prefix hits", "schedule", "draft")),
    Deviation("prefix caching with a residual window",
              "a hit's cached pages are sealed (their codes), where a request computing the prefix itself still "
              "reads the last `residual` tokens before the hit's end in full precision for its first rows; "
              "with batch_invariant=True everything else is exact, and formats without a residual window "
              "(fp8, int8, bf16, fp16) are exact with prefix hits too",
              lambda c: c.rounds and c.batch_invariant and c.prefix_caching and c.residual_window,
              ("prefix hits", "schedule")),
]


def deviations(caps: Capabilities) -> list[Deviation]:
    """The declared deviations `caps` runs under."""
    return [d for d in DEVIATIONS if d.applies(caps)]


def check(caps: Capabilities, when: str = "build") -> None:
    """Raise the first refused combination of `when` that `caps` has."""
    for r in REFUSED:
        if r.when == when and r.applies(caps):
            error = r.kind(r.message(caps))
            error.refusal = r.name  # which row: the combination suite tells a refusal from a bad argument
            raise error


def refusal(caps: Capabilities, name: str) -> str | None:
    """The message of refusal `name` if it applies to `caps` (for checks made later, e.g. per request)."""
    r = next(r for r in REFUSED if r.name == name)
    return r.message(caps) if r.applies(caps) else None


def deviations_markdown() -> str:
    """The design note's list of combinations that run outside the contract, one line each."""
    return "\n".join(f"- {d.name}: {d.why} (may change with: {', '.join(d.excuses)})" for d in DEVIATIONS)


def refused_markdown() -> str:
    """The design note's list of refused combinations, one line each."""
    lines = []
    for r in REFUSED:
        at = "when the request is made" if r.when == "request" else "before the model loads"
        lines.append(f"- {r.name}: {r.why} ({at})")
    return "\n".join(lines)
