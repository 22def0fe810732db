"""Hybrid linear-attention targets: Qwen3-Next and Qwen3.5 (dense and MoE, text-only or the text model
of the composite config). Most layers are Gated DeltaNet (GDN) mixers with a recurrent state per
sequence; every `full_attention_interval`-th layer is gated full attention over the paged KV cache.
Read as transformers reads them:

- GDN: in_proj_qkv -> depthwise causal conv1d (kernel `linear_conv_kernel_dim`) -> silu -> q, k, v;
  q and k L2-normed, q scaled by 1/sqrt(d_k); beta = sigmoid(in_proj_b x); decay g = -exp(A_log) *
  softplus(in_proj_a x + dt_bias); per value head, the state S [d_k, d_v] goes
  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
  then a gated RMSNorm (norm(o) * silu(in_proj_z x)) and out_proj. Qwen3-Next checkpoints pack
  q/k/v/z and b/a per key-head group (in_proj_qkvz, in_proj_ba); they are unpacked at load.
- Gated attention: q_proj gives each head its query and an output gate, q and k RMS-normed, partial
  rotary (`partial_rotary_factor` of head_dim), output times sigmoid(gate) before o_proj.
- Norms are zero-centred, (1 + w), computed in float32; the MLP is dense or a mixture of experts with
  a shared expert behind a sigmoid gate.

Recurrent state lives in slots (one per running sequence, engine/block_manager.py), per GDN layer a
conv window [conv_dim, kernel - 1] and the state [heads_v, d_k, d_v] in float32 (RecurrentState).
A step's rows advance their sequence's slot in order; a sequence's first rows (num_computed_tokens
0: new, or recomputed after preemption) start from zeros. Rows that may be rejected (a DFlash verify)
leave the slot untouched: the layer keeps their inputs, and commit() replays the accepted ones, so the
slot holds exactly the state after the last accepted row. On the GPU (models/gdn_triton.py) decode and
verify rows run the recurrent form, and prefill chunks fla-core's chunked form, as transformers does."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashdraft.attention.base import AttentionBackend, AttentionBatch
from flashdraft.models.moe import MoE, is_moe_layer, stack_experts
from flashdraft.models.rope import RotaryTable, apply_rope
from flashdraft.models.transformer import (
    MLP,
    DecoderLM,
    Embedding,
    Linear,
    activation,
    fused_enabled,
    load_packed,
)

HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # packed in this order (GatedDeltaNet.in_proj)


def text_config(cfg):
    """The language model's config: the composite Qwen3.5 config keeps it under text_config."""
    return getattr(cfg, "text_config", None) or cfg


class OffsetRMSNorm(nn.Module):
    """x / RMS(x) * (1 + w), all in float32, cast back to x's dtype at the end (zero-centred weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


@dataclass
class RecurrentRows:
    """A step's recurrent-state bookkeeping, per sequence (AttentionBatch.recurrent)."""
    slots: list[int]  # the sequence's state slot
    fresh: list[bool]  # its rows start from zero state (first prefill chunk, recompute)
    keep: list[bool]  # its rows may be rejected: leave the slot, keep inputs for commit()
    spans: object | None = None  # the CHUNKED sequences (gdn_triton.ChunkedSpans; device_tensors)
    single: bool = False  # no sequence has more than one row (a decode step; device_tensors)
    _dev: tuple | None = None

    def device_tensors(self, query_start_loc: list[int], device: torch.device,
                       chunked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(qsl [S+1], seq [S, 3] = slot, fresh, mode) as int32 device tensors for the GDN kernels
        (models/gdn_triton.py); made once per step, shared by every layer. mode: KEEP for kept rows;
        with `chunked`, CHUNKED for committed chunks of at least CHUNKED_MIN_ROWS rows (self.spans);
        else COMMIT."""
        if self._dev is None:
            from flashdraft.engine.graphs import to_device
            from flashdraft.models.gdn_triton import CHUNKED, CHUNKED_MIN_ROWS, COMMIT, KEEP, ChunkedSpans

            S = len(self.slots)
            host = list(query_start_loc[: S + 1])
            spans = []
            placeholder = all(slot < 0 for slot in self.slots)  # a warm-up step: its chunks store nothing
            for s, (slot, fresh, keep) in enumerate(zip(self.slots, self.fresh, self.keep)):
                r0, r1 = query_start_loc[s], query_start_loc[s + 1]
                mode = KEEP if keep else COMMIT
                if chunked and mode == COMMIT and (slot >= 0 or placeholder) and r1 - r0 >= CHUNKED_MIN_ROWS:
                    mode = CHUNKED
                    spans.append((r0, r1, slot, fresh))
                host += [slot, int(fresh), mode]
            packed = to_device(host, torch.int32, device)
            self._dev = packed[: S + 1], packed[S + 1:].view(S, 3)
            self.spans = ChunkedSpans(spans, device) if spans else None
            self.single = all(query_start_loc[s + 1] - query_start_loc[s] <= 1 for s in range(S))
        return self._dev


def take_rows(rec: RecurrentRows, rows: dict[int, int], width: int) -> list[int]:
    """The rows each sequence of a step commits (its slot's entry of rows for kept ones, else 0),
    padded with zeros to `width` sequences."""
    take = [rows.get(slot, 0) if keep and slot >= 0 else 0 for slot, keep in zip(rec.slots, rec.keep)]
    return take + [0] * (width - len(take))


@dataclass
class PendingRows:
    """A step's inputs of one GDN layer, kept while some of its sequences' rows may be rejected."""
    rows: RecurrentRows | None  # the step's sequences (a graph's: set by the runner at each replay)
    query_start_loc: list[int] | None
    qkv: torch.Tensor
    b: torch.Tensor
    a: torch.Tensor
    mixed: torch.Tensor | None = None  # the conv outputs (kernel path)
    device_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (qsl, seq) of a graphed step
    # a captured verify's: (the CUDA graph of every GDN layer's commit kernels, its `take` input buffer)
    commit_graph: tuple | None = None


class RecurrentState:
    """One GDN layer's state for every slot, and the inputs of the current step's kept rows."""

    def __init__(self, num_slots: int, conv_dim: int, kernel: int, heads: int, d_k: int, d_v: int,
                 device: torch.device, dtype: torch.dtype):
        self.conv = torch.zeros(num_slots, conv_dim, kernel - 1, device=device, dtype=dtype)
        self.rec = torch.zeros(num_slots, heads, d_k, d_v, device=device, dtype=torch.float32)
        self.pending: PendingRows | None = None
        self.step_rows: RecurrentRows | None = None  # a graphed step's sequences (the runner's, per replay)
        # graphed verifies keep their rows' projections and conv outputs here, one buffer for every graph
        # (a graph's own tensors would stay allocated per graph: gigabytes at 27B shapes); graphs are
        # captured largest first, so the first allocation holds them all
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None

    def kept_rows(self, proj: torch.Tensor, conv_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the kept-rows buffers for a step of proj's rows: (projections, conv outputs)."""
        n = proj.shape[0]
        if self.kept is None or self.kept[0].shape[0] < n or self.kept[0].shape[1] != proj.shape[1]:
            self.kept = (torch.empty_like(proj, memory_format=torch.contiguous_format),
                         torch.empty(n, conv_dim, device=proj.device, dtype=proj.dtype))
        return self.kept[0][:n], self.kept[1][:n]

    def start(self, slot: int, fresh: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window, state) a sequence's rows start from: its slot's, or zeros when fresh."""
        if fresh:
            return torch.zeros_like(self.conv[slot]), torch.zeros_like(self.rec[slot])
        return self.conv[slot], self.rec[slot]

    @staticmethod
    def bytes_per_slot(conv_dim: int, kernel: int, heads: int, d_k: int, d_v: int, dtype: torch.dtype) -> int:
        return conv_dim * (kernel - 1) * torch.finfo(dtype).bits // 8 + heads * d_k * d_v * 4


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads_k, self.heads_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.d_k, self.d_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.heads_k * self.d_k, self.heads_v * self.d_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.act = activation(cfg.hidden_act)
        h = cfg.hidden_size
        # HF's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a as one matrix (one GEMM a step)
        self.splits = [self.conv_dim, self.value_dim, self.heads_v, self.heads_v]
        self.in_proj = Linear(h, sum(self.splits), bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.heads_v))
        self.A_log = nn.Parameter(torch.zeros(self.heads_v))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.d_v))
        self.norm_eps = cfg.rms_norm_eps
        self.out_proj = Linear(self.value_dim, h, bias=False)

    def make_state(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> RecurrentState:
        return RecurrentState(num_slots, self.conv_dim, self.kernel, self.heads_v, self.d_k, self.d_v, device, dtype)

    def state_bytes(self, dtype: torch.dtype) -> int:
        return RecurrentState.bytes_per_slot(self.conv_dim, self.kernel, self.heads_v, self.d_k, self.d_v, dtype)

    def forward(self, x: torch.Tensor, state: RecurrentState, batch: AttentionBatch,
                parts: bool = False) -> torch.Tensor:
        """parts: out_proj's result may be split-K parts (transformer.linear), for an add_rmsnorm."""
        proj = self.in_proj(x)
        qkv, z, b, a = proj.split(self.splits, dim=-1)
        rec = batch.recurrent
        if isinstance(rec, torch.Tensor):
            # a graphed step (DeviceMeta): its sequences as device tensors. A verify graph (rows per
            # sequence > 1) keeps its inputs for commit() whatever the keep flags (a capture cannot
            # look at them), in the state's one kept-rows buffer; the runner names the step's
            # sequences in state.step_rows before each replay
            qsl = batch.query_start_loc
            if batch.max_query_len == 1:
                _, core = self.run_kernels(qkv, b, a, state, qsl, rec, single=True)
                return self.output(x, core, z, parts)
            kept, mixed = state.kept_rows(proj, self.conv_dim)
            kept.copy_(proj)
            qkv, _, b, a = kept.split(self.splits, dim=-1)
            _, core = self.run_kernels(qkv, b, a, state, qsl, rec, mixed)
            state.pending = PendingRows(state.step_rows, None, qkv, b, a, mixed, (qsl, rec))
            return self.output(x, core, z, parts)
        if rec is None:  # a placeholder step (kernel warm-up): from zero state, nothing kept
            n = len(batch.query_start_loc) - 1
            rec = RecurrentRows([-1] * n, [True] * n, [False] * n)
        pending = PendingRows(rec, batch.query_start_loc, qkv, b, a)
        if self.kernels(x):
            from flashdraft.models.gdn_triton import chunked_available

            pending.device_rows = rec.device_tensors(batch.query_start_loc, x.device, chunked_available(x.device))
            pending.mixed, core = self.run_kernels(qkv, b, a, state, *pending.device_rows, spans=rec.spans,
                                                   single=rec.single)
        else:
            core = torch.zeros(x.shape[0], self.heads_v, self.d_v, device=x.device, dtype=x.dtype)
            for s, slot in enumerate(rec.slots):
                r0, r1 = batch.query_start_loc[s], batch.query_start_loc[s + 1]
                if r1 == r0:
                    continue
                keep = rec.keep[s] and slot >= 0
                out, conv1, s1 = self.scan(qkv[r0:r1], b[r0:r1], a[r0:r1], *state.start(slot, rec.fresh[s]),
                                           chunked=not keep and r1 - r0 > 1)
                core[r0:r1] = out
                if slot >= 0 and not keep:
                    state.conv[slot] = conv1
                    state.rec[slot] = s1
        state.pending = pending if any(rec.keep) else None
        return self.output(x, core, z, parts)

    def run_kernels(self, qkv, b, a, state: RecurrentState, qsl: torch.Tensor, seq: torch.Tensor, mixed=None,
                    spans=None, single: bool = False):
        """The step on the GPU (models/gdn_triton.py): (conv outputs, into `mixed` when given;
        recurrence outputs [T, heads_v, d_v]). spans: the CHUNKED sequences, for the chunked kernel.
        single: no sequence has more than one row (decode), so the conv launch moves the windows on."""
        from flashdraft.models import gdn_triton

        mixed = gdn_triton.conv_rows(qkv, self.conv1d.weight, state.conv, qsl, seq, mixed, window_too=single)
        if not single:
            gdn_triton.advance_windows(qkv, state.conv, qsl, seq)
        core = gdn_triton.recur(mixed, a, b, self.A_log, self.dt_bias, state.rec, qsl, seq, self.key_dim,
                                self.heads_k)
        if spans:
            gdn_triton.chunked(mixed, a, b, self.A_log, self.dt_bias, state.rec, spans, self.key_dim, self.heads_k,
                               core)
        return mixed, core.view(-1, self.heads_v, self.d_v)

    def output(self, x: torch.Tensor, core: torch.Tensor, z: torch.Tensor, parts: bool = False) -> torch.Tensor:
        z = z.reshape(-1, self.heads_v, self.d_v)
        if self.kernels(x):
            from flashdraft.models import gdn_triton

            normed = gdn_triton.gated_norm(core, z, self.norm.weight, self.norm_eps)
        else:
            normed = self.gated_norm(core, z)
        return self.out_proj(normed.reshape(x.shape[0], self.value_dim), parts=parts)

    def kernels(self, x: torch.Tensor) -> bool:
        """Whether the step runs the Triton GDN kernels (models/gdn_triton.py): on the fused path,
        for the silu conv activation they implement."""
        return fused_enabled(x) and self.act is F.silu

    def commit(self, state: RecurrentState, rows: dict[int, int], takes: dict | None = None) -> None:
        """Each slot of `rows` holds its state after the first rows[slot] kept rows of the last step
        (the accepted ones). takes: the device copies of the rows taken per sequence, shared by the
        layers of one commit (their steps are the same)."""
        p, state.pending = state.pending, None
        if p is None or (p.rows is None and p.device_rows is None):
            return
        rec, qsl = p.rows, p.query_start_loc
        if p.mixed is not None:
            from flashdraft.engine.graphs import to_device

            seq = p.device_rows[1]
            takes = {} if takes is None else takes
            key = (id(seq), seq.shape[0])
            if key not in takes:
                if rec is not None:
                    take = take_rows(rec, rows, seq.shape[0])
                else:  # a step described by device tensors alone (a tensor-parallel rank's): its [S, 3] rows
                    take = [rows.get(slot, 0) if keep and slot >= 0 else 0 for slot, _, keep in seq.tolist()]
                takes[key] = to_device(take, torch.int32, p.qkv.device)
            self.commit_kernels(state, p, takes[key])
            return
        for s, slot in enumerate(rec.slots):
            if not rec.keep[s] or slot not in rows:
                continue
            r0, r1 = qsl[s], qsl[s] + rows[slot]
            _, conv1, s1 = self.scan(p.qkv[r0:r1], p.b[r0:r1], p.a[r0:r1], *state.start(slot, rec.fresh[s]))
            state.conv[slot] = conv1
            state.rec[slot] = s1

    def commit_kernels(self, state: RecurrentState, p: PendingRows, take: torch.Tensor) -> None:
        """The commit on the GPU: each slot's conv window and state after the first take[s] kept rows
        of its sequence (two launches for the whole batch; graphed verifies replay them as a graph)."""
        from flashdraft.models import gdn_triton

        qsl, seq = p.device_rows
        gdn_triton.advance_windows(p.qkv, state.conv, qsl, seq, take)
        gdn_triton.recur(p.mixed, p.a, p.b, self.A_log, self.dt_bias, state.rec, qsl, seq, self.key_dim,
                         self.heads_k, take=take)

    def scan(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv0: torch.Tensor, s0: torch.Tensor,
             chunked: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence's rows in order from (conv window, state): (outputs [n, heads_v, d_v] in qkv's
        dtype, the conv window and the state after the last row). Row by row (the recurrent form, as
        transformers decodes), or with chunked=True by transformers' chunked form (as it prefills;
        the same in exact arithmetic). Rows that may be rejected always take the recurrent form,
        which the replay of the accepted ones repeats operation for operation."""
        n = qkv.shape[0]
        window = torch.cat([conv0, qkv.T.to(conv0.dtype)], dim=1)  # [conv_dim, kernel - 1 + n]
        conv = F.conv1d(window[None], self.conv1d.weight, groups=self.conv_dim)[0]  # [conv_dim, n]
        mixed = self.act(conv).T.to(qkv.dtype)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(n, self.heads_k, self.d_k), k.reshape(n, self.heads_k, self.d_k)
        v = v.reshape(n, self.heads_v, self.d_v)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # log decay [n, heads_v]
        conv1 = window[:, -(self.kernel - 1):].clone()
        rep = self.heads_v // self.heads_k
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)  # (older transformers want it)
        if chunked:
            from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

            # the torch function itself: transformers swaps in fla-core's kernel where it is installed
            rule = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)
            out, S = rule(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=s0[None],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
            return out[0].to(qkv.dtype), conv1, S[0].float()
        q, k, v = q.float(), k.float(), v.float()
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * self.d_k**-0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        decay = g.exp()
        S = s0.clone()
        out = torch.empty(n, self.heads_v, self.d_v, device=qkv.device, dtype=torch.float32)
        for t in range(n):
            S = S * decay[t, :, None, None]
            mem = (S * k[t, :, :, None]).sum(-2)  # S^T k: [heads_v, d_v]
            delta = (v[t] - mem) * beta[t, :, None]
            S = S + k[t, :, :, None] * delta[:, None, :]
            out[t] = (S * q[t, :, :, None]).sum(-2)
        return out.to(qkv.dtype), conv1, S

    def gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm(o) * w * silu(z), as transformers' gated RMSNorm rounds it."""
        h = o.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        h = self.norm.weight * h.to(o.dtype)
        return (h * F.silu(z.float())).to(o.dtype)


class GatedAttention(nn.Module):
    def __init__(self, cfg, rotary_dim: int):
        super().__init__()
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.rotary_dim = rotary_dim
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(cfg, "attention_bias", False))
        h = cfg.hidden_size
        # HF's q_proj (per head its query, then its gate), k_proj and v_proj packed (load_packed)
        self.kv_size = self.n_kv * self.head_dim
        self.splits = [2 * self.n_heads * self.head_dim, self.kv_size, self.kv_size]
        self.qkv_proj = Linear(h, sum(self.splits), bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, positions, rope: RotaryTable, k_cache, v_cache, attn: AttentionBackend,
                batch: AttentionBatch, parts: bool = False):
        """parts: on the fused path o_proj's result may be split-K parts (transformer.linear)."""
        proj = self.qkv_proj(x)
        qg = proj[:, :self.splits[0]]
        gate = qg.reshape(-1, self.n_heads, 2 * self.head_dim)[..., self.head_dim:]
        if fused_enabled(x):  # one kernel for the (1 + w) q/k norms, the partial RoPE and the K/V store
            from flashdraft.models import fused

            q = fused.qk_norm_rope_store(proj, positions, rope.cos, rope.sin, self.q_norm.weight, self.k_norm.weight,
                                         self.q_norm.eps, k_cache, v_cache, batch.slot_mapping, gated=True,
                                         offset=True)
            o = attn.forward(q, k_cache, v_cache, batch, self.scale)
            o = fused.sigmoid_gate(o, gate)
            return self.o_proj(o.reshape(-1, self.n_heads * self.head_dim), parts=parts)
        _, k, v = proj.split(self.splits, dim=-1)
        q = qg.reshape(-1, self.n_heads, 2 * self.head_dim)[..., :self.head_dim]
        k = k.reshape(-1, self.n_kv, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        v = v.reshape(-1, self.n_kv, self.head_dim)
        cos, sin = rope.lookup(positions)
        r = self.rotary_dim
        q = torch.cat([apply_rope(q[..., :r], cos, sin), q[..., r:]], -1)
        k = torch.cat([apply_rope(k[..., :r], cos, sin), k[..., r:]], -1)
        attn.store_kv(k_cache, v_cache, k, v, batch)
        o = attn.forward(q.contiguous(), k_cache, v_cache, batch, self.scale)
        o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(-1, self.n_heads * self.head_dim))


class SharedExpertMoE(MoE):
    """Routed experts plus a shared expert scaled by sigmoid(shared_expert_gate x)."""

    def __init__(self, cfg, act):
        super().__init__(cfg, act)
        if cfg.model_type == "qwen3_5_moe_text":  # Qwen3.5-MoE always renormalises its top-k
            self.norm_topk_prob = True
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return MoE._summed(self, super().forward(x) + shared)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert.forward_fused(x)
        return MoE._summed(self, super().forward_fused(x) + torch.sigmoid(self.shared_expert_gate(x)) * shared)

    def _summed(self, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' output as it is: under tensor parallelism each rank's part, summed over the
        ranks with the shared expert's part (forward), one all-reduce a layer."""
        return out


class HybridLayer(nn.Module):
    def __init__(self, cfg, i: int, rotary_dim: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg, rotary_dim)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if is_moe_layer(cfg, i):
            self.mlp = SharedExpertMoE(cfg, activation(cfg.hidden_act))
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, h, positions, rope, cache, attn, batch):
        x = self.input_layernorm(h)
        h = h + self.mixer(x, positions, rope, cache, attn, batch)
        x = self.post_attention_layernorm(h)
        return h + self.mlp(x)

    def forward_fused(self, y, h, positions, rope, cache, attn, batch):
        """The fused path: y the last layer's output, h its residual stream (None at the first layer);
        each residual add and (1 + w) norm in one kernel. Returns this layer's (output, residual)."""
        from flashdraft.models import fused

        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        x, h = fused.add_rmsnorm(y, h, n1.weight, n1.eps, offset=True)
        x, h = fused.add_rmsnorm(self.mixer(x, positions, rope, cache, attn, batch, parts=True), h, n2.weight,
                                 n2.eps, offset=True)
        if isinstance(self.mlp, MLP):
            return self.mlp.forward_fused(x, parts=True), h
        return self.mlp.forward_fused(x), h

    def mixer(self, x, positions, rope, cache, attn, batch, parts: bool = False):
        """parts: the output projection's result may be split-K parts, for an add_rmsnorm."""
        if self.kind == "linear_attention":
            return self.linear_attn(x, cache, batch, parts=parts)
        return self.self_attn(x, positions, rope, cache[0], cache[1], attn, batch, parts=parts)


def _joined(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """A GDN layer's in_proj: its four parts in IN_PROJ's order."""
    return torch.cat([parts[n] for n in IN_PROJ], 0)


class HybridLM(nn.Module):
    """The DecoderLM interface (models/transformer.py) for hybrid targets. kv_layers: the layers with
    K/V pages; the others are given their RecurrentState in place of (k, v) by the runner."""

    has_sinks = False

    def __init__(self, cfg):
        super().__init__()
        self.full_config = cfg
        cfg = text_config(cfg)
        self.config = cfg
        bad = sorted({t for t in cfg.layer_types if t not in ("linear_attention", "full_attention")})
        if bad:
            raise ValueError(f"layer_types {bad} are not supported (linear_attention, full_attention)")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        params = getattr(cfg, "rope_parameters", None) or {}
        factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        self.rotary_dim = int(head_dim * factor)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i, self.rotary_dim) for i in range(cfg.num_hidden_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False) or
                         getattr(self.full_config, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RotaryTable | None = None
        self.kv_layers = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
        self.layer_masks = [(True, None)] * cfg.num_hidden_layers
        self.head_dim = head_dim
        self.tp = None  # tensor parallelism: this rank's TPGroup (models/parallel.py)
        self.tp_takes: dict = {}

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tied else self.lm_head.weight

    def recurrent_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.kind == "linear_attention"]

    def state_bytes_per_seq(self, dtype: torch.dtype) -> int:
        return sum(self.layers[i].linear_attn.state_bytes(dtype) for i in self.recurrent_layers())

    def kept_bytes_per_row(self, dtype: torch.dtype) -> int:
        """Bytes a graphed verify row keeps for the commit (RecurrentState.kept_rows), all GDN layers."""
        size = torch.finfo(dtype).bits // 8
        return sum(size * (sum(g.splits) + g.conv_dim) for g in (self.layers[i].linear_attn
                                                                  for i in self.recurrent_layers()))

    def make_states(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> dict[int, RecurrentState]:
        return {i: self.layers[i].linear_attn.make_state(num_slots, device, dtype) for i in self.recurrent_layers()}

    def kernels_on(self, x: torch.Tensor) -> bool:
        """Whether steps over activations like x run the GDN kernels (what CUDA graphs need)."""
        return all(self.layers[i].linear_attn.kernels(x) for i in self.recurrent_layers())

    def commit_states(self, states: dict[int, RecurrentState], rows: dict[int, int]) -> None:
        """rows: slot -> the accepted rows of its sequence's last (kept) step."""
        takes: dict = {}
        for i, state in states.items():
            self.layers[i].linear_attn.commit(state, rows, takes)

    def commit_pending(self, states: dict[int, RecurrentState], pending: dict, take: torch.Tensor) -> None:
        """Every GDN layer's commit kernels over a graphed verify's kept rows (`pending`: layer -> its
        PendingRows), each sequence taking take[s] rows: what ModelRunner captures as a commit graph."""
        for i, p in pending.items():
            self.layers[i].linear_attn.commit_kernels(states[i], p, take)

    def setup_rope(self, max_len: int) -> None:
        p = self.embed_tokens.weight
        self.rope = RotaryTable(self.config, self.rotary_dim, max_len, p.device, p.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, attn: AttentionBackend,
                batch: AttentionBatch, tap_layers=()):
        h = self.embed_tokens(input_ids)
        taps: dict[int, torch.Tensor] = {}
        if fused_enabled(h):  # each layer's residual add folded into the next layer's first norm
            from flashdraft.models import fused

            y, res = h, None
            for i, layer in enumerate(self.layers):
                y, res = layer.forward_fused(y, res, positions, self.rope, kv_cache[i], attn, batch)
                if i in tap_layers:
                    taps[i] = fused.join_parts(y, res) + res
            out = fused.add_rmsnorm(y, res, self.norm.weight, self.norm.eps, offset=True)[0]
        else:
            for i, layer in enumerate(self.layers):
                h = layer(h, positions, self.rope, kv_cache[i], attn, batch)
                if i in tap_layers:
                    taps[i] = h
            out = self.norm(h)
        if len(self.layers) - 1 in taps:  # HF's last hidden_states entry: the final-normed state
            taps[len(self.layers) - 1] = out
        return out, (torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else None)

    compute_logits = DecoderLM.compute_logits

    def load_hf_state_dict(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names: model.* (Qwen3-Next, Qwen3.5 text) or model.language_model.* (the composite
        Qwen3.5); the vision tower and the multi-token-prediction head are not used here and skipped.
        weights: a dict, or (name, tensor) pairs read one at a time (loader.stream_weights): a GDN layer's
        in_proj parts are joined, and a layer's experts stacked, as soon as they are all in."""
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        load_packed(self, stack_experts(self._renamed(pairs), getattr(self.config, "num_experts", None)))

    def _renamed(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under this module's names, a GDN layer's four in_proj parts (Qwen3-Next's
        two packed ones unpacked) joined into its in_proj once all are in."""
        skip = {"lm_head.weight"} if self.tied else set()
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, w in pairs:
            if name.startswith(("model.visual.", "mtp.", "model.mtp.")) or name in skip:
                continue
            name = name.removeprefix("model.language_model.").removeprefix("model.")
            p = name.split(".")
            if len(p) >= 4 and p[2] == "linear_attn" and p[3] in ("in_proj_qkvz", "in_proj_ba", *IN_PROJ):
                key = ".".join(p[:3]) + ".in_proj." + p[-1]
                got = self._unpack_next(".".join(p[:3]), p[3], w) if p[3] in ("in_proj_qkvz", "in_proj_ba") \
                    else {p[3]: w}
                parts.setdefault(key, {}).update(got)
                if set(parts[key]) == set(IN_PROJ):
                    got = w = None  # (held here, the parts would outlive their join until the next tensor)
                    yield key, _joined(parts.pop(key))
                continue
            yield name, w
        for key, have in parts.items():
            raise ValueError(f"checkpoint has only {sorted(have)} of {key.replace('in_proj', '/'.join(IN_PROJ))}")

    def _unpack_next(self, prefix: str, kind: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Qwen3-Next packs per key-head group [q, k, v, z] (in_proj_qkvz) and [b, a] (in_proj_ba)."""
        gdn = self.layers[int(prefix.split(".")[1])].linear_attn
        # the whole layer's heads (a tensor-parallel share's are fewer: models/parallel.py)
        hk, hv = getattr(gdn, "whole_heads", (gdn.heads_k, gdn.heads_v))
        dk, dv, rep = gdn.d_k, gdn.d_v, hv // hk
        if kind == "in_proj_ba":
            b, a = w.view(hk, 2 * rep, -1).split([rep, rep], dim=1)
            return {"in_proj_b": b.reshape(hv, -1), "in_proj_a": a.reshape(hv, -1)}
        q, k, v, z = w.view(hk, 2 * dk + 2 * rep * dv, -1).split([dk, dk, rep * dv, rep * dv], dim=1)
        qkv = torch.cat([q.reshape(hk * dk, -1), k.reshape(hk * dk, -1), v.reshape(hv * dv, -1)])
        return {"in_proj_qkv": qkv, "in_proj_z": z.reshape(hv * dv, -1)}
