"""Token selection. Greedy is `argmax` (ties go to the lowest token id, on every path). Sampling is
Gumbel-max with noise that is a pure function of (seed, position, token id): the token at position
p of a request is drawn with the same noise whether it comes from plain decoding or from a
speculative verify slot, so a seeded request is reproducible on either path, on CPU or GPU, in any
batch. Temperature, top-k and top-p act on the logits before the noise, identically for every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.kernels.dispatch import fused_enabled

_M32 = 0xFFFFFFFF


def _mul32_(x: torch.Tensor, m: int) -> torch.Tensor:
    # x <- (x * m) mod 2**32 in int64 without overflow: split x into 16-bit halves. In place, as is
    # _mix32_: the noise of a verify is [rows, vocab] int64 (38 MB at 96 x 49k), and a fresh tensor per
    # operation made it 3x as slow on a CPU.
    hi = x >> 16
    hi.mul_(m).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.bitwise_and_(0xFFFF).mul_(m).add_(hi).bitwise_and_(_M32)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32 constants) of x, in place; x holds values in [0, 2**32)."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int,
                 token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[N, vocab] float32 Gumbel(0, 1) noise keyed by (seed, position, token id); column j stands for
    token j, or for token_ids[j] ([vocab], or [N, vocab]: each row's own tokens) when given."""
    seeds = seeds.to(torch.int64)
    key = _mix32_((seeds & _M32) ^ _mix32_((seeds >> 32) & _M32 ^ 0x9E3779B9))
    key = _mix32_(key ^ _mix32_(positions.to(torch.int64) & _M32))
    tok = _token_hash(vocab, seeds.device) if token_ids is None else _mix32_(token_ids.long() * 0x9E3779B1 & _M32)
    h = _mix32_(key[:, None] ^ (tok if tok.dim() == 2 else tok[None, :]))
    u = h.bitwise_right_shift_(8).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24))  # in (0, 1), exact
    return u.log_().neg_().log_().neg_()


_TOKEN_HASH: dict[tuple[int, torch.device], torch.Tensor] = {}


def _token_hash(vocab: int, device: torch.device) -> torch.Tensor:
    """The token half of the noise's key for ids 0..vocab-1: the same every step, so made once per
    vocabulary and device (some twenty elementwise passes over the vocabulary each step otherwise)."""
    key = (vocab, device)
    if key not in _TOKEN_HASH:
        tok = torch.arange(vocab, device=device, dtype=torch.int64)
        _TOKEN_HASH[key] = _mix32_(tok * 0x9E3779B1 & _M32)
    return _TOKEN_HASH[key]


@dataclass
class SamplingBatch:
    """Per-row sampling settings, one row per logits row; the tensors may be None when every row
    is greedy (temperature 0), which takes the argmax alone."""

    temperature: torch.Tensor | None  # [N] float32; 0 means greedy
    top_k: torch.Tensor | None  # [N] int64; vocab size when disabled
    top_p: torch.Tensor | None  # [N] float32
    seeds: torch.Tensor | None  # [N] int64
    positions: torch.Tensor | None  # [N] int64: position of the token being chosen
    all_greedy: bool
    # whether any row has top-k below the vocabulary / top-p below 1, known on the host (None: read from
    # the tensors, a wait for the device: an engine step would lose its overlap with the next)
    any_top_k: bool | None = None
    any_top_p: bool | None = None
    min_p: torch.Tensor | None = None  # [N] float32, where any row keeps only tokens of min_p x the top probability


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, need_k: bool | None = None, need_p: bool | None = None,
                  min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Temperature, then min_p (when given), top-k and top-p (vLLM's order); excluded tokens get -inf.
    need_k / need_p: whether any row filters by top-k / top-p, when the caller knows it (else read back
    from the tensors)."""
    logits = logits / temperature.clamp_min(1e-6)[:, None]
    if min_p is not None:  # probability below min_p x the row's top probability
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    vocab = logits.shape[-1]
    if need_k is None:
        need_k = bool((top_k < vocab).any())
    if need_p is None:
        need_p = bool((top_p < 1.0).any())
    if not (need_k or need_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    if need_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly above this token
        drop |= before >= top_p[:, None]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> argmax over V: on the fused GPU path the two Triton kernels of
    token_ops.argmax (kernels/token_ops.py), else torch's argmax. Both break ties to the lowest id."""
    if logits.numel() and fused_enabled(logits):
        from flashdraft.kernels import token_ops

        return token_ops.argmax(logits.reshape(-1, logits.shape[-1])).view(logits.shape[:-1])
    return logits.argmax(dim=-1)


# elements of [rows, vocab] noise made at once: its int64 hash holds several temporaries of that size,
# each 1.6 GB at 4,096 verify rows of a 49k vocabulary in one go (256 requests x B=16)
NOISE_CHUNK = 1 << 26


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [N, V] float32 (or, when every row is greedy, any float dtype: the argmax of the
    model-dtype logits is the argmax of their exact float32 upcast) -> token ids [N] int64.
    The noise is made for a bounded number of rows at a time (NOISE_CHUNK): the same draws."""
    greedy = greedy_tokens(logits)
    if sb.all_greedy:
        return greedy
    filtered = filter_logits(logits, sb.temperature, sb.top_k, sb.top_p, sb.any_top_k, sb.any_top_p, sb.min_p)
    vocab = logits.shape[-1]
    step = max(1, NOISE_CHUNK // vocab)
    sampled = torch.empty_like(greedy)
    for i in range(0, logits.shape[0], step):
        noise = gumbel_noise(sb.seeds[i: i + step], sb.positions[i: i + step], vocab)
        sampled[i: i + step] = noise.add_(filtered[i: i + step]).argmax(dim=-1)
    return torch.where(sb.temperature > 0, sampled, greedy)


# the drafter's most likely tokens a drawn draft chooses among (see draw_drafts)
DRAW_CANDIDATES = 1024


def draw_drafts(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Draft tokens drawn the way the target will draw: argmax(logits / T + noise), the noise of the
    (seed, position) the target's sampler uses for the token the draft stands for; rows with T = 0 take
    the argmax. logits [N, V] float32, the rest [N]; token_ids as in gumbel_noise. A drafter whose
    distribution equals the target's then proposes exactly the target's token (a Gumbel-max coupling),
    so drafts of sampled requests are accepted far more often than argmax drafts; which token is
    proposed never changes what is committed. The draw runs over the drafter's DRAW_CANDIDATES most
    likely tokens only: noise over SmolLM2's whole 49k vocabulary for every draft slot made 12 MT-Bench
    requests at T=1 take 1.7x as long on a CPU, and the cut to 1,024 lowers their tau by 0.02 (1.545
    against 1.566; argmax drafts 1.336). Top-k and top-p are left to the verify. Nothing here reads a
    value back to the host (graph-safe)."""
    perturbed, cand = _perturbed(logits, temperature, seeds, positions, token_ids)
    pick = perturbed.argmax(dim=-1, keepdim=True)
    return torch.where(temperature > 0, cand.gather(1, pick)[:, 0], logits.argmax(dim=-1))


def _perturbed(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
               token_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits / T + the target's noise over the DRAW_CANDIDATES most likely tokens: (values, columns)."""
    vals, cand = logits.topk(min(DRAW_CANDIDATES, logits.shape[-1]), dim=-1)
    ids = cand if token_ids is None else token_ids[cand]
    noise = gumbel_noise(seeds, positions, cand.shape[1], ids)
    return vals / temperature.clamp_min(1e-6)[:, None] + noise, cand


def _top_log_probs(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.float().log_softmax(-1).topk(k) of a [N, V] x: on the fused GPU path the two Triton kernels of
    token_ops.topk_log_softmax, which read x in its own dtype (ties to the lower column; torch
    leaves their order open)."""
    if x.numel() and fused_enabled(x):
        from flashdraft.kernels import token_ops

        return token_ops.topk_log_softmax(x, k)
    return x.float().log_softmax(-1).topk(k, dim=-1)


def draw_candidates(logits: torch.Tensor, k: int, temperature: torch.Tensor | None = None,
                    seeds: torch.Tensor | None = None,
                    positions: torch.Tensor | None = None,
                    token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A token tree's candidates for each draft slot (speculative/tree.py): the k best columns of
    logits [N, V] (float32 where drawn; greedy rows may come in the model dtype) with their
    log-probabilities, best first, ([N, k] float32, [N, k] int64). Greedy rows (no temperature, or
    T = 0) rank by the drafter's distribution; sampled rows by the draw draw_drafts makes (logits / T
    plus the noise the target will draw that position's token with), scored by the softmax of those
    perturbed values, so the first candidate is the drawn draft."""
    logp, cand = _top_log_probs(logits, min(k, logits.shape[-1]))
    if temperature is None:
        return logp, cand
    perturbed, cols = _perturbed(logits, temperature, seeds, positions, token_ids)
    p_logp, p_idx = _top_log_probs(perturbed, min(k, cols.shape[1]))
    hot = (temperature > 0)[:, None]
    return torch.where(hot, p_logp, logp), torch.where(hot, cols.gather(1, p_idx), cand)
