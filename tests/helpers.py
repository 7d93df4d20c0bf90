"""Helpers several test files share (tests/ is on sys.path: the rootdir conftest puts it there; no test
file imports another).

- the scheduler without an engine: `request`, `run_step` (plays the engine's part: after `schedule()` it
  marks the scheduled tokens computed, appends a fake sampled token to every sequence whose tokens are
  all computed, and finishes a sequence once it has its requested outputs), `manager`;
- the toy Markov chains and chi-square tests (one sample, two samples) of the losslessness tests;
- speculative decoding in the engine on the tiny random Llama: `prompts`, `plain` (greedy reference
  outputs, cached per worker).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvlab.cache.block_manager import BlockManager, LayerGroup
from kvlab.registry import ALLOCATORS
from kvlab.sampling_params import SamplingParams
from kvlab.sequence import Sequence

if TYPE_CHECKING:  # torch is imported by the helpers that use it: the scheduler's tests stay torch-free
    import torch

    from kvlab.engine.scheduler import ScheduledBatch, Scheduler

# -- the scheduler without an engine ------------------------------------------------------
FAKE_TOKEN = 7


def request(seq_id: int, prompt_len: int, max_tokens: int = 4) -> Sequence:
    prompt = [(seq_id * 31 + i) % 97 + 10 for i in range(prompt_len)]
    return Sequence(seq_id, prompt, SamplingParams(max_tokens=max_tokens), prompt_len + max_tokens, arrival_time=0.0)


def run_step(s: Scheduler) -> ScheduledBatch:
    batch = s.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
    for seq in batch.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(FAKE_TOKEN)
            if seq.num_output_tokens >= seq.params.max_tokens:
                s.finish(seq, "length")
    for seq in s.running:
        s.block_manager.release_out_of_window(seq)
    return batch


def manager(num_blocks: int, max_chunk: int, kept_tokens=None, block_size: int = 4) -> BlockManager:
    return BlockManager([LayerGroup((0,))], ALLOCATORS.build("paged"), num_blocks, block_size, 4096, max_chunk,
                        kept_tokens=kept_tokens)


# -- verifier losslessness: a toy target and draft, each a Markov chain on V tokens --------------
V = 6


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Upper 99.9% quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells of positive probability (cells of probability 0 must be empty)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[probs > 0] * counts.sum()
    return float(((counts[probs > 0] - expected) ** 2 / expected).sum()), int((probs > 0).sum()) - 1


def chain(g, support=None) -> torch.Tensor:
    """A random transition matrix [V, V], each row supported on `support` (default: everything)."""
    import torch

    w = torch.rand(V, V, generator=g, dtype=torch.float64) + 0.05
    if support is not None:
        mask = torch.zeros(V, dtype=torch.bool)
        mask[support] = True
        w = w * mask
    return w / w.sum(-1, keepdim=True)


def point_chain(g) -> torch.Tensor:
    """A deterministic draft: after token t it proposes a fixed token (an n-gram lookup's point mass)."""
    import torch

    from kvlab.speculation.verifier import point_masses

    return point_masses(torch.randint(0, V, (V,), generator=g), V, torch.float64)


CASES = {
    "q=p": lambda g, P: P,
    "random q": lambda g, P: chain(g),
    "disjoint supports": lambda g, P: chain(g, [3, 4, 5]),  # the target lives on 0, 1, 2
    "point-mass q": lambda g, P: point_chain(g),
    "q zero on part of p's support": lambda g, P: chain(g, [0, 1]),
}


def two_sample_chi_square(a: list, b: list) -> tuple[float, int]:
    """Pearson's two-sample statistic for equal-sized samples; cells with < 10 draws pooled into one."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    cells, rare_a, rare_b = [], 0, 0
    for key in set(ca) | set(cb):
        if ca[key] + cb[key] >= 10:
            cells.append((ca[key], cb[key]))
        else:
            rare_a, rare_b = rare_a + ca[key], rare_b + cb[key]
    if rare_a + rare_b:
        cells.append((rare_a, rare_b))
    return sum((x - y) ** 2 / (x + y) for x, y in cells), len(cells) - 1


# -- speculative decoding in the engine ------------------------------------------------------
MODEL = "random:llama-tiny"
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # llama-tiny: 2 layers x K,V x 2 heads x 16 x float32


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase (n-gram lookup finds matches) and random ones."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(3, 256, (3 + i % 4,), generator=g).tolist()
        out.append(phrase * (2 + i % 3) if i % 2 == 0 else torch.randint(3, 256, (7 + 5 * i,), generator=g).tolist())
    return out


_plain: dict = {}


def plain(batch: list[list[int]], max_tokens: int, model: str = MODEL, **params) -> list[list[int]]:
    key = (model, tuple(map(tuple, batch)), max_tokens, tuple(sorted(params.items())))
    if key not in _plain:
        from kvlab import LLM

        llm = LLM(model, block_size=16, kv_cache_memory="4MiB")
        sp = SamplingParams(max_tokens=max_tokens, **params)
        _plain[key] = [o.token_ids for o in llm.generate(batch, sp)]
    return _plain[key]
