"""Which of the target's own pages a self-speculating draft reads: a page-granular view of its cache. Torch-free.

A view is chosen by a registered cache policy (`draft_args.policy` / `policy_args` of the `self_compressed`
draft, kvlab/speculation/drafts/self_compressed.py) but never evicts anything: it names the table
positions of a sequence's *full* pages that the draft's attention reads (the partial last page, the
newest tokens, is always read: the draft holds a copy of it in its scratch). Supported:

    streaming_llm   StreamingLLM's attention sinks plus a recent window (Xiao et al. 2023, arXiv:2309.17453),
                    at page granularity: the pages holding the first `n_sink` tokens, then the most recent
                    full pages, `budget // block_size` pages in all with the newest (partial) one
                    (`compression_ratio` r: int(n * (1 - r)) tokens of a sequence of n)
    full            every page (the draft reads what the target reads: a layerskip-style draft over the
                    target's own cache, or, with every layer, the target itself)

Query-aware page selection (Quest) needs the draft's own queries and is refused with the list above; a
token-level policy (SnapKV, H2O, ...) is no page view but a token view, a compacted copy
(kvlab/speculation/drafts/token_view.py). Over a packed target, or with a quantised view, the draft reads a
copy of these pages' tokens (kvlab/speculation/drafts/view_copy.py) instead of the pages themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED = ("streaming_llm", "full")


@dataclass(frozen=True)
class PageView:
    """The pages a draft reads of a sequence: `sink_tokens` leading tokens, and `tokens(n)` in all."""

    name: str
    sink_tokens: int = 0
    budget: int | None = None  # tokens read (None with ratio None: every page)
    ratio: float | None = None  # or the fraction of a sequence's tokens left out

    def tokens(self, num_tokens: int) -> int:
        """Tokens the view of a sequence caching `num_tokens` holds (at page granularity: rounded down)."""
        if self.budget is not None:
            return min(num_tokens, self.budget)
        if self.ratio is not None:
            return min(num_tokens, max(1, int(num_tokens * (1.0 - self.ratio))))
        return num_tokens

    def full_pages(self, num_tokens: int, block_size: int) -> list[int]:
        """Table positions of the full pages read of a sequence caching `num_tokens` (its partial last
        page, positions >= num_tokens // block_size, is read besides): the sink pages, then the most recent."""
        full = num_tokens // block_size
        if self.tokens(num_tokens) >= num_tokens:  # the view holds everything
            return list(range(full))
        pages = max(1, self.tokens(num_tokens) // block_size) - (1 if num_tokens % block_size else 0)
        if pages >= full:
            return list(range(full))
        sinks = min(-(-self.sink_tokens // block_size), max(pages, 0))
        recent = max(pages - sinks, 0)
        return list(range(sinks)) + list(range(full - recent, full))


def page_view(policy) -> PageView:
    """The page-granular view a built policy names; ValueError naming what is supported otherwise."""
    name = getattr(type(policy), "registry_name", type(policy).__name__)
    if name == "full":
        return PageView("full")
    if name == "streaming_llm":
        if policy.budget is None and policy.compression_ratio is None:
            raise ValueError("draft self_compressed: policy streaming_llm needs policy_args.budget (tokens the draft "
                             "reads per sequence) or policy_args.compression_ratio")
        return PageView(name, policy.n_sink, policy.budget, policy.compression_ratio)
    kind = ("query-aware page selection (the draft's own queries would choose its pages)"
            if getattr(policy, "reads_sparsely", None) else "a token-granular view (it needs a compacted copy)")
    raise ValueError(f"draft self_compressed: policy {name!r} would be {kind}, which is not supported yet; "
                     f"supported views: {', '.join(SUPPORTED)} (page-granular, over the target's own pages), or a "
                     f"token-level policy with a budget (snapkv, h2o, tova, ...: a compacted copy)")
