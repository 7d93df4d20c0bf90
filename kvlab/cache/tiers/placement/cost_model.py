"""Restore or recompute, as a pure function of measured rates and page counts. Torch-free.

    recompute(tokens, start) = tokens * per_token_s + per_token2_s * ((start + tokens)^2 - start^2)
                            the marginal cost of tokens [start, start + tokens) behind `start` cached ones: the
                            step runs anyway, for the new message; a prefill of n tokens costs
                            fixed + per_token_s * n + per_token2_s * n^2 (attention: token i reads i keys)
    restore({tier: n})    = sum over tiers of latency_s[tier] + n * per_page_s[tier]
    keep a page in tier   = (per_page_s[tier] + demote_s[tier]) * margin <= recompute(block_size)

`latency_s` is what a restore pays whatever its size, as the request sees it: the reads ahead handed to the tier's
worker and waited for (the round trip), the bookkeeping; `per_page_s` a page's read and copy. The demotions a
returning request's fresh pages force are paid whichever way it is served (restored or recomputed, its history
takes the same pool pages), so they are no part of that choice; they are part of whether a tier is worth using at
all (`worth`): a page kept in a tier costs its demotion (`demote_s`: a row copy when the tier writes behind, the
file write when it does not) plus its restore, against recomputing its tokens. `crossover_tokens` is the history
length above which restoring wins.

Rates are fitted robustly: the recompute rate through the fastest start-up calibration forward of each size
(`floor_curve` through three sizes, so the attention's quadratic part is seen, `floor_line` through two:
repeated identical forwards, where a shared machine's noise only adds time), else through the
engine's observed (tokens, seconds) steps by `theil_sen` (the median of the pairwise slopes, so one step slowed
down by a neighbour does not swing the rate; the intercept the median of the residuals, floored at 0), as are
the (pages, seconds) restores.
In the spirit of LMCache's and Mooncake's store-vs-recompute trade-off (Cheng et al. 2024, arXiv:2409.13761;
Qin et al. 2024, arXiv:2407.00079).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Rates:
    """Measured (or prior) rates: seconds per recomputed token; per tier (latency s, seconds per page) of a
    restore and seconds per page of a demotion."""

    per_token_s: float
    restore: dict = field(default_factory=dict)  # tier -> (latency_s, per_page_s)
    demote: dict = field(default_factory=dict)  # tier -> seconds per page the step pays to demote
    per_token2_s: float = 0.0  # the quadratic part of a prefill: seconds per token squared


def recompute_seconds(rates: Rates, tokens: int, start: int = 0) -> float:
    """Seconds to compute `tokens` tokens behind `start` cached ones (the marginal cost in a step that runs)."""
    return tokens * rates.per_token_s + rates.per_token2_s * ((start + tokens) ** 2 - start ** 2)


def restore_seconds(rates: Rates, pages: dict[int, int]) -> float:
    """Seconds a request waits to get `pages` ({tier: count}) back: each tier's latency, and its pages."""
    return sum(rates.restore[t][0] + n * rates.restore[t][1] for t, n in pages.items() if n)


def restore_pays(rates: Rates, pages: dict[int, int], tokens: int, margin: float = 1.0, start: int = 0) -> bool:
    """Restore `pages` rather than recompute the `tokens` they hold (behind `start` tokens the hit keeps)?"""
    return restore_seconds(rates, pages) * margin <= recompute_seconds(rates, tokens, start)


def worth(rates: Rates, tier: int, block_size: int, margin: float = 1.0) -> bool:
    """Is keeping a page in `tier` (its demotion, then its restore, the latency spread over a run) at least
    `margin` times cheaper than recomputing its `block_size` tokens?"""
    cost = rates.restore[tier][1] + rates.demote.get(tier, 0.0)
    return cost * margin <= recompute_seconds(rates, block_size)


def crossover_tokens(rates: Rates, tier: int, block_size: int, margin: float = 1.0) -> float:
    """History length (tokens) above which restoring it from `tier` beats recomputing it (inf: never): the root of
    per_token2_s * h^2 + (per_token_s - margin * per_page / block_size) * h = margin * latency."""
    latency, per_page = rates.restore[tier]
    a, b, c = rates.per_token2_s, rates.per_token_s - margin * per_page / block_size, margin * latency
    if a > 0:
        return (-b + (b * b + 4 * a * c) ** 0.5) / (2 * a)
    return c / b if b > 0 else float("inf")


def median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def theil_sen(points) -> tuple[float, float] | None:
    """(intercept >= 0, slope >= 0) of the Theil-Sen line through (x, y) points: the median of the slopes of
    every pair with distinct x, the intercept the median of y - slope * x; None unless two x differ."""
    points = list(points)
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 != x1]
    if not slopes:
        return None
    slope = max(median(slopes), 0.0)
    return max(median([y - slope * x for x, y in points]), 0.0), slope


def floor_line(points) -> tuple[float, float] | None:
    """(intercept >= 0, slope >= 0) of the line through the fastest y at the smallest and the largest x: timings
    of identical work repeated, where noise only ever adds time (the minimum is the steady estimate); None
    unless two x differ."""
    points = list(points)
    xs = {x for x, _ in points}
    if len(xs) < 2:
        return None
    lo, hi = min(xs), max(xs)
    y_lo, y_hi = min(y for x, y in points if x == lo), min(y for x, y in points if x == hi)
    slope = max((y_hi - y_lo) / (hi - lo), 0.0)
    return max(y_lo - slope * lo, 0.0), slope


def floor_curve(points) -> tuple[float, float, float] | None:
    """(fixed >= 0, per token >= 0, per token squared > 0) of the parabola through the fastest y at the smallest,
    a middle and the largest x (repeated identical work: the minimum is the steady estimate); None unless three
    x differ and the curve bends upward (else the straight `floor_line` holds)."""
    points = list(points)
    xs = sorted({x for x, _ in points})
    if len(xs) < 3:
        return None
    x1, x2, x3 = xs[0], xs[len(xs) // 2], xs[-1]
    y1, y2, y3 = (min(y for x, y in points if x == k) for k in (x1, x2, x3))
    s12, s23 = (y2 - y1) / (x2 - x1), (y3 - y2) / (x3 - x2)
    a = (s23 - s12) / (x3 - x1)
    if a <= 0:
        return None
    b = max(s12 - a * (x1 + x2), 0.0)
    return max(y1 - b * x1 - a * x1 * x1, 0.0), b, a


def fit(points) -> tuple[float, float] | None:
    """(intercept >= 0, slope) of the least-squares line through (x, y) points; None unless two x differ."""
    points = list(points)
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    if slope <= 0:
        return my, 0.0
    return max(my - slope * mx, 0.0), slope
