"""Few-row GEMMs of a Qwen3-8B decoder on the GPU: cuBLAS (F.linear) against the Triton kernels of
kernels/skinny_gemm.py over a sweep of tile configs, at M = 1, 8, 16, 32 rows, and the GPU
time of a decode step, a 16-row verify and a draft block split by kernel (torch profiler over
CUDA-graph replays), and the paged attention kernel at every forced split-K count. `--sections moe`
times the expert kernels (kernels/moe_experts.py) of --model's MoE shape at --rows tokens, sorted and
unsorted, and sweeps the unsorted path's tiles. `--sections floors` times what no GEMM can go below:
an empty kernel launched in a graph (with and without PDL), and each shape's weights read by a plain
streaming kernel (four programs an SM, no reduction), cold and hot in L2. The GEMM section's "parts"
row is the tile rules with the split-K parts left to the consumer (skinny_linear(parts=True)), as
the fused layers call their o, out and down projections.

Every GEMM is timed inside one CUDA graph of `calls` launches that cycle through enough copies of
the weight to overflow L2 (a decode step reads each layer's weights once, cold), CUDA events around
replays. Reported: microseconds per call, GB/s of weight bytes, and the ratio to the copy bandwidth
measured in the same run.

    python benchmarks/device/gemm_sweep.py --out DIR            # H100: about 4 minutes
    TRITON_INTERPRET=1 python benchmarks/device/gemm_sweep.py --tiny --device cpu --out /tmp/gs

Writes DIR/gemm_sweep.json and DIR/gemm_sweep.md; prints the table and the JSON as one line."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "device")]

from gpu_roofline import Roofline  # noqa: E402
from timing import Clock, copy_bandwidth, graph_ms, log, run_info, short_error  # noqa: E402

from flashdraft.kernels.launch import pdl_enter, pdl_trigger  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
# --model: the (N, K) of other decoders' GEMMs; Qwen3.5's Gated DeltaNet layers have their own in / out
# projections (q, k, v, z, b, a as one matrix) beside the gated attention's (query and output gate)
MODEL_SHAPES = {
    "qwen3-8b": SHAPES,
    "qwen3.5-27b": {"gdn_in": (16480, 5120), "gdn_out": (5120, 6144), "qkv": (14336, 5120), "o": (5120, 6144),
                    "gate_up": (34816, 5120), "down": (5120, 17408)},
    "qwen3.5-4b": {"gdn_in": (12352, 2560), "gdn_out": (2560, 4096), "qkv": (10240, 2560), "o": (2560, 4096),
                   "gate_up": (18432, 2560), "down": (2560, 9216), "lm_head": (248320, 2560)},
    "qwen3.5-0.8b": {"gdn_in": (8224, 1024), "gdn_out": (1024, 2048), "qkv": (5120, 1024), "o": (1024, 2048),
                     "gate_up": (7168, 1024), "down": (1024, 3584)},
    # the MoE targets' dense GEMMs (attention and router; their experts: the moe section)
    "qwen3-30b-a3b": {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048)},
    "gpt-oss-20b": {"qkv": (5120, 2880), "o": (2880, 4096), "router": (32, 2880)},
    # the shipped pair's target (SmolLM2-135M) and drafter: verify and draft blocks of 8 rows a request
    "smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                     "fc": (576, 2880)},
}
TINY_SHAPES = {"qkv": (192, 128), "gate_up": (256, 128), "down": (128, 256)}
# the moe section: (experts, routed per token, hidden, expert width, biases) of fused_moe
MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768, False), "gpt-oss-20b": (32, 4, 2880, 2880, True)}
TINY_MOE = (8, 2, 128, 64, True)
# (BLOCK_N, BLOCK_K, stages) candidates of the unsorted path's two GEMMs, swept one after the other
MOE_DIRECT_TILES = ((16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 3), (64, 128, 3), (32, 64, 5), (16, 64, 5))


def gemv_configs(tiny: bool):
    if tiny:
        return [dict(block_n=16, block_k=64, num_warps=4, num_stages=1)]
    out = []
    for bn, bk, w, s in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (1, 3)):
        if bn * bk <= 2048 * w:
            out.append(dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s))
    return out


QUICK_DOT = ((16, 128, 4, 5), (16, 256, 4, 5), (32, 128, 4, 5), (32, 256, 4, 5), (64, 128, 4, 5), (64, 256, 4, 4),
             (128, 128, 4, 5), (128, 64, 4, 5), (128, 128, 8, 4), (256, 64, 8, 4))


def dot_configs(tiny: bool, quick: bool = False):
    if tiny:
        return [dict(block_n=16, block_k=32, num_warps=4, num_stages=1)]
    if quick:
        return [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s) for bn, bk, w, s in QUICK_DOT]
    out = [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=s)
           for bn, bk, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (3, 5))]
    out += [dict(block_n=128, block_k=bk, num_warps=8, num_stages=s) for bk in (64, 128) for s in (3, 4)]
    return out


def glu_configs(tiny: bool, M: int, mid: bool = False):
    """{} = the tile rules; then explicit (block_n, block_k, warps, stages) per strip."""
    if tiny or M == 1:
        return [{}]
    mpad = max(16, triton.next_power_of_2(M))
    bks, stages = ((64, 128), (3, 4)) if mid else ((128, 256), (3, 4, 5))
    return [{}] + [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=st)
                   for bn, bk, st in itertools.product((16, 32), bks, stages)
                   if st * (2 * bn + mpad) * bk * 2 <= 220 * 1024]


def mid_configs(N: int, K: int, M: int):
    """--mid: (block_n, block_k, warps, stages, split) for verify blocks of 33-256 rows, where the
    x^T tile is as wide as the weight strip: narrower strips and split-K for more programs."""
    mpad = max(16, triton.next_power_of_2(M))
    out = []
    for bn, bk, st, sp in itertools.product((16, 32, 64), (64, 128), (3, 4), (1, 2, 3)):
        if K % (sp * bk) == 0 and N % bn == 0 and st * (bn + mpad) * bk * 2 <= 220 * 1024:
            out.append(dict(block_n=bn, block_k=bk, num_warps=4, num_stages=st, split=sp))
    return out


class Sweep:
    def __init__(self, args):
        self.args = args
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.clock = Clock(self.dev, round_s=0.05, rounds=3)
        self.res: dict = {"errors": [], "gemm": []}

    def graph_time(self, fn, calls: int) -> float:
        """Microseconds per fn(i) call, `calls` calls inside one graph on CUDA (timing.graph_ms), with i
        counting up so the calls cycle through the weight copies."""
        i = itertools.count()
        return graph_ms(lambda: fn(next(i)), self.clock, inner=calls)["ms"] * 1e3

    def gemm(self) -> None:
        from flashdraft.kernels import skinny_gemm

        shapes = TINY_SHAPES if self.args.tiny else MODEL_SHAPES[self.args.model]
        rows = [1, 3] if self.args.tiny else [int(m) for m in self.args.rows.split(",")]
        bw = self.bw
        deadline = time.perf_counter() + self.args.budget_s
        for name, (N, K) in shapes.items():
            if self.args.shapes and name not in self.args.shapes.split(","):
                continue
            el = torch.finfo(self.dtype).bits // 8
            wbytes = N * K * el
            copies = max(1, min(16, -(-(400 << 20) // wbytes))) if self.cuda else 1
            ws = [torch.randn(N, K, device=self.dev, dtype=self.dtype) * 0.02 for _ in range(copies)]
            calls = max(copies, 8)
            for M in rows:
                x = torch.randn(M, K, device=self.dev, dtype=self.dtype)
                ref = F.linear(x.float(), ws[0].float())
                cands = [("cublas", {}, lambda i, x=x, w=ws: F.linear(x, w[i % len(w)]))]
                if M == 1 and not self.args.quick:
                    cands += [("gemv", c, lambda i, c=c, x=x, w=ws: skinny_gemm.gemv(x, w[i % len(w)], **c))
                              for c in gemv_configs(self.args.tiny)]
                if self.args.mid:
                    cands += [("dot", c, lambda i, c=c, x=x, w=ws: skinny_gemm.dot(x, w[i % len(w)], **c))
                              for c in mid_configs(N, K, M)]
                else:
                    cands += [("dot", c, lambda i, c=c, x=x, w=ws: skinny_gemm.dot(x, w[i % len(w)], **c))
                              for c in dot_configs(self.args.tiny, self.args.quick)]
                # what the model runs: the tile rules of skinny_gemm._dot_tiles (and _dot_split), and those
                # tiles with K split over 1-4 programs a strip
                cands += [("rules", {}, lambda i, x=x, w=ws: skinny_gemm.skinny_linear(x, w[i % len(w)]))]
                cands += [("parts", {}, lambda i, x=x, w=ws: skinny_gemm.skinny_linear(x, w[i % len(w)], parts=True))]
                cands += [("split", {"split": sp}, lambda i, sp=sp, x=x, w=ws: skinny_gemm.skinny_linear(
                    x, w[i % len(w)], split=sp)) for sp in (1, 2, 3, 4)]
                if self.args.split_tiles and not self.args.mid:  # split-K with explicit tiles and pipeline depths
                    cands += [("dot", dict(block_n=bn, block_k=bk, num_warps=4, num_stages=st, split=sp),
                               lambda i, c=(bn, bk, 4, st, sp), x=x, w=ws: skinny_gemm.dot(x, w[i % len(w)], *c))
                              for bn, bk, st, sp in itertools.product((16, 32, 64), (64, 128, 256), (2, 3, 4, 5),
                                                                      (1, 2, 3, 4, 5))
                              if K % (sp * bk) == 0 and N % bn == 0 and (sp == 1 or bn <= 64)
                              and (bk > 64 or K % 128)]  # 64-wide tiles where 128 does not divide K (GPT-OSS's 2,880)
                if name == "gate_up":  # the same bytes with the silu * up epilogue: [M, N/2] out
                    from flashdraft.kernels import layer_ops

                    cands += [("glu", c, lambda i, c=c, x=x, w=ws: skinny_gemm.skinny_linear(
                        x, w[i % len(w)], glu=True, tiles=tuple(c.values()) if c else None))
                        for c in glu_configs(self.args.tiny, M, self.args.mid)]
                    if self.cuda:  # what rows past the Triton limit run: cuBLAS, then the silu * up kernel
                        cands += [("cublas+silu", {},
                                   lambda i, x=x, w=ws: layer_ops.silu_mul(F.linear(x, w[i % len(w)])))]
                best = None
                for kind, cfg, fn in cands:
                    if time.perf_counter() > deadline:
                        self.res["errors"].append({"where": f"{name} M={M}", "error": "time budget"})
                        break
                    row = {"shape": name, "N": N, "K": K, "M": M, "kind": kind, **cfg}
                    try:
                        y = fn(0).float()
                        y = y.sum(1) if y.dim() == 3 else y  # split-K parts
                        want = ref
                        if kind in ("glu", "cublas+silu"):
                            want = F.silu(ref[:, : N // 2]) * ref[:, N // 2:]
                        err = float((y - want).abs().max() / want.abs().max())
                        us = self.graph_time(fn, max(8, calls))
                        gbps = (wbytes + M * K * el + M * N * el) / (us * 1e-6) / 1e9
                        row |= {"us": us, "gbps": gbps, "of_copy_bw": gbps / bw, "rel_err": err}
                        if kind in ("gemv", "dot") and (best is None or us < best["us"]):
                            best = row
                    except Exception as e:
                        row["error"] = short_error(e)
                    self.res["gemm"].append(row)
                cub = next(r for r in self.res["gemm"] if r["shape"] == name and r["M"] == M and r["kind"] == "cublas")
                rules = next((r for r in self.res["gemm"] if r["shape"] == name and r["M"] == M
                              and r["kind"] == "rules" and "us" in r), None)
                parts = next((r for r in self.res["gemm"] if r["shape"] == name and r["M"] == M
                              and r["kind"] == "parts" and "us" in r), None)
                if best and "us" in cub:
                    tiles = {k: best[k] for k in ("block_n", "block_k", "num_warps", "num_stages", "split")
                             if k in best}
                    log(f"{name} {N}x{K} M={M}: cublas {cub['us']:.1f} us ({cub['gbps']:.0f} GB/s); best triton "
                        f"{best['kind']} {best['us']:.1f} us ({best['gbps']:.0f} GB/s, "
                        f"{best['of_copy_bw']:.2f} of copy) {tiles} err {best['rel_err']:.1e}"
                        + (f"; tile rules {rules['us']:.1f} us ({rules['of_copy_bw']:.2f})" if rules else "")
                        + (f", parts {parts['us']:.1f} us" if parts else ""))
            ws.clear()  # free the copies before the next shape's
            if self.cuda:
                torch.cuda.empty_cache()

    def moe(self) -> None:
        """fused_moe (slot outputs, as the model calls it) at --rows tokens with random routings, the
        expert weights read cold (each call routes anew among the layer's experts): the sorted path,
        the unsorted (direct) path with its tile rules, then its gate_up tiles and its down tiles
        swept in turn. Bytes: the distinct experts a call reads."""
        from flashdraft import settings
        from flashdraft.kernels import moe_experts

        E, k, H, inter, bias = TINY_MOE if self.args.tiny else MOE_SHAPES[self.args.model]
        el = torch.finfo(self.dtype).bits // 8
        g = torch.Generator(device=self.dev).manual_seed(0)
        wgu = torch.randn(E, 2 * inter, H, device=self.dev, dtype=self.dtype, generator=g) * 0.02
        wd = torch.randn(E, H, inter, device=self.dev, dtype=self.dtype, generator=g) * 0.02
        bgu = torch.randn(E, 2 * inter, device=self.dev, dtype=self.dtype, generator=g) if bias else None
        bd = torch.randn(E, H, device=self.dev, dtype=self.dtype, generator=g) if bias else None
        act = ("swiglu_oai", 1.702, 7.0) if bias else ("silu",)
        per_expert = (3 * H * inter + (3 * inter + H if bias else 0)) * el
        out = self.res["moe"] = []
        saved = settings.MOE_DIRECT, settings.MOE_DIRECT_TILES
        rows = [1, 2] if self.args.tiny else [int(m) for m in self.args.rows.split(",")]
        try:
            for T in rows:
                n_routes = 1 if self.args.tiny else 32
                ids = [torch.stack([torch.randperm(E, device=self.dev, generator=g)[:k] for _ in range(T)])
                       for _ in range(n_routes)]
                w = torch.softmax(torch.randn(T, k, device=self.dev, generator=g), -1).to(self.dtype)
                x = torch.randn(T, H, device=self.dev, dtype=self.dtype, generator=g)
                experts = sum(len(set(r.flatten().tolist())) for r in ids) / n_routes
                nbytes = experts * per_expert

                def fn(i, ids=ids, w=w, x=x):
                    return moe_experts.fused_moe(x, wgu, wd, w, ids[i % len(ids)], act, bgu, bd, slots=True)

                def timed(kind, direct, tiles, T=T, experts=experts, nbytes=nbytes, fn=fn, calls=n_routes):
                    settings.MOE_DIRECT = direct
                    settings.MOE_DIRECT_TILES = tiles
                    row = {"tokens": T, "kind": kind, "tiles": tiles if direct else None, "experts": experts}
                    try:
                        us = self.graph_time(fn, max(8, calls))
                        row |= {"us": us, "of_copy_bw": nbytes / (us * 1e-6) / 1e9 / self.bw}
                    except Exception as e:
                        row["error"] = short_error(e)
                    out.append(row)
                    return row

                settings.MOE_DIRECT = 0
                ref = fn(0).float()
                sorted_row = timed("sorted", 0, saved[1])
                settings.MOE_DIRECT = 1 << 30
                row = timed("direct", 1 << 30, saved[1])
                row["max_abs_diff"] = float((fn(0).float() - ref).abs().max())
                best = {"gate_up": saved[1][0], "down": saved[1][1]}
                for part in ("gate_up", "down"):
                    cands = MOE_DIRECT_TILES[:1] if self.args.tiny else MOE_DIRECT_TILES
                    rs = [timed(f"direct {part}", 1 << 30,
                                (c, best["down"]) if part == "gate_up" else (best["gate_up"], c)) for c in cands]
                    rs = [r for r in rs if "us" in r]
                    if rs:
                        best[part] = min(rs, key=lambda r: r["us"])["tiles"][0 if part == "gate_up" else 1]
                b = timed("direct best", 1 << 30, (best["gate_up"], best["down"]))
                log(f"moe {self.args.model} T={T} ({experts:.1f} experts, {nbytes / 1e6:.1f} MB): sorted "
                    f"{sorted_row.get('us', float('nan')):.1f} us, direct {row.get('us', float('nan')):.1f} us, "
                    f"best direct {b.get('us', float('nan')):.1f} us ({b.get('of_copy_bw', 0):.2f} of copy) "
                    f"{b['tiles']}")
        finally:
            settings.MOE_DIRECT, settings.MOE_DIRECT_TILES = saved

    def floors(self) -> None:
        """An empty kernel's launch in a graph (PDL on and off), and each shape's weights read by
        the streaming kernel below, cold (copies past L2) and hot (one copy), microseconds a call."""
        from flashdraft.kernels.launch import launch_kwargs

        y = torch.zeros(16, device=self.dev, dtype=torch.float32)
        kw = launch_kwargs(y)
        row = {}
        for grid in (1, 132, 528):
            row[f"empty_{grid}_pdl_us"] = self.graph_time(lambda i, g=grid: _empty[(g,)](y, **kw), 64)
            row[f"empty_{grid}_us"] = self.graph_time(lambda i, g=grid: _empty[(g,)](y, USE_PDL=0), 64)
        log("empty kernel in a graph: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        self.res["floors"] = {"empty": row, "stream": []}
        sms = torch.cuda.get_device_properties(self.dev).multi_processor_count if self.cuda else 4
        shapes = TINY_SHAPES if self.args.tiny else MODEL_SHAPES[self.args.model]
        for name, (N, K) in shapes.items():
            el = torch.finfo(self.dtype).bits // 8
            copies = max(1, min(16, -(-(400 << 20) // (N * K * el)))) if self.cuda else 1
            ws = [torch.randn(N * K, device=self.dev, dtype=self.dtype) for _ in range(copies)]
            progs, block = 4 * sms, 8192 if self.cuda else 64
            per = N * K // progs // block * block
            if per == 0:
                continue
            def read(w, progs=progs, per=per, block=block):
                _stream[(progs,)](w, y, per, BLOCK=block, **kw)

            cold = self.graph_time(lambda i, ws=ws, c=copies, read=read: read(ws[i % c]), 2 * copies)
            hot = self.graph_time(lambda i, w=ws[0], read=read: read(w), 16)
            gbps = progs * per * el / (cold * 1e-6) / 1e9
            self.res["floors"]["stream"].append({"shape": name, "N": N, "K": K, "cold_us": cold, "hot_us": hot,
                                                 "of_copy_bw": gbps / self.bw})
            log(f"{name} {N}x{K}: streamed cold {cold:.2f} us ({gbps / self.bw:.2f} of copy), hot {hot:.2f} us")
            ws.clear()

    def roofline_run(self) -> Roofline:
        """The Qwen3-8B-shaped target and 5-layer drafter of gpu_roofline.py, built once."""
        if getattr(self, "rl", None) is None:
            ns = argparse.Namespace(device=self.args.device, tiny=self.args.tiny, budget_s=60, matmul_n=None,
                                    backends=None, context=None, batches="1,8,32", drafter_layers=None)
            self.rl = Roofline(ns)
            self.rl.bw, self.rl.tflops = self.bw, float("inf")  # only the memory roofline is used
            self.rl.clock = self.clock
            self.rl.build()
        return self.rl

    def profile(self) -> None:
        """Kernel time split of graph replays: plain decode at batch 1 and 32, the 16-row verify
        (with taps) and the draft block at batch 1; default (fused) path."""
        rl = self.roofline_run()
        from flashdraft.attention.triton_backend import TritonAttention
        from flashdraft.engine.sampler import greedy_tokens
        from flashdraft.kernels.dispatch import fused_mode

        target, drafter = rl.target, rl.drafter
        taps = tuple(rl.spec.target_layer_ids)
        B = rl.block
        out = self.res["profile"] = {}
        cases = [("decode", 1, 1), ("decode", 32, 1), ("verify", 1, B), ("draft", 1, B)]
        if self.args.tiny:
            cases = cases[:1]
        for kind, S, q in cases:
            attn = TritonAttention()
            if kind == "draft":
                def fn(g, attn=attn, S=S):
                    h = drafter(target.embed_tokens(g.input_ids), g.positions, rl.dkv, attn, g.meta)
                    return greedy_tokens(target.compute_logits(h.view(S, B, -1)[:, 1:], float32=False))
            else:
                def fn(g, attn=attn, kind=kind):
                    hidden, tapped = target(g.input_ids, g.positions, rl.tkv, attn, g.meta,
                                            taps if kind == "verify" else ())
                    return greedy_tokens(target.compute_logits(hidden, float32=False)), tapped
            try:
                with fused_mode("on"):
                    g = rl.graph(fn, S, q, attn, causal=kind != "draft")
                out[f"{kind}_b{S}"] = self._profile_graph(f"{kind} b={S}", g.replay)
            except Exception as e:
                log(f"ERROR profile {kind} b={S}: {short_error(e)}")
                self.res["errors"].append({"where": f"profile {kind} b={S}", "error": short_error(e)})
            if self.cuda:
                torch.cuda.empty_cache()

    def _profile_graph(self, name: str, replay) -> dict:
        step = self.clock.time(replay)
        rows = []
        if self.cuda:
            from torch.profiler import ProfilerActivity, profile

            for _ in range(3):
                replay()
            torch.cuda.synchronize()
            n = 10
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(n):
                    replay()
                torch.cuda.synchronize()
            for e in p.key_averages():
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if t > 0:
                    rows.append({"name": e.key[:120], "calls_per_step": e.count / n, "us_per_step": t / n})
            rows.sort(key=lambda r: -r["us_per_step"])
        busy = sum(r["us_per_step"] for r in rows)
        log(f"{name}: {step['ms']:.3f} ms per replay, kernels busy {busy / 1e3:.3f} ms")
        for r in rows[:10]:
            log(f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.0f}  {r['name'][:90]}")
        return {"ms": step["ms"], "kernel_busy_us": busy, "kernels": rows}

    def attention_splits(self) -> None:
        """paged_attention at batch 1 and 8 (decode, 16-row verify and draft, 1k context) with the
        split-K heuristic and with every forced split count."""
        rl = self.roofline_run()
        from flashdraft.attention.base import DeviceMeta
        from flashdraft.kernels.attention import paged_attention

        tc = rl.tcfg
        out = self.res["attention_splits"] = []
        for kind, q_len, causal in (("decode", 1, True), ("verify", rl.block, True), ("draft", rl.block, False)):
            for S in (1, 8):
                L = rl.ctx + q_len
                inp = rl.step_inputs(S, q_len)
                qsl = torch.arange(S + 1, device=self.dev, dtype=torch.int32) * q_len
                meta = DeviceMeta(inp["slot_mapping"], qsl, inp["seq_lens"], rl.tables[:S].contiguous(), q_len, L,
                                  rl.bs, causal)
                q = torch.randn(S * q_len, tc.num_attention_heads, tc.head_dim, device=self.dev, dtype=self.dtype)
                kc, vc = rl.tk[0], rl.tv[0]
                scale = tc.head_dim**-0.5
                ref = paged_attention(q, kc, vc, meta, scale, num_splits=1).float()
                row = {"kind": kind, "batch": S, "keys": L}
                for sp in (None, 1, 2, 4, 8, 16, 32):
                    buf = torch.empty_like(q)
                    try:
                        diff = float((paged_attention(q, kc, vc, meta, scale, num_splits=sp).float() - ref).abs().max())
                        t = graph_ms(lambda sp=sp, buf=buf, q=q, meta=meta, kc=kc, vc=vc, scale=scale:
                                     paged_attention(q, kc, vc, meta, scale, out=buf, num_splits=sp), self.clock)
                        row[f"splits_{sp or 'auto'}"] = {"us": t["ms"] * 1e3, "max_abs_diff": diff}
                    except Exception as e:
                        row[f"splits_{sp or 'auto'}"] = {"error": short_error(e)}
                times = [f"{k.removeprefix('splits_')}: {v['us']:.1f}" for k, v in row.items()
                         if isinstance(v, dict) and "us" in v]
                log(f"attention {kind} b={S}: " + ", ".join(times))
                out.append(row)

    def run(self) -> None:
        n = (1 << 30) if not self.args.tiny else (32 << 20)
        bps = copy_bandwidth(self.dev, n)
        if bps is None:  # off CUDA: the same copy on the clock
            src = torch.ones(n, dtype=torch.uint8, device=self.dev)
            dst = torch.empty_like(src)
            bps = 2 * n / (self.clock.time(lambda: dst.copy_(src))["ms"] / 1e3)
        self.bw = bps / 1e9
        self.res |= run_info(self.dev) | {"copy_gbps": self.bw}
        log(f"copy bandwidth {self.bw:.0f} GB/s")
        for part in self.args.sections.split(","):
            try:
                getattr(self, part)()
            except Exception as e:
                log(f"ERROR {part}: {short_error(e)}")
                self.res["errors"].append({"where": part, "error": short_error(e)})

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gemm_sweep.json").write_text(json.dumps(self.res, indent=1))
        lines = [f"copy {self.res.get('copy_gbps', 0):.0f} GB/s, {self.res.get('device', self.args.device)}", "",
                 "| shape | M | cuBLAS us | GB/s | best Triton us | GB/s | of copy | config |",
                 "|---|---|---|---|---|---|---|---|"]
        for (name, M), grp in itertools.groupby(self.res["gemm"], key=lambda r: (r["shape"], r["M"])):
            grp = [r for r in grp if "us" in r]
            cub = [r for r in grp if r["kind"] == "cublas"]
            tri = sorted((r for r in grp if r["kind"] in ("gemv", "dot")), key=lambda r: r["us"])
            if cub and tri:
                b = tri[0]
                cfg = (f"{b['block_n']}x{b['block_k']} w{b['num_warps']} s{b['num_stages']}"
                       + (f" split {b['split']}" if b.get("split", 1) > 1 else "") if "block_n" in b
                       else "tile rules")
                lines.append(f"| {name} | {M} | {cub[0]['us']:.1f} | {cub[0]['gbps']:.0f} | {b['us']:.1f} | "
                             f"{b['gbps']:.0f} | {b['of_copy_bw']:.2f} | {b['kind']} {cfg} |")
                glu = sorted((r for r in grp if r["kind"] == "glu"), key=lambda r: r["us"])
                if glu:
                    cfg = (f"{glu[0]['block_n']}x{glu[0]['block_k']} s{glu[0]['num_stages']}" if "block_n" in glu[0]
                           else "tile rules")
                    rules = [r for r in glu if "block_n" not in r]
                    cs = [r for r in grp if r["kind"] == "cublas+silu"]
                    lines.append(f"| {name} + silu*up | {M} | {cs[0]['us'] if cs else float('nan'):.1f} | | "
                                 f"{glu[0]['us']:.1f} | {glu[0]['gbps']:.0f} | {glu[0]['of_copy_bw']:.2f} | "
                                 f"glu {cfg}; tile rules {rules[0]['us']:.1f} us |")
        (out / "gemm_sweep.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        print(json.dumps(self.res, default=str), flush=True)


@triton.jit
def _empty(y_ptr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    pdl_trigger(USE_PDL)
    if tl.program_id(0) == 0:
        tl.store(y_ptr, 1.0)


@triton.jit
def _stream(w_ptr, y_ptr, per_prog, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Each program sums its `per_prog` contiguous elements: a read with nothing else to wait on."""
    base = w_ptr + tl.program_id(0).to(tl.int64) * per_prog
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for o in range(0, per_prog, BLOCK):
        acc += tl.load(base + o + tl.arange(0, BLOCK)).to(tl.float32)
    pdl_trigger(USE_PDL)
    tl.store(y_ptr + tl.program_id(0) % 16, tl.sum(acc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop the sweep after this many seconds")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of the GEMM shapes")
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(MODEL_SHAPES), help="whose GEMM shapes (and, "
                    "for the MoE targets, expert shapes: --sections moe)")
    ap.add_argument("--sections", default="gemm,profile,attention_splits",
                    help="any of gemm, profile, attention_splits, moe, floors")
    ap.add_argument("--rows", default="1,8,16,32", help="GEMM rows (M) to sweep")
    ap.add_argument("--quick", action="store_true", help="GEMM sweep: 8 dot tile configs, no gemv")
    ap.add_argument("--mid", action="store_true",
                    help="GEMM sweep: the tiles of mid_configs (33-256 rows; run with FLASHDRAFT_SKINNY_ROWS "
                    "at least --rows) instead of the few-row ones, and cuBLAS + the silu * up kernel")
    ap.add_argument("--split-tiles", action="store_true",
                    help="GEMM sweep: also split-K 1-5 over strips of 16-64 rows, 2-5 pipeline stages "
                         "(64-wide K tiles where 128 does not divide K)")
    args = ap.parse_args()
    s = Sweep(args)
    try:
        s.run()
    finally:
        s.write(Path(args.out))


if __name__ == "__main__":
    main()
