"""GPU memory of one answer generator (the self-distillation step of train-drafter): answers a prompt
file for some seconds with the settings of benchmarks/device/greedy_gen.sh (768 sequences, 16,384
tokens a step, a 16 GB KV cache, sampled prefixes then greedy), then prints the steps that raised the
allocated memory most and what the process holds and reserves at the end. Run it with and without
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to see what the allocator keeps.

    python benchmarks/device/gen_memory.py smollm2.gguf kinds.jsonl.gz --seconds 75
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from flashdraft import LLM
from flashdraft.train.data import generate_responses, read_prompt_file

GB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("prompts")
    ap.add_argument("--seconds", type=float, default=75)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--sampled-prefix", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=2048)
    args = ap.parse_args()
    llm = LLM(args.gguf, draft=None, device="cuda", dtype="bfloat16", max_num_seqs=768,
              max_num_batched_tokens=16384, kv_cache_memory_gb=16, max_model_len=args.max_prompt_tokens + 512)
    eng = llm.engine
    print(f"loaded: allocated {torch.cuda.memory_allocated() / GB:.2f} GB, "
          f"reserved {torch.cuda.memory_reserved() / GB:.2f} GB", flush=True)

    last = {}
    schedule, step = eng.scheduler.schedule, eng.step

    def scheduled(*a, **k):
        b = schedule(*a, **k)
        last["shape"] = (len(b.seqs), sum(b.num_new_tokens), max(b.num_new_tokens, default=0))
        return b

    rows = []

    def measured_step():
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = step()
        rows.append((torch.cuda.max_memory_allocated() - before, last.get("shape")))
        return out

    eng.scheduler.schedule, eng.step = scheduled, measured_step
    with tempfile.TemporaryDirectory() as tmp:
        n = generate_responses(llm, read_prompt_file(args.prompts), Path(tmp) / "data.jsonl", 512,
                               args.max_prompt_tokens, time_budget_s=args.seconds, temperature=args.temperature,
                               sampled_prefix=args.sampled_prefix, seed=1)
    rows.sort(key=lambda r: r[0], reverse=True)
    print(f"{n} answers in {len(rows)} steps; the steps that raised allocated memory most "
          "(GB over the step's start; sequences, tokens, most tokens of one sequence):")
    for extra, shape in rows[:5]:
        print(f"  {extra / GB:.2f}  {shape}")
    print(f"end: allocated {torch.cuda.memory_allocated() / GB:.2f} GB, "
          f"reserved {torch.cuda.memory_reserved() / GB:.2f} GB (most {torch.cuda.max_memory_reserved() / GB:.2f})")


if __name__ == "__main__":
    main()
