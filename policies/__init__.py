"""Eviction / compression policies (registry: kvlab.registry.POLICIES), one file each."""

from kvlab.policies import chunkkv, full, h2o, keydiff, knorm, pyramidkv, random, snapkv, streaming_llm, tova  # noqa: F401
from kvlab.policies.base import Policy

__all__ = ["Policy"]
