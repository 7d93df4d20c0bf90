"""The speculation benchmarks' shared workload: two tasks' prompts and one timed kvlab run over them.

`edit` copies a given passage with its spelling corrected (repetition-heavy: most of the output already appears
in the prompt); `free` writes a short story (little to look up). Used by experiments/bench_speculation.py,
bench_batch_invariant.py, bench_cross_vocab.py and bench_adaptive_length.py, so their prompts stay the same.

    ps = prompts(tokenizer, "edit")                       # [8 prompts] of token ids
    stats, outs = run(llm, [[p] for p in ps[:2]], 32)     # llm.stats() after the batches, and their outputs
"""

from __future__ import annotations

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more then a hundred years. Every night its keeper "
    "climbed the narow stairs, lit the lamp and watched the ships pass safely through the rocky straight.",
    "Our garden has three aple trees, a row of carrots and a small pond where frogs sing in the evening. "
    "In summer we pick beans every morning and give the extra ones to our neigbours.",
    "The train to the capital leaves at seven oclock. Pasengers should arrive early, because the platform "
    "changes often and the announcements are hard to here over the noise of the station.",
    "Bread needs only flour, water, salt and yeast, but good bread needs time. Let the dough rise slowley "
    "overnight in a cool place, then bake it in a very hot oven untill the crust is dark.",
    "The museum opened a new room for old maps. Visitors can see how sailors once drew the coastlines, "
    "with sea monsters in the empty corners and rivers that were never realy there.",
    "Every winter the lake freezes and the children of the village skate on it from morning till night. "
    "Their parents watch from the shore, drinking hot tea and worrying about thin ice.",
    "The library lends books, music and even tools. Members can borow a drill for a weekend, as long as "
    "they bring it back clean and on time, with all its peices in the box.",
    "A good map is simple. It shows the roads you need, the places you want to see and nothing else, so "
    "that a traveller can find the way without geting lost in details.",
]
STORIES = ["a robot who learns to paint", "a cat that finds a secret door", "two friends lost in a forest",
           "a baker who wins a prize", "a storm at sea", "a girl who talks to birds", "the last day of summer",
           "a clock that runs backwards"]


def prompts(tokenizer, task: str) -> list[list[int]]:
    """The task's eight prompts (`edit` or `free`), tokenized."""
    if task == "edit":
        texts = [f"Copy the following passage, correcting its spelling mistakes.\n\nPassage: {p}\n\n"
                 f"Corrected passage: " for p in PASSAGES]
    else:
        texts = [f"Write a short story about {s}.\n\nStory: " for s in STORIES]
    return [tokenizer(t)["input_ids"] for t in texts]


def run(llm, batches: list[list[list[int]]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    """Greedy, EOS ignored, each batch in turn on a freshly reset `llm` -> (llm.stats(), every output's tokens)."""
    from kvlab import SamplingParams

    llm.reset_stats()
    outs = []
    for batch in batches:
        outs += [o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    return llm.stats(), outs
