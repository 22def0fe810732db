"""Where the first step of an MT-Bench turn 2 spends its GPU time with the prefix cache and without: turn 1
answered, then turn 2 with max_tokens=1 once with turn 1's pages cached and once after reset_prefix_cache();
the last question's two calls run under torch.profiler, whose top kernels are printed per arm.

    python benchmarks/device/prefix_ttft_profile.py smollm2.gguf mt_bench_turns.jsonl [DTYPE] [N]"""
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flashdraft import LLM, SamplingParams  # noqa: E402

SHIPPED = str(ROOT / "flashdraft" / "drafters" / "smollm2-135m-dflash")
gguf, path = sys.argv[1], sys.argv[2]
dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
n = int(sys.argv[4]) if len(sys.argv) > 4 else 12
rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][:n]
llm = LLM(gguf, draft=SHIPPED, device="cuda", dtype=dtype, speculative_min_acceptance_length=None)
p128 = SamplingParams(max_tokens=128, ignore_eos=True)
p1 = SamplingParams(max_tokens=1, ignore_eos=True)
llm.chat([{"role": "user", "content": rows[0]["turns"][0]}], p128)
res = {"cached": [], "cold": []}
profs = {}
for i, row in enumerate(rows):
    first = [{"role": "user", "content": row["turns"][0]}]
    ans = llm.chat(first, p128)[0]
    second = first + [{"role": "assistant", "content": ans.text}, {"role": "user", "content": row["turns"][1]}]
    for arm in ("cached", "cold"):
        if arm == "cold":
            llm.reset_prefix_cache()
        else:
            llm.chat(first, p128)
        torch.cuda.synchronize()
        if i == len(rows) - 1:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                out = llm.chat(second, p1)[0]
                torch.cuda.synchronize()
            profs[arm] = prof
        else:
            out = llm.chat(second, p1)[0]
            torch.cuda.synchronize()
        m = out.metrics
        res[arm].append((1e3 * m["ttft_s"], m["num_cached_tokens"], m["num_prompt_tokens"]))
for arm, r in res.items():
    print(arm, "TTFT median ms", statistics.median(x[0] for x in r), "cached tokens", statistics.mean(x[1] for x in r),
          "prompt tokens", statistics.mean(x[2] for x in r))
for arm, prof in profs.items():
    ka = prof.key_averages()
    cuda = sum(e.self_device_time_total for e in ka) / 1e3
    print(f"== {arm}: self CUDA total {cuda:.3f} ms")
    print(ka.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))
