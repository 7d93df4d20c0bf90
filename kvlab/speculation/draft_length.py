"""How long a draft's next chain is: a per-sequence rule fed by its acceptance history, and a confidence stop. Torch-free.

Off by default (`adaptive: false`): every step drafts `num_tokens`, so fixed-length results stay reproducible.
With `adaptive: true` a sequence's length moves after each verification of a chain, between 1 and
`max_num_tokens`, by the draft's `length_rule`:

    step        one more token after a fully accepted chain, one fewer after a rejection (kvlab's rule so far)
    heuristic   two more after a fully accepted chain, one fewer after a rejection: Hugging Face assisted
                generation's `num_assistant_tokens_schedule="heuristic"` (Joao Gante, "Assisted Generation", 2023)

A chain cut short by the request's max_tokens does not grow the length (its acceptance says nothing about
a longer chain). Independently of the rule, a draft with a model may stop a chain early when its confidence falls
(`confidence_threshold`, as Hugging Face's `assistant_confidence_threshold`, Gante et al.): after drafting a token
whose distribution's top probability is below the threshold, it drafts no further token this step (that token is
still proposed, as Hugging Face's stopping criterion keeps it). Either way only the *length* of a proposal changes:
a verifier that accepts a prefix of any proposal by speculative rejection sampling emits what plain decoding
would (Leviathan et al. 2023, arXiv:2211.17192), so both are lossless.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LengthRule:
    """Grow by `grow` after a fully accepted chain, shrink by `shrink` after a rejection, within [1, longest]."""

    name: str
    grow: int
    shrink: int

    def next_length(self, current: int, drafted: int, accepted: int, capped: bool, longest: int) -> int:
        """The next chain length of a sequence whose `drafted` tokens just verified with `accepted` taken
        (`capped`: its chain was cut short by max_tokens, so a full accept does not grow it)."""
        if accepted < drafted:
            return max(1, current - self.shrink)
        if capped:
            return current
        return min(longest, current + self.grow)


RULES = {"step": LengthRule("step", grow=1, shrink=1), "heuristic": LengthRule("heuristic", grow=2, shrink=1)}


def length_rule(name: str, draft: str = "?") -> LengthRule:
    """The rule called `name`; ValueError naming the rules otherwise."""
    if not isinstance(name, str) or name not in RULES:
        raise ValueError(f"draft {draft}: length_rule must be one of {sorted(RULES)}, got {name!r}")
    return RULES[name]


def confident(top_probability: float, threshold: float | None) -> bool:
    """Whether a draft may go on after a token drawn from a distribution whose largest probability is
    `top_probability` (no threshold: always)."""
    return threshold is None or top_probability >= threshold


def check_threshold(name: str, threshold) -> None:
    """A confidence threshold is None or a probability in [0, 1]; ValueError otherwise."""
    if threshold is None:
        return
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"draft {name}: confidence_threshold must be None or a probability in [0, 1], got {threshold!r}")
