"""K/V rows addressed by cache slot (page * block_size + offset), for the target's and the drafter's
caches alike: the slots of a request's positions, copies between slots (token trees move accepted
rows to their positions' slots) and, for tests, NaN written into slots nothing may read again."""

from __future__ import annotations

import torch

from flashdraft.engine.block_manager import BlockManager


def position_slots(bm: BlockManager, seq_id: int, positions) -> list[int]:
    """The cache slot of each of a request's positions, from its block table."""
    bs, table = bm.block_size, bm.table(seq_id)
    return [table[q // bs] * bs + q % bs for q in positions]


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """[layers, pages, page_size, heads, dim] -> [layers, slots, heads, dim] (a view)."""
    return cache.view(cache.shape[0], -1, *cache.shape[3:])


def copy_slots(caches, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy every layer's K/V from slots src to slots dst (all reads before any write)."""
    for cache in caches:
        flat = _flat(cache)
        flat[:, dst] = flat[:, src]


def move_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
               kernel: bool = False) -> None:
    """Every layer's K/V from slots src to slots dst: src, dst [S, D] per request (-1: none) through
    tree_ops.move_slots when kernel, else flat slot lists through copy_slots."""
    if kernel:
        from flashdraft.kernels.tree_ops import move_slots

        move_slots(k_cache, v_cache, src, dst)
    else:
        copy_slots((k_cache, v_cache), src, dst)


def poison_slots(caches, slots: torch.Tensor) -> None:
    """Tests: NaN into every layer's K/V at `slots` (padding rows' -1 skipped), so any later read shows."""
    slots = slots[slots >= 0]
    for cache in caches:
        _flat(cache)[:, slots] = float("nan")
