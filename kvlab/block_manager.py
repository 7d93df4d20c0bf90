"""Where every sequence's KV lives: one allocator per layer group. Torch-free.

Layers that attend alike share a group (and so a block table): all layers of a
Llama form one group; Gemma 3's sliding-window layers form a second group whose
blocks slide out of the window and go back to the pool. Per-layer budgets of
future eviction policies become more groups. Every group holds `num_blocks`
blocks of `block_size` slots; a block id means the same slots in each layer of
its group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvlab.allocators.base import Allocator
from kvlab.sequence import Sequence


@dataclass(frozen=True)
class LayerGroup:
    layers: tuple[int, ...]
    sliding_window: int | None = None  # attend to the last `sliding_window` keys only


class BlockManager:
    def __init__(self, groups: list[LayerGroup], make_allocator: Callable[[], Allocator], num_blocks: int,
                 block_size: int, max_model_len: int):
        self.groups = groups
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.allocators = [make_allocator() for _ in groups]
        for allocator in self.allocators:
            allocator.setup(num_blocks, block_size, max_model_len)
        # waste is measured on the full-attention group(s): that is where requests compete for memory
        full = [i for i, g in enumerate(groups) if g.sliding_window is None]
        self.primary = max(full or range(len(groups)), key=lambda i: len(groups[i].layers))

    # -- sizing --------------------------------------------------------------
    def capacity_error(self, seq: Sequence) -> str | None:
        """Why `seq` could never run alone in this pool, or None."""
        a = self.primary_allocator
        reserved = a.reservation(seq.num_tokens, seq.max_len)
        need = a.blocks_for(max(reserved, seq.max_len))
        if need <= a.usable_blocks:
            return None
        if reserved > seq.max_len:
            what = (f"the {getattr(type(a), 'registry_name', type(a).__name__)} allocator reserves "
                    f"max_model_len = {reserved} tokens for every request")
            fix = "raise kv_cache_memory or lower max_model_len"
        elif seq.is_scoring:
            what = f"{seq.score_from} context + {seq.num_tokens - seq.score_from} continuation tokens"
            fix = "raise kv_cache_memory or shorten the context"
        else:
            what = f"{seq.num_prompt_tokens} prompt + {seq.max_len - seq.num_prompt_tokens} new"
            fix = "raise kv_cache_memory or lower max_tokens / max_model_len"
        reserve = f" ({self.num_blocks - a.usable_blocks} kept in reserve)" if a.usable_blocks < self.num_blocks else ""
        return (f"request needs {need} blocks of {self.block_size} tokens ({what}), but the KV pool has only "
                f"{a.usable_blocks}{reserve}; {fix}")

    # -- state machine -------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        return all(a.can_allocate(seq.num_tokens, seq.max_len) for a in self.allocators)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        for a in self.allocators:
            a.allocate(seq.seq_id, num_tokens, seq.max_len)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return all(a.can_append(seq.seq_id, num_new_tokens) for a in self.allocators)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        for a in self.allocators:
            a.append_slots(seq.seq_id, num_new_tokens)

    def free(self, seq: Sequence) -> None:
        for a in self.allocators:
            a.free(seq.seq_id)

    def release_out_of_window(self, seq: Sequence) -> None:
        """Free sliding-window blocks no future query of `seq` can see."""
        first_query = seq.num_computed_tokens  # the next token to compute sits here
        for group, a in zip(self.groups, self.allocators):
            if group.sliding_window is not None:
                a.release_before(seq.seq_id, first_query - group.sliding_window + 1)

    def take_copies(self) -> list[list[tuple[int, int]]]:
        """Pending copy-on-write block copies, per group."""
        return [a.take_copies() for a in self.allocators]

    # -- views for the runner and the metrics --------------------------------
    def block_tables(self, seq: Sequence) -> list[list[int]]:
        return [a.block_table(seq.seq_id) for a in self.allocators]

    @property
    def primary_allocator(self) -> Allocator:
        return self.allocators[self.primary]

    def num_used_blocks(self) -> int:
        return self.primary_allocator.num_used_blocks
