"""Multi-step speculative sampling over a token tree is lossless (SpecInfer, arXiv:2305.09781).

The toy target and draft of tests/speculation/test_verifier.py (Markov chains on 6 tokens) and a fixed tree of
6 drafted nodes (the root has 3 children, the first of them 2, the second 1), verified for 10^5
rows at once. Siblings are either drawn i.i.d. from the draft (SpecInfer's setting) or distinct
point masses (top-k branches of a deterministic draft). The first emitted token and the first two
(a second verification round when the root's children are all rejected) are checked with a
chi-square test against P[s] and P[s][x] * P[x][y].
"""

from __future__ import annotations

import pytest
import torch

from kvlab.speculation.tree_verifier import ancestor_mask, tree_depths, tree_speculative_sample
from kvlab.speculation.verifier import inverse_cdf, point_masses
from helpers import CASES, V, chain, chi2_critical, chi_square

N, START = 100_000, 0
PARENTS = [-1, 0, 1, 1, 0, 4, 0]  # preorder: root -> 1 (-> 2, 3), 4 (-> 5), 6


def draft_tree(Q, prev: torch.Tensor, g, point: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B, N+1] and the distribution each was drawn from [B, N+1, V] for the tree PARENTS."""
    B = prev.shape[0]
    tokens = torch.zeros(B, len(PARENTS), dtype=torch.int64)
    tokens[:, 0] = prev
    q = torch.zeros(B, len(PARENTS), V, dtype=torch.float64)
    rank = torch.zeros(len(PARENTS), dtype=torch.int64)  # sibling index of each node
    for n in range(1, len(PARENTS)):
        rank[n] = sum(1 for m in range(1, n) if PARENTS[m] == PARENTS[n])
    order = torch.argsort(Q, dim=-1, descending=True)  # [V, V] a deterministic draft's ranking after each token
    for n in range(1, len(PARENTS)):
        ctx = tokens[:, PARENTS[n]]
        if point:  # distinct branches: the (rank+1)-th most likely token, as a point mass
            tokens[:, n] = order[ctx, rank[n]]
            q[:, n] = point_masses(tokens[:, n], V, torch.float64)
        else:  # i.i.d. siblings from the draft
            tokens[:, n] = inverse_cdf(Q[ctx], torch.rand(B, generator=g, dtype=torch.float64))
            q[:, n] = Q[ctx]
    return tokens, q


def verify_round(P, Q, prev, g, point):
    """-> (accepted [B], emitted [B, D+1]: the path's tokens then the final token, padded)."""
    B = prev.shape[0]
    tokens, q = draft_tree(Q, prev, g, point)
    p = P[tokens]  # [B, N+1, V] target after each node
    valid = torch.ones(B, len(PARENTS), dtype=torch.bool)
    path, accepted, final = tree_speculative_sample(p, q, tokens, PARENTS, valid,
                                                    torch.rand(B, len(PARENTS), generator=g, dtype=torch.float64),
                                                    torch.rand(B, generator=g, dtype=torch.float64))
    emitted = tokens.gather(1, path.clamp_min(0))  # [B, D]
    emitted = torch.cat([emitted, final[:, None]], 1)  # [B, D+1]
    emitted[torch.arange(B), accepted] = final
    return accepted, emitted


@pytest.mark.parametrize("siblings", ["iid", "point"])
@pytest.mark.parametrize("case", list(CASES))
def test_tree_emits_tokens_that_follow_the_target(case, siblings):
    g = torch.Generator().manual_seed(4321)
    P = chain(g, [0, 1, 2]) if case == "disjoint supports" else chain(g)
    Q = CASES[case](g, P)
    point = siblings == "point" or case == "point-mass q"
    prev = torch.full((N,), START)
    accepted, emitted = verify_round(P, Q, prev, g, point)
    first = emitted[:, 0]
    _, again = verify_round(P, Q, first, g, point)
    second = torch.where(accepted >= 1, emitted[:, 1], again[:, 0])
    stat, df = chi_square(torch.bincount(first, minlength=V), P[START])
    assert stat < chi2_critical(df), f"{case}/{siblings}: first token chi2 {stat:.1f} >= {chi2_critical(df):.1f}"
    pairs = torch.bincount(first * V + second, minlength=V * V)
    stat, df = chi_square(pairs, P[START][:, None] * P)
    assert stat < chi2_critical(df), f"{case}/{siblings}: pairs chi2 {stat:.1f} >= {chi2_critical(df):.1f}"
    if case == "q=p" and not point:
        assert accepted.double().mean().item() == 2  # the first child is always accepted, then its first child
    if case == "disjoint supports":
        assert accepted.sum().item() == 0


def test_a_wrong_residual_is_caught():
    """Drawing the final token from p instead of the residual left by the rejected siblings is
    biased: the same statistic rejects it (the test can fail)."""
    g = torch.Generator().manual_seed(7)
    P, Q = chain(g), chain(g)
    prev = torch.full((N,), START)
    tokens, q = draft_tree(Q, prev, g, point=False)
    path, accepted, _ = tree_speculative_sample(P[tokens], q, tokens, PARENTS, torch.ones(N, len(PARENTS),
                                                dtype=torch.bool), torch.rand(N, len(PARENTS), generator=g,
                                                dtype=torch.float64), torch.rand(N, generator=g, dtype=torch.float64))
    wrong = inverse_cdf(P[prev], torch.rand(N, generator=g, dtype=torch.float64))  # ignores the rejections
    first = torch.where(accepted >= 1, tokens.gather(1, path[:, :1].clamp_min(0))[:, 0], wrong)
    stat, df = chi_square(torch.bincount(first, minlength=V), P[START])
    assert stat > chi2_critical(df)


def test_greedy_takes_the_longest_path_matching_the_argmax():
    # root -> a (-> c), b (-> d -> e): the argmax after the root is b, after b is d, after d is not e
    parents = [-1, 0, 1, 0, 3, 4]
    tokens = torch.tensor([[0, 1, 2, 3, 4, 5]])
    argmax = {0: 3, 3: 4, 4: 2}  # node -> the target's argmax after it
    p = torch.zeros(1, 6, V)
    for n in range(6):
        p[0, n, argmax.get(n, 0)] = 1.0
    q = point_masses(tokens, V)[:, :, :]
    path, accepted, final = tree_speculative_sample(p, q, tokens, parents, torch.ones(1, 6, dtype=torch.bool),
                                                    torch.zeros(1, 6), torch.zeros(1))
    assert accepted.tolist() == [2] and path[0].tolist() == [3, 4, -1] and final.tolist() == [2]
    # a node outside the row's tree (valid False) is never accepted
    valid = torch.ones(1, 6, dtype=torch.bool)
    valid[0, 3:] = False
    path, accepted, final = tree_speculative_sample(p, q, tokens, parents, valid, torch.zeros(1, 6), torch.zeros(1))
    assert accepted.tolist() == [0] and final.tolist() == [3]


def test_tree_helpers_and_bad_input():
    assert tree_depths([-1, 0, 1, 0]) == [0, 1, 2, 1]
    assert ancestor_mask([-1, 0, 1, 0]).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    with pytest.raises(ValueError, match="earlier node"):
        tree_depths([-1, 2, 0])
    with pytest.raises(ValueError, match="root"):
        tree_depths([0, 0])
    with pytest.raises(ValueError, match="shapes disagree"):
        tree_speculative_sample(torch.zeros(1, 3, V), torch.zeros(1, 2, V), torch.zeros(1, 3, dtype=torch.int64),
                                [-1, 0, 0], torch.ones(1, 3, dtype=torch.bool), torch.zeros(1, 3), torch.zeros(1))
