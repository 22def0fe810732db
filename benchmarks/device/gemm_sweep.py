"""Few-row GEMMs of a Qwen3-8B decoder on the GPU: cuBLAS (F.linear) against the Triton kernels of
flashdraft/models/skinny.py over a sweep of tile configs, at M = 1, 8, 16, 32 rows, and the whole
decode step's GPU time split by kernel (torch profiler over CUDA-graph replays).

Every GEMM is timed inside one CUDA graph of `calls` launches that cycle through enough copies of
the weight to overflow L2 (a decode step reads each layer's weights once, cold), CUDA events around
replays. Reported: microseconds per call, GB/s of weight bytes, and the ratio to the copy bandwidth
measured in the same run.

    python benchmarks/device/gemm_sweep.py --out DIR            # H100: about 4 minutes
    TRITON_INTERPRET=1 python benchmarks/device/gemm_sweep.py --tiny --device cpu --out /tmp/gs

Writes DIR/gemm_sweep.json and DIR/gemm_sweep.md."""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_roofline import QWEN3_8B, Clock, Roofline, log, short_error

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
TINY_SHAPES = {"qkv": (192, 128), "down": (128, 256)}


def gemv_configs(tiny: bool):
    if tiny:
        return [dict(block_n=16, block_k=64, num_warps=4, num_stages=1)]
    out = []
    for bn, bk, w, s in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (1, 3)):
        if bn * bk <= 2048 * w:
            out.append(dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s))
    return out


def dot_configs(tiny: bool):
    if tiny:
        return [dict(block_n=16, block_k=32, num_warps=4, num_stages=1)]
    out = [dict(block_n=bn, block_k=bk, num_warps=4, num_stages=s)
           for bn, bk, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (3, 5))]
    out += [dict(block_n=128, block_k=bk, num_warps=8, num_stages=s) for bk in (64, 128) for s in (3, 4)]
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
        """Microseconds per fn() call, `calls` calls captured in one graph (eager off CUDA)."""
        fn(0)
        if not self.cuda:
            t = time.perf_counter()
            for i in range(calls):
                fn(i)
            return (time.perf_counter() - t) * 1e6 / calls
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(0)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fn(i)
        t = self.clock.time(g.replay, warmup=2, max_iters=20)
        del g
        return t["ms"] * 1e3 / calls

    def gemm(self) -> None:
        from flashdraft.models import skinny

        shapes = TINY_SHAPES if self.args.tiny else SHAPES
        rows = [1, 3] if self.args.tiny else [1, 8, 16, 32]
        bw = self.bw
        deadline = time.perf_counter() + self.args.budget_s
        for name, (N, K) in shapes.items():
            el = torch.finfo(self.dtype).bits // 8
            wbytes = N * K * el
            copies = max(1, min(16, -(-(400 << 20) // wbytes))) if self.cuda else 1
            ws = [torch.randn(N, K, device=self.dev, dtype=self.dtype) * 0.02 for _ in range(copies)]
            calls = max(copies, 8)
            for M in rows:
                x = torch.randn(M, K, device=self.dev, dtype=self.dtype)
                ref = F.linear(x.float(), ws[0].float())
                cands = [("cublas", {}, lambda i, x=x: F.linear(x, ws[i % copies]))]
                if M == 1:
                    cands += [("gemv", c, lambda i, c=c, x=x: skinny.gemv(x, ws[i % copies], **c))
                              for c in gemv_configs(self.args.tiny)]
                cands += [("dot", c, lambda i, c=c, x=x: skinny.dot(x, ws[i % copies], **c))
                          for c in dot_configs(self.args.tiny)]
                best = None
                for kind, cfg, fn in cands:
                    if time.perf_counter() > deadline:
                        self.res["errors"].append({"where": f"{name} M={M}", "error": "time budget"})
                        break
                    row = {"shape": name, "N": N, "K": K, "M": M, "kind": kind, **cfg}
                    try:
                        err = float((fn(0).float() - ref).abs().max() / ref.abs().max())
                        us = self.graph_time(fn, calls)
                        gbps = (wbytes + M * K * el + M * N * el) / (us * 1e-6) / 1e9
                        row |= {"us": us, "gbps": gbps, "of_copy_bw": gbps / bw, "rel_err": err}
                        if kind != "cublas" and (best is None or us < best["us"]):
                            best = row
                    except Exception as e:
                        row["error"] = short_error(e)
                    self.res["gemm"].append(row)
                cub = next(r for r in self.res["gemm"] if r["shape"] == name and r["M"] == M and r["kind"] == "cublas")
                if best and "us" in cub:
                    log(f"{name} {N}x{K} M={M}: cublas {cub['us']:.1f} us ({cub['gbps']:.0f} GB/s); best triton "
                        f"{best['kind']} {best['us']:.1f} us ({best['gbps']:.0f} GB/s, {best['of_copy_bw']:.2f} of copy) "
                        f"{ {k: best[k] for k in ('block_n', 'block_k', 'num_warps', 'num_stages')} } err {best['rel_err']:.1e}")
            del ws
            if self.cuda:
                torch.cuda.empty_cache()

    def profile_decode(self) -> None:
        """Kernel time split of one fused decode step (batch 1, 1k context) over graph replays."""
        ns = argparse.Namespace(device=self.args.device, tiny=self.args.tiny, budget_s=60, matmul_n=None,
                                context=None, batches="1", drafter_layers=None)
        rl = Roofline(ns)
        rl.bw, rl.tflops = self.bw, float("inf")  # only the memory roofline is used
        rl.build()
        from flashdraft.attention.triton_paged import TritonAttention
        from flashdraft.models.transformer import fused_mode

        attn, target = TritonAttention(), rl.target
        with fused_mode("on"):
            g = rl.graph(lambda g: target.compute_logits(target(g.input_ids, g.positions, rl.tkv, attn, g.meta)[0])
                         .argmax(-1), 1, 1, attn)
        step = self.clock.time(g.replay)
        prof_rows = []
        if self.cuda:
            from torch.profiler import ProfilerActivity, profile

            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            n = 10
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(n):
                    g.replay()
                torch.cuda.synchronize()
            for e in p.key_averages():
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if t > 0:
                    prof_rows.append({"name": e.key[:120], "calls_per_step": e.count / n, "us_per_step": t / n})
            prof_rows.sort(key=lambda r: -r["us_per_step"])
        busy = sum(r["us_per_step"] for r in prof_rows)
        self.res["decode_profile"] = {"step_ms": step["ms"], "kernel_busy_us": busy, "kernels": prof_rows,
                                      "roofline_ms": rl.decode_roofline(1)["mem_ms"]}
        log(f"decode b=1 step {step['ms']:.3f} ms, kernels busy {busy / 1e3:.3f} ms, roofline "
            f"{rl.decode_roofline(1)['mem_ms']:.3f} ms")
        for r in prof_rows[:15]:
            log(f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.0f}  {r['name'][:90]}")

    def run(self) -> None:
        rl = Roofline(argparse.Namespace(device=self.args.device, tiny=self.args.tiny, budget_s=60, matmul_n=None))
        rl.clock = self.clock
        n = (1 << 30) if not self.args.tiny else (32 << 20)
        t = rl._time_copy(n)
        self.bw = 2 * n / (t["ms"] / 1e3) / 1e9
        self.res["copy_gbps"] = self.bw
        if self.cuda:
            p = torch.cuda.get_device_properties(self.dev)
            self.res["device"] = p.name
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
                 "| shape | M | cuBLAS us | GB/s | best Triton us | GB/s | of copy | config |", "|---|---|---|---|---|---|---|---|"]
        for (name, M), grp in itertools.groupby(self.res["gemm"], key=lambda r: (r["shape"], r["M"])):
            grp = [r for r in grp if "us" in r]
            cub = [r for r in grp if r["kind"] == "cublas"]
            tri = sorted((r for r in grp if r["kind"] != "cublas"), key=lambda r: r["us"])
            if cub and tri:
                b = tri[0]
                lines.append(f"| {name} | {M} | {cub[0]['us']:.1f} | {cub[0]['gbps']:.0f} | {b['us']:.1f} | "
                             f"{b['gbps']:.0f} | {b['of_copy_bw']:.2f} | {b['kind']} {b['block_n']}x{b['block_k']} "
                             f"w{b['num_warps']} s{b['num_stages']} |")
        (out / "gemm_sweep.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop the sweep after this many seconds")
    ap.add_argument("--sections", default="gemm,profile_decode")
    args = ap.parse_args()
    s = Sweep(args)
    try:
        s.run()
    finally:
        s.write(Path(args.out))


if __name__ == "__main__":
    main()
