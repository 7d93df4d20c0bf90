"""Hugging Face assisted generation's draft length, schedule and confidence stop, set where transformers reads them.

transformers (5.x: generation/candidate_generator.py, AssistedCandidateGenerator.__init__) takes
`num_assistant_tokens`, `num_assistant_tokens_schedule` and `assistant_confidence_threshold` from the assistant
model's own `generation_config`, not from `generate()`'s keyword arguments, which it accepts and ignores; unset,
they are 20 tokens, the `constant` schedule and a 0.4 confidence stop (re-fitted by ROC for a same-tokenizer
assistant). With `assistant_early_exit` the assistant is the target model itself, so its config is the one to set.
The `heuristic` schedule writes its last length back into that config, so set the options before every call.

    set_assistant_options(assistant, num_tokens=4, schedule="constant", threshold=0.0)
    target.generate(ids, assistant_model=assistant, ...)
"""

from __future__ import annotations

SCHEDULES = ("constant", "heuristic", "heuristic_transient")


def set_assistant_options(assistant, num_tokens: int, schedule: str = "constant", threshold: float = 0.0) -> None:
    """Draft `num_tokens` per verification (the start length of a heuristic schedule), moved by `schedule`,
    stopping below a top probability of `threshold` (0: never) -- on `assistant.generation_config`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown Hugging Face assistant schedule {schedule!r}; one of {SCHEDULES}")
    config = assistant.generation_config
    config.num_assistant_tokens = num_tokens
    config.num_assistant_tokens_schedule = schedule
    config.assistant_confidence_threshold = threshold
