"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds; SamplingParams checks."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.sampler import sample
from kvlab.sampling_params import SamplingParams

VOCAB = 64


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=gen(seed)) * 3  # [rows, V]


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n draws from one row: a batch of n copies sharing one generator (n independent samples)."""
    return sample(logits_row.expand(n, -1), [params] * n, [gen(seed)] * n)


def test_greedy_is_the_argmax_of_every_row():
    logits = random_logits(8)
    tokens = sample(logits, [SamplingParams()] * 8, [None] * 8)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert len(set(tokens)) > 1  # rows differ, so a constant answer would fail


def test_greedy_rows_ignore_their_generator_and_neighbours():
    logits = random_logits(3, seed=1)
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(), SamplingParams(temperature=2.0)]
    tokens = sample(logits, params, [gen(5), None, gen(6)])
    assert tokens[1] == logits[1].argmax().item()


def test_top_k_1_is_greedy_even_at_high_temperature():
    logits = random_logits(16, seed=2)
    params = [SamplingParams(temperature=100.0, top_k=1)] * 16
    for seed in range(5):
        tokens = sample(logits, params, [gen(seed * 100 + i) for i in range(16)])
        assert tokens == logits.argmax(dim=-1).tolist()


def test_high_temperature_without_filters_is_not_greedy():
    """The control for the test above: the same logits do spread out when nothing filters them."""
    row = random_logits(1, seed=2)[0]
    tokens = draws(row, SamplingParams(temperature=100.0), 50)
    assert len(set(tokens)) > 10


def test_tiny_top_p_keeps_only_the_most_likely_token():
    row = random_logits(1, seed=3)[0]
    tokens = draws(row, SamplingParams(temperature=5.0, top_p=1e-6), 100)
    assert set(tokens) == {row.argmax().item()}


def test_top_k_samples_only_among_the_k_most_likely():
    row = random_logits(1, seed=4)[0]
    top5 = set(row.topk(5).indices.tolist())
    tokens = draws(row, SamplingParams(temperature=10.0, top_k=5), 400)
    assert set(tokens) <= top5
    assert len(set(tokens)) == 5  # flat enough at T=10 that every one of the five shows up


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (.5), 3 (.3), 2 (.15), 0 (.05)
    row = torch.full((VOCAB,), -1e9)
    row[:4] = probs.log()
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=0.7), 300)) == {1, 3}  # .5 < .7 <= .8
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=0.85), 300)) == {1, 3, 2}
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=0.5), 300)) == {1}  # .5 reaches .5


def test_top_k_and_top_p_together_apply_both():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    row = torch.full((VOCAB,), -1e9)
    row[:4] = probs.log()
    # top_k=2 renormalises to (.57, .43); top_p=0.5 then keeps only the first
    assert set(draws(row, SamplingParams(temperature=1.0, top_k=2, top_p=0.5), 200)) == {0}
    assert set(draws(row, SamplingParams(temperature=1.0, top_k=3, top_p=0.99), 400)) == {0, 1, 2}


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sample_frequencies_follow_the_tempered_softmax(temperature):
    row = torch.full((VOCAB,), -1e9)
    row[:3] = torch.tensor([2.0, 1.0, 0.0])
    n = 1500
    tokens = draws(row, SamplingParams(temperature=temperature), n, seed=7)
    expected = torch.softmax(row[:3] / temperature, dim=-1).tolist()
    for t, p in enumerate(expected):
        freq = tokens.count(t) / n
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, (t, freq, p)


# -- tempered + filtered frequencies against an independent reference ----------------------
# chi-square critical values at p = 1e-4 (scipy.stats.chi2.isf(1e-4, df)): a false alarm in 10,000 runs
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86}
SUPPORT = [17, 3, 41, 8, 60, 29, 0]  # vocab ids of the live logits, not in rank order
LIVE_LOGITS = [2.0, 1.6, 1.2, 0.8, 0.4, 0.0, -0.4]


def expected_distribution(logits: list[float], temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """Brute force, in plain Python: temper, softmax, keep the k most likely, then walk them in order keeping
    each token while the renormalised mass before it is < top_p (the first is always kept); renormalise."""
    z = [x / temperature for x in logits]
    e = [math.exp(x - max(z)) for x in z]
    probs = [x / sum(e) for x in e]
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])[: top_k or len(probs)]
    total = sum(probs[i] for i in ranked)
    kept, before = [], 0.0
    for i in ranked:
        if not kept or before < top_p:
            kept.append(i)
        before += probs[i] / total
    mass = sum(probs[i] for i in kept)
    return {i: probs[i] / mass for i in kept}


@pytest.mark.parametrize("temperature, top_k, top_p, kept", [
    (0.5, 0, 0.6, 2),   # at T=1 top-p 0.6 would keep 3 tokens
    (0.5, 0, 0.9, 3),   # at T=1: 5
    (0.5, 4, 0.7, 2),   # at T=1: 3
    (0.5, 5, 0.9, 3),   # at T=1: 4
    (0.5, 3, 1.0, 3),   # top-k alone: the tempered softmax over the three kept
    (2.0, 0, 0.6, 4),   # at T=1: 3
    (2.0, 0, 0.9, 6),   # at T=1: 5
    (2.0, 5, 0.9, 5),   # at T=1: 4
    (2.0, 3, 1.0, 3),
])
def test_tempered_top_k_top_p_frequencies_match_a_brute_force_reference(temperature, top_k, top_p, kept):
    """Temperature comes first, then top-k / top-p on the tempered distribution (vLLM, HF's logits warpers).

    The live logits are chosen so that the kept set at T=1 differs from the one at T: filtering the
    untempered logits would keep another set. 4,000 seeded draws, Pearson chi-square at p = 1e-4.
    """
    row = torch.full((VOCAB,), -1e9)
    row[SUPPORT] = torch.tensor(LIVE_LOGITS)
    expected = expected_distribution(LIVE_LOGITS, temperature, top_k, top_p)
    assert len(expected) == kept  # the reference itself, checked by hand above
    n = 4000
    tokens = draws(row, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), n, seed=11)
    allowed = {SUPPORT[i] for i in expected}
    assert set(tokens) <= allowed, f"drew filtered-out tokens {set(tokens) - allowed}"
    counts = {i: tokens.count(SUPPORT[i]) for i in expected}
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in expected.items())
    if len(expected) > 1:
        assert chi2 < CHI2_CRIT[len(expected) - 1], (counts, {i: round(n * p) for i, p in expected.items()})
    else:
        assert counts[next(iter(expected))] == n


def _seeded_run(position: int, companions: list[SamplingParams], steps: int = 12) -> list[int]:
    """Tokens of one seeded request placed at `position` among `companions`, one sample per step."""
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    batch = companions[:position] + [params] + companions[position:]
    generators = [gen(p.seed if p.seed is not None else 99 + i) if not p.greedy else None
                  for i, p in enumerate(batch)]
    generators[position] = gen(params.seed)  # the engine seeds each request's own generator
    out = []
    for step in range(steps):
        logits = torch.randn(len(batch), VOCAB, generator=gen(10_000 + step * 7 + len(batch)))  # companions'
        logits[position] = random_logits(1, seed=step)[0]  # the request's own logits are fixed per step
        out.append(sample(logits, batch, generators)[position])
    return out


def test_a_seeded_request_samples_the_same_tokens_whatever_its_batch():
    alone = _seeded_run(0, [])
    others = [SamplingParams(temperature=1.3), SamplingParams(), SamplingParams(temperature=0.7, top_k=3, seed=5),
              SamplingParams(temperature=2.0, top_p=0.5)]
    assert _seeded_run(0, others) == alone
    assert _seeded_run(2, others) == alone
    assert _seeded_run(1, others[:2]) == alone
    assert len(set(alone)) > 3  # really sampled, not greedy


def test_different_seeds_give_different_tokens():
    row = random_logits(1, seed=8)[0]
    params = SamplingParams(temperature=1.0)
    assert draws(row, params, 30, seed=1) == draws(row, params, 30, seed=1)
    assert draws(row, params, 30, seed=1) != draws(row, params, 30, seed=2)


# -- SamplingParams validation ------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), r"max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens=-3), r"max_tokens must be an integer >= 1, got -3"),
    (dict(max_tokens=2.5), r"max_tokens must be an integer >= 1, got 2.5"),
    (dict(temperature=-0.1), r"temperature must be >= 0, got -0.1"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\], got 1.01"),
    (dict(top_p=-0.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), r"top_k must be >= 0 \(0 disables it\), got -1"),
])
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_edges_are_accepted():
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, stop_token_ids=[3, 4])
    assert p.greedy and p.stop_token_ids == (3, 4)
    assert not SamplingParams(temperature=1e-3).greedy
