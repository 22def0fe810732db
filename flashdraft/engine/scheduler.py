"""Continuous batching. Every step has a token budget; running sequences go first (one token each,
plus draft tokens when speculating, or their next prefill chunk), then waiting sequences are
admitted while KV pages and the budget last. When pages run out the most recently admitted
running sequence is preempted by recompute: its pages are freed and it re-enters the waiting
queue at the front, to be prefilled again (prompt and output so far)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from flashdraft.config import EngineConfig
from flashdraft.engine.block_manager import BlockManager
from flashdraft.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # incl. draft slots when verifying
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: Callable[[Sequence], int] = lambda s: 0) -> ScheduledBatch:
        """`lookahead(seq)`: extra (draft) slots a decoding sequence verifies this step."""
        out = ScheduledBatch()
        budget = self.max_num_batched_tokens
        for seq in self.running:  # blocks completed by the last step join the prefix cache
            self.bm.register(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(1 + lookahead(seq), budget) if remaining == 1 else min(remaining, budget)
            while not self.bm.can_fit(seq.seq_id, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.bm.allocate(seq.seq_id, seq.num_computed_tokens + n)
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def admit(self, reserve: int = 0) -> ScheduledBatch:
        """Admit the waiting requests whose whole remaining prompt fits now (pages, with `reserve` more
        slots each, the token budget, max_num_seqs), in order, stopping at the first that does not,
        without scheduling the running ones: their prefill is a step of its own, launched beside the
        running requests' (speculative/ahead.py)."""
        out = ScheduledBatch()
        self._admit(out, self.max_num_batched_tokens, whole=True, reserve=reserve)
        return out

    def _admit(self, out: ScheduledBatch, budget: int, whole: bool = False, reserve: int = 0) -> None:
        """Waiting requests into `out` and the running list: their prompt, or as much of it as the
        budget and the free pages allow (whole: all of it and `reserve` slots more, or stop)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # (a prompt whose log-probabilities are still wanted is computed whole: its rows give them)
            matched = not self.bm.table(seq.seq_id) and seq.num_computed_tokens == 0 and not (
                seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens)
            if matched:  # the prompt's cached prefix (prefix caching), prefilled no more
                seq.num_computed_tokens = self.bm.match(seq.seq_id, seq.token_ids)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = seq.num_computed_tokens
            room = (self.bm.num_free_blocks + len(self.bm.table(seq.seq_id))) * self.bm.block_size
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget, room - seq.num_computed_tokens - (reserve if whole else 0))
            if n <= 0 or (whole and n < remaining):
                if matched:  # it waits holding nothing: its cached pages stay evictable meanwhile
                    self.bm.free(seq.seq_id)
                    seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.bm.allocate(seq.seq_id, seq.num_computed_tokens + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.register(seq.seq_id, seq.token_ids, seq.num_computed_tokens)  # its prefill finds them again
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.register(seq.seq_id, seq.token_ids, seq.num_computed_tokens)  # a next turn starts with them
        self.bm.free(seq.seq_id)
