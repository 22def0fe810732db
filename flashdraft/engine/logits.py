"""The target's logits -> the tokens a step commits, for requests that process or read them
(SamplingParams.needs_logits): vLLM's processors, in vLLM's order, then the sampler, and the raw
log-probabilities. Every path that chooses a target token calls `choose`: plain decoding, prefill ends,
and each verify row of a DFlash step. A verify row's processors see what plain decoding would see at its
position: the committed output plus the drafts on the row's own path (a chain's earlier rows, a tree
row's ancestors), its output length the row's depth past the committed output. Acceptance then compares
drafts against the processed distribution, so the committed tokens are plain decoding's.

Order (vLLM's sampler): logit_bias, min_tokens (stop tokens barred below the minimum), penalties
(repetition over prompt and output tokens, then frequency and presence over output tokens), the greedy
choice; then temperature, min_p, top-k, top-p and the seeded draw (sampler.py). Log-probabilities are
the raw distribution's (vLLM's default logprobs mode), the chosen token's and the k most likely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.engine.graphs import to_device
from flashdraft.engine.sampler import SamplingBatch, sample
from flashdraft.engine.sequence import Sequence, TokenLogprob
from flashdraft.structured.masks import apply_grammars


@dataclass
class Seen:
    """Tokens of the step's own rows that a row's processors count as output before it: pairs (logits row,
    index into the step's input ids), each counted where its weight is 1 (None: always). Chains count a
    verify row's earlier draft rows (weights on the host); trees a row's ancestors (weights from the
    tree's ancestor masks, on the device)."""

    rows: list[int]
    src: list[int]
    ids: torch.Tensor  # the step's input ids on the device
    weights: torch.Tensor | None = None  # [len(rows)] 0/1 on the device


@dataclass
class StepLogprobs:
    """Raw log-probabilities of a step's chosen tokens, on the device until read: the chosen token's [R] and
    the k most likely (values [R, k], ids [R, k]), one row per chosen token."""

    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def select(self, index: torch.Tensor) -> StepLogprobs:
        """The rows at `index` (on the device), in its order."""
        return StepLogprobs(self.chosen[index], self.top_values[index], self.top_ids[index])

    def read(self, tokens: list[int], seqs: list[Sequence]) -> list[TokenLogprob]:
        """Host entries for rows of `tokens` (the chosen ids), each with its request's number of top entries."""
        chosen, vals, ids = (t.tolist() for t in (self.chosen, self.top_values, self.top_ids))
        out = []
        for r, (tok, s) in enumerate(zip(tokens, seqs)):
            k = s.params.logprobs or 0
            out.append(TokenLogprob(tok, chosen[r], list(zip(ids[r][:k], vals[r][:k]))))
        return out


def choose(model, hidden: torch.Tensor, seqs: list[Sequence], positions: list[int] | torch.Tensor,
           sb: SamplingBatch, eos_ids: set[int] | list[int], seen: Seen | None = None, checked=None
           ) -> tuple[torch.Tensor, StepLogprobs | None]:
    """The target's token for each row of hidden [R, H] (row r: request seqs[r], drawing the token at
    positions[r]), and their raw log-probabilities when any request asks for them. checked: requests
    whose grammar is not applied here (their tokens are checked after: speculative/grammar_check.py).
    A greedy request whose only processor is its grammar takes the argmax of the logits unconstrained
    greedy requests take (bf16 on a bf16 target) among the tokens its grammar allows."""
    skip = (lambda s: False) if checked is None else checked
    need = any(s.params.needs_logits and not skip(s) for s in seqs)
    f32 = not sb.all_greedy or any(s.params.needs_logits and not s.params.grammar_only for s in seqs)
    logits = model.compute_logits(hidden, float32=f32)
    if not need:
        return sample(logits, sb), None
    k = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
    logp = logits.log_softmax(-1) if k is not None else None
    if any(s.params.processes_logits and not skip(s) for s in seqs):
        pos = positions if isinstance(positions, torch.Tensor) else to_device(positions, torch.long, logits.device)
        logits = process(logits, seqs, pos, eos_ids, seen, skip)  # (in place: compute_logits made it, logp apart)
    toks = sample(logits, sb)
    if logp is None:
        return toks, None
    top = logp.topk(max(k, 1), dim=-1)
    return toks, StepLogprobs(logp.gather(1, toks[:, None])[:, 0], top.values, top.indices)


def process(logits: torch.Tensor, seqs: list[Sequence], positions: torch.Tensor, eos_ids, seen: Seen | None = None,
            checked=None) -> torch.Tensor:
    """vLLM's processors over logits [R, V] float32 (changed in place and returned): row r belongs to
    seqs[r] and chooses the token at positions[r] (on the device), so its output so far is the request's
    committed output up to that position, plus the step's own rows in `seen`. Flat scatters throughout:
    nothing here waits for the device."""
    dev, V = logits.device, logits.shape[1]
    flat = logits.view(-1)
    bias = [(r * V + t, b) for r, s in enumerate(seqs) for t, b in (s.params.logit_bias or {}).items()]
    if bias:
        at, b = zip(*bias)
        flat.scatter_add_(0, to_device(at, torch.long, dev), to_device(b, torch.float32, dev))
    # min_tokens: the request's stop tokens (EOS unless ignored) barred while its output is shorter (a stop
    # id past the vocabulary is never drawn: nothing to bar)
    bar = [(r, r * V + t) for r, s in enumerate(seqs) if s.params.min_tokens for t in _stop_ids(s, eos_ids) if t < V]
    if bar:
        rows, at = zip(*bar)
        x = to_device([rows, at, [seqs[r].num_prompt_tokens + seqs[r].params.min_tokens for r in rows]], torch.long,
                      dev)
        flat.scatter_add_(0, x[1], torch.where(positions[x[0]] < x[2], float("-inf"), 0.0))
    penalized = [r for r, s in enumerate(seqs) if s.params.penalizes]
    if penalized:
        _penalties(logits, seqs, penalized, seen)
    constrained = [r for r, s in enumerate(seqs) if s.grammar is not None and not (checked and checked(s))]
    if constrained:  # the grammar's mask after the processors (vLLM applies it to the processed logits)
        apply_grammars(logits, seqs, constrained, seen)
    return logits


def _stop_ids(seq: Sequence, eos_ids) -> list[int]:
    p = seq.params
    return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)))


def _penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int], seen: Seen | None) -> None:
    """Repetition, frequency and presence penalties of the rows `rows`, in vLLM's order. A row's output counts
    are its request's committed output (a verify row's request committed nothing past its block's start)
    plus the step's own rows it sees; the committed part is made once per request, then taken by its rows."""
    dev, V = logits.device, logits.shape[1]
    owners: dict[int, int] = {}  # request -> its row in the per-request tensors
    of_row = [owners.setdefault(id(seqs[r]), len(owners)) for r in rows]
    reqs = list({id(seqs[r]): seqs[r] for r in rows}.values())
    ints = to_device([rows, of_row], torch.long, dev)
    params = [seqs[r].params for r in rows]
    rep, freq, pres = to_device([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                                 [p.presence_penalty for p in params]], torch.float32, dev)[:, :, None]
    counts = torch.zeros(len(reqs) * V, dtype=torch.float32, device=dev)
    out = [u * V + t for u, s in enumerate(reqs) for t in s.output_token_ids]  # (sampled: every id is below V)
    if out:
        counts.scatter_add_(0, to_device(out, torch.long, dev), torch.ones(1, device=dev).expand(len(out)))
    counts = counts.view(len(reqs), V).index_select(0, ints[1])
    if seen is not None:  # the step's own rows each row sees
        pos = {r: i for i, r in enumerate(rows)}
        keep = [j for j, r in enumerate(seen.rows) if r in pos]
        if keep:
            idx = to_device([[pos[seen.rows[j]] * V for j in keep], [seen.src[j] for j in keep], keep], torch.long,
                            dev)
            w = torch.ones(1, device=dev).expand(len(keep)) if seen.weights is None else seen.weights[idx[2]].float()
            counts.view(-1).scatter_add_(0, idx[0] + seen.ids[idx[1]], w)
    sub = logits.index_select(0, ints[0])
    if any(p.repetition_penalty != 1.0 for p in params):  # tokens of the prompt or the output so far
        prompt = [u * V + t for u, s in enumerate(reqs) if s.params.repetition_penalty != 1.0
                  for t in set(s.token_ids[: s.num_prompt_tokens])]  # (checked against the vocabulary)
        in_prompt = torch.zeros(len(reqs) * V, dtype=torch.bool, device=dev)
        if prompt:
            in_prompt.scatter_(0, to_device(prompt, torch.long, dev), True)
        factor = torch.where((counts > 0) | in_prompt.view(len(reqs), V).index_select(0, ints[1]), rep, 1.0)
        sub = torch.where(sub > 0, sub / factor, sub * factor)
    logits.index_copy_(0, ints[0], sub - freq * counts - pres * (counts > 0).float())


def prompt_logprobs(model, hidden: torch.Tensor, seq: Sequence, start: int) -> None:
    """Append to seq.prompt_logprobs the entries of the prompt tokens that rows hidden [n, H] (the rows of
    positions start..start+n-1) predict: row i gives the prompt token at start + i + 1. Positions already
    held (a preempted request computing its prompt again) are skipped."""
    have, end = len(seq.prompt_logprobs), min(start + hidden.shape[0], seq.num_prompt_tokens - 1)
    first = max(have - 1, start)  # the row that predicts prompt token `have`
    if first >= end:
        return
    logp = model.compute_logits(hidden[first - start: end - start], float32=True).log_softmax(-1)
    targets = torch.tensor(seq.token_ids[first + 1: end + 1], device=logp.device)
    k = max(seq.params.prompt_logprobs, 1)
    top = logp.topk(k, dim=-1)
    chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
    vals, ids = top.values.tolist(), top.indices.tolist()
    n = seq.params.prompt_logprobs
    for i, tok in enumerate(seq.token_ids[first + 1: end + 1]):
        seq.prompt_logprobs.append(TokenLogprob(tok, chosen[i], list(zip(ids[i][:n], vals[i][:n]))))
