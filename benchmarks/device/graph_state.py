"""The same decode graph replayed in engines of different configurations, and after a burst of heavy
compute: a control for A/B runs of step graphs. The shipped pair's decode graph is the same graph in a
chain engine and in a token-tree engine, yet it has replayed ~10% slower in the tree engine (its kernels
overlapping less under PDL), and a chain engine's decode graph slowed as much after 200 bf16 matmuls; so
compare step graphs against a decode graph replayed in the same engine, not across engines.

    python benchmarks/device/graph_state.py smollm2.gguf humaneval.jsonl 7,0

For each tree size (0: the chain), one engine: its batch-1 decode graph filled with a real step's inputs,
the mean µs a replay over 200 back-to-back replays; then after 3 s idle; then, for the last engine, after
200 bf16 4,096 x 4,096 matmuls and after 8 s idle, each with the SM clock, memory clock, power and
throttle reasons nvidia-smi reports."""
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from e2e_step import fill_graph  # noqa: E402

from flashdraft import LLM  # noqa: E402
from flashdraft.bench.command import tokenize  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402

SHIPPED = str(ROOT / "flashdraft" / "drafters" / "smollm2-135m-dflash")


def replay_us(fn, n: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / n * 1000, 1)


def clocks() -> str:
    query = "clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active"
    cmd = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"]
    return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()


def main() -> None:
    gguf, ds, trees = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
    for i, tree in enumerate(trees):
        name = f"tree of {tree}" if tree else "chain"
        llm = LLM(gguf, draft=SHIPPED, device="cuda", dtype="bfloat16", speculative_min_acceptance_length=None,
                  speculative_tree_size=tree or None)
        eng, sp = llm.engine, llm.engine.spec
        _, ids, _ = tokenize(eng, load_prompts(ds, 1), True, 256)
        fill_graph(llm, ids[:1])
        decode = eng.runner.graphs[(("decode", sp.tap_layers), 1, 1)].replay
        print(f"{name} engine: decode graph {replay_us(decode)} us | {clocks()}", flush=True)
        time.sleep(3)
        print(f"{name} engine, after 3 s idle: {replay_us(decode)} us | {clocks()}", flush=True)
        if i == len(trees) - 1:
            x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
            for _ in range(200):
                x @ x
            torch.cuda.synchronize()
            print(f"{name} engine, after 200 matmuls: {replay_us(decode)} us | {clocks()}", flush=True)
            time.sleep(8)
            print(f"{name} engine, 8 s later: {replay_us(decode)} us | {clocks()}", flush=True)
        del llm, eng, sp, decode
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
