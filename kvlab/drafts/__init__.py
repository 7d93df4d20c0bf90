"""Draft models for speculative decoding (registry: kvlab.registry.DRAFTS)."""

from kvlab.drafts.base import DraftModel, Proposal
from kvlab.drafts.model import ModelDraft
from kvlab.drafts.ngram import NgramDraft

__all__ = ["DraftModel", "ModelDraft", "NgramDraft", "Proposal"]
