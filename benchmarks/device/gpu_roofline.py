"""Every measurement of a GPU run in one script: the machine's copy bandwidth and bf16 matmul rate, a
Qwen3-8B-shaped target (random bf16 weights) decoding at batch 1/8/32 with 1k context inside a CUDA
graph, one DFlash step (5-layer z-lab-shaped drafter, block 16: draft, verify, context write) per
part and whole, and the attention kernels alone against SDPA, flex_attention and the bandwidth
floor. Every time is set against a roofline built from the measured bandwidth and matmul rate.

Run on a GPU (H100 80 GB: expected 3-4 minutes and a peak of about 30 GB; first a check of every
code path with --tiny, about a minute, most of it compiling flex_attention; --no-flex skips that):

    python benchmarks/device/gpu_roofline.py --tiny --out roofline-tiny
    python benchmarks/device/gpu_roofline.py --out roofline-h100

Smoke test anywhere (small shapes, CPU allowed, no graphs off CUDA, Triton only if importable):

    python benchmarks/device/gpu_roofline.py --tiny --device cpu --out /tmp/roofline-tiny
    TRITON_INTERPRET=1 python benchmarks/device/gpu_roofline.py --tiny --device cpu --out /tmp/rt

(the second also runs the triton rows, in the Triton interpreter: about 10 minutes on 2 cores).

Writes DIR/roofline.json (all numbers, errors included) and DIR/roofline.md (summary tables), and prints
the tables and the JSON as one line.
Backends: `triton` (flashdraft.kernels.attention, CUDA only, when importable, or on CPU under
TRITON_INTERPRET=1), `triton+fused` (the same with the fused Triton norm / RoPE + KV store / silu
kernels of flashdraft.kernels.layer_ops and the few-row Triton GEMMs of flashdraft.kernels.skinny_gemm: the
engine's default on CUDA, with programmatic dependent launch on Hopper), `triton+fused+pdloff`
(the same without it, kernels/launch.py), `triton+fused+cublas` (the same with cuBLAS
for every GEMM; every other row runs the torch elementwise ops and cuBLAS), `torch_static`
(StaticTorchAttention; the plain-PyTorch + CUDA-graph baseline) and, for decode only, `torch_eager`
(TorchAttention without graphs: the engine's current GPU path). Each failing measurement is
recorded in the JSON and the run goes on. Optional parts (flex_attention, torch_eager) are skipped
once --budget-s seconds have passed."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import T0, Clock, copy_bandwidth, graph_ms, log, run_info, short_error  # noqa: E402

from flashdraft.attention.base import AttentionBatch, DeviceMeta, LayerMasks  # noqa: E402
from flashdraft.attention.torch_ref import StaticTorchAttention, TorchAttention  # noqa: E402
from flashdraft.engine.graphs import StepGraph  # noqa: E402
from flashdraft.engine.memory import kv_bytes_per_token  # noqa: E402
from flashdraft.engine.sampler import greedy_tokens  # noqa: E402
from flashdraft.kernels.dispatch import fused_mode, gemm_mode  # noqa: E402
from flashdraft.kernels.launch import pdl_mode  # noqa: E402
from flashdraft.models.dflash_draft import DFlashDraftModel  # noqa: E402
from flashdraft.models.rope import rope_parameters  # noqa: E402
from flashdraft.models.transformer import DecoderLM  # noqa: E402
from flashdraft.speculative.formats import DraftSpec, default_target_layer_ids  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=1000)
# Qwen3-30B-A3B: 48 layers of 128 experts (8 routed per token, renormalised), expert MLPs of 768
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
TINY_MOE = dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[])
# GPT-OSS-20B: 24 layers alternating 128-token sliding windows and full attention, attention sinks, biases,
# 32 experts (4 routed) of 2880 with the clamped SwiGLU, yarn rope; experts in bf16 (checkpoints' MXFP4
# is dequantized at load)
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, vocab_size=201088, num_local_experts=32, num_experts_per_tok=4,
                   sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, swiglu_alpha=1.702,
                   swiglu_limit=7.0, attention_bias=True, rope_parameters={
                       "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                       "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
TINY_OSS = dict(TINY, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"] * 3, swiglu_alpha=1.702, swiglu_limit=7.0,
                attention_bias=True, rope_parameters=GPT_OSS_20B["rope_parameters"])
TARGETS = {"qwen3-8b": (QWEN3_8B, TINY), "qwen3-30b-a3b": (QWEN3_30B_A3B, TINY_MOE),
           "gpt-oss-20b": (GPT_OSS_20B, TINY_OSS)}
# ---- models ---------------------------------------------------------------------------------------
def target_config(shape: dict) -> SimpleNamespace:
    if "num_local_experts" in shape:
        return SimpleNamespace(model_type="gpt_oss", rms_norm_eps=1e-5, max_position_embeddings=131072,
                               tie_word_embeddings=False, num_experts=shape["num_local_experts"], **shape)
    return SimpleNamespace(model_type="qwen3_moe" if "num_experts" in shape else "qwen3", rms_norm_eps=1e-6,
                           rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=40960,
                           tie_word_embeddings=False, attention_bias=False, **shape)


# DFlash2's convolutions (kernel size, group size) and selector (rank, top-k): the speculators defaults
DFLASH2 = dict(conv=(2, 16), selector=(256, 16))


def drafter_spec(tcfg, num_layers: int, block: int, kind: str = "dflash") -> DraftSpec:
    """The z-lab Qwen3-8B DFlash shape: target-sized Qwen3 layers, taps spread over the target;
    DFlash2 adds its convolutions and candidate selector."""
    layer = SimpleNamespace(
        hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=tcfg.head_dim, rms_norm_eps=tcfg.rms_norm_eps, attention_bias=False,
        rope_theta=rope_parameters(tcfg)["rope_theta"],
        rope_scaling=None, rope_parameters=None, max_position_embeddings=tcfg.max_position_embeddings,
        vocab_size=tcfg.vocab_size, model_type="qwen3")
    ids = default_target_layer_ids(tcfg.num_hidden_layers, num_layers)
    return DraftSpec(layer, block, tcfg.vocab_size - 1, ids, None, "z-lab", **(DFLASH2 if kind == "dflash2" else {}))


def random_module(make, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """Build on the meta device, allocate on `device` in `dtype`, fill in place (fast on a GPU)."""
    with torch.device("meta"):
        m = make()
    m = m.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2 or name.endswith("bias"):  # biases small too: shared ones would route every row alike
                p.normal_(0.0, 0.02, generator=gen)
            else:  # norms (sinks: a weight of one)
                p.fill_(1.0)
    return m.eval().requires_grad_(False)


@contextlib.contextmanager
def modes(backend: str):
    """The fused elementwise kernels for "+fused" backends, cuBLAS GEMMs unless "+fused" alone (or
    "+pdloff": the default path without programmatic dependent launch)."""
    fused = "+fused" in backend
    with fused_mode("on" if fused else "off"), gemm_mode("auto" if fused and not backend.endswith("+cublas")
                                                          else "cublas"), \
            pdl_mode(backend.rsplit("+pdl", 1)[1] if "+pdl" in backend else "auto"):
        yield


def nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def attn_flops(n_layers: int, n_heads: int, head_dim: int, rows: int, keys: int) -> float:
    return 4.0 * n_layers * n_heads * head_dim * rows * keys  # q k^T and p v


def _accept_triton():
    """The DFlash step's acceptance as one Triton kernel, program per sequence: accepted = leading
    drafts equal to the target's tokens; the context slots past the accepted rows set to -1; the
    next draft block's first token = the target's token after the accepted prefix."""
    import triton
    import triton.language as tl

    @triton.jit
    def _accept_kernel(drafts_ptr, tokens_ptr, full_slots_ptr, slots_ptr, next_ptr, B: tl.constexpr,
                       BLOCK: tl.constexpr):
        s = tl.program_id(0)
        j = tl.arange(0, BLOCK)
        d = tl.load(drafts_ptr + s * (B - 1) + j, mask=j < B - 1, other=-1)
        t = tl.load(tokens_ptr + s * B + j, mask=j < B, other=-2)
        accepted = tl.min(tl.where((j >= B - 1) | (d != t), j, B - 1), 0)  # the first mismatch, or B - 1
        full = tl.load(full_slots_ptr + s * B + j, mask=j < B, other=-1)
        tl.store(slots_ptr + s * B + j, tl.where(j <= accepted, full, -1), mask=j < B)
        tl.store(next_ptr + s * B, tl.sum(tl.where(j == accepted, t, 0), 0))

    return _accept_kernel


# ---- the run --------------------------------------------------------------------------------------
class Roofline:
    def __init__(self, args):
        self.args = args
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.clock = Clock(self.dev, round_s=0.2 if not args.tiny else 0.05)
        self.deadline = T0 + args.budget_s
        self.res: dict = {"errors": [], "skipped": []}
        self.tiny = args.tiny

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def error(self, where: str, e: BaseException) -> dict:
        msg = short_error(e)
        log(f"ERROR {where}: {msg}")
        self.res["errors"].append({"where": where, "error": msg, "traceback": traceback.format_exc()[-3000:]})
        return {"error": msg}

    def free(self) -> None:
        if self.cuda:
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as e:  # a failed capture can leave an error behind; record it, go on
                self.error("synchronize", e)

    # ---- machine --------------------------------------------------------------------------------
    def machine(self) -> None:
        a = self.args
        info = run_info(self.dev) | {"python": platform.python_version(),
                                     "dtype": str(self.dtype).removeprefix("torch.")}
        if self.cuda:
            p = torch.cuda.get_device_properties(self.dev)
            info |= {"name": p.name, "total_memory_gb": p.total_memory / 1e9, "sms": p.multi_processor_count,
                     "cuda": torch.version.cuda}
        self.res["machine"] = info
        log(f"machine: {info}")
        n = (1 << 30) if not self.tiny else (32 << 20)
        bps = copy_bandwidth(self.dev, n)
        if bps is None:  # off CUDA: the same copy on the clock
            src = torch.ones(n, dtype=torch.uint8, device=self.dev)
            dst = torch.empty_like(src)
            bps = 2 * n / (self.clock.time(lambda: dst.copy_(src))["ms"] / 1e3)
        self.bw = bw = bps / 1e9
        self.res["copy"] = {"bytes": n, "gbps_read_plus_write": bw}
        log(f"copy {n / 2**30:.2f} GiB: {bw:.0f} GB/s (read+write)")
        N = a.matmul_n or (8192 if not self.tiny else 256)
        t = self._time_matmul(N)
        self.tflops = 2 * N**3 / (t["ms"] / 1e3) / 1e12
        self.res["matmul"] = {"n": N, "dtype": str(self.dtype).removeprefix("torch."), "tflops": self.tflops, **t}
        log(f"matmul {N}^3 {self.res['matmul']['dtype']}: {t['ms']:.3f} ms -> {self.tflops:.1f} TFLOP/s")
        self.free()

    def _time_matmul(self, N: int) -> dict:
        x = torch.randn(N, N, device=self.dev, dtype=self.dtype)
        y = torch.randn(N, N, device=self.dev, dtype=self.dtype)
        z = torch.empty_like(x)
        return self.clock.time(lambda: torch.mm(x, y, out=z), warmup=3)

    # ---- models and caches ----------------------------------------------------------------------
    def build(self) -> None:
        a = self.args
        shape = TARGETS[a.target][1 if self.tiny else 0]
        self.tcfg = target_config(shape)
        self.ctx = a.context or (1024 if not self.tiny else 64)
        self.block = 16
        self.bs = 16
        default_batches = [1, 8, 32] if not self.tiny else [1, 3]
        self.batches = [int(b) for b in a.batches.split(",")] if a.batches else default_batches
        t = time.perf_counter()
        self.target = random_module(lambda: DecoderLM(self.tcfg), self.dev, self.dtype, 0)
        self.target.setup_rope(self.ctx + 2 * self.block + 8)
        self.kinds = a.drafter_kinds.split(",")
        self.drafters = {}
        for kind in self.kinds:
            spec = drafter_spec(self.tcfg, a.drafter_layers or (5 if not self.tiny else 2), self.block, kind)
            drafter = random_module(lambda spec=spec: DFlashDraftModel(spec), self.dev, self.dtype, 1)
            drafter.setup(self.ctx + 2 * self.block + 8)
            self.drafters[kind] = (spec, drafter)
        self.spec, self.drafter = self.drafters[self.kinds[0]]
        # pages: every sequence owns ctx + block + 1 positions' worth, in a random order
        self.pages = -(-(self.ctx + self.block + 1) // self.bs)
        max_b = max(self.batches)
        n_blocks = max_b * self.pages + 1
        g = torch.Generator(device=self.dev).manual_seed(2)
        self.tables = torch.randperm(n_blocks, device=self.dev, generator=g)[: max_b * self.pages]
        self.tables = self.tables.view(max_b, self.pages).to(torch.int32)
        tc, dc = self.tcfg, self.spec.layer_config

        def cache(n_layers):
            shape = (n_layers, n_blocks, self.bs, tc.num_key_value_heads, tc.head_dim)
            k = torch.empty(shape, device=self.dev, dtype=self.dtype).normal_(generator=g)
            v = torch.empty(shape, device=self.dev, dtype=self.dtype).normal_(generator=g)
            return k, v, [(k[i], v[i]) for i in range(n_layers)]

        self.tk, self.tv, self.tkv = cache(tc.num_hidden_layers)
        self.dk, self.dv, self.dkv = cache(dc.num_hidden_layers)
        self.sync_build_s = time.perf_counter() - t
        emb = self.target.embed_tokens.weight
        self.kv_tok_target = kv_bytes_per_token(self.target, self.dtype)
        self.kv_tok_drafter = 2 * dc.num_hidden_layers * dc.num_key_value_heads * dc.head_dim * emb.element_size()
        self.w_target = nbytes(self.target)
        self.w_dense_target = self.w_target - sum(p.numel() * p.element_size()
                                                  for n, p in self.target.named_parameters() if ".experts." in n)
        self.w_embed = emb.numel() * emb.element_size()
        self.w_lm_head = self.target.lm_head_weight.numel() * emb.element_size()
        # a step reads the drafter's weights but, of DFlash2's codebooks, only its candidates' rows
        self.w_drafters = {k: nbytes(d) - sum(p.numel() * p.element_size() for n, p in d.named_parameters()
                                               if "_codebook" in n) for k, (_, d) in self.drafters.items()}
        self.w_drafter = self.w_drafters[self.kinds[0]]
        info = {"target_config": shape, "context": self.ctx, "block": self.block, "kv_block_size": self.bs,
                "batches": self.batches, "drafter_layers": dc.num_hidden_layers,
                "drafter_taps": list(self.spec.target_layer_ids), "target_weight_bytes": self.w_target,
                "embed_bytes": self.w_embed, "lm_head_bytes": self.w_lm_head, "drafter_weight_bytes": self.w_drafter,
                "drafter_kinds": self.kinds, "drafter_step_bytes": self.w_drafters,
                "kv_bytes_per_token_target": self.kv_tok_target, "kv_bytes_per_token_drafter": self.kv_tok_drafter,
                "kv_cache_bytes": 2 * (self.tk.numel() + self.dk.numel()) * emb.element_size(),
                "build_s": self.sync_build_s}
        self.res["model"] = info
        log(f"built target {self.w_target / 1e9:.2f} GB + drafter {self.w_drafter / 1e9:.2f} GB + KV "
            f"{info['kv_cache_bytes'] / 1e9:.2f} GB in {self.sync_build_s:.1f}s")
        self.backends = {}
        if self.cuda or os.environ.get("TRITON_INTERPRET") == "1":
            try:
                from flashdraft.attention.triton_backend import TritonAttention
                from flashdraft.kernels import layer_ops  # noqa: F401

                self.backends["triton"] = TritonAttention
                self.backends["triton+fused"] = TritonAttention
                self.backends["triton+fused+pdloff"] = TritonAttention
                self.backends["triton+fused+cublas"] = TritonAttention
            except Exception as e:
                self.error("import triton backend", e)
        else:
            self.res["skipped"].append("triton: not on CUDA")
        self.backends["torch_static"] = StaticTorchAttention
        if self.args.backends:
            keep = self.args.backends.split(",")
            unknown = [b for b in keep if b not in self.backends]
            if unknown:
                raise ValueError(f"unknown backend(s) {unknown}; available here: {', '.join(self.backends)}")
            self.backends = {b: self.backends[b] for b in keep}

    # ---- helpers over the shared state ----------------------------------------------------------
    def step_inputs(self, S: int, q: int, seed: int = 0) -> dict:
        """Device tensors of one step: S sequences with ctx committed tokens, q new rows each."""
        pos = (self.ctx + torch.arange(q, device=self.dev)).repeat(S)
        seq = torch.arange(S, device=self.dev).repeat_interleave(q)
        slots = self.tables[seq, pos // self.bs].long() * self.bs + pos % self.bs
        g = torch.Generator(device=self.dev).manual_seed(seed)
        ids = torch.randint(0, self.tcfg.vocab_size - 1, (S * q,), device=self.dev, generator=g)
        return dict(input_ids=ids, positions=pos, slot_mapping=slots,
                    seq_lens=torch.full((S,), self.ctx + q, dtype=torch.int32, device=self.dev),
                    block_tables=self.tables[:S])

    def graph(self, fn, S: int, q: int, attn, causal: bool = True, extra=None) -> StepGraph:
        g = StepGraph(fn, num_seqs=S, q_len=q, max_blocks=self.pages, block_size=self.bs, device=self.dev,
                      causal=causal, max_seq_len=self.ctx + q, attn=[attn], extra=extra)
        g.fill(**self.step_inputs(S, q))
        return g.capture()

    def roofline(self, bytes_: float, flops: float) -> dict:
        mem_ms = bytes_ / (self.bw * 1e9) * 1e3
        cmp_ms = flops / (self.tflops * 1e12) * 1e3
        return {"bytes": bytes_, "flops": flops, "mem_ms": mem_ms, "compute_ms": cmp_ms,
                "bound": "memory" if mem_ms >= cmp_ms else "compute", "roofline_ms": max(mem_ms, cmp_ms)}

    def expert_bytes(self, S: int, q: int) -> tuple[int, int]:
        """A MoE target: (bytes of the experts a step of S sequences x q rows leaves unread, distinct
        (layer, expert) pairs it reads), from the routing of that step's inputs; (0, 0) for a dense one."""
        from flashdraft.models.moe import MoE

        moes = [m for m in self.target.modules() if isinstance(m, MoE)]
        if not moes:
            return 0, 0
        seen = []
        cls = type(moes[0])
        real_route = cls.route

        def route(mod, x):
            w, idx = real_route(mod, x)
            seen.append(idx.unique().numel())
            return w, idx

        cls.route = route
        try:
            inp = self.step_inputs(S, q)
            batch = AttentionBatch(inp["slot_mapping"], [i * q for i in range(S + 1)], [self.ctx + q] * S,
                                   self.tables[:S].tolist(), self.bs)
            attn = TorchAttention()
            attn.prepare(batch, self.dev)
            with torch.inference_mode(), fused_mode("off"):
                self.target(inp["input_ids"], inp["positions"], self.tkv, attn, batch)
        finally:
            cls.route = real_route
        per = moes[0].experts.gate_up_proj[0].numel() + moes[0].experts.down_proj[0].numel()
        el = self.target.embed_tokens.weight.element_size()
        touched = sum(seen)
        return (len(moes) * moes[0].num_experts - touched) * per * el, touched

    def keys_read(self, keys: int) -> float:
        """Keys a target row at `keys` context reads, averaged over layers (sliding layers read their window)."""
        masks = self.target.layer_masks
        return sum(min(keys, w or keys) for _, w in masks) / len(masks)

    def target_attn(self, cls):
        """The target's attention: one backend, or one per mask when layers slide (as the engine's runner)."""
        if any(w for _, w in self.target.layer_masks):
            return LayerMasks(cls, self.target.layer_masks)
        return cls()

    def decode_roofline(self, S: int) -> dict:
        tc = self.tcfg
        unread, touched = self.expert_bytes(S, 1)
        w = self.w_target - self.w_embed - unread + S * tc.hidden_size * self.target.embed_tokens.weight.element_size()
        kv = S * self.keys_read(self.ctx + 1) * self.kv_tok_target
        matmul_params = (self.w_target - self.w_embed - unread) / self.target.embed_tokens.weight.element_size()
        if touched:  # each token runs k experts, not every expert read
            per = (self.w_target - self.w_embed) - self.w_dense_target
            matmul_params = (self.w_dense_target - self.w_embed) / self.target.embed_tokens.weight.element_size() + \
                per / self.target.embed_tokens.weight.element_size() * tc.num_experts_per_tok / tc.num_experts
        flops = 2 * S * matmul_params + attn_flops(tc.num_hidden_layers, tc.num_attention_heads, tc.head_dim, S,
                                                   self.keys_read(self.ctx + 1))
        return self.roofline(w + kv, flops) | ({"experts_read": touched} if touched else {})

    def dflash_roofline(self, S: int, kind: str = "dflash") -> dict:
        tc, dc, B = self.tcfg, self.spec.layer_config, self.block
        el = self.target.embed_tokens.weight.element_size()
        keys = self.ctx + B
        unread, touched = self.expert_bytes(S, B)
        t_params = (self.w_target - self.w_embed) / el
        if touched:
            t_params = (self.w_dense_target - self.w_embed) / el + \
                (self.w_target - self.w_dense_target) / el * tc.num_experts_per_tok / tc.num_experts
        d_params = self.w_drafters[kind] / el
        lm = self.w_lm_head / el
        bytes_ = (self.w_target - self.w_embed - unread + self.w_drafters[kind] + self.w_lm_head
                  + S * (self.keys_read(keys) * self.kv_tok_target + keys * self.kv_tok_drafter))
        flops = (2 * S * B * t_params + attn_flops(tc.num_hidden_layers, tc.num_attention_heads, tc.head_dim,
                                                    S * B, self.keys_read(keys))
                 + 2 * S * B * d_params + 2 * S * (B - 1) * lm
                 + attn_flops(dc.num_hidden_layers, dc.num_attention_heads, dc.head_dim, S * B, keys))
        return self.roofline(bytes_, flops) | ({"experts_read": touched} if touched else {})

    # ---- plain decode ---------------------------------------------------------------------------
    def decode(self) -> None:
        out = self.res["decode"] = []
        first: dict[int, tuple] = {}  # batch -> (backend, tokens, hidden) of the first backend
        for name, cls in self.backends.items():
            for S in self.batches:
                row = {"backend": name, "batch": S, "graph": self.cuda, **self.decode_roofline(S)}
                try:
                    with modes(name):  # captured with the graph
                        row |= self._decode_one(name, cls, S, first)
                    log(f"decode {name} b={S}: {row['ms']:.3f} ms/step ({row['tok_s']:.0f} tok/s), roofline "
                        f"{row['roofline_ms']:.3f} ms ({row['bound']}), x{row['ms'] / row['roofline_ms']:.2f}; "
                        f"with host inputs {row['run_from_host_lists']['ms']:.3f} ms")
                except Exception as e:
                    row |= self.error(f"decode {name} b={S}", e)
                if "ms" in row:
                    row["vs_roofline"] = row["ms"] / row["roofline_ms"]
                out.append(row)
                self.free()
        first.clear()
        for S in self.batches:
            if self.remaining() < 60:
                self.res["skipped"].append(f"decode torch_eager b={S}: time budget")
                continue
            row = {"backend": "torch_eager", "batch": S, "graph": False, **self.decode_roofline(S)}
            try:
                with fused_mode("off"):
                    row |= self._decode_eager(S)
                row["vs_roofline"] = row["ms"] / row["roofline_ms"]
                log(f"decode torch_eager b={S}: {row['ms']:.3f} ms/step, x{row['vs_roofline']:.2f} of roofline")
            except Exception as e:
                row |= self.error(f"decode torch_eager b={S}", e)
            out.append(row)
            self.free()

    def _decode_one(self, name: str, cls, S: int, first: dict) -> dict:
        attn, target = self.target_attn(cls), self.target

        def fn(g):
            hidden, _ = target(g.input_ids, g.positions, self.tkv, attn, g.meta)
            return greedy_tokens(target.compute_logits(hidden, float32=False)), hidden  # greedy, as the engine

        g = self.graph(fn, S, 1, attn)
        tokens, hidden = g.replay()
        self.clock.sync()
        row = self.clock.time(g.replay)
        row["tok_s"] = S / (row["ms"] / 1e3)
        # what an engine step pays: the step's values from host lists into the buffers, then replay
        host = {k: v.tolist() for k, v in self.step_inputs(S, 1).items()}
        row["run_from_host_lists"] = self.clock.time(lambda: g.run(**host))
        if S in first:  # agreement with the first backend: same inputs, same weights, same KV
            ref_name, ref_tokens, ref_hidden = first[S]
            row["token_match_vs_" + ref_name] = float((tokens == ref_tokens).float().mean())
            row["hidden_max_abs_diff_vs_" + ref_name] = float((hidden.float() - ref_hidden).abs().max())
        else:
            first[S] = (name, tokens.clone(), hidden.float().clone())
        return row

    def _decode_eager(self, S: int) -> dict:
        """TorchAttention without graphs: prepare + forward every step, as the engine runs today."""
        inp = self.step_inputs(S, 1)
        batch = AttentionBatch(inp["slot_mapping"], list(range(S + 1)), [self.ctx + 1] * S,
                               self.tables[:S].tolist(), self.bs)
        attn = TorchAttention()

        def step():
            with torch.inference_mode():
                attn.prepare(batch, self.dev)
                hidden, _ = self.target(inp["input_ids"], inp["positions"], self.tkv, attn, batch)
                return greedy_tokens(self.target.compute_logits(hidden, float32=False))

        row = self.clock.time(step, warmup=2, max_iters=30)
        row["tok_s"] = S / (row["ms"] / 1e3)
        return row

    # ---- one DFlash step ------------------------------------------------------------------------
    def dflash(self) -> None:
        out = self.res["dflash"] = []
        decode_ms = {(r["backend"], r["batch"]): r.get("ms") for r in self.res.get("decode", [])}
        for name, cls, kind in [(n, c, k) for k in self.kinds for n, c in self.backends.items()]:
            for S in self.batches:
                row = {"backend": name, "kind": kind, "batch": S, "graph": self.cuda,
                       "step_roofline": self.dflash_roofline(S, kind),
                       "decode_roofline_ms": self.decode_roofline(S)["mem_ms"]}
                try:
                    with modes(name):
                        row |= self._dflash_one(cls, S, kind)
                    ms = row["step_ms"] = row["step"]["ms"]
                    row["step_vs_roofline"] = ms / row["step_roofline"]["roofline_ms"]
                    # tokens per step needed to beat an ideal plain decoder / our own graph decode
                    row["break_even_tokens_vs_decode_roofline"] = ms / row["decode_roofline_ms"]
                    if decode_ms.get((name, S)):
                        row["break_even_tokens_vs_measured_decode"] = ms / decode_ms[(name, S)]
                    log(f"{kind} {name} b={S}: draft {row['draft']['ms']:.3f} verify {row['verify']['ms']:.3f} "
                        f"context {row['context']['ms']:.3f} step {ms:.3f} ms; step roofline "
                        f"{row['step_roofline']['roofline_ms']:.3f} ms ({row['step_roofline']['bound']}); "
                        f"break-even {row['break_even_tokens_vs_decode_roofline']:.2f} tok/step vs decode roofline")
                except Exception as e:
                    row |= self.error(f"dflash {name} b={S}", e)
                out.append(row)
                self.free()

    def _dflash_one(self, cls, S: int, kind: str = "dflash") -> dict:
        """Graphs per part; the whole step adds the glue between them, on the device: the drafts
        copied into the verify input, then (on CUDA one Triton kernel, else torch ops) acceptance,
        the context slots of the accepted rows and the next block's first token. The context
        graph reads the taps where the captured verify left them."""
        B, H = self.block, self.tcfg.hidden_size
        taps = tuple(self.spec.target_layer_ids)
        target, drafter = self.target, self.drafters[kind][1]
        da, va, ca = cls(), self.target_attn(cls), cls()

        def draft_fn(g):
            h = drafter(target.embed_tokens(g.input_ids), g.positions, self.dkv, da, g.meta).view(S, B, -1)[:, 1:]
            logits = target.compute_logits(h, float32=False)
            if drafter.candidate_selector is not None:  # DFlash2: the selector's slot-by-slot choice
                return drafter.candidate_selector.select(logits, h, g.input_ids.view(S, B)[:, 0])
            return greedy_tokens(logits)  # [S, B-1], as the engine

        def verify_fn(g):
            hidden, tapped = target(g.input_ids, g.positions, self.tkv, va, g.meta, taps)
            return greedy_tokens(target.compute_logits(hidden, float32=False)), tapped  # greedy, as the engine

        def context_fn(g):
            drafter.write_context(g.extra["taps"], g.positions, self.dkv, ca, g.meta)

        gd = self.graph(draft_fn, S, B, da, causal=False)
        gd.input_ids.view(S, B)[:, 1:].fill_(self.spec.mask_token_id)
        gv = self.graph(verify_fn, S, B, va)
        # a captured verify leaves its taps in a static buffer: the context graph reads them there
        tap_buf = gv.outputs[1] if self.cuda else torch.zeros(S * B, len(taps) * H, device=self.dev, dtype=self.dtype)
        gc = self.graph(context_fn, S, B, ca, extra={"taps": tap_buf})
        full_slots = gc.meta.slot_mapping.clone()
        ar = torch.arange(B, device=self.dev)
        accept = _accept_triton() if self.cuda else None

        def step():
            with torch.inference_mode():
                drafts = gd.replay()
                gv.input_ids.view(S, B)[:, 1:].copy_(drafts)
                tokens, tapped = gv.replay()
                if accept is not None:  # one kernel: the torch ops below, fused
                    accept[(S,)](drafts, tokens, full_slots, gc.meta.slot_mapping, gd.input_ids, B=B,
                                 BLOCK=1 << (B - 1).bit_length())
                else:
                    t = tokens.view(S, B)
                    accepted = (drafts == t[:, : B - 1]).int().cumprod(-1).sum(-1)  # [S]
                    keep = (ar[None, :] <= accepted[:, None]).flatten()
                    gc.meta.slot_mapping.copy_(torch.where(keep, full_slots, -1))
                    tap_buf.copy_(tapped)
                    # the next draft starts from the target's token after the accepted prefix
                    gd.input_ids.view(S, B)[:, 0].copy_(t.gather(1, accepted[:, None].long())[:, 0])
                gc.replay()

        parts = {"draft": gd.replay, "verify": gv.replay, "context": gc.replay, "step": step}
        return {part: self.clock.time(fn) for part, fn in parts.items()}

    # ---- attention alone ----------------------------------------------------------------------
    def time_op(self, fn, inner: int = 20) -> dict:
        """Milliseconds per call; on CUDA `inner` calls inside one graph (no launch overhead)."""
        return graph_ms(fn, self.clock, inner)

    def attention(self) -> None:
        out = self.res["attention"] = []
        triton_fn = None
        if "triton" in self.backends:
            try:
                from flashdraft.kernels.attention import paged_attention as triton_fn
            except Exception as e:
                self.error("import paged_attention", e)
        flex_jobs = []
        for kind, q_len, causal in (("decode", 1, True), ("verify", self.block, True), ("draft", self.block, False)):
            for S in self.batches:
                L = self.ctx + q_len
                tc = self.tcfg
                kv_bytes = 2 * S * L * tc.num_key_value_heads * tc.head_dim * self.tk.element_size()
                row = {"kind": kind, "batch": S, "q_len": q_len, "causal": causal, "keys": L, "kv_bytes": kv_bytes,
                       "floor_ms": kv_bytes / (self.bw * 1e9) * 1e3}
                try:
                    flex_jobs.append(self._attention_one(row, triton_fn))
                    log(f"attention {kind} b={S}: " + ", ".join(
                        f"{k} {row[k]['ms'] * 1e3:.1f} us" for k in ("triton", "torch_static", "sdpa")
                        if isinstance(row.get(k), dict) and "ms" in row[k]) + f", floor {row['floor_ms'] * 1e3:.1f} us")
                except Exception as e:
                    row |= self.error(f"attention {kind} b={S}", e)
                out.append(row)
        if self.args.no_flex:
            self.res["skipped"].append("flex: --no-flex")
        else:
            self.flex(flex_jobs)
        self.free()

    def _attention_one(self, row: dict, triton_fn) -> tuple:
        """One layer's paged cache (the target's layer 0), Qwen3-8B heads; the same K/V gathered
        contiguous for SDPA and flex. Returns the inputs flex needs later."""
        S, q_len, L, causal, kind = row["batch"], row["q_len"], row["keys"], row["causal"], row["kind"]
        tc = self.tcfg
        nh, nkv, hd = tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim
        scale = hd**-0.5
        kc, vc = self.tk[0], self.tv[0]
        inp = self.step_inputs(S, q_len)
        qsl = torch.arange(S + 1, device=self.dev, dtype=torch.int32) * q_len
        meta = DeviceMeta(inp["slot_mapping"], qsl, inp["seq_lens"], self.tables[:S].contiguous(), q_len, L, self.bs,
                          causal)
        g = torch.Generator(device=self.dev).manual_seed(3)
        q = torch.randn(S * q_len, nh, hd, device=self.dev, dtype=self.dtype, generator=g)
        key_pos = torch.arange(L, device=self.dev)
        slots = self.tables[:S, key_pos // self.bs].long() * self.bs + key_pos % self.bs  # [S, L]
        kk = kc.view(-1, nkv, hd)[slots].permute(0, 2, 1, 3).contiguous()  # [S, nkv, L, hd]
        vv = vc.view(-1, nkv, hd)[slots].permute(0, 2, 1, 3).contiguous()
        qq = q.view(S, q_len, nh, hd).transpose(1, 2).contiguous()  # [S, nh, q, hd]
        static = StaticTorchAttention()
        static.set_meta(meta)
        ref = static.forward(q, kc, vc, meta, scale)
        row["torch_static"] = self.time_op(lambda: static.forward(q, kc, vc, meta, scale))
        if triton_fn is not None:
            try:
                o = triton_fn(q, kc, vc, meta, scale)
                row["triton_max_abs_diff"] = float((o.float() - ref.float()).abs().max())
                buf = torch.empty_like(q)
                row["triton"] = self.time_op(lambda: triton_fn(q, kc, vc, meta, scale, out=buf))
            except Exception as e:
                row["triton"] = self.error(f"attention triton {kind} b={S}", e)
        row["sdpa"] = self.sdpa(qq, kk, vv, q_len, L, causal, scale, ref, S)
        return row, qq, kk, vv, q_len, L, causal, scale, ref, S

    def sdpa(self, qq, kk, vv, q_len, L, causal, scale, ref, S) -> dict:
        """SDPA on contiguous K/V: GQA natively when supported, else K/V expanded beforehand."""
        variants = []
        if causal and q_len > 1:
            from torch.nn.attention.bias import causal_lower_right

            bias = causal_lower_right(q_len, L)
            mask = torch.ones(q_len, L, dtype=torch.bool, device=self.dev).tril(L - q_len)
            variants += [("causal_lower_right+gqa", dict(attn_mask=bias, enable_gqa=True), False),
                         ("bool_mask+gqa", dict(attn_mask=mask, enable_gqa=True), False),
                         ("bool_mask+expanded_kv", dict(attn_mask=mask), True)]
        else:
            variants += [("gqa", dict(enable_gqa=True), False), ("expanded_kv", {}, True)]
        group = qq.shape[1] // kk.shape[1]
        errors = []
        for label, kw, expand in variants:
            try:
                k, v = (kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)) if expand else (kk, vv)
                fn = lambda: F.scaled_dot_product_attention(qq, k, v, scale=scale, **kw)  # noqa: B023
                o = fn()
                diff = float((o.transpose(1, 2).reshape(ref.shape).float() - ref.float()).abs().max())
                return {"variant": label, "max_abs_diff": diff, **self.time_op(fn)}
            except Exception as e:
                errors.append(f"{label}: {short_error(e)}")
        self.res["errors"].append({"where": f"sdpa q={q_len} b={S}", "error": "; ".join(errors)})
        return {"error": "; ".join(errors)}

    def flex(self, jobs) -> None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except Exception as e:
            self.error("import flex_attention", e)
            return
        if self.cuda:
            import torch._dynamo

            for knob in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, 64)
            flex = torch.compile(flex_attention, dynamic=False)
        else:
            flex = flex_attention  # eager (reference implementation) off CUDA
        for row, qq, kk, vv, q_len, L, causal, scale, ref, S in jobs:
            if self.remaining() < 25:
                row["flex"] = {"skipped": "time budget"}
                self.res["skipped"].append(f"flex {row['kind']} b={S}: time budget")
                continue
            t = time.perf_counter()
            try:
                block_mask = None
                if causal and q_len > 1:
                    off = L - q_len

                    def mask_mod(b, h, q_idx, kv_idx, off=off):
                        return kv_idx <= q_idx + off

                    block_mask = create_block_mask(mask_mod, None, None, q_len, L, device=str(self.dev))
                fn = lambda: flex(qq, kk, vv, block_mask=block_mask, scale=scale, enable_gqa=True)  # noqa: B023
                o = fn()
                diff = float((o.transpose(1, 2).reshape(ref.shape).float() - ref.float()).abs().max())
                row["flex"] = {"compiled": self.cuda, "max_abs_diff": diff, "first_call_s": time.perf_counter() - t,
                               **self.time_op(fn)}
                log(f"attention flex {row['kind']} b={S}: {row['flex']['ms'] * 1e3:.1f} us "
                    f"(first call {row['flex']['first_call_s']:.1f}s)")
            except Exception as e:
                row["flex"] = self.error(f"flex {row['kind']} b={S}", e)

    # ---- report ---------------------------------------------------------------------------------
    def write(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.res["args"] = vars(self.args)
        self.res["total_s"] = time.perf_counter() - T0
        if self.cuda:
            self.res["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        (out_dir / "roofline.json").write_text(json.dumps(self.res, indent=1, default=str))
        (out_dir / "roofline.md").write_text(markdown(self.res))
        log(f"wrote {out_dir / 'roofline.json'} and {out_dir / 'roofline.md'}")
        print(markdown(self.res))
        print(json.dumps(self.res, default=str), flush=True)


def fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(r: dict) -> str:
    m = r.get("machine", {})
    lines = [f"# GPU roofline: {m.get('name', m.get('device'))}", "",
             f"torch {m.get('torch')}, triton {m.get('triton')}, commit {m.get('commit')}, "
             f"dtype {m.get('dtype')}, total {fmt(r.get('total_s'), '.0f')} s, "
             f"peak memory {fmt(r.get('max_memory_allocated_gb'), '.1f')} GB", ""]
    if "copy" in r:
        lines += [f"- copy bandwidth (device-to-device, {r['copy']['bytes'] / 2**30:.2f} GiB, read+write): "
                  f"**{r['copy']['gbps_read_plus_write']:.0f} GB/s**",
                  f"- matmul {r['matmul']['n']}^3 {r['matmul']['dtype']}: **{r['matmul']['tflops']:.1f} TFLOP/s**", ""]
    if "model" in r:
        mo = r["model"]
        lines += [f"Target {mo['target_config']}, context {mo['context']}, weights "
                  f"{mo['target_weight_bytes'] / 1e9:.2f} GB (embedding {mo['embed_bytes'] / 1e9:.2f} GB, "
                  "not read by a step), drafter "
                  f"{mo['drafter_layers']} layers {mo['drafter_weight_bytes'] / 1e9:.2f} GB, taps "
                  f"{mo['drafter_taps']}, KV {mo['kv_bytes_per_token_target'] / 1e3:.1f} kB/token.", ""]
    if r.get("decode"):
        lines += ["## Plain decode step (embed -> layers -> norm -> lm_head -> argmax)", "",
                  "| backend | batch | graph | ms/step | tok/s | mem roofline ms | compute roofline ms | bound | "
                  "x roofline | ms/step incl. host inputs | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for d in r["decode"]:
            note = d.get("error", "")
            for k, v in d.items():
                if k.startswith("token_match_vs_"):
                    note += f"tokens = {k.removeprefix('token_match_vs_')}: {v:.3f}; "
                if k.startswith("hidden_max_abs_diff_vs_"):
                    note += f"max abs hidden diff {v:.3g}"
            host_ms = (d.get("run_from_host_lists") or {}).get("ms")
            lines.append(f"| {d['backend']} | {d['batch']} | {d['graph']} | {fmt(d.get('ms'))} | "
                         f"{fmt(d.get('tok_s'), '.0f')} | {fmt(d['mem_ms'])} | {fmt(d['compute_ms'])} | {d['bound']} | "
                         f"{fmt(d.get('vs_roofline'), '.2f')} | {fmt(host_ms)} | {note} |")
        lines.append("")
    if r.get("dflash"):
        lines += ["## One DFlash step (draft 16 non-causal + lm_head 15 rows, verify 16 causal + taps + lm_head, "
                  "context write), graphs per part", "",
                  "| drafter | backend | batch | draft ms | verify ms | context ms | step ms | "
                  "step roofline ms (bound) | x step roofline | decode mem roofline ms | "
                  "break-even tok/step vs decode roofline | vs measured decode |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for d in r["dflash"]:
            sr = d["step_roofline"]

            def part(p, d=d):
                return fmt(d[p]["ms"]) if isinstance(d.get(p), dict) else "-"

            lines.append(f"| {d.get('kind', 'dflash')} | {d['backend']} | {d['batch']} | {part('draft')} | "
                         f"{part('verify')} | {part('context')} | "
                         f"{fmt(d.get('step_ms'))} | {fmt(sr['roofline_ms'])} ({sr['bound']}) | "
                         f"{fmt(d.get('step_vs_roofline'), '.2f')} | {fmt(d['decode_roofline_ms'])} | "
                         f"{fmt(d.get('break_even_tokens_vs_decode_roofline'), '.2f')} | "
                         f"{fmt(d.get('break_even_tokens_vs_measured_decode'), '.2f')} |")
        lines.append("")
    if r.get("attention"):
        lines += ["## Attention alone (one layer, us per call)", "",
                  "| kind | batch | keys | triton | torch_static | sdpa (contiguous) | flex | bandwidth floor |",
                  "|---|---|---|---|---|---|---|---|"]
        for a in r["attention"]:
            def us(k, a=a):
                v = a.get(k)
                if not isinstance(v, dict):
                    return "-"
                if "ms" in v:
                    return f"{v['ms'] * 1e3:.1f}" + (f" ({v['variant']})" if "variant" in v else "")
                return "error" if "error" in v else v.get("skipped", "-")
            lines.append(f"| {a['kind']} | {a['batch']} | {a['keys']} | {us('triton')} | {us('torch_static')} | "
                         f"{us('sdpa')} | {us('flex')} | {a['floor_ms'] * 1e3:.1f} |")
        lines.append("")
    if r.get("errors") or r.get("skipped"):
        lines += ["## Errors and skips", ""]
        lines += [f"- {e['where']}: {e['error']}" for e in r.get("errors", [])]
        lines += [f"- skipped {s}" for s in r.get("skipped", [])]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder for roofline.json and roofline.md")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes for a smoke test (CPU allowed)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32; tiny 1,3)")
    ap.add_argument("--context", type=int, default=None, help="committed tokens per sequence (default 1024)")
    ap.add_argument("--target", choices=list(TARGETS), default="qwen3-8b",
                    help="random-weight target shape (qwen3-30b-a3b: a mixture of experts; rooflines count the "
                         "experts each step's routing reads)")
    ap.add_argument("--drafter-layers", type=int, default=None)
    ap.add_argument("--drafter-kinds", default="dflash",
                    help="comma-separated: dflash (z-lab DFlash) and/or dflash2 (convolutions + candidate selector)")
    ap.add_argument("--matmul-n", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="optional parts (flex_attention, eager decode) are skipped once this has passed")
    ap.add_argument("--backends", default=None, help="comma-separated subset of the backends (default all)")
    ap.add_argument("--no-flex", action="store_true", help="skip flex_attention (its compiles take the longest)")
    ap.add_argument("--sections", default="machine,decode,dflash,attention")
    args = ap.parse_args()
    torch.manual_seed(0)
    run = Roofline(args)
    sections = args.sections.split(",")
    log(f"start: {vars(args)}")
    try:
        run.machine()  # bandwidth and matmul rate feed every roofline
        run.build()
        if "decode" in sections:
            run.decode()
        if "dflash" in sections:
            run.dflash()
        if "attention" in sections:
            run.attention()
    except Exception as e:
        run.error("fatal", e)
    finally:
        run.write(Path(args.out))
    log("done")


if __name__ == "__main__":
    main()
