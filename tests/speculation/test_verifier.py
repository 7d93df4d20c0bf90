"""Speculative rejection sampling is lossless: emitted tokens follow the target distribution.

A toy target and draft on a 6-token vocabulary, each a Markov chain (the next-token distribution
depends on the previous token), so the verifier must use the right row for each draft position.
10^5 rows are verified at once; the first emitted token and the first two (a consecutive pair,
spanning a second verification round when the first draft is rejected) are checked with a
chi-square test against P[s] and P[s][x] * P[x][y]. scipy is not installed here: the statistic is
computed by hand, against the 99.9% quantile from the Wilson-Hilferty approximation.
"""

from __future__ import annotations


import pytest
import torch

from kvlab.speculation.verifier import acceptance_histogram, inverse_cdf, point_masses, speculative_sample

from helpers import CASES, V, chain, chi2_critical, chi_square

K, N, START = 3, 100_000, 0


def verify_round(P, Q, prev: torch.Tensor, g, point: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification of K drafts after token `prev` [B] -> (accepted [B], emitted [B, K+1], padded)."""
    B = prev.shape[0]
    drafts, ctx = [], prev
    for _ in range(K):  # the draft's chain: d_i ~ Q[d_{i-1}]
        ctx = inverse_cdf(Q[ctx], torch.rand(B, generator=g, dtype=torch.float64))
        drafts.append(ctx)
    draft = torch.stack(drafts, 1)  # [B, K]
    before = torch.cat([prev[:, None], draft], 1)  # [B, K+1] token each row conditions on
    p = P[before]  # [B, K+1, V]
    q = point_masses(draft, V, torch.float64) if point else Q[before[:, :K]]  # [B, K, V]
    accepted, final = speculative_sample(p, q, draft, torch.full((B,), K), torch.rand(B, K, generator=g,
                                         dtype=torch.float64), torch.rand(B, generator=g, dtype=torch.float64))
    emitted = torch.cat([draft, final[:, None]], 1)  # [B, K+1]
    emitted[torch.arange(B), accepted] = final  # the final token sits right after the accepted prefix
    return accepted, emitted


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_target(case):
    g = torch.Generator().manual_seed(1234)
    P = chain(g, [0, 1, 2]) if case == "disjoint supports" else chain(g)
    Q = CASES[case](g, P)
    prev = torch.full((N,), START)
    accepted, emitted = verify_round(P, Q, prev, g, point=case == "point-mass q")
    first = emitted[:, 0]
    # the second token: the first round's second token, or (first draft rejected) a second round's first
    _, again = verify_round(P, Q, first, g, point=case == "point-mass q")
    second = torch.where(accepted >= 1, emitted[:, 1], again[:, 0])
    stat, df = chi_square(torch.bincount(first, minlength=V), P[START])
    assert stat < chi2_critical(df), f"{case}: first token chi2 {stat:.1f} >= {chi2_critical(df):.1f} (df {df})"
    pairs = torch.bincount(first * V + second, minlength=V * V)
    stat, df = chi_square(pairs, P[START][:, None] * P)
    assert stat < chi2_critical(df), f"{case}: pairs chi2 {stat:.1f} >= {chi2_critical(df):.1f} (df {df})"
    rate = accepted.double().mean().item()
    if case == "q=p":
        assert rate == K  # every draft accepted
    if case == "disjoint supports":
        assert rate == 0  # every draft rejected


def test_the_statistic_rejects_a_wrong_distribution():
    """The check can fail: tokens drawn from the draft instead of the target are caught."""
    g = torch.Generator().manual_seed(5)
    P, Q = chain(g), chain(g)
    drawn = inverse_cdf(Q[torch.full((N,), START)], torch.rand(N, generator=g, dtype=torch.float64))
    stat, df = chi_square(torch.bincount(drawn, minlength=V), P[START])
    assert stat > chi2_critical(df)


def test_greedy_is_exact_match_with_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3], [1.5, 0.2, 0.1], [0.0, 0.1, 3.0], [0.2, 0.1, 0.0]])  # [K+1=4, V=3]
    p = point_masses(logits.argmax(-1), 3)[None]  # [1, 4, 3]: argmaxes 1, 0, 2, 0
    for draft, want_accepted, want_final in (([1, 0, 2], 3, 0), ([1, 2, 2], 1, 0), ([0, 0, 2], 0, 1)):
        d = torch.tensor([draft])
        accepted, final = speculative_sample(p, point_masses(d, 3), d, torch.tensor([3]), torch.zeros(1, 3),
                                             torch.zeros(1))
        assert (accepted.item(), final.item()) == (want_accepted, want_final)


def test_ragged_rows_and_padding():
    """Rows with fewer drafts than the batch's widest ignore the padding; a row with none samples p_0."""
    p = point_masses(torch.tensor([[1, 2, 3], [4, 4, 4]]), 5)  # [2, 3, 5]
    draft = torch.tensor([[1, 2], [0, 0]])
    accepted, final = speculative_sample(p, point_masses(draft, 5), draft, torch.tensor([1, 0]),
                                         torch.zeros(2, 2), torch.zeros(2))
    assert accepted.tolist() == [1, 0] and final.tolist() == [2, 4]


def test_acceptance_histogram():
    tried, took = acceptance_histogram([0, 2, 3, 1], [3, 3, 3, 2])
    assert tried == [4, 3, 2] and took == [3, 2, 1]


def test_greedy_accept_is_speculative_sampling_with_point_masses():
    """The speculator's greedy fast path (argmax rows, no [B, k + 1, V] tensors) accepts and emits exactly what
    speculative_sample does with point masses and u = 0, over random chains of mixed lengths (drafts that agree
    with the argmax for a random prefix, then a random token)."""
    from types import SimpleNamespace

    from kvlab.speculation.speculator import greedy_accept

    g = torch.Generator().manual_seed(7)
    V = 11
    for _ in range(50):
        B = int(torch.randint(1, 6, (1,), generator=g))
        ks = torch.randint(1, 5, (B,), generator=g).tolist()
        logits = torch.randn(sum(k + 1 for k in ks), V, generator=g)  # [sum(k+1), V]
        top = logits.argmax(dim=-1).tolist()
        seqs, offset = [], 0
        for k in ks:
            agree = int(torch.randint(0, k + 1, (1,), generator=g))
            drafts = top[offset:offset + agree] + torch.randint(0, V, (k - agree,), generator=g).tolist()
            seqs.append(SimpleNamespace(draft_token_ids=drafts))
            offset += k + 1
        K = max(ks)
        p, q = torch.zeros(B, K + 1, V), torch.zeros(B, K, V)
        draft = torch.zeros(B, K, dtype=torch.int64)
        offset = 0
        for b, (seq, k) in enumerate(zip(seqs, ks)):
            p[b, :k + 1] = point_masses(torch.tensor(top[offset:offset + k + 1]), V)
            draft[b, :k] = torch.tensor(seq.draft_token_ids)
            q[b, :k] = point_masses(draft[b, :k], V)
            offset += k + 1
        accepted, final = speculative_sample(p, q, draft, torch.tensor(ks), torch.zeros(B, K), torch.zeros(B))
        assert greedy_accept(top, seqs) == (accepted.tolist(), final.tolist())
