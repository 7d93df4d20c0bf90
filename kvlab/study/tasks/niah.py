"""Needle in a haystack, with RULER-style passkey and multi-key variants.

Haystack: the Paul Graham essays (as in the LLMTest_NeedleInAHaystack benchmark,
Kamradt 2023, and RULER, Hsieh et al. 2024, arXiv:2404.06654). For each cell of
variants x context_lengths x depths, a prompt of exactly `context_length` tokens
holds an instruction, a slice of the haystack with the needle inserted at
`depth` (0: start, 1: end of the haystack), and a question; the model answers
greedily and a sample counts as correct when the answer contains the value.

  needle:   "One of the special magic numbers for <key> is: <7 digits>."
  passkey:  "The pass key is <5 digits>. Remember it. <5 digits> is the pass key."
  multikey: `num_keys` magic-number needles with different keys; one is asked for
            (it sits at `depth`, the distractors at random depths).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from kvlab.study.tasks.base import Result, RunContext, Task, check_positive
from kvlab.study.tasks.data import corpus_tokens, encode, get_tokenizer
from kvlab.study.tasks.perplexity import check_fits
from kvlab.study.tasks.progress import progress_bar

VARIANTS = ("needle", "passkey", "multikey")
KEYS = ("apple", "river", "castle", "violin", "tiger", "harbor", "meadow", "rocket", "lantern", "glacier",
        "pepper", "canyon", "falcon", "orchid", "saturn", "marble")
MAGIC_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
               "I will quiz you about the numbers afterwards.\n")
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.\n")


@dataclass
class NeedleInAHaystack(Task):
    METRICS: ClassVar[tuple[str, ...]] = ("niah/accuracy", "niah/*/accuracy")

    haystack: str = "paul-graham-essays"                                  # folder of .txt files
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))   # needle | passkey | multikey
    context_lengths: list[int] = field(default_factory=lambda: [256, 512])  # prompt tokens
    depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])  # needle position in the haystack
    samples_per_cell: int = 1                                             # prompts per cell
    num_keys: int = 4                                                     # multikey: needles in the haystack
    max_new_tokens: int = 12                                              # answer tokens
    batch_size: int = 16                                                  # prompts per llm.generate call

    def __post_init__(self) -> None:
        check_positive(self, "context_lengths", "samples_per_cell", "num_keys", "max_new_tokens", "batch_size")
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise ValueError(f"NeedleInAHaystack.variants: unknown {bad or 'empty list'}; choose from {list(VARIANTS)}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"NeedleInAHaystack.depths must lie in [0, 1], got {self.depths}")
        if self.num_keys > len(KEYS):
            raise ValueError(f"NeedleInAHaystack.num_keys must be <= {len(KEYS)}, got {self.num_keys}")

    def samples(self, tokenizer, haystack: list[int], seed: int):
        """The prompts as a datasets.Dataset: variant, context_length, depth, sample, prompt ids, answer."""
        import datasets

        rows = []
        for variant in self.variants:
            for length in self.context_lengths:
                for depth in self.depths:
                    for s in range(self.samples_per_cell):
                        rng = random.Random(f"{seed}/{variant}/{length}/{depth}/{s}")
                        ids, answer = build_prompt(variant, length, depth, self.num_keys, tokenizer, haystack, rng)
                        rows.append({"variant": variant, "context_length": length, "depth": depth, "sample": s,
                                     "prompt_token_ids": ids, "answer": answer})
        return datasets.Dataset.from_list(rows)

    def run(self, llm, ctx: RunContext) -> Result:

        from kvlab import SamplingParams

        check_fits(llm, max(self.context_lengths) + self.max_new_tokens, "context_length + max_new_tokens")
        tokenizer = get_tokenizer(llm)
        ds = self.samples(tokenizer, corpus_tokens(self.haystack, ctx.data_dir, tokenizer), ctx.seed)
        params = SamplingParams(max_tokens=self.max_new_tokens, temperature=0.0)
        answers = []
        with progress_bar(ctx.progress, total=len(ds), desc="niah") as bar:
            for batch in ds.iter(batch_size=self.batch_size):
                for out in llm.generate(batch["prompt_token_ids"], params):
                    answers.append(tokenizer.decode(list(out.token_ids), skip_special_tokens=True))
                bar.update(len(batch["answer"]))
        table = ds.remove_columns("prompt_token_ids").to_pandas()
        table["output"] = answers
        table["correct"] = [a in out for a, out in zip(table["answer"], answers)]
        cells = (table.groupby(["variant", "context_length", "depth"], as_index=False)["correct"].mean()
                 .rename(columns={"correct": "accuracy"}))
        metrics = {"niah/accuracy": float(table["correct"].mean())}
        for variant, acc in table.groupby("variant")["correct"].mean().items():
            metrics[f"niah/{variant}/accuracy"] = float(acc)
        return Result(metrics, {"niah_cells": cells, "niah_samples": table}, plot_cells(cells))


def build_prompt(variant, length, depth, num_keys, tokenizer, haystack, rng) -> tuple[list[int], str]:
    """Prompt ids of exactly `length` tokens, and the expected answer."""
    if variant == "passkey":
        value = str(rng.randint(10000, 99999))
        intro, question = PASSKEY_INTRO, "\nWhat is the pass key? The pass key is"
        needles = [f" The pass key is {value}. Remember it. {value} is the pass key. "]
    else:
        keys = rng.sample(KEYS, num_keys if variant == "multikey" else 1)
        values = [str(rng.randint(1000000, 9999999)) for _ in keys]
        value, intro = values[0], MAGIC_INTRO
        question = (f"\nWhat is the special magic number for {keys[0]} mentioned in the provided text? "
                    f"The special magic number for {keys[0]} mentioned in the provided text is")
        needles = [f" One of the special magic numbers for {k} is: {v}. " for k, v in zip(keys, values)]
    intro_ids, question_ids = encode(tokenizer, intro), encode(tokenizer, question)
    needle_ids = [encode(tokenizer, n) for n in needles]
    budget = length - len(intro_ids) - len(question_ids) - sum(map(len, needle_ids))
    if budget < 1:
        raise ValueError(f"niah: context_length {length} is too short for the {variant} needle and question")
    start = rng.randrange(0, max(len(haystack) - budget, 1))
    hay = list(haystack[start:start + budget])
    # the asked needle at `depth`, distractors at random depths; insert from the back so offsets hold
    spots = [round(depth * len(hay))] + [rng.randrange(0, len(hay) + 1) for _ in needle_ids[1:]]
    for spot, ids in sorted(zip(spots, needle_ids), key=lambda p: -p[0]):
        hay[spot:spot] = ids
    return intro_ids + hay + question_ids, value


def plot_cells(cells) -> dict:
    """One heatmap per variant: accuracy over depth (rows) x context length (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(cells["variant"]))
    fig, axes = plt.subplots(1, len(variants), figsize=(3.2 * len(variants), 2.8), squeeze=False)
    for ax, variant in zip(axes[0], variants):
        grid = cells[cells["variant"] == variant].pivot(index="depth", columns="context_length", values="accuracy")
        im = ax.imshow(grid.values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(grid.shape[1]), grid.columns)
        ax.set_yticks(range(grid.shape[0]), [f"{d:g}" for d in grid.index])
        ax.set_xlabel("context length")
        ax.set_ylabel("needle depth")
        ax.set_title(variant)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    return {"niah_heatmap": fig}
