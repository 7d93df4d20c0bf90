"""Conformance suites for plugins: what every policy, draft and allocator must do inside the engine.

    from kvlab.testing import check_allocator, check_combination, check_draft, check_placement, check_policy
"""

from kvlab.testing.allocators import check_allocator
from kvlab.testing.combinations import check_combination
from kvlab.testing.drafts import check_draft
from kvlab.testing.placements import check_placement
from kvlab.testing.policies import CHECKS, check_policy, expected_kept, prompts

__all__ = ["CHECKS", "check_allocator", "check_combination", "check_draft", "check_policy", "expected_kept", "prompts"]
