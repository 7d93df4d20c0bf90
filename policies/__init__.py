"""Eviction / compression policies (registry: kvlab.registry.POLICIES), one file each."""

from kvlab.policies import (  # noqa: F401
    adakv, chunkkv, expected_attention, full, h2o, keydiff, knorm, pyramidkv, random, snapkv, streaming_llm, tova,
)
from kvlab.policies.base import Policy

__all__ = ["Policy"]
