"""The drafter's context: its K/V cache of committed positions, the attention that reads it, and the
writes into it (DFLASH.md, step 1: each draft layer's K/V of every position's fused taps).

Every step writes the context of all its target rows, rejected drafts' rows included: those lie at or
past the new committed length, where the next draft block (B scratch slots) or verify rewrites them
before anything reads them. On CUDA, and wherever graphs run (off CUDA: the tests' graph harness), each
step writes at once (in its graph, where it has one): a graph's drafter reads the cache as it stands.
Off CUDA the rows wait, in order, until the cache is next read (a draft, the cache's slots moved or
poisoned), then go in as one write: the cache then holds what writing each step at once would have
left. While drafts are paused most of them are never needed: rows waiting when no request is left are
dropped (`idle`), except under prefix caching, whose pages a later request's drafts read.
"""

from __future__ import annotations

import torch

from flashdraft.attention.base import AttentionBatch, LayerMasks
from flashdraft.engine.model_runner import ModelRunner, make_backend
from flashdraft.models.dflash_draft import DFlashDraftModel

WAITING_BYTES = 64 << 20  # waiting rows' taps written at once even when no draft needs them yet


class DrafterContext:
    def __init__(self, drafter: DFlashDraftModel, runner: ModelRunner):
        self.drafter, self.runner = drafter, runner
        c = drafter.config
        shape = (c.num_hidden_layers, runner.k_cache.shape[1], runner.block_size, c.num_key_value_heads,
                 drafter.head_dim)  # the target's pages: a position's draft K/V lies at its target slot
        self.k_cache = torch.zeros(shape, device=runner.device, dtype=runner.kv_dtype)
        self.v_cache = torch.zeros(shape, device=runner.device, dtype=runner.kv_dtype)
        self.kv = [(self.k_cache[i], self.v_cache[i]) for i in range(c.num_hidden_layers)]
        masks = drafter.spec.layer_masks
        if masks and any(m != (False, None) for m in masks):  # causal or sliding-window drafter layers
            self.attn = LayerMasks(lambda: make_backend(runner.backend_name), masks)
        else:
            self.attn = make_backend(runner.backend_name)
        self.defer = runner.device.type != "cuda"
        self._waiting: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # taps, positions, slots
        self._waiting_bytes = 0

    def write(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The context K/V of a step's rows (their taps) at `slots`: now, or when next read (the docstring)."""
        if not self.defer or self.runner.use_graphs:
            self._store(taps, positions, slots)
            return
        self._waiting.append((taps, positions, slots))
        self._waiting_bytes += taps.numel() * taps.element_size()
        if self._waiting_bytes >= WAITING_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write every waiting step's rows, in the order the steps ran: before anything reads the cache."""
        if self._waiting:
            taps, positions, slots = (torch.cat(x) for x in zip(*self._waiting))
            self._waiting, self._waiting_bytes = [], 0
            self._store(taps, positions, slots)

    def idle(self, prefix_caching: bool) -> None:
        """No request is left: waiting rows are written where cached pages keep them for later requests,
        else dropped (a new request's drafts read only positions its own steps write)."""
        if not self._waiting:
            return
        if prefix_caching:
            self.flush()
        else:
            self._waiting, self._waiting_bytes = [], 0

    def _store(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        store = AttentionBatch(slots, [], [], [], self.runner.block_size)  # store-only: slots
        self.drafter.write_context(taps, positions, self.kv, self.attn, store)
