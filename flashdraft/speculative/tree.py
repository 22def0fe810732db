"""Token trees: more than one candidate per draft slot, verified in one target forward.

The drafter scores every slot of its block in one forward (slot k: the token at start + k). A chain
verifies only the argmax of each slot; a tree of N nodes verifies the N token sequences the drafter
finds most likely, as EAGLE-2 builds its trees: a node is a path of ranks (r_1, .., r_d), the r_j-th
most likely token of slot j, scored by the sum of those tokens' log-probabilities; the tree is the N
best nodes. Every prefix of a chosen path scores at least as high, so the tree is prefix-closed.
With the block's slots scored independently, the best N come from expanding, depth by depth, the N
best nodes of the depth above by the N best tokens of the slot (a node outside the N best of its
depth cannot have a descendant among the N best overall): fixed shapes, no host sync, graph-safe.

Layout of a verify block of a tree: row 0 is the last committed token x_start (the root); row i + 1
is node i, nodes sorted by depth (so any first m nodes are a prefix-closed tree too, which is what a
verify cut short by the token budget checks). Node i sits at position start + depth_i and attends to
the context and to its ancestors' rows (`ancestor_masks`: bit j set = row j is visible).

Acceptance walks the tree with the target's own tokens: node i is accepted iff its parent is and its
token equals the target's token at the parent's row (argmax at T = 0, the seeded sample at T > 0, the
same rule as a chain's, so the output is plain decoding's). Siblings hold different tokens, so at most
one accepted path exists; the request commits the target's tokens along it, bonus included."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft import settings
from flashdraft.kernels.dispatch import fused_enabled

MAX_TREE_SIZE = 63  # rows 0..63 of a verify block fit one int64 ancestor mask


@dataclass
class Trees:
    """One tree per request, as device tensors [S, N]: node tokens, the verify row of each node's
    parent (0 = the root row), depth (1..max_depth), and valid (False: never accepted; a padding node
    when fewer than N candidates exist). max_depth bounds every depth (static: no device read).
    ancestors: their [S, N + 1] ancestor masks, when whoever built the trees made those too."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    max_depth: int
    ancestors: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def masks(self) -> torch.Tensor:
        """[S, N + 1] int64 ancestor masks of the verify rows (ancestor_masks)."""
        return self.ancestors if self.ancestors is not None else ancestor_masks(self.parents, self.max_depth)


def use_kernels(x: torch.Tensor) -> bool:
    """Whether tree work over tensors like `x` runs in kernels/tree_ops.py's kernels (see
    settings.TREE_KERNELS; off: the torch ops of this module)."""
    mode = settings.TREE_KERNELS
    if mode not in ("auto", "off"):
        raise ValueError(f"FLASHDRAFT_TREE_KERNELS must be auto or off, got {mode!r}")
    return mode == "auto" and fused_enabled(x)


def build_trees(logp: torch.Tensor, tokens: torch.Tensor, size: int) -> Trees:
    """logp [S, D, K]: log-probabilities of each slot's K candidates, sorted descending; tokens
    [S, D, K] their ids. K >= size gives the exact N = size best paths (fewer, if K < size, among the
    paths those candidates make). Ties between a node and its descendants (a slot of probability 1)
    go to the shallower node: depth d's scores are lowered by d * 1e-6."""
    S, D, K = logp.shape
    N = size
    dev = logp.device
    neg = torch.finfo(logp.dtype).min
    # depth 1: the N best tokens of slot 1 (padding past K scores -inf)
    score = torch.full((S, N), neg, dtype=logp.dtype, device=dev)
    tok = torch.zeros((S, N), dtype=tokens.dtype, device=dev)
    w = min(N, K)
    score[:, :w] = logp[:, 0, :w]
    tok[:, :w] = tokens[:, 0, :w]
    scores, toks, parents = [score], [tok], [torch.full((S, N), -1, dtype=torch.long, device=dev)]
    for d in range(1, D):
        cand = (score[:, :, None] + logp[:, d, None, :]).view(S, N * K)  # parent j, rank r -> j * K + r
        score, idx = cand.topk(N, dim=1)
        score = torch.where(score > neg / 2, score, neg)  # a padding parent's children stay at the floor
        toks.append(tokens[:, d, :].gather(1, idx % K))
        parents.append((d - 1) * N + idx // K)  # the parent's index among all candidates
        scores.append(score)
    depth_of = torch.arange(D, device=dev).repeat_interleave(N)  # candidate c is at depth c // N + 1
    all_scores = torch.cat(scores, 1) - (depth_of + 1).to(logp.dtype) * 1e-6
    chosen = all_scores.topk(N, dim=1).indices.sort(dim=1).values  # depth-major: parents come first
    row_of = torch.zeros((S, D * N), dtype=torch.long, device=dev)
    row_of.scatter_(1, chosen, torch.arange(1, N + 1, device=dev).expand(S, N))  # 0: not in the tree
    parent_c = torch.cat(parents, 1).gather(1, chosen)
    parent_row = torch.where(parent_c < 0, 0, row_of.gather(1, parent_c.clamp_min(0)))
    finite = torch.cat(scores, 1).gather(1, chosen) > neg / 2
    valid = finite & ((parent_c < 0) | (parent_row > 0))
    for _ in range(D - 1):  # a node under an invalid one is invalid too
        valid = valid & torch.cat([valid.new_ones(S, 1), valid], 1).gather(1, parent_row)
    return Trees(torch.cat(toks, 1).gather(1, chosen), parent_row, depth_of[chosen] + 1, valid, D)


def chain(tokens: torch.Tensor) -> Trees:
    """The chain of drafts [S, k] as a tree: node i's parent is row i (the node before it)."""
    S, k = tokens.shape
    rows = torch.arange(k, device=tokens.device).expand(S, k)
    return Trees(tokens, rows.clone(), rows + 1, torch.ones_like(tokens, dtype=torch.bool), k)


def ancestor_masks(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [S, N] -> [S, N + 1] int64: bit j of row i set iff row j is row i or an ancestor of it
    (the root row 0 sees itself). Each round adds one more generation: max_depth rounds settle all."""
    S, N = parents.shape
    rows = torch.arange(N + 1, device=parents.device)
    own = torch.ones_like(rows).bitwise_left_shift(rows).expand(S, N + 1)  # row 63 sets the sign bit: fine
    masks = own
    for _ in range(max_depth):
        masks = torch.cat([own[:, :1], own[:, 1:] | masks.gather(1, parents)], 1)
    return masks


def accept(trees: Trees, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target [S, 1 + n]: the target's token at each verify row (n <= N: the first n nodes were
    verified, a prefix-closed tree). Returns a [S], the accepted drafts (the depth of the deepest
    accepted node), and path [S, max_depth + 1], the verify row at each depth of the accepted path
    (0, the root's row, past a): target.gather(1, path)[:, :a + 1] are the tokens to commit."""
    n = target.shape[1] - 1
    S, D = target.shape[0], trees.max_depth
    parents, depths = trees.parents[:, :n], trees.depths[:, :n]
    match = trees.valid[:, :n] & (trees.tokens[:, :n] == target.gather(1, parents))
    ok = torch.ones((S, n + 1), dtype=torch.bool, device=target.device)
    for _ in range(D):
        ok = torch.cat([ok[:, :1], match & ok.gather(1, parents)], 1)
    depth_row = torch.cat([depths.new_zeros(S, 1), depths], 1)
    best = torch.where(ok, depth_row, -1).argmax(1)  # one accepted node per depth: siblings differ
    parent_row = torch.cat([parents.new_zeros(S, 1), parents], 1)
    path = torch.zeros((S, D + 1), dtype=torch.long, device=target.device)
    cur = best[:, None]
    for _ in range(D):
        path.scatter_(1, depth_row.gather(1, cur), cur)
        cur = parent_row.gather(1, cur)
    return depth_row.gather(1, best[:, None])[:, 0], path


def path_moves(path: torch.Tensor, a: torch.Tensor, start: torch.Tensor, block_tables: torch.Tensor,
               page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V moves of the accepted rows, as tree_ops.accept_paths computes them: the row at depth
    d (1 <= d <= a) lies at the slot of position start + path[d] and belongs at start + d. Returns
    (from slot, to slot) [S, D], -1 where nothing moves (past a, a row already in place, or start < 0:
    a padding request)."""
    D = path.shape[1] - 1
    d = torch.arange(1, D + 1, device=path.device)
    move = (d <= a[:, None]) & (path[:, 1:] != d) & (start[:, None] >= 0)
    tables = block_tables.long()

    def slot(q: torch.Tensor) -> torch.Tensor:
        p = tables.gather(1, (q // page).clamp(0, tables.shape[1] - 1))
        return torch.where(move, p * page + q % page, -1)

    base = start.clamp_min(0)[:, None]
    return slot(base + path[:, 1:]), slot(base + d)
