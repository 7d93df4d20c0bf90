"""Next-token sampling for a batch of sequences with their own parameters."""

from __future__ import annotations

import torch

from kvlab.sampling_params import SamplingParams


class SamplingError(RuntimeError):
    """Row `row` of a batch could not be sampled (`cause`: what torch raised)."""

    def __init__(self, row: int, cause: Exception):
        super().__init__(f"row {row}: {cause}")
        self.row, self.cause = row, cause


def request_generator(engine_seed: int, request_id: int, seed: int | None) -> torch.Generator:
    """The random stream of one sampled request.

    A user seed `s` and an engine-assigned stream (engine seed, request id) are
    hashed in different domains of numpy's SeedSequence (spawn keys (0,) and
    (1, request_id)), so no user seed can reproduce an unseeded request's
    stream, and two unseeded requests never share one; requests that share a
    user seed share a stream.
    """
    import numpy as np

    if seed is not None:
        seq = np.random.SeedSequence(seed, spawn_key=(0,))
    else:
        seq = np.random.SeedSequence(engine_seed, spawn_key=(1, request_id))
    state = int(seq.generate_state(1, np.uint64)[0]) & (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(state)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] float -> one token per row.

    Greedy rows take the argmax; the others are tempered, filtered by top-k and
    top-p, and drawn with their own generator, so a seeded request samples the
    same tokens whatever it is batched with.
    """
    tokens = logits.argmax(dim=-1)  # [B]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device, dtype=torch.float64)
        probs = _filtered_probs(_tempered(logits[idx], temps), [params[i] for i in rows])
        for j, i in enumerate(rows):
            try:
                tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i]).item()
            except RuntimeError as exc:  # e.g. NaN logits: name the row, so the engine can name the request
                raise SamplingError(i, exc) from exc
    return tokens.tolist()


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] -> the distribution each row samples from, [R, V] float32: greedy rows the point
    mass on the argmax, the others tempered and filtered by top-k / top-p exactly as `sample` does
    (speculative verification applies it identically to the target and the draft)."""
    probs = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()  # [R, V]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device, dtype=torch.float64)
        probs[idx] = _filtered_probs(_tempered(logits[idx], temps), [params[i] for i in rows])
    return probs


def _tempered(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """logits [R, V], temperatures [R] float64 -> [R, V] float32 tempered logits. Shifted by the row
    max and divided in float64: any positive temperature, however small, leaves the best token at 0
    and the rest <= 0 (at worst -inf), never NaN."""
    sub = logits.double()
    return ((sub - sub.max(dim=-1, keepdim=True).values) / temps[:, None]).float()


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] (tempered) -> probabilities [R, V] after per-row top-k and top-p."""
    top_k = torch.tensor([p.top_k or logits.shape[-1] for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop |= before >= top_p[:, None]
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def draw(q: torch.Tensor, greedy: bool, generator: torch.Generator | None = None) -> int:
    """One token from the probabilities q [V]: the most likely when greedy, else drawn with `generator`
    (a draft's proposal; kvlab.speculation.drafts)."""
    return int(q.argmax()) if greedy else int(torch.multinomial(q, 1, generator=generator))
