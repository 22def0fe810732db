"""Profile engine steps on the GPU with a random-weight model of SmolLM2's shape (no weights to
ship): plain decode at batch 256 and speculative steps, torch profiler tables to stdout."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from fixtures import build_random_drafter, build_tiny_model  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402

tmp = Path(tempfile.mkdtemp())
shape = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=2048)
target = build_tiny_model(tmp / "t", "llama", rope_scaling=None, **shape)
draft = build_random_drafter(tmp / "d", target, block_size=16, num_layers=3, target_layer_ids=[1, 14, 27],
                             head_dim=64, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
g = torch.Generator().manual_seed(0)
lengths = torch.randint(50, 400, (256,), generator=g).tolist()
prompts = [torch.randint(20, 49000, (n,), generator=g).tolist() for n in lengths]
for name, d in (("plain", None), ("dflash", str(draft))):
    llm = LLM(str(target), draft=d, device="cuda", dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=16384,
              kv_cache_memory_gb=8, max_model_len=1024)
    p = SamplingParams(max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:8], p)
    torch.cuda.synchronize()
    t0 = time.time()
    outs = llm.generate(prompts, p)
    torch.cuda.synchronize()
    dt = time.time() - t0
    print(f"{name}: {len(prompts) * 64 / dt:.0f} tok/s, {llm.engine.stats['num_steps']} steps total")
    eng = llm.engine
    for s in prompts[:256]:
        eng.add_request(None, p, prompt_token_ids=s)
    for _ in range(12):  # prefill and a few decode steps
        eng.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))
    while eng.has_unfinished():
        eng.step()
