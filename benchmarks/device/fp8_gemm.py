"""Few-row GEMMs of a Qwen3-8B decoder with FP8 block-scaled weights (128 x 128) and 4-bit ones (groups of 128)
against bf16, on one GPU: bf16 cuBLAS (F.linear), bf16 Triton (kernels/skinny_gemm.py), FP8 W8A16 Triton
(kernels/fp8_gemm.py), torch._scaled_mm with 128 x 128 weight and 1 x 128 activation block scales (W8A8, where
this torch and GPU take it; its activation quantization not timed), and int4 W4A16 Triton (kernels/int4_gemm.py),
at M = 1, 8, 32 rows. Each GEMM is timed inside one CUDA
graph that cycles through enough weight copies to overflow L2 (a decode step reads each weight once,
cold). Reported: us per call and the ratio to the weight bytes' roofline (bytes / the copy bandwidth
measured in the same run).

    python benchmarks/device/fp8_gemm.py --out DIR"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import Clock, copy_bandwidth, graph_ms, log, run_info, short_error  # noqa: E402

from flashdraft.kernels.fp8_gemm import fp8_linear  # noqa: E402
from flashdraft.kernels.int4_gemm import int4_linear  # noqa: E402
from flashdraft.kernels.skinny_gemm import skinny_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
BLOCK = (128, 128)
GROUP = 128  # int4: input columns a scale and zero point
L2_BYTES = 256 << 20  # copies of a weight cycled through: more bytes than any L2 holds


def cycled(make, nbytes):
    copies = [make() for _ in range(max(2, -(-L2_BYTES // nbytes)))]
    state = {"i": 0}

    def take():
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]
    return take, len(copies)


def arms(x, bf16, fp8, int4, N, K, sn, sk):
    """Each arm's call and the weight bytes it reads, for activations x [M, K]."""
    xq = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    xs = torch.ones(x.shape[0], sk, device=x.device)

    layouts = [(xs, lambda s: s.t()), (xs.t().contiguous().t(), lambda s: s.t()),
               (xs.t().contiguous().t(), lambda s: s.t().contiguous()), (xs, lambda s: s.t().contiguous())]

    def scaled():  # (the first scale layout this torch takes)
        w, s = fp8()
        for i, (a, b) in enumerate(layouts):
            try:
                return torch._scaled_mm(xq, w.t(), scale_a=a, scale_b=b(s), out_dtype=torch.bfloat16)
            except RuntimeError:
                if i == len(layouts) - 1:
                    raise
    return {"bf16 cuBLAS": (lambda: F.linear(x, bf16()), N * K * 2),
            "bf16 Triton": (lambda: skinny_linear(x, bf16()), N * K * 2),
            "fp8 W8A16 Triton": (lambda: fp8_linear(x, *fp8(), BLOCK), N * K + sn * sk * 4),
            "fp8 W8A8 _scaled_mm": (scaled, N * K + sn * sk * 4),
            "int4 W4A16 Triton": (lambda: int4_linear(x, *int4(), GROUP), N * K // 2 + N * (K // GROUP) * 8)}


def sweep(name, N, K, M, fp8, clock, bw, dev) -> list[dict]:
    """The FP8 kernel's time at every tile config of the grid, best first."""
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    sn, sk = -(-N // BLOCK[0]), -(-K // BLOCK[1])
    rows = []
    quick = Clock(dev, round_s=0.02, rounds=2)
    for bn, sub, split, warps in itertools.product((16, 32, 64), (2, 4, 8), (1, 2, 4), (4,)):
        tiles = (bn, 128, sub, split, 16 if M <= 16 else 32 if M <= 32 else 64, warps)
        try:
            t = graph_ms(lambda: fp8_linear(x, *fp8(), BLOCK, tiles), quick)  # noqa: B023 (timed at once)
        except Exception as e:  # noqa: BLE001
            log(f"  {tiles}: {short_error(e)}")
            torch.cuda.synchronize()
            continue
        roof = (N * K + sn * sk * 4) / bw * 1e6
        rows.append({"gemm": name, "M": M, "tiles": tiles, "us": round(1e3 * t["ms"], 2),
                     "x_roofline": round(1e3 * t["ms"] / roof, 2)})
    return sorted(rows, key=lambda r: r["us"])


def time_shape(name, N, K, ms, clock, bw, dev, do_sweep=False) -> list[dict]:
    sn, sk = -(-N // BLOCK[0]), -(-K // BLOCK[1])
    bf16, _ = cycled(lambda: torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02, N * K * 2)
    fp8, _ = cycled(lambda: ((torch.randn(N, K, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn),
                             torch.rand(sn, sk, device=dev) * 1e-3), N * K)
    int4, _ = cycled(lambda: (torch.randint(-2**31, 2**31 - 1, (N, K // 8), device=dev, dtype=torch.int32),
                              torch.rand(N, K // GROUP, device=dev) * 1e-3,
                              torch.randint(0, 16, (N, K // GROUP), device=dev).float()), N * K // 2)
    rows = []
    for M in ms:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        for arm, (fn, nbytes) in arms(x, bf16, fp8, int4, N, K, sn, sk).items():
            base = {"gemm": name, "N": N, "K": K, "M": M, "arm": arm}
            try:
                t = graph_ms(fn, clock)
                us, roof = 1e3 * t["ms"], nbytes / bw * 1e6 if bw else None
                row = base | {"us": round(us, 2), "roofline_us": round(roof, 2) if roof else None,
                              "x_roofline": round(us / roof, 2) if roof else None, "graph": t["graph"]}
            except Exception as e:  # noqa: BLE001 (an arm this torch or GPU does not take: said so)
                row = base | {"error": short_error(e)}
                torch.cuda.synchronize()
            rows.append(row)
            log(json.dumps(row))
        if do_sweep and M in (1, 32):
            best = sweep(name, N, K, M, fp8, clock, bw, dev)
            for r in best[:3]:
                log("  sweep " + json.dumps(r))
            rows.append({"gemm": name, "M": M, "arm": "fp8 sweep best", "best": best[:5]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="also sweep the FP8 kernel's tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    clock, bw = Clock(dev), copy_bandwidth(dev)
    ms = [int(m) for m in args.rows.split(",")]
    rows = []
    for name, (N, K) in SHAPES.items():
        rows += time_shape(name, N, K, ms, clock, bw, dev, args.sweep)
        torch.cuda.empty_cache()
    record = {"run": run_info(dev), "copy_bandwidth_gbs": bw / 1e9 if bw else None, "rows": rows}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_gemm.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({"copy_bandwidth_gbs": record["copy_bandwidth_gbs"]}))


if __name__ == "__main__":
    main()
