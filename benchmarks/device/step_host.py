"""Where a concurrency-1 step of the real pair spends its time: SmolLM2-135M alone and with the
drafter, greedy, one request at a time. Per arm: tokens/s and steps/s over a few prompts, then
one more request under cProfile, split into the wait for the GPU (the step's one device->host read,
`tolist`) and everything else (host work: scheduling, metadata, launches, commits); the top
functions by own time. Run it at two commits (PYTHONPATH) one after the other on one machine for a side-by-side.

    python benchmarks/device/step_host.py --gguf smollm2.gguf --draft DRAFTER_DIR \\
        --prompts humaneval.jsonl --out results/step_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch

from flashdraft import LLM, SamplingParams
from flashdraft.bench.datasets import load_prompts


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def arm(model: str, draft: str | None, prompts: list[str], max_tokens: int, device: str) -> dict:
    llm = LLM(model, draft=draft, device=device, dtype="bfloat16" if device == "cuda" else "float32", max_num_seqs=8)
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up
    steps0, toks = eng.stats["num_steps"], 0
    sync(device)
    t0 = time.perf_counter()
    for p in prompts[1:]:
        toks += len(llm.generate([p], params)[0].token_ids)
    wall = time.perf_counter() - t0
    steps = eng.stats["num_steps"] - steps0
    prof = cProfile.Profile()
    steps0 = eng.stats["num_steps"]
    prof.enable()
    llm.generate(prompts[:1], params)
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())  # own time of every function: the profiled wall
    wait = sum(v[2] for k, v in st.stats.items() if k[2] in ("<method 'tolist' of 'torch._C.TensorBase' objects>",
                                                             "<method 'item' of 'torch._C.TensorBase' objects>"))
    n = eng.stats["num_steps"] - steps0
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    out = {"draft": draft, "tok_s": toks / wall, "steps_per_s": steps / wall, "tokens_per_step": toks / steps,
           "profiled_steps": n, "profiled_ms_per_step": 1e3 * total / n, "gpu_wait_ms_per_step": 1e3 * wait / n,
           "host_ms_per_step": 1e3 * (total - wait) / n, "top_tottime": text.getvalue()[-6000:]}
    if eng.spec is not None:
        out["acceptance_length"] = eng.spec_totals()["acceptance_length"]
    print(f"{'dflash' if draft else 'plain'}: {out['tok_s']:.0f} tok/s, {out['steps_per_s']:.0f} steps/s; profiled "
          f"{out['profiled_ms_per_step']:.3f} ms/step = host {out['host_ms_per_step']:.3f} + GPU wait "
          f"{out['gpu_wait_ms_per_step']:.3f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True, help="jsonl of {prompt}")
    ap.add_argument("--num-prompts", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    prompts = [p.text for p in load_prompts(args.prompts, args.num_prompts)]
    if None in prompts:
        raise ValueError(f"{args.prompts}: every prompt needs a raw text")
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    res = {"device": name, "torch": torch.__version__,
           "plain": arm(args.gguf, None, prompts, args.max_tokens, args.device),
           "dflash": arm(args.gguf, args.draft, prompts, args.max_tokens, args.device)}
    res["dflash_over_plain"] = res["dflash"]["tok_s"] / res["plain"]["tok_s"]
    print(f"DFlash / plain: {res['dflash_over_plain']:.2f}x", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
