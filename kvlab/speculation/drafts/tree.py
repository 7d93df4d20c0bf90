"""A token tree drafted from a model's top-k branches, verified in one target pass (SpecInfer).

Based on SpecInfer (Miao et al. 2024, arXiv:2305.09781): instead of one chain, the draft proposes a
tree -- `width` children of every node on the first `branch_levels` levels, then one child per
node down to `depth` (SpecInfer's expansion configuration <width, ..., width, 1, ..., 1>) -- and the
target scores every node in one forward pass under a tree attention mask (each node sees the
committed tokens and its own ancestors; `kernels/attention_plan.py`). Greedy requests branch on the
draft's top-`width` tokens (point masses); sampled requests draw each node's `width` children i.i.d.
from the draft's distribution (with the request's temperature / top-k / top-p and generator), which
is what makes multi-step speculative sampling over siblings lossless (`kvlab/speculation/tree_verifier.py`).

The drafting network is the model named by `model`, or -- `model` None -- the target's own first
`layers` decoder layers and head (as `layerskip`). It runs on the `model` draft's own pool: the
request's shadow sequence computes the first-child chain, and every other branch is a fork of its
parent's shadow (pages shared, copy-on-write on the first write into the shared last page), so the
draft needs no tree mask of its own; forks are freed when the proposal is made. Each tree level is
one packed forward of all open branches of all requests.

Tree layout handed to the engine: depth-first preorder with children in drafting order, so the
first-child chain sits at draft indices 0..depth-1; `Proposal.parents[i]` is the parent draft index
of draft token i (-1: the last committed token).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlab.speculation.drafts.base import Proposal
from kvlab.speculation.drafts.layerskip import early_exit
from kvlab.speculation.drafts.model import ModelDraft
from kvlab.registry import DRAFTS
from kvlab.sampler import probabilities
from kvlab.sequence import Sequence


def expansion_sizes(width: int, depth: int, branch_levels: int) -> list[int]:
    """Nodes per level of the tree <width x branch_levels, 1 x (depth - branch_levels)>."""
    sizes, open_ = [], 1
    for level in range(depth):
        open_ *= width if level < branch_levels else 1
        sizes.append(open_)
    return sizes


def preorder(nodes: list[tuple[int, int]]) -> list[int]:
    """Nodes [(parent, token)] in creation order (parents first) -> their depth-first preorder, children
    in creation order (the first-child chain first)."""
    children: dict[int, list[int]] = {}
    for n, (parent, _) in enumerate(nodes):
        children.setdefault(parent, []).append(n)
    order, stack = [], list(reversed(children.get(-1, [])))
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(children.get(n, [])))
    return order


@DRAFTS.register("tree")
@dataclass
class TreeDraft(ModelDraft):
    """A token tree of the draft's top-`width` branches (or `width` i.i.d. samples) on the first
    `branch_levels` levels, chains below, `depth` levels in all."""

    moves_kv_slots: ClassVar[bool] = True  # the accepted path's KV moves to the committed positions
    stops_on_confidence: ClassVar[bool] = False  # a tree has a fixed shape: no confidence stop
    num_tokens: int = field(default=1, init=False)  # the node count (set from the shape)
    max_num_tokens: int = field(default=1, init=False)
    model: str | None = None  # drafting model (as for 'model'); None: the target's first `layers` layers
    layers: int = 4  # with model None: decoder layers of the target the draft runs (layerskip)
    width: int = 2  # children of every node on a branching level, >= 1
    depth: int = 4  # levels of drafted tokens (the longest path), >= 1
    branch_levels: int = 1  # levels, from the root, whose nodes branch; 1 .. depth
    _fork_ids: object = field(default_factory=lambda: itertools.count(-1, -1), init=False, repr=False)

    def __post_init__(self) -> None:
        for key in ("width", "depth", "branch_levels", "layers"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"draft tree: {key} must be an integer >= 1, got {value!r}")
        if self.branch_levels > self.depth:
            raise ValueError(f"draft tree: branch_levels ({self.branch_levels}) must be <= depth ({self.depth})")
        if self.adaptive:
            raise ValueError("draft tree: adaptive draft length is an option of chain drafts; a tree has a fixed "
                             "shape (width, depth, branch_levels)")
        # the node count is the draft length the engine budgets (tentative slots, the token budget)
        self.num_tokens = self.max_num_tokens = sum(expansion_sizes(self.width, self.depth, self.branch_levels))
        super().__post_init__()

    def _draft_model(self, engine) -> torch.nn.Module:
        if self.model is None:
            return early_exit(engine.model, self.layers).eval()
        return super()._draft_model(engine)

    def _extra_tokens(self) -> int:
        """Room for the open branches of 64 sequences: each fork may copy its shared last page."""
        leaves = expansion_sizes(self.width, self.depth, self.branch_levels)[-1]
        return 64 * leaves * (self.depth + 64)

    def propose(self, seqs, lengths, generators) -> list[Proposal]:
        """`lengths[i]`: at most that many nodes for sequence i (the tree is cut to a preorder prefix
        by the engine); the tree's depth is at most that too."""
        if self._pool is None:
            raise RuntimeError("draft 'tree' was not set up: the engine calls setup(engine) first")
        live = {s.seq_id for s in seqs}
        for seq_id in [k for k in self._shadows if k not in live]:
            self._drop(seq_id)
        nodes: list[list[tuple[int, int]]] = [[] for _ in seqs]  # per seq: (parent node, token), creation order
        qs: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        sizes = [1] + [s for s in expansion_sizes(self.width, self.depth, self.branch_levels)]
        branching = [sizes[d + 1] // sizes[d] for d in range(self.depth)]
        open_ = [(i, self._sync(s), -1) for i, s in enumerate(seqs) if lengths[i] > 0]  # (seq, shadow, node)
        forks: list[Sequence] = []
        try:
            for level in range(self.depth):
                open_ = [(i, sh, node) for i, sh, node in open_ if level < lengths[i] and self._room(sh)]
                if not open_:
                    break
                logits = self._forward([sh for _, sh, _ in open_])  # [L, V]
                q = probabilities(logits, [seqs[i].params for i, _, _ in open_])  # [L, V]
                grown = []
                for row, (i, sh, node) in enumerate(open_):
                    tokens = self._children(logits[row], q[row], branching[level], seqs[i].params.greedy,
                                            generators[i])
                    shadows = [sh] + [self._fork(sh, forks) for _ in tokens[1:]]
                    for child_sh, token in zip(shadows, tokens):
                        nodes[i].append((node, token))
                        qs[i].append(None if seqs[i].params.greedy else q[row])
                        child_sh.token_ids.append(token)
                        grown.append((i, child_sh, len(nodes[i]) - 1))
                open_ = grown
        finally:
            for fork in forks:
                self._pool.free(fork)
        return [self._proposal(n, q) for n, q in zip(nodes, qs)]

    def _children(self, logits: torch.Tensor, q: torch.Tensor, width: int, greedy: bool, generator) -> list[int]:
        """logits [V], q [V] (the request's distribution) -> `width` child tokens: the draft's top-`width`
        by logit for greedy requests (their q is a point mass: it ranks nothing past the argmax), or
        i.i.d. draws from q."""
        if greedy:
            return logits.topk(min(width, logits.shape[-1])).indices.tolist() if width > 1 else [int(q.argmax())]
        return torch.multinomial(q, width, replacement=True, generator=generator).tolist()

    def _fork(self, sh: Sequence, forks: list[Sequence]) -> Sequence:
        """A branch sharing every page of `sh` (which has computed all its tokens)."""
        child = Sequence(next(self._fork_ids), list(sh.token_ids), sh.params, sh.max_len, sh.arrival_time)
        child.num_computed_tokens = sh.num_computed_tokens
        self._pool.fork(sh, child)
        forks.append(child)
        return child

    def _room(self, sh: Sequence) -> bool:
        """Slots for the shadow's uncomputed tokens; False (the branch stops growing) if the pool is full:
        a request's own shadow is then dropped (recomputed when there is room), as for 'model'."""
        if self._take_slots(sh):
            return True
        if sh.seq_id >= 0:
            self._drop(sh.seq_id)
        return False

    @staticmethod
    def _proposal(nodes: list[tuple[int, int]], qs: list) -> Proposal:
        order = preorder(nodes)
        where = {n: i for i, n in enumerate(order)}
        parents = [where[nodes[n][0]] if nodes[n][0] >= 0 else -1 for n in order]
        probs = None if not order or qs[0] is None else torch.stack([qs[n] for n in order])
        return Proposal([nodes[n][1] for n in order], probs, parents)
