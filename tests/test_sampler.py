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
