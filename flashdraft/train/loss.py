"""The DFlash training objective (DFLASH.md): blocks anchored at response positions p, input
[x_p, MASK x (B-1)] at positions p..p+B-1, seeing the context features of positions strictly
before p and their own B slots bidirectionally, never other blocks; slot k is scored against
x[p+k] (same position) with weight exp(-(k-1)/gamma), slot 0 unweighted.

What slot k is scored against (`labels`):
- "data": the token x[p+k] of the training sequence (the published recipe).
- "argmax": the target's own greedy choice for position p+k given x[:p+k] (its logits at p+k-1),
  the token a greedy verify accepts there; equal to "data" on greedy self-distilled responses,
  and the target's mode where the responses were sampled.
- "kl": KL(target || drafter) over the whole vocabulary at each slot, the target's distribution
  at p+k-1 as a soft label (speculators' default objective)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashdraft import settings
from flashdraft.models.dflash_draft import DFlashDraftModel
from flashdraft.models.layers import rms_norm
from flashdraft.models.rope import apply_rope

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
LABELS = ("data", "argmax", "kl")


def gamma_for(block_size: int) -> float:
    # published values for B = 16 / 10 / 8, linear in between and beyond
    return GAMMA.get(block_size, max(1.0, 7.0 * block_size / 16))


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, num_anchors: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_anchors sorted anchor positions per sequence among response tokens that have at
    least one token after them. -> anchors [b, N] (long), valid [b, N] (bool)."""
    b, s = loss_mask.shape
    pos = torch.arange(s)
    ok = loss_mask.bool().cpu() & (pos[None, :] < (lengths.cpu()[:, None] - 1))
    n = min(num_anchors, int(ok.sum(1).max()))
    anchors = torch.zeros(b, max(n, 1), dtype=torch.long)
    valid = torch.zeros(b, max(n, 1), dtype=torch.bool)
    for i in range(b):
        cand = ok[i].nonzero().flatten()
        pick = cand[torch.randperm(len(cand), generator=gen)[:n]].sort().values
        anchors[i, : len(pick)] = pick
        valid[i, : len(pick)] = True
    return anchors, valid


def block_attention_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block: int,
                         window: int | None = None) -> torch.Tensor:
    """[b, N*B, ctx_len + N*B] bool, True = visible. window: see only the last `window` context
    positions before the anchor (and position 0), a curriculum for the first steps."""
    b, n = anchors.shape
    q_anchor = anchors.repeat_interleave(block, dim=1)  # [b, NB]
    q_block = torch.arange(n, device=anchors.device).repeat_interleave(block)
    pos = torch.arange(ctx_len, device=anchors.device)[None, None, :]
    ctx = pos < q_anchor[:, :, None]
    if window:
        ctx &= (pos >= q_anchor[:, :, None] - window) | (pos == 0)
    own = q_block[:, None] == q_block[None, :]
    own = own[None].expand(b, -1, -1) & valid.repeat_interleave(block, dim=1)[:, None, :]
    mask = torch.cat([ctx, own], dim=-1)
    mask[..., 0] |= ~valid.repeat_interleave(block, dim=1)  # padded blocks see one key, no loss
    return mask


def key_groups(anchors: torch.Tensor, groups: int) -> list[tuple[int, int, int]]:
    """Consecutive anchor groups (sorted anchors) and the context keys each needs:
    [(first anchor index, end index, context length)]. A block sees context strictly before its
    anchor (and position 0), and of the block slots only its own, so the queries of a group need
    context keys [0, max anchor) and their own group's slots; the other keys are masked for every
    query of the group, and leaving them out changes nothing but the work."""
    n = anchors.shape[1]
    size = -(-n // max(1, groups))
    ends = anchors.max(0).values.tolist()  # the largest anchor at each index over the batch
    return [(g, min(g + size, n), max(1, max(ends[g: g + size]))) for g in range(0, n, size)]


# the norms and RoPE, compiled where settings.TRAIN_COMPILE asks (the why is written there)
def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the model computes it, returned in x's dtype: the dtype autocast would cast it to
    for the next matmul."""
    return rms_norm(x, w, eps).to(x.dtype)


def _norm_rope(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q/k norm then RoPE (x [T, heads, D]; cos/sin [T, D]), in float32, returned in x's dtype."""
    return apply_rope(rms_norm(x, w, eps), cos, sin).to(x.dtype)


_compiled: dict = {}


def _compiling(like: torch.Tensor) -> bool:
    """Whether settings.TRAIN_COMPILE asks for the compiled functions for tensors like `like`."""
    mode = settings.TRAIN_COMPILE
    if mode not in ("auto", "1", "0"):
        raise ValueError(f"FLASHDRAFT_TRAIN_COMPILE must be auto, 1 or 0, got {mode!r}")
    return mode == "1" or (mode == "auto" and like.device.type == "cuda")


def _fn(name: str, eager, like: torch.Tensor):
    """`eager` compiled (once, shapes dynamic) when _compiling(like), else `eager` itself."""
    if not _compiling(like):
        return eager
    if name not in _compiled:
        _compiled[name] = torch.compile(eager, dynamic=True)
    return _compiled[name]


def _heads(t: torch.Tensor, b: int, n_kv: int, head_dim: int, rep: int) -> torch.Tensor:
    """[b * L, n_kv, D] or [b, L, n_kv * D] -> [b, n_kv * rep, L, D] (GQA heads repeated)."""
    return t.reshape(b, -1, n_kv, head_dim).transpose(1, 2).repeat_interleave(rep, 1)


# Not cuDNN's attention: it plans a graph on the host for every new shape (each anchor group's key
# count is new), ~7 ms forward and ~15 ms backward per call on an H200, most of a training step
# (measured with a profile of the training step)
TRAIN_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def _attention(q, k, v, mask, scale):
    with sdpa_kernel(TRAIN_SDPA):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def draft_hidden(drafter: DFlashDraftModel, taps: torch.Tensor, embed: torch.Tensor, anchors: torch.Tensor,
                 mask: torch.Tensor, groups: int = 8) -> torch.Tensor:
    """Training forward. taps [b, S, n*H]; embed [b, N*B, H] -> normed hidden [b, N*B, H].
    Attention runs per group of consecutive anchors over only the keys the group can see
    (`key_groups`): about 4x less attention work than all queries over all S + N*B keys, which
    groups=0 runs (the reference). anchors may stay on the CPU: the groups are planned from them
    without waiting for the GPU."""
    b, s, _ = taps.shape
    n = anchors.shape[1]
    block = embed.shape[1] // n
    parts = key_groups(anchors, groups) if groups else [(0, n, s)]
    anchors = anchors.to(taps.device, non_blocking=True)
    ctx_pos = torch.arange(s, device=taps.device)
    q_pos = (anchors[:, :, None] + torch.arange(block, device=taps.device)).flatten(1)  # [b, NB]
    cos_c, sin_c = drafter.rope.lookup(ctx_pos)
    cos_q, sin_q = drafter.rope.lookup(q_pos.flatten())
    rms, norm_rope = _fn("rms", _rms_norm, taps), _fn("norm_rope", _norm_rope, taps)
    ctx = rms(drafter.fc(taps), drafter.hidden_norm.weight, drafter.hidden_norm.eps)
    h = embed
    for layer in drafter.layers:
        a = layer.self_attn
        conv = getattr(layer, "attention_conv", None)  # DFlash2: within each block of `block` rows
        x = rms(h, layer.input_layernorm.weight, layer.input_layernorm.eps)
        if conv is not None:
            x, delta = conv.prepare(x.flatten(0, 1))
            x = x.view_as(h)
        q, kb, vb = a.qkv_proj(x).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        _, kc, vc = a.qkv_proj(ctx).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        # norms and rope in float32; q and k come back in the matmul dtype, as attention takes them
        q = norm_rope(q.reshape(-1, a.n_heads, a.head_dim), a.q_norm.weight, a.q_norm.eps, cos_q, sin_q)
        kb = norm_rope(kb.reshape(-1, a.n_kv, a.head_dim), a.k_norm.weight, a.k_norm.eps, cos_q, sin_q)
        kc = norm_rope(kc.reshape(-1, a.n_kv, a.head_dim), a.k_norm.weight, a.k_norm.eps,
                       cos_c.repeat(b, 1), sin_c.repeat(b, 1))
        kc, vc, kb, vb = (_heads(t, b, a.n_kv, a.head_dim, a.n_heads // a.n_kv) for t in (kc, vc, kb, vb))
        q = q.view(b, -1, a.n_heads, a.head_dim).transpose(1, 2)
        outs = []
        for g0, g1, n_ctx in parts:
            r0, r1 = g0 * block, g1 * block  # the group's query rows = its own block slots
            m = torch.cat([mask[:, r0:r1, :n_ctx], mask[:, r0:r1, s + r0: s + r1]], -1)
            outs.append(_attention(q[:, :, r0:r1], torch.cat([kc[:, :, :n_ctx], kb[:, :, r0:r1]], 2),
                                   torch.cat([vc[:, :, :n_ctx], vb[:, :, r0:r1]], 2), m[:, None], a.scale))
        o = a.o_proj(torch.cat(outs, 2).transpose(1, 2).reshape(b, -1, a.q_size))
        if conv is not None:
            o = conv.finish(o.flatten(0, 1), delta).view_as(o)
        h = h + o
        x = rms(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        if conv is None:
            h = h + layer.mlp(x)
        else:
            x, delta = layer.mlp_conv.prepare(x.flatten(0, 1))
            h = h + layer.mlp_conv.finish(layer.mlp(x), delta).view_as(h)
    return drafter.norm(h)


def walk_anchors(anchors: torch.Tensor, valid: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
    """The anchors a greedy verify meets, [b, N] bool: from each row's first anchor, a block anchored at
    p commits run(p) tokens and the next block is anchored at p + run(p) (at the first sampled anchor
    from there when anchors are a subset of the positions). anchors sorted per row (sample_anchors),
    valid ones first; run [b, N] >= 1. On the device without a wait for it: the chain is followed by
    pointer doubling (after r rounds the set holds the first 2^r anchors of the walk)."""
    b, n = anchors.shape
    big = torch.iinfo(anchors.dtype).max
    keys = torch.where(valid, anchors, big)
    nxt = torch.searchsorted(keys, torch.where(valid, anchors + run, big)).clamp_max(n)  # n: past the end
    jump = torch.cat([nxt, nxt.new_full((b, 1), n)], 1)  # [b, n + 1], the end maps to itself
    seen = torch.zeros(b, n + 1, dtype=torch.int32, device=anchors.device)
    seen[:, 0] = valid[:, 0].to(torch.int32)
    for _ in range(max(1, math.ceil(math.log2(n + 1)))):
        seen = seen.scatter_reduce(1, jump, seen, reduce="amax")
        jump = jump.gather(1, jump)
    return seen[:, :n].bool() & valid


def _ce_rows(logits: torch.Tensor, y: torch.Tensor, want_grad: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Cross-entropy (float32) and argmax of logits [n, V] against y [n], and the gradient with
    respect to the logits, softmax - one-hot, in the logits' dtype: _HeadLoss's eager branch in the
    form the compiler fuses (the one-hot as a comparison, not a scatter into a copy)."""
    log_q = F.log_softmax(logits, -1, dtype=torch.promote_types(logits.dtype, torch.float32))
    loss = -log_q.gather(1, y[:, None])[:, 0]
    pred = logits.argmax(-1)
    if not want_grad:
        return loss, pred, None
    hit = torch.arange(logits.shape[1], device=logits.device)[None, :] == y[:, None]
    return loss, pred, (log_q.exp() - hit.to(log_q.dtype)).to(logits.dtype)


class _HeadLoss(torch.autograd.Function):
    """Per-row loss of lm_head(hidden) and its gradient in one pass over row chunks. lm_head is
    frozen, so d loss_r / d hidden_r is all the backward needs: it is computed with the loss and
    scaled by the incoming per-row gradient in backward. Against checkpointed chunks this saves
    the recomputed logits and their float32 backward passes; the full logits never exist."""

    @staticmethod
    def forward(ctx, hidden, w, labels, soft, rows, chunk, want_grad):
        losses, preds, grads = [], [], []
        fused = _fn("ce", _ce_rows, hidden) if soft is None and _compiling(hidden) else None
        for i in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[i: i + chunk], w)  # the matmul dtype (bf16 under autocast)
            if fused is not None:  # the cross-entropy branch below in a few fused kernels
                loss, pred, g = fused(logits, labels[i: i + chunk], want_grad)
                losses.append(loss)
                preds.append(pred)
            else:
                preds.append(logits.argmax(-1))
                f32 = torch.promote_types(logits.dtype, torch.float32)  # float64 stays float64 (tests)
                log_q = F.log_softmax(logits, -1, dtype=f32)
                if soft is None:  # cross-entropy against labels; d/dlogits = softmax - one-hot
                    y = labels[i: i + chunk, None]
                    losses.append(-log_q.gather(1, y)[:, 0])
                    if want_grad:
                        g = torch.exp(log_q, out=logits)
                        g.scatter_add_(1, y, torch.full_like(y, -1, dtype=g.dtype))
                else:  # KL(p || q), p the target's softmax at these rows; d/dlogits = q - p
                    log_p = F.log_softmax(soft[rows[i: i + chunk]], -1, dtype=f32)
                    p = log_p.exp()
                    losses.append((p * (log_p - log_q)).sum(-1))
                    if want_grad:
                        g = torch.exp(log_q, out=logits).sub_(p.to(logits.dtype))
            if want_grad:
                grads.append((g @ w.to(g.dtype)).to(hidden.dtype))
        ctx.save_for_backward(torch.cat(grads) if want_grad else None)
        pred = torch.cat(preds)
        ctx.mark_non_differentiable(pred)
        return torch.cat(losses), pred

    @staticmethod
    def backward(ctx, grad_loss, grad_pred):
        (grad_rows,) = ctx.saved_tensors
        return grad_loss[:, None].to(grad_rows.dtype) * grad_rows, None, None, None, None, None, None


def head_cross_entropy(hidden: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor, chunk: int = 8192,
                       soft: torch.Tensor | None = None, rows: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy (float32) and argmax of lm_head(hidden) [rows, H] against labels [rows],
    in row chunks (the full float32 logits would be 13 GB for 16 sequences x 512 anchors x 8 slots of
    a 49k vocabulary). With soft ([positions, vocab] target logits) and rows (the position of each
    hidden row), the per-row loss is KL(softmax(soft[rows]) || softmax(lm_head(hidden))) instead;
    labels are unused then. lm_head is frozen: no gradient reaches it."""
    want_grad = torch.is_grad_enabled() and hidden.requires_grad
    return _HeadLoss.apply(hidden, lm_head.detach(), labels, soft, rows, chunk, want_grad)


def dflash_loss(drafter: DFlashDraftModel, lm_head: torch.Tensor, embed_table: torch.Tensor, taps: torch.Tensor,
                ids: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                mask_token_id: int, gamma: float, window: int | None = None, labels: str = "data",
                target_logits: torch.Tensor | None = None, walk_floor: float | None = None,
                selector_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Weighted same-position loss (cross-entropy, or KL for labels="kl"); also per-slot accuracy
    and the acceptance length a greedy verify would see on these blocks (leading correct slots + 1),
    against the sequence's tokens for labels="data" and the target's greedy choices otherwise.
    target_logits [b, S, vocab]: the frozen target's logits over ids, needed unless labels="data".
    anchors may be on the CPU (as make_batch leaves them) and the statistics stay on ids' device:
    nothing here waits for the GPU.

    walk_floor w (0 <= w <= 1): each block's loss is weighted 1 when its anchor lies on the walk a greedy
    verify would take through the sequence with this step's drafts (`walk_anchors`: the anchors serving
    meets, which start right after a missed draft) and w elsewhere; None weights every anchor alike.

    A DFlash2 drafter adds selector_weight x its candidate selector's loss (`selector_loss`), and its
    statistics follow the selector's own path through each block, as serving drafts it."""
    if labels not in LABELS:
        raise ValueError(f"unknown labels {labels!r}; use one of {', '.join(LABELS)}")
    if labels != "data" and target_logits is None:
        raise ValueError(f"labels={labels!r} needs the target's logits")
    if walk_floor is not None and not 0 <= walk_floor <= 1:
        raise ValueError(f"walk_floor must lie in [0, 1], not {walk_floor}")
    b, s = ids.shape
    block = drafter.spec.block_size
    dev = ids.device
    anchors_in = anchors
    anchors = anchors.to(dev, non_blocking=True)
    blocks = torch.full((b, anchors.shape[1], block), mask_token_id, device=dev)
    blocks[:, :, 0] = ids.gather(1, anchors)
    label_pos = anchors[:, :, None] + torch.arange(block, device=dev)  # [b, N, B]
    in_seq = label_pos < lengths[:, None, None]
    label_pos = label_pos.clamp_max(s - 1)
    # the token scored at position t: the data's x[t], or the target's greedy choice from its logits at t - 1
    source = ids if labels == "data" else torch.cat([ids[:, :1], target_logits[:, :-1].argmax(-1)], 1)
    targets = source.gather(1, label_pos.flatten(1)).view_as(label_pos)
    k = torch.arange(block, device=dev, dtype=torch.float32)
    w = torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))
    weight = w[None, None, :] * (in_seq & valid[:, :, None]).float()
    mask = block_attention_mask(anchors, valid, s, block, window)
    hidden = draft_hidden(drafter, taps, F.embedding(blocks.flatten(1), embed_table), anchors_in, mask)
    hidden = hidden.view(b, -1, block, hidden.shape[-1])[:, :, 1:].flatten(0, 2)  # slot 0 is never scored
    soft = rows = None
    if labels == "kl":  # slot k at position p + k is scored against the target's logits at p + k - 1
        soft = target_logits.flatten(0, 1)
        seq0 = torch.arange(b, device=dev)[:, None, None] * s
        rows = torch.where(weight > 0, seq0 + label_pos - 1, seq0)[:, :, 1:].flatten()  # unscored: a real row
    ce, pred = head_cross_entropy(hidden, lm_head, targets[:, :, 1:].flatten(), soft=soft, rows=rows)
    sel_loss = None
    if drafter.candidate_selector is not None:
        # predecessors teacher-forced: the anchor for slot 1, then the scored token one slot before
        prev = torch.cat([blocks[:, :, :1], targets[:, :, 1:-1]], 2).flatten()
        sel_loss, pred = selector_loss(drafter.candidate_selector, hidden, lm_head, prev,
                                       targets[:, :, 1:].flatten(), block - 1)
    with torch.no_grad():
        correct = (pred.view_as(targets[:, :, 1:]) == targets[:, :, 1:]) & (weight[:, :, 1:] > 0)
        scored = weight[:, :, 1:] > 0
        acc = correct.float().sum((0, 1)) / scored.float().sum((0, 1)).clamp_min(1)
        full = valid & in_seq[:, :, -1]  # blocks whose every slot lies inside the sequence
        run = correct.long().cumprod(-1).sum(-1) + 1
        tau = (run.float() * full).sum() / full.sum()  # NaN when no block is whole
        stats = {"acc_per_slot": acc, "tau": tau}
        if walk_floor is not None:
            on_walk = walk_anchors(anchors, valid, run)
            weight = weight * torch.where(on_walk, 1.0, walk_floor)[:, :, None]
            stats["walk_tau"] = (run * on_walk).sum() / on_walk.sum().clamp_min(1)
    wt = weight[:, :, 1:].flatten()
    loss = (ce * wt).sum() / wt.sum().clamp_min(1e-6)
    if sel_loss is not None:
        stats["selector_loss"] = (sel_loss.detach() * wt).sum() / wt.sum().clamp_min(1e-6)
        loss = loss + selector_weight * (sel_loss * wt).sum() / wt.sum().clamp_min(1e-6)
    return loss, stats


def selector_loss(sel, hidden: torch.Tensor, lm_head: torch.Tensor, prev: torch.Tensor, target: torch.Tensor,
                  slots: int, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash2's candidate selector (speculators' recipe): per draft row [R, H] the top-k tokens of the
    drafter's own logits, the target token put in place of the k-th when missing, scored given the
    teacher-forced predecessor prev [R] (cross-entropy over the k, per row, float32). Also returns the
    token the selector picks at each row when it walks each block from its anchor on its own choices
    (rows are blocks of `slots` rows), which is what serving drafts: [R]."""
    k = sel.top_k
    with torch.no_grad():  # the serving candidates: top-k of the drafter's logits, in row chunks
        vals, cand = zip(*(F.linear(hidden[i: i + chunk], lm_head).topk(k, dim=-1)
                           for i in range(0, hidden.shape[0], chunk)))
        vals, cand = torch.cat(vals), torch.cat(cand)
        hit = cand == target[:, None]
        has = hit.any(-1)
        train_cand = cand.clone()
        train_cand[:, -1] = torch.where(has, cand[:, -1], target)
        label = torch.where(has, hit.to(torch.int64).argmax(-1), k - 1)
    unary = torch.einsum("rh,rkh->rk", hidden, lm_head[train_cand].to(hidden.dtype))
    proj = sel.hidden_projection(hidden)
    scores = sel.scores(unary, train_cand, proj, prev)
    loss = F.cross_entropy(scores.float(), label, reduction="none")
    with torch.no_grad():  # the selector's own path, block by block, from each block's anchor
        n = hidden.shape[0] // slots
        v, c, p = vals.view(n, slots, k), cand.view(n, slots, k), proj.view(n, slots, -1)
        chosen, last = [], prev.view(n, slots)[:, 0]
        for j in range(slots):
            score = sel.scores(v[:, j].to(p.dtype), c[:, j], p[:, j], last)
            last = c[:, j].gather(1, score.argmax(-1, keepdim=True))[:, 0]
            chosen.append(last)
    return loss, torch.stack(chosen, 1).flatten()
