"""The same decode graph replayed in engines of different configurations, and after single operations
a token-tree engine runs at start and a chain engine does not: a control for A/B runs of step graphs,
and the search for what slows a whole engine's graphs. The shipped pair's decode graph is the same
graph in a chain engine and in a token-tree engine, yet it has replayed ~10% slower in the tree engine
(its kernels overlapping less under PDL), and a chain engine's decode graph slowed as much after 200
bf16 matmuls (docs/performance.md section 4); so compare step graphs against a decode graph replayed
in the same engine, not across engines.

    python benchmarks/device/graph_state.py smollm2.gguf humaneval.jsonl 7,0 [PROBES]

For each tree size (0: the chain), one engine: its batch-1 decode graph filled with a real step's
inputs, the mean us a replay over 200 back-to-back replays, with the SM clock, memory clock, power, GPU and memory
temperatures and throttle reasons nvidia-smi reports; then again after each probe in turn (comma-separated, default
all, in this order): idle3 (3 s idle), tree-attn (the target's attention variants under tree masks
compiled and run, as a tree engine does at start), topk (the tree's top-k kernels over a drafter
head's logits), build (the tree build kernel), accept (the tree acceptance and K/V move kernels),
replay-all (every captured graph of the engine replayed once, as a chain engine's cost measurement
does), fill (40 normal fills of 1 GiB, as dummy weights are written: memory-bound load), idle8, matmul
(200 bf16 4,096 x 4,096 matmuls: compute-bound load), idle8. Not in the default list: alloc (1 GiB more
from the caching allocator, not written, kept), empty (that dropped, and torch.cuda.empty_cache()), randn
(torch.randn over 16 values) and stack (the thread stack limit raised to 16 KiB)."""
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from e2e_step import fill_graph  # noqa: E402
from pair_kernels import SHIPPED, replay_ms  # noqa: E402

from flashdraft import LLM  # noqa: E402
from flashdraft.bench.command import tokenize  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402

PROBES = "idle3,tree-attn,topk,build,accept,replay-all,fill,idle8,matmul,idle8"
KEPT: list[torch.Tensor] = []


def replay_us(fn, n: int = 200) -> float:
    return round(replay_ms(fn, n) * 1000, 1)


def clocks() -> str:
    query = "clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory,clocks_throttle_reasons.active"
    cmd = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"]
    return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()


def probe(name: str, llm: LLM) -> None:
    eng, dev = llm.engine, llm.engine.device
    if name.startswith("idle"):
        time.sleep(float(name[4:]))
    elif name == "tree-attn":
        from flashdraft.attention.triton_paged import compile_variants

        t, r = eng.model_config, eng.runner
        compile_variants(t.num_attention_heads, t.num_key_value_heads, r.model.head_dim, r.block_size, eng.dtype,
                         dev, tree=True)
    elif name == "topk":
        from flashdraft.models.fused_tokens import topk_log_softmax

        topk_log_softmax(torch.randn(56, eng.model_config.vocab_size, device=dev, dtype=eng.dtype), 7)
    elif name == "build":
        from flashdraft.speculative.tree_triton import build_trees

        logp = torch.randn(8, 7, 7, device=dev).sort(-1, descending=True).values
        build_trees(logp, torch.randint(100, (8, 7, 7), device=dev), 7)
    elif name == "accept":
        from flashdraft.speculative.tree_triton import accept_paths, build_trees, move_slots

        logp = torch.randn(8, 7, 7, device=dev).sort(-1, descending=True).values
        trees = build_trees(logp, torch.randint(100, (8, 7, 7), device=dev), 7)
        target = torch.randint(100, (8, 8), device=dev)
        start = torch.arange(8, device=dev) * 16
        tables = torch.arange(64, device=dev, dtype=torch.int32).view(8, 8)
        *_, src, dst = accept_paths(trees, target, start, tables, 16)
        kv = torch.zeros(2, 64, 16, 3, 64, device=dev, dtype=eng.dtype)
        move_slots(kv, kv.clone(), src, dst)
    elif name == "replay-all":
        for g in list(eng.runner.graphs.values()):
            if getattr(g, "captured", False):
                g.replay()
    elif name == "fill":
        x = torch.empty(1 << 29, device=dev, dtype=torch.bfloat16)
        for _ in range(40):
            x.normal_()
    elif name == "randn":  # the fill's kernel over 16 values
        torch.randn(16, device=dev)
    elif name == "stack":  # the thread stack (local memory a thread) raised to 16 KiB, through the driver
        import ctypes

        rc = ctypes.CDLL("libcuda.so.1").cuCtxSetLimit(0, 16384)  # CU_LIMIT_STACK_SIZE
        if rc:
            raise RuntimeError(f"cuCtxSetLimit: CUresult {rc}")
    elif name == "alloc":  # 1 GiB more from the allocator, never written, kept until "empty"
        KEPT.append(torch.empty(1 << 29, device=dev, dtype=torch.bfloat16))
    elif name == "empty":  # what "alloc" kept dropped, and the allocator's free blocks handed back to CUDA
        KEPT.clear()
        torch.cuda.empty_cache()
    elif name == "matmul":
        x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        for _ in range(200):
            x @ x
    else:
        raise ValueError(f"unknown probe {name!r}; the probes are {PROBES}")
    torch.cuda.synchronize()


def main() -> None:
    gguf, ds, trees = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
    probes = (sys.argv[4] if len(sys.argv) > 4 else PROBES).split(",")
    for tree in trees:
        name = f"tree of {tree}" if tree else "chain"
        llm = LLM(gguf, draft=SHIPPED, device="cuda", dtype="bfloat16", speculative_min_acceptance_length=None,
                  speculative_tree_size=tree or None)
        _, ids, _ = tokenize(llm.engine, load_prompts(ds, 1), True, 256)
        fill_graph(llm, ids[:1])
        sp = llm.engine.spec
        decode = llm.engine.runner.graphs[(("decode", sp.tap_layers), 1, 1)].replay
        print(f"{name} engine: decode graph {replay_us(decode)} us | {clocks()}", flush=True)
        for p in probes:
            probe(p, llm)
            if p == "replay-all":  # the decode graph's inputs again
                fill_graph(llm, ids[:1])
            print(f"{name} engine, after {p}: {replay_us(decode)} us | {clocks()}", flush=True)
        del llm, sp, decode
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
