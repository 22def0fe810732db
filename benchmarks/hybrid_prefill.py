"""Prefill time of a hybrid target (Gated DeltaNet layers) through the public API: fla-core's chunked
kernel against the recurrent kernel for the same chunks (gdn_triton.CHUNKED_MIN_ROWS switched), with
random weights at a real shape (e2e_step.py's config-only folders, load_format="dummy"). Each figure:
`LLM.generate(prompts, max_tokens=1)` after one warm-up call of the same prompts, the arms alternating.

    python benchmarks/hybrid_prefill.py --target qwen3.5-4b --out prefill.json     # a GPU with fla-core

Writes one JSON document (stdout, and --out)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_step import TARGETS, emit, write_folders  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402
from flashdraft.models import gdn_triton  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen3.5-4b", choices=[t for t in TARGETS if "qwen3.5" in t])
    ap.add_argument("--shapes", default="1x4096,8x1024,1x1024", help="prompts x tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not gdn_triton.chunked_available(torch.device("cuda")):
        raise SystemExit("needs a GPU and fla-core (pip install -e '.[gpu]')")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    result = {"target": args.target, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "max_num_batched_tokens": None, "ms": {}}
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        target, _ = write_folders(Path(tmp), TARGETS[args.target], 5, 16)
        longest = max(L for _, L in shapes)
        llm = LLM(str(target), load_format="dummy", max_num_seqs=max(n for n, _ in shapes), kv_cache_memory_gb=8,
                  max_model_len=longest + 64)
        result["max_num_batched_tokens"] = llm.engine.config.max_num_batched_tokens
        gen = torch.Generator().manual_seed(0)
        default = gdn_triton.CHUNKED_MIN_ROWS
        for n, L in shapes:
            prompts = torch.randint(0, 1000, (n, L), generator=gen).tolist()
            for _ in range(args.repeats):
                for arm, min_rows in (("chunked", default), ("recurrent", 1 << 30)):
                    gdn_triton.CHUNKED_MIN_ROWS = min_rows
                    llm.generate(prompts, params)  # warm-up
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    llm.generate(prompts, params)
                    torch.cuda.synchronize()
                    ms = round(1e3 * (time.perf_counter() - t0), 2)
                    result["ms"].setdefault(f"{n}x{L}", {}).setdefault(arm, []).append(ms)
                    print(json.dumps({"prompts": f"{n}x{L}", "arm": arm, "ms": ms}), flush=True)
        gdn_triton.CHUNKED_MIN_ROWS = default
    emit(result, args.out)


if __name__ == "__main__":
    main()
