"""lm-eval's generation requests in kvlab's terms: gen_kwargs -> SamplingParams, stop strings, left truncation.

lm-eval hands `generate_until` a context and a dict of generation kwargs (`until`, `max_gen_toks`,
`do_sample`, `temperature`, `top_p`, ...). They are normalised by lm-eval's own
`normalize_gen_kwargs` (aliases such as `max_new_tokens`, do_sample vs temperature), then mapped onto
`kvlab.SamplingParams`; the decoded text is cut at the first stop string, as lm-eval's `hf` backend
does (`postprocess_generated_text`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("kvlab.study.lm_eval")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed")  # gen_kwargs passed on to SamplingParams
IGNORED_KEYS = ("do_sample",)  # consumed by normalize_gen_kwargs (do_sample=False -> temperature 0)


@dataclass
class Generation:
    """One group of generate_until requests' settings."""

    until: list[str]  # stop strings (the EOS text included, as lm-eval's hf backend adds it)
    max_gen_toks: int
    sampling: dict  # SamplingParams keyword arguments other than max_tokens


def parse_gen_kwargs(gen_kwargs: dict, default_max_gen_toks: int, eos_text: str | None) -> Generation:
    """lm-eval's gen_kwargs -> Generation; a key kvlab cannot honour is an error naming the ones it can."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs), default_max_gen_toks))
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
    max_gen_toks = int(kwargs.pop("max_gen_toks"))
    for key in IGNORED_KEYS:
        kwargs.pop(key, None)
    unknown = sorted(set(kwargs) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"generation kwarg {unknown[0]!r} is not supported by the kvlab model; it takes until, "
                         f"max_gen_toks (or max_new_tokens / max_tokens), do_sample, {', '.join(SAMPLING_KEYS)}")
    sampling = {k: kwargs[k] for k in SAMPLING_KEYS if k in kwargs and kwargs[k] is not None}
    return Generation(until, max_gen_toks, sampling)


def cut_at_stop(text: str, stops: list[str]) -> str:
    """`text` up to the first occurrence of any stop string (empty stops ignored), as lm-eval's
    `postprocess_generated_text` does (the engine also stops at them when it can: KvlabLM._engine_stops)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


def left_truncate(ids: list[int], limit: int, what: str) -> list[int]:
    """The last `limit` ids, with a warning when some are dropped (lm-eval's hf backend truncates so)."""
    if len(ids) <= limit:
        return ids
    log.warning("%s of %d tokens exceeds the %d that fit; truncating %d tokens from the left",
                what, len(ids), limit, len(ids) - limit)
    return ids[-limit:]
