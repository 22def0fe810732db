"""Triton paged attention and KV-cache store: the kernels behind `attention.triton_backend.TritonAttention`.

One kernel family serves every step kind: decode (q_len 1), verify (q_len B, causal), the DFlash
draft block (q_len B, non-causal) and prefill chunks (long q_len, causal, after earlier context).
A program owns one (query tile, sequence, kv head[, KV partition]). Its BLOCK_M tile rows are
(query row, group member) pairs, row-major, so the GQA group shares every K/V load: a K/V row is
read once per kv head, not once per query head. Keys are walked BLOCK_N at a time through the
block table (one int32 page id per key, so any page size works and a tile may span pages), with a
flash-attention online softmax in float32 (base 2, the scale folded into log2 e).

Bytes read per (sequence, kv head), e = element size, L = seq_len, D = head_dim:
  K and V: 2 * L * D * e per query tile, block table: 4 * L, queries: q_len * group * D * e.
  bf16, D=128: 516 B per key and kv head; a 4k-key decode with 8 kv heads reads ~17 MB per layer.
  Prefill re-reads K/V once per query tile, i.e. ceil(q_len * group / BLOCK_M) times.
  Split-K adds (D + 2) * 4 B written and read again per (query row, head, partition), about
  2 * rows / PART of the bf16 K/V bytes of a partition of PART keys. A partition holds at least 64
  keys: splitting only happens when the grid cannot fill the GPU, where the step is latency-bound
  and the extra bytes (<= 200% of K/V for a 64-row verify tile, 50% for decode: a few MB at batch
  1) cost less than walking the keys in 8 long programs. H100, 1k keys at batch 1, Qwen3-8B heads
  (benchmarks/device/gemm_sweep.py): verify 38.9 us with one partition per kv head, 12.5 with 8,
  10.6 with 16 (SDPA on contiguous K/V: 15.0); decode 25.0 / 9.0 / 8.0 us.

Tiling (tl.dot needs >= 16 along every dim on real hardware, so BLOCK_M >= 16 even for decode):
  BLOCK_D = next power of two >= head_dim (96 -> 128, masked).
  BLOCK_M = next power of two >= max_query_len * group, clamped to [16, 128] for D <= 64 and
    [16, 64] above (the fp32 accumulator, BLOCK_M x BLOCK_D, stays at <= 32 KB per program), and
    never below the group. Decode with group 8 fills half of a 16-row tile; verify/draft blocks of
    16 rows x group 4 are one 64-row tile, so K/V are streamed once per (sequence, kv head).
  BLOCK_N = 64 keys (32 for D > 64 with BLOCK_M > 32): K and V tiles of 8-16 KB each in flight.
  num_warps = 8 once (BLOCK_M + BLOCK_N) x BLOCK_D reaches 8192 elements, else 4: compiled for
    sm_90, no bf16 variant spills registers (4 warps for a 16 x 64 x 128 decode tile did).
Split-K (flash-decoding) partitions and their merge: attention_splits.py.

Compiles: the split count is a runtime argument, not a constant, so eager steps
with new sequence lengths (prefill chunks) reuse the compiled kernels; as constants, every new
length could compile another variant in the middle of serving.

Graph safety: grids and workspace shapes depend only on S, n_kv, max_query_len, max_seq_len and T,
never on tensor values; programs past a sequence's rows return at once; no host syncs; the split-K workspace is
cached per (device, shape), so a CUDA graph captures a buffer that stays alive, and the arrival
counts are back at zero after every launch. Query rows with no visible key (seq_len 0) give zeros;
rows past query_start_loc[S] are written with zeros when zero_padding asks (CUDA graphs: a bucket's
padding rows must hold no stale NaN for the layers after), else never written."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft import settings
from flashdraft.attention.base import AttentionBatch, DeviceMeta
from flashdraft.kernels.attention_splits import (
    MAX_SPLITS,
    MIN_SPLIT_KEYS,
    NEG,
    REDUCE_SPLITS,
    _merge_partials,
    _num_splits,
    _reduce_kernel,
    _workspace,
)
from flashdraft.kernels.launch import arrival_counts, launch_kwargs, pdl_enter, pdl_trigger, sm_count

# the Triton interpreter multiplies bf16 bit patterns as integers in tl.dot: give it float32 operands
INTERPRET = settings.interpreted()


@triton.jit
def to_page(x, inv_scale, dt: tl.constexpr):
    """A K or V value as its page stores it: FP8 pages (kv_cache_dtype fp8) hold x * inv_scale (1 / the layer's
    k_scale or v_scale) saturated at +-448, as attention/torch_ref.py's to_pages; others x in their dtype."""
    if dt == tl.float8e4nv:
        return tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0).to(dt)
    return x.to(dt)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, PAGE: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per new token: copies its [n_kv, D] K and V rows to cache slot `slot`."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    page = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < N_KV) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    pdl_trigger(USE_PDL)
    tl.store(kc_ptr + page * stride_kcb + off * stride_kcs + h * stride_kch + d,
             to_page(k, 1.0, kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + page * stride_vcb + off * stride_vcs + h * stride_vch + d,
             to_page(v, 1.0, vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    """F32_DOT: full float32 products, for float32 data (no tf32) and under the interpreter."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tile_rows(qsl_ptr, tile, seq, kv_head, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of one query tile: (first token, q_len, row in sequence, head, row valid)."""
    ROWS: tl.constexpr = BLOCK_M // GROUP
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    m = tl.arange(0, BLOCK_M)
    row = tile * ROWS + m // GROUP
    head = kv_head * GROUP + m % GROUP
    valid = (m < ROWS * GROUP) & (row < q_len)
    return q_start, q_len, row, head, valid


@triton.jit
def _attend(q, k, v, key, key_ok, pos, tree, ctx, m_i, l_i, acc, scale_log2, CAUSAL: tl.constexpr,
            TREE: tl.constexpr, WINDOW: tl.constexpr, F32_DOT: tl.constexpr):
    """One key tile of the online softmax (base 2): the updated (running max, running sum, acc).
    TREE: rows with a non-zero ancestor mask `tree` see the keys before `ctx` and key ctx + j iff
    bit j is set (token trees, base.py), instead of the causal rule. WINDOW > 0: a sliding window
    (base.py). FP8 pages' k and v widen to q's dtype (exactly)."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = _dot(q, tl.trans(k), F32_DOT) * scale_log2
    visible = key_ok[None, :]
    if CAUSAL:
        seen = key[None, :] <= pos[:, None]
        if TREE:
            rel = key[None, :] - ctx
            bit = (tree[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)) & 1
            seen = tl.where(tree[:, None] != 0, (rel < 0) | ((bit != 0) & (rel < 64)), seen)
        visible = visible & seen
    if WINDOW > 0:
        visible = visible & (pos[:, None] - key[None, :] < WINDOW)
        if not CAUSAL:
            visible = visible & (key[None, :] - pos[:, None] < WINDOW)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32_DOT)
    return m_new, l_i, acc


@triton.jit
def _zero_padding_rows(out_ptr, qsl_ptr, seq, kv_head, num_tokens, stride_ot, stride_oh, N_KV: tl.constexpr,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Zeros of this kv head's query heads in the rows past the last sequence's (a graph bucket's
    padding rows), shared out among the grid's sequences: BLOCK_M // GROUP rows at a time each."""
    ROWS: tl.constexpr = BLOCK_M // GROUP
    num_seqs = tl.num_programs(1) // N_KV
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + m % GROUP
    zeros = tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty)
    for first in range(tl.load(qsl_ptr + num_seqs) + seq * ROWS, num_tokens, num_seqs * ROWS):
        row = first + m // GROUP
        ok = (m < ROWS * GROUP) & (row < num_tokens)
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], zeros,
                 mask=ok[:, None] & (d < HEAD_DIM)[None, :])


# integers that change from step to step are not specialised on (Triton would otherwise compile a
# variant per divisibility class, "== 1" and "% 16 == 0", the first time a step's token count hits one:
# a compile stall in the middle of serving)
@triton.jit(do_not_specialize=["num_tokens", "num_splits", "stride_bt"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, out_ptr, ws_o_ptr, ws_m_ptr, ws_l_ptr, count_ptr, used_ptr,
                 qsl_ptr, seq_lens_ptr, bt_ptr, tree_ptr, sink_ptr, scale_log2, num_tokens, num_heads, num_splits,
                 stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 stride_ot, stride_oh, stride_bt,
                 N_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr,
                 TREE: tl.constexpr, WINDOW: tl.constexpr, SINK: tl.constexpr, SPLIT: tl.constexpr,
                 MIN_PART: tl.constexpr, MERGE: tl.constexpr, MERGE_M: tl.constexpr,
                 ZERO_PADDING: tl.constexpr, F32_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (query tile, sequence * n_kv, partition). One split: normalised output straight to
    `out`. Several, MERGE: a tile whose keys fill one partition writes `out` the same way; else
    each partition holding keys writes its unnormalised partial to the workspace, and the tile's
    last to finish (an arrival count) merges them in partition order (the same sums whichever
    finished last), over the tile's first MERGE_M rows (the rows a tile can hold: a decode tile's
    GROUP). Several, not MERGE: every partition writes its partial (empty ones neutral ones) for
    `_reduce_kernel`. ZERO_PADDING: the rows past the last sequence's are written with zeros (by the
    first partition of each tile-0 program).

    Before waiting for the previous kernel (PDL, launch.py) a program reads what no kernel of the
    step writes: the metadata (copied in by the host before the step) and, of its first key tile,
    the block-table entries and the K/V rows of keys cached before this step (below seq_len -
    q_len). The keys this step stores, and the queries, are read after the wait."""
    tile = tl.program_id(0)
    seq = tl.program_id(1) // N_KV
    kv_head = tl.program_id(1) % N_KV
    split = tl.program_id(2)
    q_start, q_len, row, head, valid = _tile_rows(qsl_ptr, tile, seq, kv_head, GROUP, BLOCK_M)
    if tile * (BLOCK_M // GROUP) >= q_len:
        pdl_enter(USE_PDL)  # every program waits: the grid completes only after its predecessor
        if ZERO_PADDING:  # after the wait: the kernel before may still read what `out` holds
            if (tile == 0) & (split == 0):
                _zero_padding_rows(out_ptr, qsl_ptr, seq, kv_head, num_tokens, stride_ot, stride_oh, N_KV, GROUP,
                                   HEAD_DIM, BLOCK_D, BLOCK_M)
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pos = seq_len - q_len + row  # absolute position of each query row
    if CAUSAL:
        kv_end = tl.minimum(seq_len, tl.max(tl.where(valid, pos, -1)) + 1)
    else:
        kv_end = seq_len
    first = 0
    if WINDOW > 0:  # keys before every row's window are never read
        first = tl.maximum(tl.min(tl.where(valid, pos, seq_len)) - WINDOW + 1, 0)
    # the tile's own key range [first, kv_end) cut into at most num_splits partitions of a multiple of
    # MIN_PART keys, whole key tiles (the grid is fixed by the graph; the partitions follow the
    # sequence): the `used` first ones hold keys, the programs of the others end here. 32-key tiles
    # step by 64 keys too: Qwen3-8B's 16-row block at batch 1 and 4k keys took 24.6 us a layer over
    # the 43 partitions of 96 keys that 49 allow, 19.2 over 32 of 128 (H200)
    span = tl.maximum(kv_end - first, 0)
    part = tl.maximum(tl.cdiv(tl.cdiv(span, num_splits), MIN_PART) * MIN_PART, MIN_PART)
    used = tl.maximum(tl.cdiv(span, part), 1)
    if SPLIT:
        if split >= used:  # no keys: nothing to write (the merge reads the `used` first partials)
            pdl_enter(USE_PDL)
            return
    lo = first + split * part
    hi = tl.minimum(kv_end, lo + part)
    n = tl.arange(0, BLOCK_N)
    key = lo + n
    key_ok = key < hi
    cached = key_ok & (key < seq_len - q_len)  # stored by earlier steps
    page = tl.load(bt_ptr + seq * stride_bt + key // PAGE, mask=key_ok, other=0).to(tl.int64)
    k_off = (page * stride_kb + (key % PAGE) * stride_ks + kv_head * stride_kh)[:, None] + d[None, :]
    v_off = (page * stride_vb + (key % PAGE) * stride_vs + kv_head * stride_vh)[:, None] + d[None, :]
    k = tl.load(k_ptr + k_off, mask=cached[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_ptr + v_off, mask=cached[:, None] & d_ok[None, :], other=0.0)
    pdl_enter(USE_PDL)
    if ZERO_PADDING:
        if (tile == 0) & (split == 0):
            _zero_padding_rows(out_ptr, qsl_ptr, seq, kv_head, num_tokens, stride_ot, stride_oh, N_KV, GROUP,
                               HEAD_DIM, BLOCK_D, BLOCK_M)
    if SPLIT and not MERGE:
        if split == 0:  # how many partials _reduce_kernel merges for these rows
            tl.store(used_ptr + q_start + row, used, mask=valid)
    q = tl.load(q_ptr + (q_start + row)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=valid[:, None] & d_ok[None, :], other=0.0)
    ctx = seq_len - q_len
    if TREE:
        tree = tl.load(tree_ptr + q_start + row, mask=valid, other=0)
    else:
        tree = row
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINK:  # one more logit per head, of value zero: counted once, by the first partition
        if split == 0:
            m_i = tl.load(sink_ptr + head, mask=valid, other=NEG).to(tl.float32) * 1.4426950408889634
            l_i = tl.where(valid, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if lo < hi:  # the first tile: its keys stored this step are read now
        late = (key_ok & ~cached)[:, None] & d_ok[None, :]
        k = tl.where(late, tl.load(k_ptr + k_off, mask=late, other=0.0), k)
        v = tl.where(late, tl.load(v_ptr + v_off, mask=late, other=0.0), v)
        m_i, l_i, acc = _attend(q, k, v, key, key_ok, pos, tree, ctx, m_i, l_i, acc, scale_log2, CAUSAL, TREE,
                                WINDOW, F32_DOT)
    for start in range(lo + BLOCK_N, hi, BLOCK_N):
        key = start + n
        key_ok = key < hi
        page = tl.load(bt_ptr + seq * stride_bt + key // PAGE, mask=key_ok, other=0).to(tl.int64)
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (page * stride_kb + (key % PAGE) * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (page * stride_vb + (key % PAGE) * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend(q, k, v, key, key_ok, pos, tree, ctx, m_i, l_i, acc, scale_log2, CAUSAL, TREE,
                                WINDOW, F32_DOT)

    pdl_trigger(USE_PDL)
    mask = valid[:, None] & d_ok[None, :]
    out = out_ptr + (q_start + row)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if SPLIT:
        idx = (split * num_tokens + q_start + row) * num_heads + head
        if not MERGE:
            tl.store(ws_o_ptr + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=mask)
            tl.store(ws_m_ptr + idx, m_i, mask=valid)
            tl.store(ws_l_ptr + idx, l_i, mask=valid)
            return
        if used > 1:
            # this partition's partial to its slot; the tile's last partition to arrive merges them
            tl.store(ws_o_ptr + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=mask)
            tl.store(ws_m_ptr + idx, m_i, mask=valid)
            tl.store(ws_l_ptr + idx, l_i, mask=valid)
            tl.debug_barrier()  # every thread's partial is written before the count (release) below
            count = count_ptr + tile * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == used - 1:
                _merge_partials(out_ptr, ws_o_ptr, ws_m_ptr, ws_l_ptr, used, num_tokens, num_heads, q_start, q_len,
                                tile, kv_head, stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, MERGE_M)
                tl.atomic_xchg(count, 0)  # ready for the next launch (CUDA graphs replay it)
            return
    tl.store(out, (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, n_kv, D] (any strides) into caches [num_blocks, page, n_kv, D] at slot_mapping;
    slots < 0 are skipped."""
    T, n_kv, hd = k.shape
    if T == 0:
        return
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _store_kv_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, *k.stride(), *v.stride(),
                           *k_cache.stride()[:3], *v_cache.stride()[:3], N_KV=n_kv, HEAD_DIM=hd,
                           BLOCK_H=triton.next_power_of_2(n_kv), BLOCK_D=triton.next_power_of_2(hd),
                           PAGE=k_cache.shape[1], **launch_kwargs(k))


def _tiles(head_dim: int, group: int, max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_D, BLOCK_M, BLOCK_N, num_warps); see the module docstring."""
    block_d = triton.next_power_of_2(head_dim)
    cap = 128 if block_d <= 64 else 64
    block_m = max(min(max(16, triton.next_power_of_2(max_query_len * group)), cap), triton.next_power_of_2(group))
    block_n = 64 if block_d <= 64 or block_m <= 32 else 32
    return block_d, block_m, block_n, 8 if (block_m + block_n) * block_d >= 8192 else 4


def auto_splits(head_dim: int, group: int, max_query_len: int, num_seqs: int, n_kv: int, keys: int,
                device: torch.device) -> int:
    """The split-K count paged_attention picks for a grid of num_seqs x n_kv x its query tiles over at
    most `keys` keys a tile. A tile of more than 32 x 64 (rows x keys a step: the B = 16 draft or
    verify block of a 3-head group) walks its keys slower: it counts as that many such tiles."""
    _, block_m, block_n, _ = _tiles(head_dim, group, max_query_len)
    tiles = triton.cdiv(max_query_len, block_m // group)
    return _num_splits(tiles * num_seqs * n_kv * max(1, block_m * block_n // 2048), keys, device)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DeviceMeta, scale: float,
                    out: torch.Tensor | None = None, num_splits: int | None = None,
                    zero_padding: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, n_heads, D] -> [T, n_heads, D] over the paged caches described by `meta`.
    num_splits overrides the split-K heuristic (tests, tuning). zero_padding: rows past the last
    sequence's are zeros (written by the attention kernel, or by the merge kernel where one runs)."""
    T, H, hd = q.shape
    n_kv = k_cache.shape[2]
    group = H // n_kv
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    S = meta.seq_lens.shape[0]
    if T == 0 or S == 0 or meta.max_query_len == 0:
        return out.zero_() if zero_padding else out
    block_d, block_m, block_n, warps = _tiles(hd, group, meta.max_query_len)
    tiles = triton.cdiv(meta.max_query_len, block_m // group)
    if num_splits is None:
        keys = meta.max_seq_len  # the most keys a tile reads: on sliding layers, its window and rows
        if meta.window is not None:
            keys = min(keys, meta.window + meta.max_query_len)
        num_splits = auto_splits(hd, group, meta.max_query_len, S, n_kv, keys, q.device)
    # the rows a query tile can hold (a decode tile: its GROUP heads of one row); a few partitions are
    # merged by the tile's last one to finish, more by _reduce_kernel (see settings.MERGE_SPLITS)
    merge_m = triton.next_power_of_2(min(block_m // group, meta.max_query_len) * group)
    merge = 1 < num_splits <= settings.MERGE_SPLITS
    ws = _workspace(q.device, num_splits, T, H, hd) if num_splits > 1 else (out, out, out, meta.seq_lens)
    count = arrival_counts(q.device, tiles * S * n_kv) if merge else meta.seq_lens
    consts = dict(N_KV=n_kv, GROUP=group, HEAD_DIM=hd, BLOCK_D=block_d, BLOCK_M=block_m)
    tree = meta.tree_mask is not None and meta.causal
    if tree and meta.window is not None:
        raise NotImplementedError("sliding-window attention under token-tree masks")
    _attn_kernel[(tiles, S * n_kv, num_splits)](
        q, k_cache, v_cache, out, *ws[:3], count, ws[3], meta.query_start_loc, meta.seq_lens, meta.block_tables,
        meta.tree_mask if tree else meta.seq_lens, sinks if sinks is not None else meta.seq_lens,
        scale * 1.4426950408889634, T, H, num_splits,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        out.stride(0), out.stride(1), meta.block_tables.stride(0), **consts, BLOCK_N=block_n,
        PAGE=k_cache.shape[1], CAUSAL=meta.causal, TREE=tree, WINDOW=meta.window or 0, SINK=sinks is not None,
        SPLIT=num_splits > 1, MIN_PART=triton.cdiv(MIN_SPLIT_KEYS, block_n) * block_n,
        MERGE=merge, MERGE_M=merge_m, ZERO_PADDING=zero_padding and (num_splits == 1 or merge),
        F32_DOT=INTERPRET or q.dtype == torch.float32, num_warps=warps, **launch_kwargs(q))
    if num_splits > 1 and not merge:
        # a program per (token, kv head) merges the group's heads; too few of those to fill the GPU
        # (a decode at batch 1: 4-8) read the partials at a few SMs' bandwidth, so then one per query head
        g = group if T * n_kv >= sm_count(q.device) else 1
        _reduce_kernel[(T, H // g)](out, *ws, meta.query_start_loc, S, T, H, out.stride(0), out.stride(1),
                                    GROUP=g, BLOCK_G=triton.next_power_of_2(g), HEAD_DIM=hd, BLOCK_D=block_d,
                                    BLOCK_S=max(1, REDUCE_SPLITS // triton.next_power_of_2(g)),
                                    ZERO_PADDING=zero_padding, num_warps=4, **launch_kwargs(q))
    return out


def compile_variants(n_heads: int, n_kv: int, head_dim: int, page: int, dtype: torch.dtype, device: torch.device,
                     causal: bool = True, tree: bool = False, window: int | None = None, sinks: bool = False,
                     kv_dtype: torch.dtype | None = None) -> int:
    """Compile, before serving, every attention variant an eager step (prefill, mixed prefill +
    decode) can pick: each query-tile height (from the step's longest query, 16 to the cap rows)
    without split-K, with it merged in the kernel and with it merged by `_reduce_kernel` (tree: the
    variants with token-tree masks, for steps that verify trees), and that merge both per query head
    and per kv head (below and above the token count that fills the GPU). Otherwise the first step
    that needs one compiles it mid-run, a stall of a second or so. Returns how many variants were
    launched. kv_dtype: the pages' (default: dtype)."""
    group = n_heads // n_kv
    heights = {}
    for q_len in (1 << i for i in range(12)):
        heights.setdefault(_tiles(head_dim, group, q_len)[1], q_len)
    merge_rows = triton.cdiv(sm_count(device), n_kv)  # the fewest tokens whose merge takes a kv head a program
    pages = triton.cdiv(max(*heights.values(), merge_rows), page) + 1
    k = torch.zeros(pages, page, n_kv, head_dim, device=device, dtype=kv_dtype or dtype)
    v = torch.zeros_like(k)
    launched = 0
    for q_len in (*heights.values(), merge_rows):
        batch = AttentionBatch(slot_mapping=torch.full((q_len,), -1, dtype=torch.long), query_start_loc=[0, q_len],
                               seq_lens=[pages * page], block_tables=[list(range(pages))], block_size=page,
                               causal=causal, tree_mask=torch.zeros(q_len, dtype=torch.long) if tree else None,
                               window=window)
        meta = DeviceMeta.from_batch(batch, device)
        q = torch.zeros(q_len, n_heads, head_dim, device=device, dtype=dtype)
        for splits in (1, 2, MAX_SPLITS):  # 2: merged in the kernel; MAX_SPLITS: by _reduce_kernel
            paged_attention(q, k, v, meta, 1.0, num_splits=splits,
                            sinks=torch.zeros(n_heads, device=device) if sinks else None)
            launched += 1
    return launched
