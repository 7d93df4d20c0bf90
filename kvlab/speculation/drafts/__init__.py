"""Draft models for speculative decoding (registry: kvlab.registry.DRAFTS)."""

from kvlab.speculation.drafts.base import DraftModel, Proposal
from kvlab.speculation.drafts.layerskip import LayerSkipDraft
from kvlab.speculation.drafts.model import ModelDraft
from kvlab.speculation.drafts.ngram import NgramDraft
from kvlab.speculation.drafts.self_compressed import SelfCompressedDraft
from kvlab.speculation.drafts.slem import SLEMDraft
from kvlab.speculation.drafts.slrs import SLRSDraft
from kvlab.speculation.drafts.tli import TLIDraft
from kvlab.speculation.drafts.tree import TreeDraft

__all__ = ["DraftModel", "LayerSkipDraft", "ModelDraft", "NgramDraft", "Proposal", "SelfCompressedDraft", "SLEMDraft", "SLRSDraft",
           "TLIDraft", "TreeDraft"]
