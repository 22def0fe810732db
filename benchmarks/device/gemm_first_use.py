"""Host time of a cuBLAS GEMM at a row count it has not seen before against one it has: why eager
steps pad their rows (flashdraft.engine.model_runner.PAD_ROWS). SmolLM2's gate/up [3072, 576] and
down [576, 1536] shapes, bf16, launch time only (no sync inside a timed loop).

    python benchmarks/device/gemm_first_use.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    w1 = torch.randn(3072, 576, device=dev, dtype=dt)
    w2 = torch.randn(576, 1536, device=dev, dtype=dt)
    x1 = {m: torch.randn(m, 576, device=dev, dtype=dt) for m in range(33, 1101)}
    x2 = {m: torch.randn(m, 1536, device=dev, dtype=dt) for m in range(33, 1101)}

    def us_per_gemm(rows, reps: int = 1) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for m in rows:
            for _ in range(reps):
                F.linear(x1[m], w1)
                F.linear(x2[m], w2)
        dt_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        return dt_s / (len(rows) * reps * 2) * 1e6

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per GEMM:")
    print(f"  first use of each row count 100-199: {us_per_gemm(range(100, 200)):.1f}")
    print(f"  the same row counts again:           {us_per_gemm(range(100, 200)):.1f}")
    print(f"  one row count (150) 100 times:       {us_per_gemm([150], 100):.1f}")
    print(f"  first use of each row count 1000-1099: {us_per_gemm(range(1000, 1100)):.1f}")
    print(f"  first use of each row count 40-99:   {us_per_gemm(range(40, 100)):.1f}")
    print(f"  the same row counts again:           {us_per_gemm(range(40, 100)):.1f}")


if __name__ == "__main__":
    main()
