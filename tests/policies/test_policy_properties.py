"""What each built-in policy keeps, checked against the papers on tiny hand-built inputs (no model).

For every compressing built-in: the number of tokens a layer keeps equals the budget computed here from
the policy's arguments (kvpress's `max(1, int(n * (1 - compression_ratio)))`, or `budget`; PyramidKV's
and RocketKV's own schedules written out from their papers), never from `policy.layer_budget`; the
tokens a paper always keeps are kept (StreamingLLM's sinks and recent window, H2O's recent window, the
observation window of SnapKV / PyramidKV / ChunkKV / RocketKV, TOVA's last token, Expected Attention's
sinks); and the rest is the top of a score recomputed from scratch here (loops in float64 over the
paper's formula, not the policy's tensor code). `test_every_builtin_policy_has_property_tests` fails
when a built-in is registered without a case here.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvlab.policies  # noqa: F401  (registers the built-ins)
from kvlab.registry import POLICIES

L, HKV, HQ, D = 40, 2, 4, 8  # a tiny layer: 40 cached tokens, 2 KV heads (2 query heads each), head_dim 8


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def inputs(n: int = L, seed: int = 0, hkv: int = HKV, hq: int = HQ, w: int | None = None):
    """keys / values [n, Hkv, D], queries [w or n, Hq, D] (sharp enough that attention is far from uniform),
    attention statistics [n, Hkv] (positive, distinct)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, hkv, D, generator=g)
    values = torch.randn(n, hkv, D, generator=g)
    queries = 3 * torch.randn(w or n, hq, D, generator=g)
    stats = torch.rand(n, hkv, generator=g) + 0.01
    return keys, values, queries, stats


def kvpress_kept(n: int, budget: int | None = None, ratio: float | None = None) -> int:
    """Tokens a layer keeps of n (kvpress 0.5.5: int(n * (1 - compression_ratio)), at least 1)."""
    if budget is not None:
        return min(n, budget)
    return min(n, max(1, int(n * (1 - (ratio or 0.0)))))


def per_head(kept, hkv: int = HKV) -> list[list[int]]:
    """A policy's kept indices as one sorted list per KV head; checks the shape rules of `select`."""
    assert kept is not None, "the policy kept everything"
    heads = kept if kept and isinstance(kept[0], list) else [kept] * hkv
    assert len(heads) == hkv
    for h in heads:
        assert h == sorted(set(h)), "kept indices must be sorted and distinct"
    return heads


def top(scores: list[float], k: int, among: list[int] | None = None) -> set[int]:
    """The k best indices of `scores` (among `among`), by a plain sort."""
    among = list(range(len(scores))) if among is None else among
    return set(sorted(among, key=lambda i: -scores[i])[:k])


def build(name: str, **args):
    return POLICIES.build(name, **args)


# -- from-scratch scores (float64 loops over the papers' formulas) -------------------------------------
def window_probs(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[Hq, W, L] causal softmax of each window query over the keys up to it (query i at index L - W + i),
    scaled by 1/sqrt(D); query head h reads KV head h // (Hq / Hkv) (HF's repeat_kv layout)."""
    w, hq, d = queries.shape
    n, hkv, _ = keys.shape
    g = hq // hkv
    out = torch.zeros(hq, w, n, dtype=torch.float64)
    for h in range(hq):
        k = keys[:, h // g].double()
        for i in range(w):
            upto = n - w + i + 1
            out[h, i, :upto] = torch.softmax(k[:upto] @ queries[i, h].double() / math.sqrt(d), dim=0)
    return out


def snap_votes(queries: torch.Tensor, keys: torch.Tensor, kernel: int) -> list[list[float]]:
    """SnapKV's votes per KV head for the keys before the window: the window's mean attention (mean over
    its queries and the query heads of the KV head), pooled by a centred average of `kernel` (zeros
    outside counted, as kvpress's avg_pool1d)."""
    w, hq, _ = queries.shape
    n, hkv, _ = keys.shape
    g = hq // hkv
    probs = window_probs(queries, keys)
    votes = []
    for kv in range(hkv):
        raw = [float(probs[kv * g:(kv + 1) * g, :, j].mean()) for j in range(n - w)]
        half = kernel // 2
        votes.append([sum(raw[m] for m in range(j - half, j + half + 1) if 0 <= m < n - w) / kernel
                      for j in range(n - w)])
    return votes


def snap_kept(queries, keys, kernel: int, keep: int) -> list[set[int]]:
    """Per KV head: the window (the last W tokens) plus the best-voted keep - W before it."""
    n, w = keys.shape[0], queries.shape[0]
    assert keep >= w
    return [set(range(n - w, n)) | top(v, keep - w) for v in snap_votes(queries, keys, kernel)]


# -- the guard -----------------------------------------------------------------------------------------
PROPERTY_TESTED = {"streaming_llm", "h2o", "snapkv", "pyramidkv", "chunkkv", "tova", "knorm", "keydiff",
                   "expected_attention", "random", "adakv", "rocketkv"}
NON_EVICTING = {"quest": "reads selected pages at decode, evicts nothing: test_quest_reads_the_sink_page_and_bounds"}


def test_every_builtin_policy_has_property_tests():
    builtin = {n for n in POLICIES.names() if POLICIES.get(n).__module__.startswith("kvlab.policies.")}
    compressing = {n for n in builtin if POLICIES.get(n).compresses}
    assert compressing == PROPERTY_TESTED, (
        f"compressing built-ins without property tests here: {sorted(compressing - PROPERTY_TESTED)}")
    assert builtin - compressing == {"full", *NON_EVICTING}


# -- the budget, computed independently ------------------------------------------------------------------
UNIFORM = {  # policy -> extra arguments; these keep kvpress's uniform budget in every layer
    "streaming_llm": {}, "h2o": {"recent": 4}, "snapkv": {"window_size": 4}, "chunkkv": {"window_size": 4},
    "tova": {}, "knorm": {}, "keydiff": {}, "expected_attention": {"n_future_positions": 16}, "random": {},
}


def select(policy, n: int, seed: int = 0, layer: int = 0, num_layers: int = 2):
    keys, values, queries, stats = inputs(n, seed)
    policy.begin(n)
    if "expected_attention" in type(policy).__module__:
        policy._rope = rope
    w = min(policy.query_window, n) if policy.query_window else n
    return policy.select(layer, num_layers, keys, values, queries[-w:], stats)


@pytest.mark.parametrize("name", sorted(UNIFORM))
@pytest.mark.parametrize("n, limit", [(40, {"budget": 12}), (40, {"compression_ratio": 0.5}),
                                      (37, {"compression_ratio": 0.3}), (23, {"compression_ratio": 0.75}),
                                      (33, {"budget": 32})])
def test_kept_count_is_the_kvpress_budget(name, n, limit):
    """int(37 * 0.7) = 25, int(23 * 0.25) = 5, ...: every KV head keeps exactly that many (not one more)."""
    policy = build(name, **UNIFORM[name], **limit)
    heads = per_head(select(policy, n))
    want = kvpress_kept(n, limit.get("budget"), limit.get("compression_ratio"))
    assert [len(h) for h in heads] == [want] * HKV
    assert all(0 <= i < n for h in heads for i in h)


def test_a_budget_covering_the_cache_keeps_everything():
    for name, extra in UNIFORM.items():
        assert select(build(name, **extra, budget=40), 40) is None, name
        assert select(build(name, **extra, compression_ratio=0.0), 40) is None, name


def pyramid_budgets(n: int, num_layers: int, w: int, beta: float, c: float) -> list[int]:
    """PyramidKV's per-layer budgets as its reference code (and kvpress) compute them: min = c / beta,
    max = 2c - min; if max >= n - w: max = n - w, min = 2c - max; unless n >= max >= min >= w every layer
    keeps round(c); otherwise layer l keeps round(max - l (max - min) / (L - 1))."""
    lo, hi = c / beta, 2 * c - c / beta
    if hi >= n - w:
        hi, lo = n - w, 2 * c - (n - w)
    if not n >= hi >= lo >= w:
        return [max(1, round(c))] * num_layers
    return [round(hi - layer * (hi - lo) / (num_layers - 1)) for layer in range(num_layers)]


@pytest.mark.parametrize("n, ratio, w, first, last", [
    (317, 0.5, 8, 309, 8),  # clamped (kvpress on SmolLM2: 309 -> 8)
    (577, 0.5, 8, 563, 14),  # unclamped: 563 -> 14
    (577, 0.5, 64, 513, 64),  # the last layer keeps exactly the window
    (375, 0.75, 64, 94, 94),  # the fallback rounds (SnapKV would keep int(93.75) = 93)
])
def test_pyramidkv_budgets_fall_with_depth_as_kvpress_keeps_them(n, ratio, w, first, last):
    """The first and last layers' budgets on 30 layers, as kvpress 0.5.5 kept them on SmolLM2 prompts
    (experiments/kvpress_parity/README.md), and the mean over layers is the uniform budget."""
    policy = build("pyramidkv", compression_ratio=ratio, window_size=w)
    got = [policy.layer_budget(layer, 30, n) for layer in range(30)]
    assert got == pyramid_budgets(n, 30, w, 20.0, n * (1 - ratio))
    assert (got[0], got[-1]) == (first, last)
    assert got == sorted(got, reverse=True) and abs(sum(got) / 30 - n * (1 - ratio)) <= 0.5


def test_pyramidkv_keeps_its_layer_budget_of_snapkv_votes_and_the_window():
    n, w, num_layers = 40, 4, 4
    policy = build("pyramidkv", budget=12, window_size=w, beta=2.0)
    keys, values, queries, _ = inputs(n, seed=1, w=w)
    want = pyramid_budgets(n, num_layers, w, 2.0, 12.0)
    assert len(set(want)) > 1  # the pyramid is on: budgets differ between layers
    for layer in range(num_layers):
        policy.begin(n)
        heads = per_head(policy.select(layer, num_layers, keys, values, queries, None))
        assert [set(h) for h in heads] == snap_kept(queries, keys, 5, want[layer]), layer


def rocketkv_prompt_budget(n: int, budget: int, window: int) -> int:
    """RocketKV's stage-1 budget (arXiv:2502.14051): n / c^r with c = n / budget, r = min(0.2 + 0.06 log2 c,
    0.8), at least the observation window."""
    c = max(1.0, n / budget)
    r = min(0.2 + 0.06 * math.log2(c), 0.8)
    return min(n, max(window, int(n / c ** r)))


def test_rocketkv_prompt_budget_follows_the_paper_and_keeps_snapkv_votes():
    policy = build("rocketkv", budget=64, window_size=8, kernel_size=5)
    assert policy.layer_budget(0, 2, 400) == rocketkv_prompt_budget(400, 64, 8) == 207  # 400 / 6.25^0.3586
    assert policy.layer_budget(0, 2, 64) == 64  # c = 1: nothing to evict
    n = 200
    keep = rocketkv_prompt_budget(n, 16, 8)
    policy = build("rocketkv", budget=16, window_size=8, kernel_size=5)
    keys, values, queries, _ = inputs(n, seed=2, w=8)
    policy.begin(n)
    heads = per_head(policy.select(0, 2, keys, values, queries, None))
    assert [set(h) for h in heads] == snap_kept(queries, keys, 5, keep)


# -- what each paper always keeps, and the ranking of the rest ---------------------------------------------
@pytest.mark.parametrize("n_sink", [4, 1, 0])
def test_streaming_llm_keeps_the_sinks_and_the_recent_window(n_sink):
    heads = per_head(select(build("streaming_llm", budget=12, n_sink=n_sink), 40))
    sinks, recent = set(range(n_sink)), set(range(40 - (12 - n_sink), 40))
    assert all(set(h) == sinks | recent for h in heads)
    heads = per_head(select(build("streaming_llm", compression_ratio=0.5), 40))  # 20 kept: 4 sinks + 16 recent
    assert all(set(h) == set(range(4)) | set(range(24, 40)) for h in heads)


def test_h2o_keeps_the_recent_window_and_the_heaviest_hitters():
    keys, values, _, stats = inputs(40, seed=3)
    policy = build("h2o", budget=14, recent=6)
    policy.begin(40)
    heads = per_head(policy.select(0, 2, keys, values, None, stats))
    for h, kept in enumerate(heads):
        recent = set(range(34, 40))
        assert recent <= set(kept)
        assert set(kept) - recent == top(stats[:, h].tolist(), 8, list(range(34))), h


def test_h2o_without_a_recent_window_keeps_the_heaviest_hitters_only():
    keys, values, _, stats = inputs(40, seed=4)
    stats[-5:] = 0.0  # the most recent tokens received the least attention
    policy = build("h2o", budget=10, recent=0)
    policy.begin(40)
    heads = per_head(policy.select(0, 2, keys, values, None, stats))
    assert [set(h) for h in heads] == [top(stats[:, h].tolist(), 10) for h in range(HKV)]


@pytest.mark.parametrize("seed", [0, 5])
def test_snapkv_keeps_its_observation_window_and_the_best_voted_tokens(seed):
    keys, values, queries, _ = inputs(40, seed=seed, w=6)
    policy = build("snapkv", budget=16, window_size=6, kernel_size=5)
    policy.begin(40)
    heads = per_head(policy.select(0, 2, keys, values, queries, None))
    want = snap_kept(queries, keys, 5, 16)
    assert [set(h) for h in heads] == want
    assert want[0] != want[1]  # the heads disagree: each keeps its own tokens


def test_snapkv_one_set_per_layer_sums_the_heads_votes():
    keys, values, queries, _ = inputs(40, seed=6, w=6)
    policy = build("snapkv", budget=16, window_size=6, per_head=False)
    policy.begin(40)
    kept = policy.select(0, 2, keys, values, queries, None)
    assert not isinstance(kept[0], list)
    votes = snap_votes(queries, keys, 5)
    total = [votes[0][j] + votes[1][j] for j in range(34)]
    assert set(kept) == set(range(34, 40)) | top(total, 10)


def test_chunkkv_keeps_the_best_whole_chunks_window_first():
    n, w, c = 43, 4, 5
    keys, values, queries, _ = inputs(n, seed=7, w=w)
    policy = build("chunkkv", budget=17, window_size=w, chunk_size=c)
    policy.begin(n)
    kept = policy.select(0, 2, keys, values, queries, None)
    assert len(kept) == 17 and set(range(n - w, n)) <= set(kept)
    votes = snap_votes(queries, keys, 5)
    token = [votes[0][j] + votes[1][j] for j in range(n - w)] + [math.inf] * w  # the window above every vote
    chunks = [list(range(s, min(s + c, n))) for s in range(0, n, c)]
    order = sorted(range(len(chunks)), key=lambda k: -sum(token[i] for i in chunks[k]))
    want: list[int] = []
    for k in order:
        want += chunks[k][: 17 - len(want)]
    assert set(kept) == set(want)


def test_tova_keeps_the_last_token_and_what_the_last_query_attends_to():
    keys, values, queries, _ = inputs(40, seed=8, w=1)
    policy = build("tova", budget=10)
    policy.begin(40)
    heads = per_head(policy.select(0, 2, keys, values, queries, None))
    probs = window_probs(queries, keys)[:, 0]  # [Hq, L]: the last query's attention
    score = probs.mean(dim=0).tolist()  # averaged over all query heads: one set for every KV head
    want = {39} | top(score, 9, list(range(39)))
    assert [set(h) for h in heads] == [want, want]


def test_knorm_keeps_the_smallest_key_norms():
    keys, *_ = inputs(40, seed=9)
    heads = per_head(select(build("knorm", budget=10), 40, seed=9))
    for h in range(HKV):
        norms = [math.sqrt(sum(float(x) ** 2 for x in keys[i, h])) for i in range(40)]
        assert set(heads[h]) == top([-x for x in norms], 10), h


def test_keydiff_keeps_the_keys_least_like_the_mean_direction():
    keys, *_ = inputs(40, seed=10)
    heads = per_head(select(build("keydiff", budget=10), 40, seed=10))
    for h in range(HKV):
        unit = [keys[i, h].double() / keys[i, h].double().norm() for i in range(40)]
        anchor = sum(unit) / 40
        cos = [float(u @ anchor / anchor.norm()) for u in unit]
        assert set(heads[h]) == top([-x for x in cos], 10), h


# Expected Attention needs the model's RoPE: a plain one (HF's half-split layout, base 10000) stands in.
def rope(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = positions.double()[:, None] * inv[None]
    angles = torch.cat([angles, angles], dim=-1)  # [P, D]
    return angles.cos().float(), angles.sin().float()


def rotation(p: int) -> torch.Tensor:
    """The RoPE rotation at position p as a D x D matrix: channel pairs (i, i + D/2) turned by p * theta_i."""
    half = D // 2
    m = torch.zeros(D, D, dtype=torch.float64)
    for i in range(half):
        a = p / 10000 ** (2 * i / D)
        m[i, i], m[i, i + half], m[i + half, i], m[i + half, i + half] = math.cos(a), -math.sin(a), math.sin(a), \
            math.cos(a)
    return m


def test_expected_attention_keeps_its_sinks_and_ranks_by_the_expected_attention():
    """Devoto et al.: queries ~ N(mu, Sigma) from the prompt's pre-RoPE queries (sinks left out); future
    positions n .. n + F - 1 average the rotation (R); logit = (R mu) . k / sqrt(d) + k^T R Sigma R^T k / 2d;
    softmax over keys, mean over the KV head's query heads, times ||v||."""
    n, sinks, future = 30, 2, 6
    g = torch.Generator().manual_seed(11)
    pre = torch.randn(n, HQ, D, generator=g, dtype=torch.float64)  # pre-RoPE queries
    post = torch.stack([pre[p] @ rotation(p).T for p in range(n)]).float()  # what the engine records
    keys = torch.randn(n, HKV, D, generator=g)
    values = torch.randn(n, HKV, D, generator=g)
    policy = build("expected_attention", budget=12, n_sink=sinks, n_future_positions=future)
    policy._rope = rope
    policy.begin(n)
    heads = per_head(policy.select(0, 2, keys, values, post, None))
    q = pre[sinks:]
    mean = q.mean(dim=0)  # [Hq, D]
    r = sum(rotation(p) for p in range(n, n + future)) / future
    for kv in range(HKV):
        score = [0.0] * n
        for h in range(kv * 2, kv * 2 + 2):
            centred = q[:, h] - mean[h]
            cov = r @ (centred.T @ centred / q.shape[0]) @ r.T
            mu = r @ mean[h]
            logits = torch.tensor([float(mu @ keys[i, kv].double()) / math.sqrt(D)
                                   + float(keys[i, kv].double() @ cov @ keys[i, kv].double()) / (2 * D)
                                   for i in range(sinks, n)])
            probs = torch.softmax(logits, dim=0)
            for j, i in enumerate(range(sinks, n)):
                score[i] += float(probs[j]) / 2 * float(values[i, kv].double().norm())
        assert set(heads[kv]) == set(range(sinks)) | top(score, 12 - sinks, list(range(sinks, n))), kv


def test_random_keeps_a_uniform_reproducible_subset_shared_by_the_heads():
    policy = build("random", budget=16, seed=3)
    kept = [per_head(select(policy, 40, layer=layer)) for layer in range(300)]
    assert all(h[0] == h[1] for h in kept)  # one set per layer
    assert kept[5] == per_head(select(build("random", budget=16, seed=3), 40, seed=99, layer=5))  # keys do not matter
    assert kept[5] != per_head(select(build("random", budget=16, seed=4), 40, layer=5))  # the seed does
    counts = [sum(i in h[0] for h in kept) / 300 for i in range(40)]  # each token kept with probability 16 / 40
    assert all(0.25 < c < 0.55 for c in counts), counts


def test_adakv_shares_the_layer_budget_adaptively_above_a_safeguard():
    """Feng et al.: the layer keeps budget x Hkv tokens; every head its best alpha x budget first, then the
    best remaining scores over all heads (scores: SnapKV's, the window above every vote)."""
    n, w, budget, alpha = 40, 4, 10, 0.2
    keys, values, queries, _ = inputs(n, seed=12, w=w)
    queries[:, :2] *= 4  # KV head 0's attention is concentrated, head 1's dispersed
    queries[:, 2:] *= 0.1
    policy = build("adakv", budget=budget, alpha_safeguard=alpha, scorer_args={"window_size": w})
    policy.begin(n)
    heads = per_head(policy.select(0, 2, keys, values, queries, None))
    votes = snap_votes(queries, keys, 5)
    score = [v + [math.inf] * w for v in votes]  # [Hkv][L]
    safe = max(1, int(budget * alpha))
    chosen = [top(score[h], safe) for h in range(HKV)]
    rest = sorted(((h, i) for h in range(HKV) for i in range(n) if i not in chosen[h]),
                  key=lambda x: -score[x[0]][x[1]])  # the best remaining (head, token) pairs of the layer
    for h, i in rest[: budget * HKV - safe * HKV]:
        chosen[h].add(i)
    assert [set(k) for k in heads] == chosen
    assert sum(len(k) for k in heads) == budget * HKV and len(heads[0]) != len(heads[1])  # the heads differ
    assert all(set(range(n - w, n)) <= set(k) for k in heads)


def test_quest_reads_the_sink_page_and_bounds():
    """Quest evicts nothing; its page criticality sum_d max(q_d min_d, q_d max_d) bounds every q . k of the
    page (Tang et al.), and the sink page is always read."""
    from kvlab.policies.quest import quest_bounds

    policy = build("quest", budget=32)
    keys, values, queries, stats = inputs(40, seed=13)
    assert policy.select(0, 2, keys, values, queries, stats) is None
    g = torch.Generator().manual_seed(14)
    pages = torch.randn(3, 4, HKV, D, generator=g)  # 3 pages of 4 keys
    bounds = torch.cat([pages.amax(dim=1), -pages.amin(dim=1)], dim=-1)[None]  # [1, 3, Hkv, 2D]
    q = torch.randn(1, HQ, D, generator=g)
    u = quest_bounds(q, bounds)[0]  # [Hkv, g, NB]
    for h in range(HQ):
        for p in range(3):
            best = max(float(q[0, h] @ pages[p, j, h // 2]) for j in range(4))
            assert u[h // 2, h % 2, p] >= best - 1e-5
    mass = policy.page_scores(0, q, bounds, torch.full((1, 3), 4), 1.0)
    assert mass[0, 0] == math.inf and torch.isfinite(mass[0, 1:]).all()


def test_snapkv_with_a_budget_below_its_window_compresses_while_decoding():
    """A budget below the observation window: after the first compression fewer tokens are cached than the
    window has queries; the next scoring votes with the queries of the tokens still cached (it raised
    "keep must be sorted" before), and every compression keeps the budget."""
    from kvlab import LLM, SamplingParams

    llm = LLM("random:llama-tiny", policy="snapkv",
              policy_args={"budget": 8, "window_size": 16, "when": "decode", "every": 4})
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(out.token_ids) == 24
    stats = llm.engine.stats()
    assert stats["policy_compressions"] >= 5, stats
