"""Draft models for speculative decoding (registry: kvlab.registry.DRAFTS)."""

from kvlab.drafts.base import DraftModel

__all__ = ["DraftModel"]
