"""`tli` and `slrs` are lossless across vocabularies: emitted tokens follow the target distribution.

Two toy tokenizers over one alphabet {a, b, c}: the target's has `ab`, `bc`, `ca`, `abc`; the
draft's has `ba`, `bb`, `cab` (shared: the three letters). The target is a Markov chain over its
token ids (the next-token distribution depends on the previous token, special token 0 included,
which no draft can propose); the draft a Markov chain over its own ids (a state per last draft
token, and one for an empty context). 10^5 rows run the drafts' own proposal code (`tli.to_target`
over the shared vocabulary; `slrs.segment` and `slrs.token_proposal`) into `speculative_sample`;
the first emitted token and the first two (spanning a second round when the first draft is
rejected, the draft's context then re-translated from the target's tokens) are checked with a
chi-square test against P[0] and P[0][x] * P[x][y], as in tests/speculation/test_verifier.py.
"""

from __future__ import annotations

import torch

from kvlab.speculation.drafts.slrs import segment, token_proposal
from kvlab.speculation.drafts.tli import shared_index, to_target
from kvlab.speculation.drafts.vocabulary import Bridge, toy
from kvlab.speculation.verifier import inverse_cdf, speculative_sample
from helpers import chi2_critical, chi_square

TARGET = toy(["a", "b", "c", "ab", "bc", "ca", "abc"], num_special=1)  # ids 1..7, 0 special
DRAFT = toy(["a", "b", "c", "ba", "bb", "cab"], num_special=1)  # ids 1..6, 0 special
VT, VD, N, K, START = len(TARGET), len(DRAFT), 100_000, 2, 0
BRIDGE = Bridge(DRAFT, TARGET)
EMPTY = VD  # the draft's state for a context with no text


def markov(g, rows: int, cols: int, zero: tuple = ()) -> torch.Tensor:
    w = torch.rand(rows, cols, generator=g, dtype=torch.float64) + 0.05
    w[:, list(zero)] = 0
    return w / w.sum(-1, keepdim=True)


def models(seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    P = markov(g, VT, VT)  # [VT, VT] target: next token after each target token
    P[:, 0] *= 0.2
    P = P / P.sum(-1, keepdim=True)
    Q = markov(g, VD + 1, VD, zero=(0,))  # [VD + 1, VD] draft: after each draft token, or an empty context
    return g, P, Q


def draft_state(target_context: list[int]) -> int:
    ids = BRIDGE.to_draft(target_context)
    return ids[-1] if ids else EMPTY


def draft_states(prev: torch.Tensor) -> torch.Tensor:
    """[B] last target token after START -> [B] the draft's state for the context [START, prev]."""
    table = torch.tensor([draft_state([START, t]) for t in range(VT)])
    return table[prev]


def verify(P, prev: torch.Tensor, draft: torch.Tensor, q: torch.Tensor, g) -> tuple[torch.Tensor, torch.Tensor]:
    """prev [B] last target token, draft [B, K] target ids, q [B, K, VT] -> (accepted [B], emitted [B, K+1])."""
    B = prev.shape[0]
    before = torch.cat([prev[:, None], draft], 1)  # [B, K+1]
    accepted, final = speculative_sample(P[before], q, draft, torch.full((B,), K),
                                         torch.rand(B, K, generator=g, dtype=torch.float64),
                                         torch.rand(B, generator=g, dtype=torch.float64))
    emitted = torch.cat([draft, final[:, None]], 1)
    emitted[torch.arange(B), accepted] = final
    return accepted, emitted


def tli_round(P, Q, prev: torch.Tensor, g, wrong: bool = False):
    """TLI drafts K shared tokens from the draft restricted to the intersection, then verification."""
    d_ids, t_ids = shared_index(BRIDGE.target_of, VD, VT)
    keep = torch.zeros(VD, dtype=torch.float64)
    keep[d_ids] = 1
    restricted = Q * keep
    restricted = restricted / restricted.sum(-1, keepdim=True)  # [VD + 1, VD]
    if wrong:  # the draft's unrestricted distribution carried over: not what the tokens were drawn from
        restricted_q = Q
    else:
        restricted_q = restricted
    state = draft_states(prev)
    target_of = torch.tensor([BRIDGE.target_of.get(d, 0) for d in range(VD)])
    tokens, qs = [], []
    for _ in range(K):
        d = inverse_cdf(restricted[state], torch.rand(len(state), generator=g, dtype=torch.float64))
        qs.append(to_target(restricted_q[state], d_ids, t_ids, VT))
        tokens.append(target_of[d])
        state = d
    return verify(P, prev, torch.stack(tokens, 1), torch.stack(qs, 1), g)


def slrs_round(P, Q, prev: torch.Tensor, g, wrong: bool = False):
    """SLRS: the draft samples draft tokens; their text is cut into target tokens (`segment`); psi
    (`token_proposal`) is what they were drawn from. Enough draft tokens are sampled for K target
    tokens to be fixed (every draft token adds a byte); more would not change them."""
    B, steps = prev.shape[0], (K + 1) * TARGET.max_token_bytes
    start = draft_states(prev)
    state, paths = start, []
    for _ in range(steps):
        state = inverse_cdf(Q[state], torch.rand(B, generator=g, dtype=torch.float64))
        paths.append(state)
    paths = torch.stack(paths, 1).tolist()  # [B, steps]
    keys: dict = {}  # (draft state, target prefix) -> row of `table`
    table: list = []

    def psi(s0: int, prefix: tuple) -> int:
        key = (s0, prefix if not wrong else prefix[:0])
        if key not in keys:
            def next_probs(ps):
                return torch.stack([Q[p[-1] if p else s0] for p in ps])
            keys[key] = len(table)
            table.append(token_proposal(next_probs, list(key[1]), DRAFT, TARGET, VT)[0])
        return keys[key]

    tokens, rows = [], []
    for s0, path in zip(start.tolist(), paths):
        cut = tuple(t for t, _ in segment(DRAFT.text_bytes(path), TARGET, K))
        tokens.append(cut)
        rows.append([psi(s0, cut[:i]) for i in range(K)])
    assert all(len(c) == K for c in tokens)
    return verify(P, prev, torch.tensor(tokens), torch.stack(table)[torch.tensor(rows)], g)


def check(round_fn, wrong: bool = False) -> tuple[float, float, float, float, torch.Tensor]:
    g, P, Q = models()
    prev = torch.full((N,), START)
    accepted, emitted = round_fn(P, Q, prev, g, wrong)
    first = emitted[:, 0]
    _, again = round_fn(P, Q, first, g, wrong)
    second = torch.where(accepted >= 1, emitted[:, 1], again[:, 0])
    s1, df1 = chi_square(torch.bincount(first, minlength=VT), P[START])
    s2, df2 = chi_square(torch.bincount(first * VT + second, minlength=VT * VT), P[START][:, None] * P)
    return s1, chi2_critical(df1), s2, chi2_critical(df2), accepted


def test_tli_emits_the_target_distribution():
    s1, c1, s2, c2, accepted = check(tli_round)
    assert s1 < c1, f"first token chi2 {s1:.1f} >= {c1:.1f}"
    assert s2 < c2, f"pairs chi2 {s2:.1f} >= {c2:.1f}"
    assert 0.2 < accepted.double().mean() < K  # drafts are accepted and rejected


def test_slrs_emits_the_target_distribution():
    s1, c1, s2, c2, accepted = check(slrs_round)
    assert s1 < c1, f"first token chi2 {s1:.1f} >= {c1:.1f}"
    assert s2 < c2, f"pairs chi2 {s2:.1f} >= {c2:.1f}"
    assert 0.2 < accepted.double().mean() < K
    # multi-letter target tokens no draft token spells alone are proposed too: the string-level sum
    assert any(len(TARGET.token_bytes[t]) > 1 and TARGET.token_bytes[t] not in DRAFT.ids_of for t in range(1, VT))


def test_the_checks_catch_a_wrong_proposal_distribution():
    """The tests can fail: TLI verified against the unrestricted draft distribution, or SLRS with the
    first position's psi used at every position, is caught."""
    s1, c1, s2, c2, _ = check(tli_round, wrong=True)
    assert s1 > c1 or s2 > c2
    s1, c1, s2, c2, _ = check(slrs_round, wrong=True)
    assert s1 > c1 or s2 > c2


def test_psi_sums_over_draft_tokenisations():
    """psi of a target token sums every draft path spelling it: `abc` after an empty context comes
    from a-b-c, a-ba?.. (no), a-bb? (no) ...: checked against brute-force enumeration of paths."""
    _, _, Q = models()
    import itertools

    def next_probs(ps):
        return torch.stack([Q[p[-1] if p else EMPTY] for p in ps])

    psi, evaluations = token_proposal(next_probs, [], DRAFT, TARGET, VT)
    brute = torch.zeros(VT, dtype=torch.float64)
    for path in itertools.product(range(1, VD), repeat=TARGET.max_token_bytes):
        prob, state = 1.0, EMPTY
        for d in path:
            prob, state = prob * float(Q[state, d]), d
        brute[segment(DRAFT.text_bytes(path), TARGET, 1)[0][0]] += prob  # paths of >= 3 bytes: all leaves
    # every path of 3 draft tokens has >= 3 bytes; token_proposal stops each path as soon as it does,
    # which sums the same probabilities
    assert torch.allclose(psi, brute / brute.sum(), atol=1e-12)
    assert evaluations < (VD - 1) ** TARGET.max_token_bytes
