"""Token trees in three Triton kernels, for graphed tree steps on the GPU (speculative/tree.py is the torch
reference and defines what these compute). In torch a tree's construction, ancestor masks and
acceptance are ~130 small kernels (per depth a top-k, gathers, a scatter; per generation of the masks
and of the acceptance walk a gather and a concatenation): on a latency-bound 135M target they made a
tree step ~0.8 ms slower than a chain's (H100, docs/performance.md section 4, kernels off). Here:

    build_trees     one program per request: the best `size` nodes, best first (a frontier of   (request)
                    first children and next siblings: the slots' candidates come sorted, so the
                    best node not yet taken is always one of those), then sorted by depth, the
                    parents' rows and the ancestor masks
    accept_paths    one program per request: the accepted path (a row is accepted iff every row   (request)
                    of its ancestor mask holds the target's token at its parent's row), the
                    tokens to commit, and the K/V moves of the accepted rows to their positions
    move_slots      copies the moved rows' K/V of every layer (all reads, a barrier, all writes:  (request,
                    a row's source can be another row's destination)                              layer)
    verify_meta     a graphed tree step's verify metadata from its draft blocks': each request's  (request)
                    start, its rows' slots, lengths and row offsets (torch: ~22 small ops)
    verify_rows     the verify's input ids, positions and ancestor masks from the trees (torch:    (request)
                    6 ops, copy-engine copies among them)

Nodes equal build_trees' up to exact ties of scores. Grids depend on shapes only: CUDA-graph safe. Each
kernel launches with PDL like the step's other kernels (kernels/launch.py): it waits first, and lets its
successor be scheduled before its stores.
On an H100 they took a tree-of-15 step from 2.2-2.3 ms to 1.6-1.7 ms (docs/performance.md section 4);
FLASHDRAFT_TREE_KERNELS=off runs the torch ops instead."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft.kernels.launch import launch_kwargs, pdl_enter, pdl_trigger
from flashdraft.speculative.tree import Trees

NEG = tl.constexpr(-3.0e38)  # below any log-probability sum; a frontier entry at NEG is empty


@triton.jit
def _build_kernel(logp_ptr, cand_ptr, tok_ptr, par_ptr, dep_ptr, valid_ptr, mask_ptr, D: tl.constexpr,
                  K: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, FP: tl.constexpr, USE_PDL: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    base = s * D * K
    pdl_enter(USE_PDL)
    f = tl.arange(0, FP)
    # the frontier: candidate nodes (depth, rank of their slot's candidate, parent's pick, score)
    f_score = tl.where(f == 0, tl.load(logp_ptr + base), NEG)
    f_depth = tl.where(f == 0, 1, 0)
    f_rank = tl.zeros([FP], tl.int32)
    f_par = tl.full([FP], -1, tl.int32)
    n = tl.arange(0, NP)
    n_depth = tl.zeros([NP], tl.int32)
    n_par = tl.full([NP], -1, tl.int32)
    n_score = tl.zeros([NP], tl.float32)
    n_tok = tl.zeros([NP], tl.int64)
    n_ok = tl.zeros([NP], tl.int32)
    free = 1
    for i in range(N):
        # ties between a node and its descendants (a slot of probability 1) go to the shallower node
        adj = tl.where(f_score > NEG, f_score - f_depth.to(tl.float32) * 1e-6, NEG)
        j = tl.argmax(adj, 0)
        pick = f == j
        score = tl.sum(tl.where(pick, f_score, 0.0), 0)
        depth = tl.sum(tl.where(pick, f_depth, 0), 0)
        rank = tl.sum(tl.where(pick, f_rank, 0), 0)
        par = tl.sum(tl.where(pick, f_par, 0), 0)
        live = tl.max(adj, 0) > NEG / 2
        f_score = tl.where(pick, NEG, f_score)
        tok = tl.load(cand_ptr + base + (depth - 1) * K + rank, mask=live, other=0)
        here = n == i
        n_depth = tl.where(here, tl.where(live, depth, D + 1), n_depth)  # empty picks sort last
        n_par = tl.where(here, par, n_par)
        n_score = tl.where(here, score, n_score)
        n_tok = tl.where(here, tok, n_tok)
        n_ok = tl.where(here, live.to(tl.int32), n_ok)
        # its first child (one slot deeper) and its next sibling join the frontier
        child = live & (depth < D)
        c_score = score + tl.load(logp_ptr + base + depth * K, mask=child, other=0.0)
        sib = live & (rank + 1 < K)
        p_score = tl.sum(tl.where(n == par, n_score, 0.0), 0)  # 0 for the root (par = -1)
        s_score = p_score + tl.load(logp_ptr + base + (depth - 1) * K + rank + 1, mask=sib, other=0.0)
        at = f == free
        f_score = tl.where(at, tl.where(child, c_score, NEG), f_score)
        f_depth = tl.where(at, depth + 1, f_depth)
        f_rank = tl.where(at, 0, f_rank)
        f_par = tl.where(at, i, f_par)
        at = f == free + 1
        f_score = tl.where(at, tl.where(sib, s_score, NEG), f_score)
        f_depth = tl.where(at, depth, f_depth)
        f_rank = tl.where(at, rank + 1, f_rank)
        f_par = tl.where(at, par, f_par)
        free += 2
    # rows by depth, best first within a depth (the pick order): a stable sort by depth
    real = n < N
    key = tl.where(real, n_depth * NP + n, (D + 2) * NP)
    row = tl.sum((key[None, :] < key[:, None]).to(tl.int32), 1) + 1
    par_row = tl.sum(tl.where(n_par[:, None] == n[None, :], row[None, :], 0), 1)  # 0: the root
    # ancestor masks: own bit, then one generation more per round
    own = tl.full([NP], 1, tl.int64) << row.to(tl.int64)
    mask = own
    for _ in range(D):
        up = tl.sum(tl.where(n_par[:, None] == n[None, :], mask[None, :], 0), 1)
        mask = own | tl.where(n_par < 0, 1, up)
    out = s * N + row - 1
    pdl_trigger(USE_PDL)
    tl.store(tok_ptr + out, n_tok, mask=real)
    tl.store(par_ptr + out, par_row.to(tl.int64), mask=real)
    tl.store(dep_ptr + out, tl.minimum(n_depth, D).to(tl.int64), mask=real)
    tl.store(valid_ptr + out, n_ok.to(tl.int8), mask=real)
    tl.store(mask_ptr + s * (N + 1) + row, mask, mask=real)
    tl.store(mask_ptr + s * (N + 1), 1)


def build_trees(logp: torch.Tensor, tokens: torch.Tensor, size: int) -> Trees:
    """tree.build_trees (logp [S, D, K] float32 sorted descending, tokens [S, D, K]) in one kernel;
    the Trees carry their ancestor masks."""
    S, D, K = logp.shape
    if size > 63:
        raise ValueError(f"a tree of {size} nodes needs more than 64 mask bits")
    logp, tokens = logp.contiguous(), tokens.contiguous()
    dev = logp.device
    tok = torch.empty(S, size, dtype=tokens.dtype, device=dev)  # the kernel writes every entry
    par = torch.empty(S, size, dtype=torch.long, device=dev)
    dep = torch.empty(S, size, dtype=torch.long, device=dev)
    valid = torch.empty(S, size, dtype=torch.bool, device=dev)
    masks = torch.empty(S, size + 1, dtype=torch.long, device=dev)
    if S:
        _build_kernel[(S,)](logp, tokens, tok, par, dep, valid.view(torch.int8), masks, D=D, K=K, N=size,
                            NP=triton.next_power_of_2(size), FP=triton.next_power_of_2(2 * size + 1), num_warps=1,
                            **launch_kwargs(logp))
    return Trees(tok, par, dep, valid, D, masks)


@triton.jit
def _accept_kernel(tok_ptr, par_ptr, dep_ptr, valid_ptr, mask_ptr, target_ptr, a_ptr, path_ptr, commit_ptr,
                   start_ptr, bt_ptr, src_ptr, dst_ptr, stride_bt, PAGE, N: tl.constexpr, D: tl.constexpr,
                   RP: tl.constexpr, DP: tl.constexpr, MOVES: tl.constexpr, USE_PDL: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, RP)  # verify rows: 0 the root, 1..N the nodes
    node = (r >= 1) & (r <= N)
    nb = s * N + r - 1
    pdl_enter(USE_PDL)
    tok = tl.load(tok_ptr + nb, mask=node, other=-1)
    par = tl.load(par_ptr + nb, mask=node, other=0)
    dep = tl.load(dep_ptr + nb, mask=node, other=0)
    ok = tl.load(valid_ptr + nb, mask=node, other=0) != 0
    tb = target_ptr + s * (N + 1)
    match = (node & ok & (tok == tl.load(tb + par, mask=node, other=-2))) | (r == 0)
    matched = tl.sum(tl.where(match, tl.full([RP], 1, tl.int64) << r.to(tl.int64), 0), 0)  # distinct bits
    mask = tl.load(mask_ptr + s * (N + 1) + r, mask=r <= N, other=0)
    accepted = (r <= N) & ((mask & (matched ^ -1)) == 0)  # every row of its mask matched
    depth = tl.where(accepted, dep, -1)
    best = tl.argmax(depth, 0)  # siblings hold different tokens: one accepted row per depth
    a = tl.max(depth, 0)
    best_mask = tl.sum(tl.where(r == best, mask, 0), 0)
    d = tl.arange(0, DP)
    on = (((best_mask >> r.to(tl.int64)) & 1) != 0) & (r <= N)
    path = tl.sum(tl.where(on[None, :] & (dep[None, :] == d[:, None]), r[None, :], 0), 1)  # 0 past a
    pdl_trigger(USE_PDL)
    tl.store(a_ptr + s, a.to(tl.int64))
    tl.store(path_ptr + s * (D + 1) + d, path.to(tl.int64), mask=d <= D)
    tl.store(commit_ptr + s * (D + 1) + d, tl.load(tb + path, mask=d <= D, other=0), mask=d <= D)
    if MOVES:  # the row at depth d lies at slot start + path[d] and belongs at start + d
        start = tl.load(start_ptr + s)
        move = (d >= 1) & (d <= a) & (path != d) & (d * 0 + start >= 0)  # (a block: the interpreter's masks)
        q_src, q_dst = start + path, start + d
        p_src = tl.load(bt_ptr + s * stride_bt + q_src // PAGE, mask=move, other=0).to(tl.int64)
        p_dst = tl.load(bt_ptr + s * stride_bt + q_dst // PAGE, mask=move, other=0).to(tl.int64)
        tl.store(src_ptr + s * D + d - 1, tl.where(move, p_src * PAGE + q_src % PAGE, -1), mask=(d >= 1) & (d <= D))
        tl.store(dst_ptr + s * D + d - 1, tl.where(move, p_dst * PAGE + q_dst % PAGE, -1), mask=(d >= 1) & (d <= D))


def accept_paths(trees: Trees, target: torch.Tensor, start: torch.Tensor | None = None,
                 block_tables: torch.Tensor | None = None, page: int = 0):
    """tree.accept for full verifies (target [S, N + 1]) in one kernel: (a [S], path [S, D + 1], the
    target's tokens along the path [S, D + 1]). Given start [S] (the root's position, < 0: a padding
    request) and block_tables [S, pages], also the K/V moves of the accepted rows, (from slot, to slot)
    [S, D] each, -1 where nothing moves."""
    S, N = trees.tokens.shape
    D, dev = trees.max_depth, target.device
    a = torch.empty(S, dtype=torch.long, device=dev)  # the kernel writes every entry
    path = torch.empty(S, D + 1, dtype=torch.long, device=dev)
    commit = torch.empty(S, D + 1, dtype=target.dtype, device=dev)
    moves = start is not None
    src = torch.empty(S, D, dtype=torch.long, device=dev) if moves else a
    dst = torch.empty(S, D, dtype=torch.long, device=dev) if moves else a
    if S:
        bt = block_tables if moves else a
        _accept_kernel[(S,)](trees.tokens, trees.parents, trees.depths, trees.valid.view(torch.int8), trees.masks(),
                             target.contiguous(), a, path, commit, start if moves else a, bt, src, dst,
                             bt.stride(0) if moves else 0, page, N=N, D=D, RP=triton.next_power_of_2(N + 1),
                             DP=triton.next_power_of_2(D + 1), MOVES=moves, num_warps=1, **launch_kwargs(target))
    return (a, path, commit, src, dst) if moves else (a, path, commit)


@triton.jit
def _move_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, stride_layer, D: tl.constexpr, DP: tl.constexpr,
                 ROW: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, DP)
    e = tl.arange(0, BLOCK)
    pdl_enter(USE_PDL)
    src = tl.load(src_ptr + s * D + d, mask=d < D, other=-1)
    dst = tl.load(dst_ptr + s * D + d, mask=d < D, other=-1)
    on = (src >= 0)[:, None] & (e < ROW)[None, :]
    src_off = layer * stride_layer + src[:, None] * ROW + e[None, :]
    dst_off = layer * stride_layer + dst[:, None] * ROW + e[None, :]
    k = tl.load(k_ptr + src_off, mask=on)
    v = tl.load(v_ptr + src_off, mask=on)
    tl.debug_barrier()  # every read before any write
    pdl_trigger(USE_PDL)
    tl.store(k_ptr + dst_off, k, mask=on)
    tl.store(v_ptr + dst_off, v, mask=on)


def move_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """k/v_cache [layers, pages, page, ...] contiguous: every layer's row at slot src[s, i] copied to
    slot dst[s, i] (src < 0: nothing), all reads of a request before its writes."""
    S, D = src.shape
    L = k_cache.shape[0]
    row = k_cache[0, 0, 0].numel()
    if S and L:
        _move_kernel[(S, L)](k_cache, v_cache, src, dst, k_cache.stride(0), D=D, DP=triton.next_power_of_2(D),
                             ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=4,
                             **launch_kwargs(src))


@triton.jit
def _verify_meta_kernel(lens_ptr, bt_ptr, start_ptr, slot_ptr, vlens_ptr, qsl_ptr, S, stride_bt, PAGE,
                        B: tl.constexpr, N1: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr,
                        USE_PDL: tl.constexpr):
    s = tl.program_id(0)
    pdl_enter(USE_PDL)
    seq_len = tl.load(lens_ptr + s)
    real = seq_len > 0
    start = tl.maximum(seq_len - B, 0).to(tl.int64)
    j = tl.arange(0, NP)
    q = start + j
    rows = (j < N1) & (j * 0 + seq_len > 0)  # (the condition as a block: the interpreter's masks)
    page = tl.load(bt_ptr + s * stride_bt + q // PAGE, mask=rows, other=0).to(tl.int64)
    pdl_trigger(USE_PDL)
    tl.store(slot_ptr + s * N1 + j, tl.where(rows, page * PAGE + q % PAGE, -1), mask=j < N1)
    tl.store(vlens_ptr + s, tl.where(real, start + N1, 0).to(tl.int32))
    tl.store(start_ptr + s, tl.where(real, start, -1))
    # row offsets: N1 rows for every request with rows up to this one (padding requests have none)
    t = tl.arange(0, SP)
    live = tl.load(lens_ptr + t, mask=(t < S) & (t <= s), other=0) > 0
    tl.store(qsl_ptr + s + 1, (tl.sum(live.to(tl.int32), 0) * N1).to(tl.int32))
    if s == 0:
        tl.store(qsl_ptr, 0)


def verify_meta(seq_lens: torch.Tensor, block_tables: torch.Tensor, page: int, block: int, rows: int,
                slot_mapping: torch.Tensor, verify_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """A graphed tree step's verify metadata from its draft blocks' (seq_lens [S]: the block's end, 0 for
    a padding request): each request's verify starts at its block's start (seq_len - block), `rows`
    rows long; writes their slots [S * rows] (-1 for padding), lengths [S] and row offsets [S + 1].
    Returns the starts [S] int64, -1 for padding requests (speculative/trees.py's torch ops compute the same)."""
    S = seq_lens.shape[0]
    start = torch.empty(S, dtype=torch.long, device=seq_lens.device)
    if S:
        _verify_meta_kernel[(S,)](seq_lens, block_tables, start, slot_mapping, verify_lens, query_start_loc, S,
                                  block_tables.stride(0), page, B=block, N1=rows, NP=triton.next_power_of_2(rows),
                                  SP=triton.next_power_of_2(S), num_warps=1, **launch_kwargs(seq_lens))
    return start


@triton.jit
def _verify_rows_kernel(blk_ptr, start_ptr, tok_ptr, dep_ptr, mask_ptr, ids_ptr, pos_ptr, tree_ptr,
                        B: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, USE_PDL: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, NP)  # verify rows: 0 the root, 1..N the nodes
    node = (r >= 1) & (r <= N)
    pdl_enter(USE_PDL)
    start = tl.maximum(tl.load(start_ptr + s), 0)
    root = tl.load(blk_ptr + s * B)
    tok = tl.load(tok_ptr + s * N + r - 1, mask=node, other=0)
    dep = tl.load(dep_ptr + s * N + r - 1, mask=node, other=0)
    out = s * (N + 1) + r
    tree = tl.load(mask_ptr + out, mask=r <= N)
    pdl_trigger(USE_PDL)
    tl.store(ids_ptr + out, tl.where(node, tok, root), mask=r <= N)
    tl.store(pos_ptr + out, start + dep, mask=r <= N)
    tl.store(tree_ptr + out, tree, mask=r <= N)


def verify_rows(blocks: torch.Tensor, block: int, start: torch.Tensor, trees: Trees, ids: torch.Tensor,
                positions: torch.Tensor, tree_mask: torch.Tensor) -> None:
    """A tree verify's rows from the draft blocks [S * block] (row 0 of each: the root's token) and the
    trees (built by build_trees here, masks included): ids and positions [S * (N + 1)] (the root at the
    start, node i at start + depth), tree_mask [S * (N + 1)] the ancestor masks; start < 0 (padding
    requests) counts as 0."""
    S, N = trees.tokens.shape
    if S:
        _verify_rows_kernel[(S,)](blocks, start, trees.tokens, trees.depths, trees.masks(), ids, positions, tree_mask,
                                  B=block, N=N, NP=triton.next_power_of_2(N + 1), num_warps=1,
                                  **launch_kwargs(ids))
