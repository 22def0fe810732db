"""GPU smoke test: the engine on CUDA gives the CPU's tokens (float32), plain and speculative, and
runs in bfloat16. Uses the tiny random fixtures of the test suite."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from fixtures import build_random_drafter, build_tiny_model  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402

tmp = Path(tempfile.mkdtemp())
target = build_tiny_model(tmp / "t", "qwen3")
draft = build_random_drafter(tmp / "d", target, block_size=4)
prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
p = SamplingParams(max_tokens=32, ignore_eos=True)
ref = [o.token_ids for o in LLM(str(target), draft=None, device="cpu", dtype="float32").generate(prompts, p)]
for draft_path in (None, str(draft)):
    got = [o.token_ids for o in LLM(str(target), draft=draft_path, device="cuda", dtype="float32").generate(prompts, p)]
    match = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    print(f"cuda fp32 draft={draft_path is not None}: token match vs cpu {match}/{sum(map(len, ref))}")
bf = LLM(str(target), draft=str(draft), device="cuda", dtype="bfloat16").generate(prompts, p)
print("cuda bf16 spec ok:", [len(o.token_ids) for o in bf], bf[0].metrics.get("acceptance_length"))
