"""An outside eviction policy: one dataclass, one decorator, one entry point (see ../pyproject.toml).

Once installed (`pip install experiments/example_plugin`), `value_norm` is selectable as
`LLM(..., policy="value_norm", policy_args={"budget": 64})`, as `kvlab-run policy=value_norm`, and in
sweeps; its own tests run `kvlab.testing.check_policy("value_norm", {"budget": 32})`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.policies.base import Policy
from kvlab.registry import POLICIES


@POLICIES.register("value_norm")
@dataclass
class ValueNorm(Policy):
    """Keeps the tokens whose value vectors have the largest L2 norm (they move the output most).

    recent: the most recent tokens always kept, whatever their norm.
    """

    recent: int = 4

    def score(self, layer_idx, keys, values, queries, attn_stats):
        score = values.float().norm(dim=-1)  # [L, Hkv]
        if self.recent:
            score[-self.recent:] = float("inf")
        return score
