"""Paged KV blocks: which cache pages each sequence owns. Page ids index the KV tensors that the
model runner allocates (the target's, and a DFlash drafter's context K/V, which uses the same pages); a
sequence's tokens [i*B, (i+1)*B) live in page table[i]. Hybrid targets (models/hybrid.py) also give each
sequence holding pages one recurrent-state slot, taken with its first pages and given back with them
(finish, preemption).

Prefix caching: a page whose B tokens are all committed and computed (target K/V and drafter context both
written) is registered under a hash of its tokens chained to the pages before it. Pages are reference
counted; a registered page that no sequence holds stays cached, evicted least recently used first when a
fresh page is needed. A new sequence whose first full blocks hash alike takes those pages and starts its
prefill after them: the target's K/V and the drafter's context there are what it would have computed,
since both depend only on the tokens up to each position."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int = 0, prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))  # pages holding nothing worth keeping
        self.tables: dict[int, list[int]] = {}
        self.free_slots: deque[int] = deque(range(num_state_slots))
        self.slots: dict[int, int] = {}
        self.has_slots = num_state_slots > 0
        # a recurrent state cannot be rebuilt from pages: no prefix caching for hybrid targets
        self.prefix_caching = prefix_caching and not self.has_slots
        self.refs = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> the page registered under it
        self.page_hash: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages no sequence holds, LRU first
        self.hashes: dict[int, list[bytes]] = {}  # a sequence's chain of full-block hashes so far
        self.num_queried_tokens = 0  # prompt tokens looked up at admission
        self.num_hit_tokens = 0  # of which found cached

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_for(self, seq_id: int, num_tokens: int) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(self.tables.get(seq_id, ())))

    def can_fit(self, seq_id: int, num_tokens: int) -> bool:
        return self.extra_blocks_for(seq_id, num_tokens) <= self.num_free_blocks

    def _take(self) -> int:
        if self.free_blocks:
            page = self.free_blocks.popleft()
        else:  # the least recently used cached page: forget what it held
            page, _ = self.evictable.popitem(last=False)
            del self.cached[self.page_hash.pop(page)]
        self.refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self.page_hash:
                self.evictable[page] = None
            else:
                self.free_blocks.append(page)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Grow the sequence's table to hold `num_tokens` tokens (append)."""
        need = self.extra_blocks_for(seq_id, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, free {self.num_free_blocks}")
        if self.has_slots and seq_id not in self.slots:
            if not self.free_slots:  # the scheduler admits at most max_num_seqs = the slot count
                raise RuntimeError("out of recurrent-state slots")
            self.slots[seq_id] = self.free_slots.popleft()
        table = self.tables.setdefault(seq_id, [])
        table.extend(self._take() for _ in range(need))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep pages for the first `num_tokens` tokens, free the rest (speculative rollback)."""
        table = self.tables.get(seq_id, [])
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, seq_id: int) -> None:
        for page in self.tables.pop(seq_id, []):
            self._release(page)
        self.hashes.pop(seq_id, None)
        if seq_id in self.slots:
            self.free_slots.append(self.slots.pop(seq_id))

    def match(self, seq_id: int, token_ids: list[int]) -> int:
        """A sequence that holds no page takes the cached pages of its longest cached prefix of full
        blocks, leaving at least its last token to compute (its logits); returns the tokens they hold."""
        if not self.prefix_caching or self.tables.get(seq_id):
            return 0
        B, parent, table, chain = self.block_size, b"", [], []
        for i in range((len(token_ids) - 1) // B):
            h = block_hash(parent, token_ids[i * B:(i + 1) * B])
            page = self.cached.get(h)
            if page is None:
                break
            if self.refs[page] == 0:
                del self.evictable[page]
            self.refs[page] += 1
            table.append(page)
            chain.append(h)
            parent = h
        self.num_queried_tokens += len(token_ids)
        self.num_hit_tokens += len(table) * B
        if table:
            self.tables[seq_id], self.hashes[seq_id] = table, chain
        return len(table) * B

    def register(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Register the sequence's full blocks of computed tokens not registered yet. A block computed
        alike by two sequences keeps the first page registered; the second stays the sequence's own."""
        if not self.prefix_caching:
            return
        chain, table, B = self.hashes.setdefault(seq_id, []), self.tables.get(seq_id, []), self.block_size
        for i in range(len(chain), min(num_computed // B, len(table))):
            h = block_hash(chain[-1] if chain else b"", token_ids[i * B:(i + 1) * B])
            chain.append(h)
            if h not in self.cached and table[i] not in self.page_hash:
                self.cached[h], self.page_hash[table[i]] = table[i], h

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (pages held by sequences stay theirs): a benchmark's arms start alike."""
        self.free_blocks.extend(self.evictable)
        self.evictable.clear()
        self.cached.clear()
        self.page_hash.clear()

    def slot(self, seq_id: int) -> int:
        """The sequence's recurrent-state slot (hybrid targets)."""
        return self.slots[seq_id]

    def table(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])
