"""Draft models for speculative decoding (registry: kvlab.registry.DRAFTS)."""

from kvlab.drafts.base import DraftModel, Proposal
from kvlab.drafts.layerskip import LayerSkipDraft
from kvlab.drafts.model import ModelDraft
from kvlab.drafts.ngram import NgramDraft
from kvlab.drafts.slem import SLEMDraft
from kvlab.drafts.slrs import SLRSDraft
from kvlab.drafts.tli import TLIDraft
from kvlab.drafts.tree import TreeDraft

__all__ = ["DraftModel", "LayerSkipDraft", "ModelDraft", "NgramDraft", "Proposal", "SLEMDraft", "SLRSDraft",
           "TLIDraft", "TreeDraft"]
