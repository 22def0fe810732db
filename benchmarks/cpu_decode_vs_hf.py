"""SmolLM2-135M float32 greedy decode on CPU: flashdraft vs HF transformers `generate`, side by
side in one process on the same chat prompts. Prints a table and one JSON line.

    python benchmarks/cpu_decode_vs_hf.py [--new-tokens 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import median, report  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402
from flashdraft.models.loader import default_model_path  # noqa: E402

PROMPTS = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain how a hash table works.",
    "Give me a packing list for a weekend hiking trip.",
    "Describe the water cycle for a ten-year-old.",
    "What are the pros and cons of remote work?",
    "Write a Python function that merges two sorted lists.",
    "Summarize the causes of the French Revolution.",
    "How does a bicycle stay upright?",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    n = args.new_tokens
    from transformers import AutoModelForCausalLM

    llm = LLM(draft=None, device="cpu", dtype="float32")
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=n, ignore_eos=True)

    def ours(ids):
        t0 = time.perf_counter()
        out = llm.generate([ids], params)[0]
        total = time.perf_counter() - t0
        return out.token_ids, total, out.metrics["ttft_s"]

    @torch.no_grad()
    def theirs(ids):
        x = torch.tensor([ids])
        kw = dict(attention_mask=torch.ones_like(x), do_sample=False, eos_token_id=None, pad_token_id=2)
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(x, max_new_tokens=n, **kw)
        total = time.perf_counter() - t0
        return out[0, len(ids):].tolist(), total, ttft

    ours(prompts[0]), theirs(prompts[0])  # warm-up
    rows = {"flashdraft": [], "hf": []}
    same = 0
    for _ in range(args.rounds):
        for ids in prompts:  # interleaved so machine noise hits both alike
            a, b = ours(ids), theirs(ids)
            rows["flashdraft"].append(a)
            rows["hf"].append(b)
            same += a[0] == b[0]
    t_b = time.perf_counter()
    batched = llm.generate(prompts, params)
    t_b = time.perf_counter() - t_b
    res = {}
    for name, rs in rows.items():
        res[name] = {"decode_tok_s": median((n - 1) / (t - ttft) for _, t, ttft in rs),
                     "e2e_tok_s": median(n / t for _, t, _ in rs)}
    res["flashdraft"]["batch8_tok_s"] = len(prompts) * n / t_b
    del batched
    ratio = res["flashdraft"]["decode_tok_s"] / res["hf"]["decode_tok_s"]
    report(f"SmolLM2-135M fp32 greedy, {len(prompts)} chat prompts x {n} new tokens x {args.rounds} rounds, batch 1 "
           f"(flashdraft / HF decode {ratio:.2f}x, identical outputs {same}/{len(rows['hf'])}, flashdraft at batch "
           f"8: {res['flashdraft']['batch8_tok_s']:.1f} tok/s)",
           [{"engine": name, **res[name]} for name in ("flashdraft", "hf")],
           {"bench": "cpu_decode_vs_hf", "new_tokens": n, "results": res, "ratio_decode": ratio,
            "identical": same, "runs": len(rows["hf"])}, columns=["engine", "decode_tok_s", "e2e_tok_s"],
           device="cpu")


if __name__ == "__main__":
    main()
