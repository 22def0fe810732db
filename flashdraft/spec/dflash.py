"""The DFlash step, for a continuously batched set of requests. Read top to bottom:

1. schedule: a decoding request with speculation on asks for B slots (its last committed token,
   still without K/V, plus B-1 drafts); prefill chunks and plain requests ask as usual.
2. propose: one non-causal drafter forward over `[x_start, MASK x (B-1)]` per drafting request,
   attending to the context K/V of every committed position; argmax of slots 1..B-1.
3. verify: one causal target forward over everything scheduled, returning the tapped layers.
4. accept: the target's token at every verify slot (same sampler as plain decoding, same
   (seed, position) noise), a = leading matches, commit t_0..t_a one by one (stops end the
   request exactly where plain decoding would).
5. context: K/V of the positions committed this step go into the draft cache, from their taps;
   target pages past the committed length are freed. Nothing of a rejected draft stays visible:
   the target's rejected slots lie beyond `num_computed_tokens` and the draft block's scratch
   slots lie beyond the context, and both are overwritten before they are next read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flashdraft.attention.base import AttentionBatch
from flashdraft.engine.model_runner import make_backend
from flashdraft.engine.sampler import greedy_tokens, sample
from flashdraft.engine.sequence import Sequence
from flashdraft.models.dflash_draft import DFlashDraftModel
from flashdraft.models.loader import load_weights
from flashdraft.spec.formats import read_draft_spec
from flashdraft.spec.metrics import SpecStats
from flashdraft.spec.verify import accepted_lengths

if TYPE_CHECKING:
    from flashdraft.engine.engine import LLMEngine


def load_drafter(folder: str | Path, target_config, device: torch.device, dtype: torch.dtype) -> DFlashDraftModel:
    """Load and validate a drafter against its target; errors name the mismatch."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"drafter path {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ValueError(f"drafter path {str(folder)!r} must be a folder with config.json and safetensors")
    n_target = target_config.num_hidden_layers
    spec = read_draft_spec(folder, n_target)
    h_draft, h_target = spec.layer_config.hidden_size, target_config.hidden_size
    if h_draft != h_target:
        raise ValueError(f"drafter hidden_size {h_draft} does not match the target's {h_target}")
    bad = [i for i in spec.target_layer_ids if not 0 <= i < n_target]
    if bad:
        raise ValueError(f"drafter tap layer id(s) {bad} outside the target's {n_target} layers")
    if not 0 <= spec.mask_token_id < target_config.vocab_size:
        raise ValueError(f"drafter mask_token_id {spec.mask_token_id} is outside the target vocabulary "
                         f"[0, {target_config.vocab_size})")
    spec.layer_config.vocab_size = target_config.vocab_size
    weights = load_weights(folder)
    has_embed = "embed_tokens.weight" in weights
    has_head = "lm_head.weight" in weights
    if spec.draft_vocab_size and not has_head:
        raise ValueError(f"drafter declares draft_vocab_size {spec.draft_vocab_size} but ships no lm_head")
    if has_embed and weights["embed_tokens.weight"].shape[0] != target_config.vocab_size:
        raise ValueError("drafter embed_tokens rows do not match the target vocabulary")
    with torch.device("meta"):
        model = DFlashDraftModel(spec, has_embed, has_head)
    model = model.to_empty(device=device).to(dtype)
    if model.d2t is not None:
        model.d2t = torch.zeros_like(model.d2t, dtype=torch.long)
    model.load(weights)
    return model.eval().requires_grad_(False)


def load_speculator(draft: str | Path, engine: LLMEngine) -> DFlashSpeculator:
    model = load_drafter(draft, engine.model_config, engine.device, engine.dtype)
    return DFlashSpeculator(model, engine)


@dataclass
class _Plan:
    seq: Sequence
    n: int  # tokens computed by the target this step
    row: int  # first row of this request in the flattened batch
    drafts: list[int] | None  # set when this request verifies a block
    accepted: int = 0  # leading drafts the target agreed with


class DFlashSpeculator:
    def __init__(self, drafter: DFlashDraftModel, engine: LLMEngine):
        self.drafter = drafter
        self.engine = engine
        self.block_size = drafter.spec.block_size
        k = engine.config.num_speculative_tokens
        if k is not None and not 1 <= k <= self.block_size - 1:
            raise ValueError(f"num_speculative_tokens must be in [1, {self.block_size - 1}], got {k}")
        self.num_draft = k or self.block_size - 1
        self.mask_token_id = drafter.spec.mask_token_id
        self.tap_layers = tuple(drafter.spec.target_layer_ids)
        drafter.setup(engine.max_model_len + 2 * self.block_size)
        runner = engine.runner
        c = drafter.config
        shape = (c.num_hidden_layers, runner.k_cache.shape[1], runner.block_size, c.num_key_value_heads,
                 drafter.head_dim)
        self.k_cache = torch.zeros(shape, device=engine.device, dtype=engine.dtype)
        self.v_cache = torch.zeros(shape, device=engine.device, dtype=engine.dtype)
        self.kv = [(self.k_cache[i], self.v_cache[i]) for i in range(c.num_hidden_layers)]
        self.attn = make_backend(engine.runner.backend_name)
        self.stats = SpecStats(self.num_draft)
        self.poison_rejected = False  # tests: fill every slot a rejected draft touched with NaN
        embed = drafter.embed_tokens or runner.model.embed_tokens
        self._draft_step = lambda g: self.drafter(embed(g.input_ids), g.positions, self.kv, self.attn, g.meta)
        n = engine.config.max_num_seqs
        runner.capture_graphs(("target", self.tap_layers), self.num_draft + 1, True, runner.attn,
                              runner.target_step(self.tap_layers), n)
        runner.capture_graphs(("draft",), self.block_size, False, self.attn, self._draft_step, n)
        self.pause_at = engine.config.speculative_disable_batch_size
        self.paused = False  # this step decodes without drafts (too many requests running)
        if self.pause_at is not None:  # paused steps: one row per request, taps still read
            runner.capture_graphs(("target", self.tap_layers), 1, True, runner.attn,
                                  runner.target_step(self.tap_layers), n)

    # ---- public hooks used by the engine ----------------------------------------------------
    def totals(self) -> dict:
        return self.stats.as_dict()

    def request_metrics(self, seq: Sequence) -> dict:
        st = getattr(seq, "spec_stats", None)
        return st.as_dict() if st is not None else {}

    def release(self, seq: Sequence) -> None:
        """Nothing to free: draft K/V lives in the target's pages, freed with them."""

    def lookahead(self, seq: Sequence) -> int:
        if self.paused or not seq.params.speculative or \
                seq.num_tokens - 1 + self.block_size > self.engine.max_model_len:
            return 0
        return self.num_draft

    # ---- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        eng = self.engine
        self.paused = self.pause_at is not None and len(eng.scheduler.running) >= self.pause_at
        self.stats.paused_steps += self.paused
        batch = eng.scheduler.schedule(self.lookahead)
        eng.stats["num_preemptions"] += len(batch.preempted)
        if not batch.seqs:
            return []
        plans, row = [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            decoding = seq.num_tokens - seq.num_computed_tokens == 1
            plans.append(_Plan(seq, n, row, [] if decoding and n > 1 else None))
            row += n
        bm = eng.block_manager
        for p in plans:  # the draft block spans B positions even when fewer are verified
            if p.drafts is not None:
                need = p.seq.num_computed_tokens + self.block_size
                if bm.can_fit(p.seq.seq_id, need):
                    bm.allocate(p.seq.seq_id, need)
                else:  # no page for the block: plain decoding for this request this step
                    p.drafts, p.n = None, 1
        row = 0
        for p in plans:
            p.row = row
            row += p.n
        drafting = [p for p in plans if p.drafts is not None]
        # drafts stay on the device: they are patched into the verify input there, and read back
        # together with the target's tokens in the step's one device->host transfer
        ids, tokens, draft_t = self._verify_input(plans, drafting)
        hidden, taps, _ = eng.runner.forward(batch.seqs, tokens, eng.block_manager, self.tap_layers, input_ids=ids)
        chosen = self._target_tokens(plans, hidden, draft_t, drafting)
        for i, p in enumerate(plans):
            if p.drafts is not None:
                p.accepted = int(accepted_lengths(torch.tensor([p.drafts]), torch.tensor([chosen[i]]))[0])
        self._write_context(plans, taps)
        return self._commit(plans, chosen)

    def _verify_input(self, plans: list[_Plan], drafting: list[_Plan]):
        """Token ids of the verify forward on the device, drafts included without a host round
        trip; the host lists carry the lengths (drafts as placeholders)."""
        dev = self.engine.device
        draft_t = None
        if drafting:
            d = self.propose([p.seq for p in drafting])
            draft_t = d if isinstance(d, torch.Tensor) else torch.tensor(d, dtype=torch.long, device=dev)
        tokens, dst, src = [], [], []
        k = 0
        for p in plans:
            if p.drafts is None:
                tokens.append(p.seq.token_ids[p.seq.num_computed_tokens:][:p.n])
                continue
            tokens.append([p.seq.token_ids[-1]] + [0] * (p.n - 1))
            dst.extend(range(p.row + 1, p.row + p.n))
            src.extend(range(k * draft_t.shape[1], k * draft_t.shape[1] + p.n - 1))
            k += 1
        ids = torch.tensor([t for toks in tokens for t in toks], dtype=torch.long, device=dev)
        if dst:
            idx = torch.tensor([dst, src], dtype=torch.long, device=dev)
            ids[idx[0]] = draft_t.flatten()[idx[1]]
        return ids, tokens, draft_t

    def propose(self, seqs: list[Sequence]) -> list[list[int]]:
        """Draft B-1 tokens per request in one non-causal drafter forward."""
        eng, B = self.engine, self.block_size
        blocks = [[s.token_ids[-1]] + [self.mask_token_id] * (B - 1) for s in seqs]
        embed = self.drafter.embed_tokens or eng.runner.model.embed_tokens
        out = None if self.poison_rejected else eng.runner.graphed(
            ("draft",), seqs, blocks, eng.block_manager, False, self.attn, self._draft_step)
        if out is not None:
            hidden = out[0]
        else:
            ids, pos, batch = eng.runner.build_batch(seqs, blocks, eng.block_manager, causal=False)
            self.attn.prepare(batch, eng.device)
            hidden = self.drafter(embed(ids), pos, self.kv, self.attn, batch)
        hidden = hidden.view(len(seqs), B, -1)[:, 1:]
        if self.drafter.lm_head is not None:
            draft = greedy_tokens(self.drafter.lm_head(hidden))
            if self.drafter.d2t is not None:
                draft = draft + self.drafter.d2t[draft]
        else:
            draft = greedy_tokens(eng.runner.model.compute_logits(hidden, float32=False))  # no float32 copy
        if self.poison_rejected:  # the block's scratch K/V must never be read again
            self._poison(self.k_cache, self.v_cache, batch.slot_mapping)
        return draft  # [S, B-1] on the device

    def _target_tokens(self, plans: list[_Plan], hidden: torch.Tensor, draft_t: torch.Tensor | None,
                       drafting: list[_Plan]) -> dict[int, list[int]]:
        """Target-chosen tokens: every verify slot of drafting requests, the last row of others.
        The step's only device->host transfer reads them together with the drafts."""
        rows, seqs, positions, owner = [], [], [], []
        for i, p in enumerate(plans):
            s, start = p.seq, p.seq.num_computed_tokens
            if p.drafts is not None:
                width = p.n
            elif start + p.n == s.num_tokens:
                width = 1
            else:
                continue  # a prefill chunk that does not reach the end samples nothing
            first = p.row + p.n - width
            rows.extend(range(first, first + width))
            positions.extend(range(start + p.n - width + 1, start + p.n + 1))
            seqs.extend([s] * width)
            owner.extend([i] * width)
        out: dict[int, list[int]] = {}
        if not rows:
            return out
        eng = self.engine
        sb = eng.runner.sampling_batch(seqs, positions)
        rows_t = torch.tensor(rows, device=eng.device)
        logits = eng.runner.model.compute_logits(hidden[rows_t], float32=not sb.all_greedy)
        toks = sample(logits, sb)
        host = torch.cat([toks, draft_t.flatten()]).tolist() if draft_t is not None else toks.tolist()
        for i, t in zip(owner, host):
            out.setdefault(i, []).append(t)
        if draft_t is not None:
            width, flat = draft_t.shape[1], host[len(rows):]
            for k, p in enumerate(drafting):
                p.drafts = flat[k * width: k * width + p.n - 1]
        return out

    def _write_context(self, plans: list[_Plan], taps: torch.Tensor) -> None:
        rows, seqs, ntoks = [], [], []
        for p in plans:
            if not p.seq.params.speculative:
                continue
            # a verify commits x_start and the accepted drafts; anything else commits all its rows
            n = p.accepted + 1 if p.drafts is not None else p.n
            rows.extend(range(p.row, p.row + n))
            seqs.append(p.seq)
            ntoks.append(n)
        if not rows:
            return
        eng = self.engine
        bs = eng.block_manager.block_size
        slots, pos = [], []
        for s, n in zip(seqs, ntoks):
            table = eng.block_manager.table(s.seq_id)
            for q in range(s.num_computed_tokens, s.num_computed_tokens + n):
                pos.append(q)
                slots.append(table[q // bs] * bs + q % bs)
        dev = eng.device
        batch = AttentionBatch(torch.tensor(slots, dtype=torch.long, device=dev), [], [], [], bs)
        sel = torch.tensor(rows, device=dev)
        self.drafter.write_context(taps[sel], torch.tensor(pos, device=dev), self.kv, self.attn, batch)

    def _commit(self, plans: list[_Plan], chosen: dict[int, list[int]]) -> list[Sequence]:
        eng = self.engine
        advanced = []
        for i, p in enumerate(plans):
            s = p.seq
            if p.drafts is None:
                s.num_computed_tokens += p.n
                if i in chosen:
                    eng.append_tokens(s, chosen[i])
                    advanced.append(s)
                continue
            target, a = chosen[i], p.accepted
            if not hasattr(s, "spec_stats"):
                s.spec_stats = SpecStats(self.num_draft)
            for st in (s.spec_stats, self.stats):
                st.record(a, len(p.drafts))
            start = s.num_computed_tokens
            s.num_computed_tokens = start + a + 1
            eng.append_tokens(s, target[: a + 1])
            advanced.append(s)
            if not s.is_finished:
                if self.poison_rejected:
                    self._poison_tail(s, start + p.n)
                eng.block_manager.truncate(s.seq_id, s.num_computed_tokens)
        eng.stats["num_steps"] += 1
        return advanced

    # ---- test support: make any read of rejected state visible ----------------------------
    def _poison_tail(self, seq: Sequence, end: int) -> None:
        bm, bs = self.engine.block_manager, self.engine.block_manager.block_size
        table = bm.table(seq.seq_id)
        slots = [table[q // bs] * bs + q % bs for q in range(seq.num_computed_tokens, end)]
        idx = torch.tensor(slots, dtype=torch.long, device=self.engine.device)
        r = self.engine.runner
        self._poison(r.k_cache, r.v_cache, idx)
        self._poison(self.k_cache, self.v_cache, idx)

    @staticmethod
    def _poison(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        for cache in (k_cache, v_cache):
            flat = cache.view(cache.shape[0], -1, *cache.shape[3:])
            flat[:, slots] = float("nan")
