"""The Gated DeltaNet (GDN) mixer of hybrid targets (models/hybrid.py) and its recurrent state, read as
transformers reads it: in_proj_qkv -> depthwise causal conv1d (kernel `linear_conv_kernel_dim`) -> silu ->
q, k, v; q and k L2-normed, q scaled by 1/sqrt(d_k); beta = sigmoid(in_proj_b x); decay g = -exp(A_log) *
softplus(in_proj_a x + dt_bias); per value head, the state S [d_k, d_v] goes
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
then a gated RMSNorm (norm(o) * silu(in_proj_z x)) and out_proj.

Recurrent state lives in slots (one per running sequence, engine/block_manager.py), per GDN layer a
conv window [conv_dim, kernel - 1] and the state [heads_v, d_k, d_v] in float32 (RecurrentState).
A step's rows advance their sequence's slot in order; a sequence's first rows (num_computed_tokens
0: new, or recomputed after preemption) start from zeros. Rows that may be rejected (a DFlash verify)
leave the slot untouched: the layer keeps their inputs, and commit() replays the accepted ones, so the
slot holds exactly the state after the last accepted row. On the GPU (kernels/gdn_ops.py) decode and
verify rows run the recurrent form, and prefill chunks fla-core's chunked form, as transformers does."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashdraft.attention.base import AttentionBatch
from flashdraft.engine.graphs import to_device
from flashdraft.kernels.dispatch import fused_enabled
from flashdraft.models.layers import Linear, activation


@dataclass
class RecurrentRows:
    """A step's recurrent-state bookkeeping, per sequence (AttentionBatch.recurrent)."""
    slots: list[int]  # the sequence's state slot
    fresh: list[bool]  # its rows start from zero state (first prefill chunk, recompute)
    keep: list[bool]  # its rows may be rejected: leave the slot, keep inputs for commit()
    spans: object | None = None  # the CHUNKED sequences (ChunkedSpans; device_tensors)
    single: bool = False  # no sequence has more than one row (a decode step; device_tensors)
    _dev: tuple | None = None

    def device_tensors(self, query_start_loc: list[int], device: torch.device,
                       chunked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(qsl [S+1], seq [S, 3] = slot, fresh, mode) as int32 device tensors for the GDN kernels
        (kernels/gdn_ops.py); made once per step, shared by every layer. mode: KEEP for kept rows;
        with `chunked`, CHUNKED for committed chunks of at least CHUNKED_MIN_ROWS rows (self.spans);
        else COMMIT."""
        if self._dev is None:
            from flashdraft.kernels.gdn_ops import CHUNKED, CHUNKED_MIN_ROWS, COMMIT, KEEP

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


class ChunkedSpans:
    """The CHUNKED sequences of a step as the chunked kernel reads them, made once per step and shared
    by every layer: (first row, end row, slot, fresh) each."""

    def __init__(self, spans: list[tuple[int, int, int, bool]], device: torch.device):
        cu = [0]
        for r0, r1, _, _ in spans:
            cu.append(cu[-1] + r1 - r0)
        self.n = cu[-1]
        # back to back (a prefill step): one slice of the step's rows; else their row indices
        if all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)):
            self.rows, self.first = None, spans[0][0]
            rows = []
        else:
            self.first = None
            rows = [r for r0, r1, _, _ in spans for r in range(r0, r1)]
        S = len(spans)
        self.placeholder = spans[0][2] < 0  # (all of them) from zeros, nothing stored
        packed = to_device([slot for _, _, slot, _ in spans] + [int(f) for *_, f in spans] + cu + rows, torch.long,
                           device)
        self.slots, self.fresh, self.cu = packed[:S], packed[S:2 * S].bool(), packed[2 * S:3 * S + 1]
        if self.first is None:
            self.rows = packed[3 * S + 1:]
        self.cu_cpu = torch.tensor(cu)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The chunks' rows of x [T, ...]."""
        return x[self.first:self.first + self.n] if self.first is not None else x.index_select(0, self.rows)

    def put(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        if self.first is not None:
            out[self.first:self.first + self.n] = rows
        else:
            out.index_copy_(0, self.rows, rows)


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
            from flashdraft.kernels.gdn_ops import chunked_available

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
        """The step on the GPU (kernels/gdn_ops.py): (conv outputs, into `mixed` when given;
        recurrence outputs [T, heads_v, d_v]). spans: the CHUNKED sequences, for the chunked kernel.
        single: no sequence has more than one row (decode), so the conv launch moves the windows on."""
        from flashdraft.kernels import gdn_ops

        mixed = gdn_ops.conv_rows(qkv, self.conv1d.weight, state.conv, qsl, seq, mixed, window_too=single)
        if not single:
            gdn_ops.advance_windows(qkv, state.conv, qsl, seq)
        core = gdn_ops.recur(mixed, a, b, self.A_log, self.dt_bias, state.rec, qsl, seq, self.key_dim,
                                self.heads_k)
        if spans:
            gdn_ops.chunked(mixed, a, b, self.A_log, self.dt_bias, state.rec, spans, self.key_dim, self.heads_k,
                               core)
        return mixed, core.view(-1, self.heads_v, self.d_v)

    def output(self, x: torch.Tensor, core: torch.Tensor, z: torch.Tensor, parts: bool = False) -> torch.Tensor:
        z = z.reshape(-1, self.heads_v, self.d_v)
        if self.kernels(x):
            from flashdraft.kernels import gdn_ops

            normed = gdn_ops.gated_norm(core, z, self.norm.weight, self.norm_eps)
        else:
            normed = self.gated_norm(core, z)
        return self.out_proj(normed.reshape(x.shape[0], self.value_dim), parts=parts)

    def kernels(self, x: torch.Tensor) -> bool:
        """Whether the step runs the Triton GDN kernels (kernels/gdn_ops.py): on the fused path,
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
        from flashdraft.kernels import gdn_ops

        qsl, seq = p.device_rows
        gdn_ops.advance_windows(p.qkv, state.conv, qsl, seq, take)
        gdn_ops.recur(p.mixed, p.a, p.b, self.A_log, self.dt_bias, state.rec, qsl, seq, self.key_dim,
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
