"""Eviction / compression policies (registry: kvlab.registry.POLICIES), one file each."""

from kvlab.policies import full  # noqa: F401  (register)
from kvlab.policies.base import Policy

__all__ = ["Policy"]
