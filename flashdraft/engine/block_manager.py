"""Paged KV blocks: which cache pages each sequence owns. Page ids index the KV tensors that the
model runner allocates; a sequence's tokens [i*B, (i+1)*B) live in page table[i]. Hybrid targets
(models/hybrid.py) also give each sequence holding pages one recurrent-state slot, taken with its
first pages and given back with them (finish, preemption)."""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.free_slots: deque[int] = deque(range(num_state_slots))
        self.slots: dict[int, int] = {}
        self.has_slots = num_state_slots > 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_for(self, seq_id: int, num_tokens: int) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(self.tables.get(seq_id, ())))

    def can_fit(self, seq_id: int, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq_id, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Grow the sequence's table to hold `num_tokens` tokens (append)."""
        need = self.extra_blocks_for(seq_id, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {need}, free {len(self.free_blocks)}")
        if self.has_slots and seq_id not in self.slots:
            if not self.free_slots:  # the scheduler admits at most max_num_seqs = the slot count
                raise RuntimeError("out of recurrent-state slots")
            self.slots[seq_id] = self.free_slots.popleft()
        table = self.tables.setdefault(seq_id, [])
        table.extend(self.free_blocks.popleft() for _ in range(need))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep pages for the first `num_tokens` tokens, free the rest (speculative rollback)."""
        table = self.tables.get(seq_id, [])
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            self.free_blocks.append(table.pop())

    def free(self, seq_id: int) -> None:
        self.free_blocks.extend(self.tables.pop(seq_id, []))
        if seq_id in self.slots:
            self.free_slots.append(self.slots.pop(seq_id))

    def slot(self, seq_id: int) -> int:
        """The sequence's recurrent-state slot (hybrid targets)."""
        return self.slots[seq_id]

    def table(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])
