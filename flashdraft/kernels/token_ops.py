"""Triton kernels for the token-level work of a step (see layer_ops.py for the layer kernels): the
embedding lookup, the greedy argmax over the vocabulary and the DFlash acceptance count.

    embedding           weight[ids] (few rows: torch's index_select     (token, 1024 columns)
                        takes ~14 us for 16 rows on an H100, this ~2)
    argmax              greedy token of each logits row                 (row, part), then per row
    topk_log_softmax    a token tree's candidates: the k best entries    (row, part), then per row
                        of each row and their log-probabilities (torch:
                        a softmax and a radix select, ~17 kernels)
    accepted_lengths    DFlash acceptance: leading drafts equal to the    one program per request
                        target's tokens (torch: eq, cast, cumprod, sum)
    block_slots         a graphed step's draft-block rows' cache slots    one program per request
                        from their positions and block tables (torch:
                        ~10 small ops)
    advance_blocks      a graphed step's draft blocks moved on past a     one program per request
                        verify's accepted drafts (its acceptance count
                        and packed outcome too, when given the drafts;
                        torch: ~14 small ops)

Grids depend on shapes only, never on values (CUDA-graph safe). Importing this module needs triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft.kernels.launch import launch_kwargs, pdl_enter, pdl_trigger, sm_count

EMBED_BLOCK = 1024  # columns per embedding program
ARGMAX_BLOCK = 1024  # entries per argmax step (lanes x values per lane)
ARGMAX_MAX_PARTS = 64
ACCEPT_BLOCK = 16  # draft slots per program at least: one compiled variant for blocks up to 17
TOPK_CHUNK = 2048  # entries of a row per top-k program (held in registers)
TOPK_MAX_PARTS = 128  # a row's parts merged by one program: rows of up to 262,144 entries


@triton.jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, stride_w, stride_o, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (token, BLOCK columns): out[t] = w[ids[t]]."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    row = tl.load(w_ptr + tok * stride_w + d, mask=d < N)
    pdl_trigger(USE_PDL)
    tl.store(out_ptr + t * stride_o + d, row, mask=d < N)


@triton.jit(do_not_specialize=["n", "chunk"])
def _argmax_part_kernel(x_ptr, val_ptr, idx_ptr, n, chunk, stride_x, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, part): the largest value of x[row, part * chunk : (part + 1) * chunk] and its
    first index."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, n)
    c = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    where = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(lo, hi, BLOCK):
        v = tl.load(x_ptr + row * stride_x + start + c, mask=start + c < hi, other=float("-inf")).to(tl.float32)
        take = v > best  # strictly: a lane keeps its first maximum
        best = tl.where(take, v, best)
        where = tl.where(take, start + c, where)
    top = tl.max(best, 0)
    pdl_trigger(USE_PDL)
    at = row * tl.num_programs(1) + tl.program_id(1)
    tl.store(val_ptr + at, top)
    tl.store(idx_ptr + at, tl.min(tl.where(best == top, where, 2147483647), 0))


@triton.jit(do_not_specialize=["parts"])
def _argmax_final_kernel(val_ptr, idx_ptr, out_ptr, parts, BLOCK_P: tl.constexpr, USE_PDL: tl.constexpr):
    """One row: the first index of the largest of its parts' maxima."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    v = tl.load(val_ptr + row * parts + p, mask=p < parts, other=float("-inf"))
    i = tl.load(idx_ptr + row * parts + p, mask=p < parts, other=2147483647)
    first = tl.min(tl.where(v == tl.max(v, 0), i, 2147483647), 0)
    pdl_trigger(USE_PDL)
    tl.store(out_ptr + row, tl.where(first == 2147483647, 0, first).to(tl.int64))


@triton.jit(do_not_specialize=["d_ptr", "t_ptr", "k", "stride_d", "stride_t"])  # one variant: views at any offset
def _accept_kernel(d_ptr, t_ptr, out_ptr, k, stride_d, stride_t, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    s = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    pdl_enter(USE_PDL)
    d = tl.load(d_ptr + s * stride_d + j, mask=j < k, other=-1)
    t = tl.load(t_ptr + s * stride_t + j, mask=j < k, other=-2)
    pdl_trigger(USE_PDL)
    tl.store(out_ptr + s, tl.min(tl.where((j < k) & (d != t), j, k), 0).to(tl.int64))  # first mismatch, or k


@triton.jit
def _order_key(v, col):
    """float32 v and its column -> int64 keys whose order is (v, then the lower column) descending:
    v's bits made monotonic as a signed int32 (negative floats flip their magnitude bits), the column
    stored inverted below them. Distinct columns give distinct keys."""
    bits = v.to(tl.int32, bitcast=True)
    mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | (0x7FFFFFFF - col).to(tl.int64)


@triton.jit
def _key_value(key):
    mono = (key >> 32).to(tl.int32)
    return tl.where(mono >= 0, mono, mono ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["n", "stride_x"])
def _topk_part_kernel(x_ptr, key_ptr, stat_ptr, n, stride_x, K: tl.constexpr, KP: tl.constexpr,
                      CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, part): the K best entries of x[row, part * CHUNK : (part + 1) * CHUNK] as
    order keys, and the chunk's max and sum of exp(x - max)."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    col = part * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(x_ptr + row * stride_x + col, mask=col < n, other=float("-inf")).to(tl.float32)
    top = tl.max(v, 0)
    total = tl.sum(tl.where(col < n, tl.exp(v - top), 0.0), 0)
    key = tl.where(col < n, _order_key(v, col), -9223372036854775807 - 1)
    j = tl.arange(0, KP)
    best = tl.full([KP], -9223372036854775807 - 1, tl.int64)
    for i in range(K):
        m = tl.max(key, 0)
        best = tl.where(j == i, m, best)
        key = tl.where(key == m, -9223372036854775807 - 1, key)
    pdl_trigger(USE_PDL)
    at = row * tl.num_programs(1) + part
    tl.store(key_ptr + at * K + j, best, mask=j < K)
    tl.store(stat_ptr + at * 2, top)
    tl.store(stat_ptr + at * 2 + 1, total)


@triton.jit(do_not_specialize=["parts"])
def _topk_final_kernel(key_ptr, stat_ptr, logp_ptr, idx_ptr, parts, K: tl.constexpr, KP: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, USE_PDL: tl.constexpr):
    """One row: the K best of its parts' keys, best first, as log-probabilities (x - logsumexp) and
    columns; the logsumexp from the parts' maxima and sums."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK)
    key = tl.load(key_ptr + row * parts * K + e, mask=e < parts * K, other=-9223372036854775807 - 1)
    p = tl.arange(0, BLOCK_P)
    m = tl.load(stat_ptr + (row * parts + p) * 2, mask=p < parts, other=float("-inf"))
    t = tl.load(stat_ptr + (row * parts + p) * 2 + 1, mask=p < parts, other=0.0)
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(tl.where(p < parts, t * tl.exp(m - top), 0.0), 0))
    j = tl.arange(0, KP)
    best = tl.full([KP], 0, tl.int64)
    for i in range(K):
        b = tl.max(key, 0)
        best = tl.where(j == i, b, best)
        key = tl.where(key == b, -9223372036854775807 - 1, key)
    pdl_trigger(USE_PDL)
    tl.store(logp_ptr + row * K + j, _key_value(best) - lse, mask=j < K)
    tl.store(idx_ptr + row * K + j, 0x7FFFFFFF - (best & 0xFFFFFFFF), mask=j < K)


@triton.jit
def _block_slots_kernel(pos_ptr, lens_ptr, bt_ptr, slot_ptr, stride_bt, PAGE, B: tl.constexpr, BP: tl.constexpr,
                        USE_PDL: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BP)
    pdl_enter(USE_PDL)
    rows = (j < B) & (j * 0 + tl.load(lens_ptr + s) > 0)  # (a block: the interpreter's masks)
    pos = tl.load(pos_ptr + s * B + j, mask=j < B, other=0)
    page = tl.load(bt_ptr + s * stride_bt + pos // PAGE, mask=rows, other=0).to(tl.int64)
    pdl_trigger(USE_PDL)
    tl.store(slot_ptr + s * B + j, tl.where(rows, page * PAGE + pos % PAGE, -1), mask=j < B)


@triton.jit
def _advance_kernel(pos_ptr, ids_ptr, lens_ptr, toks_ptr, acc_ptr, drafts_ptr, out_ptr, S, stride_t, stride_d,
                    K1: tl.constexpr, KP: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, ACCEPT: tl.constexpr,
                    USE_PDL: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, KP)
    b = tl.arange(0, BP)
    pdl_enter(USE_PDL)
    t = tl.load(toks_ptr + s * stride_t + j, mask=j < K1, other=0)
    if ACCEPT:  # leading drafts equal to the target's token at their row: the first mismatch, or K1 - 1
        d = tl.load(drafts_ptr + s * stride_d + j, mask=j < K1 - 1, other=-1)
        a = tl.min(tl.where((j < K1 - 1) & (d != t), j, K1 - 1), 0).to(tl.int64)
    else:
        a = tl.load(acc_ptr + s)
    seq_len = tl.load(lens_ptr + s)
    live = seq_len > 0
    start = tl.load(pos_ptr + s * B) + a + 1
    first = tl.sum(tl.where(j == a, t, 0), 0)
    pdl_trigger(USE_PDL)
    if ACCEPT:  # the host's one read: accepted drafts [S], then the target's tokens [S * K1]
        tl.store(out_ptr + s, a)
        tl.store(out_ptr + S + s * K1 + j, t, mask=j < K1)
    rows = (b < B) & (b * 0 + seq_len > 0)  # (a block: the interpreter's masks)
    tl.store(pos_ptr + s * B + b, start + b, mask=rows)
    tl.store(lens_ptr + s, tl.where(live, start + B, seq_len).to(tl.int32))
    tl.store(ids_ptr + s * B + b, first + b * 0, mask=rows & (b == 0))


# ---- wrappers -------------------------------------------------------------------------------------
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[ids]: ids [...] of in-range token ids (the engine validates prompts; sampled and
    drafted ids come from argmax/sampling over the vocabulary) -> [..., dim]."""
    if weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"embedding table must be 2-D with a unit last stride, got {tuple(weight.shape)}")
    flat = ids.reshape(-1)
    n = weight.shape[1]
    out = torch.empty(flat.shape[0], n, device=weight.device, dtype=weight.dtype)
    if flat.shape[0]:
        block = min(EMBED_BLOCK, triton.next_power_of_2(n))
        _embedding_kernel[(flat.shape[0], triton.cdiv(n, block))](flat, weight, out, weight.stride(0), out.stride(0), n,
                                                                  BLOCK=block, num_warps=4, **launch_kwargs(weight))
    return out.view(*ids.shape, n)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for a 2-D x [rows, n] (any float dtype): each row cut into parts so that the
    grid covers ~2 programs per SM, then one program per row over the parts' maxima. The part
    count follows the row count, so it is a runtime argument: no compile per batch size. torch's
    reduction takes 8-11 us for 16 rows of a 151,936-entry vocabulary on an H100, one program per
    row 35-38 us (a serial walk of 300 KB). Ties go to the lowest index, as in torch; unlike
    torch, NaNs are never chosen (a row of NaNs gives 0)."""
    if x.dim() != 2:
        raise ValueError(f"argmax takes [rows, n], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, n = x.shape
    out = torch.empty(rows, device=x.device, dtype=torch.int64)
    if rows and not n:
        raise ValueError("argmax of an empty row")
    if rows:
        parts = max(1, min(ARGMAX_MAX_PARTS, -(-2 * sm_count(x.device) // rows), -(-n // ARGMAX_BLOCK)))
        chunk = -(-n // parts)
        parts = -(-n // chunk)
        val = torch.empty(rows, parts, device=x.device, dtype=torch.float32)
        idx = torch.empty(rows, parts, device=x.device, dtype=torch.int32)
        kw = launch_kwargs(x)
        _argmax_part_kernel[(rows, parts)](x, val, idx, n, chunk, x.stride(0), BLOCK=ARGMAX_BLOCK, num_warps=4, **kw)
        _argmax_final_kernel[(rows,)](val, idx, out, parts, BLOCK_P=ARGMAX_MAX_PARTS, num_warps=1, **kw)
    return out


def accepted_lengths(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """drafts [S, k], target [S, >= k] (integer ids, rows of unit stride) -> [S] int64: the
    number of leading drafts equal to the target's token at the same column."""
    S, k = drafts.shape
    if drafts.stride(-1) != 1 or target.stride(-1) != 1:
        drafts, target = drafts.contiguous(), target.contiguous()
    out = torch.empty(S, device=drafts.device, dtype=torch.int64)
    if S:
        _accept_kernel[(S,)](drafts, target, out, k, drafts.stride(0), target.stride(0),
                             BLOCK=max(ACCEPT_BLOCK, triton.next_power_of_2(k)), num_warps=1,
                             **launch_kwargs(drafts))
    return out


def topk_log_softmax(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.float().log_softmax(-1).topk(k) for a 2-D x [rows, n] of finite values, n <= 262,144:
    ([rows, k] float32 best first, [rows, k] int64 columns), ties to the lower column (torch.topk
    leaves their order open). Each row is cut into parts of TOPK_CHUNK entries (the part's k best
    and its softmax sums), then one program per row merges them: two kernels where torch launches a
    softmax and a radix select of ~16."""
    if x.dim() != 2 or not 1 <= k <= x.shape[1]:
        raise ValueError(f"topk_log_softmax takes [rows, n] and 1 <= k <= n, got {tuple(x.shape)} and k={k}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, n = x.shape
    parts = -(-n // TOPK_CHUNK)
    if parts > TOPK_MAX_PARTS:
        raise ValueError(f"topk_log_softmax takes rows of at most {TOPK_MAX_PARTS * TOPK_CHUNK} entries, got {n}")
    logp = torch.empty(rows, k, device=x.device, dtype=torch.float32)
    idx = torch.empty(rows, k, device=x.device, dtype=torch.int64)
    if rows:
        keys = torch.empty(rows, parts, k, device=x.device, dtype=torch.int64)
        stats = torch.empty(rows, parts, 2, device=x.device, dtype=torch.float32)
        kw, kp = launch_kwargs(x), triton.next_power_of_2(k)
        _topk_part_kernel[(rows, parts)](x, keys, stats, n, x.stride(0), K=k, KP=kp, CHUNK=TOPK_CHUNK,
                                         num_warps=8, **kw)
        _topk_final_kernel[(rows,)](keys, stats, logp, idx, parts, K=k, KP=kp,
                                    BLOCK=triton.next_power_of_2(parts * k), BLOCK_P=triton.next_power_of_2(parts),
                                    num_warps=4, **kw)
    return logp, idx


def block_slots(positions: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, page: int,
                out: torch.Tensor) -> None:
    """The cache slot of each draft-block row (positions [S * B], B rows a request) from its request's
    block table into out [S * B]; -1 for the rows of requests without rows (seq_len 0)."""
    S = seq_lens.shape[0]
    if S:
        B = positions.shape[0] // S
        _block_slots_kernel[(S,)](positions, seq_lens, block_tables, out, block_tables.stride(0), page, B=B,
                                  BP=triton.next_power_of_2(B), num_warps=1, **launch_kwargs(positions))


def advance_blocks(positions: torch.Tensor, input_ids: torch.Tensor, seq_lens: torch.Tensor, toks: torch.Tensor,
                   acc: torch.Tensor | None = None, drafts: torch.Tensor | None = None,
                   outcome: torch.Tensor | None = None) -> None:
    """Move the first n = len(toks) requests' draft blocks on after a verify (positions and input_ids
    [>= n * B], B rows a request; seq_lens [>= n] int32; toks [n, k1] the target's token at each verify
    row): each block starts one past the accepted drafts, its first token the target's token there;
    requests without rows (seq_len 0) keep theirs. The accepted counts come as acc [n], or are counted
    from drafts [n, k1 - 1] (the verified drafts), then written with toks into outcome
    ([n] counts, then [n * k1] tokens)."""
    n, k1 = toks.shape
    if not n:
        return
    B = positions.shape[0] // seq_lens.shape[0]
    accept = drafts is not None
    if accept and (outcome is None or outcome.numel() < n * (k1 + 1)):
        raise ValueError("advance_blocks counts the accepted drafts only with an outcome buffer of n * (k1 + 1)")
    if not accept and acc is None:
        raise ValueError("advance_blocks needs the accepted counts (acc) or the drafts to count them")
    if toks.stride(-1) != 1 or (accept and drafts.stride(-1) != 1):
        raise ValueError("advance_blocks takes rows of unit stride")
    unused = toks  # for the pointers the variant does not read
    _advance_kernel[(n,)](positions, input_ids, seq_lens, toks, unused if accept else acc,
                          drafts if accept else unused, outcome if accept else unused, n, toks.stride(0),
                          drafts.stride(0) if accept else 0, K1=k1,
                          KP=triton.next_power_of_2(k1), B=B, BP=triton.next_power_of_2(B), ACCEPT=accept,
                          num_warps=1, **launch_kwargs(toks))
