"""A captured decode graph replays at one of two speeds, and what moves it between them.

For each target (a config-only folder of benchmarks/e2e_step.py, random bf16 weights): its batch-1 decode
graph is filled with a real step's inputs and replayed (us a replay, best of 3 x 100, CUDA events), on the
current stream and on a new one, after each operation in turn: single launches of a 16-value normal_ (one,
three more, four more), 40 normal fills of 1 GiB, cuGraphUpload of the graph, an unrelated one-kernel graph
captured and replayed, a 1,024-token prompt served, 200 bf16 4,096^3 matmuls, and the graph captured anew
four times (the same step function, buffers and inputs).

    python benchmarks/device/graph_flip.py qwen3-8b gpt-oss-20b
"""
import ctypes
import gc
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "device")]

from e2e_step import TARGETS, fill_graph, spread_routers, step_graph, write_folders  # noqa: E402
from pair_kernels import replay_ms  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402


def probe_target(name: str, root: Path) -> None:
    shape = TARGETS[name]
    target, _ = write_folders(root, shape, 1, 16)
    llm = LLM(str(target), draft=None, load_format="dummy", max_num_seqs=1, kv_cache_memory_gb=8,
              max_model_len=1024 + 192)
    if shape["model_type"] in ("qwen3_moe", "gpt_oss"):
        spread_routers(llm, 1.0)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, shape["vocab_size"], (1, 1024), generator=gen).tolist()
    llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    fill_graph(llm, prompts)
    streams = {"current stream": torch.cuda.current_stream(), "new stream": torch.cuda.Stream()}
    small = torch.zeros(16, device="cuda")

    def timed(label: str) -> None:
        def on(stream):
            with torch.cuda.stream(stream):
                return min(replay_ms(step_graph(llm, "plain", 1).replay, 100) for _ in range(3)) * 1000
        print(f"{name} {label:>40}: " + ", ".join(f"{k} {on(s):7.1f} us" for k, s in streams.items()), flush=True)

    def launches(n: int) -> None:
        for _ in range(n):
            small.normal_()
        torch.cuda.synchronize()

    def recapture() -> None:
        g = step_graph(llm, "plain", 1)
        g.graph = None
        g.capture()
        fill_graph(llm, prompts)

    timed("fresh")
    for n, total in ((1, 1), (3, 4), (4, 8)):
        launches(n)
        timed(f"{total} single launches")
    for i in range(4):
        recapture()
        timed(f"captured anew ({i + 1})")
    big = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)
    for _ in range(40):
        big.normal_()
    del big
    torch.cuda.synchronize()
    timed("40 fills of 1 GiB")
    graph = step_graph(llm, "plain", 1).graph
    rc = ctypes.CDLL("libcuda.so.1").cuGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()),
                                                    ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    timed(f"cuGraphUpload (CUresult {rc})")
    other = torch.cuda.CUDAGraph()
    with torch.cuda.graph(other):
        small.add_(1)
    other.replay()
    torch.cuda.synchronize()
    timed("a one-kernel graph captured, replayed")
    llm.generate(torch.randint(0, shape["vocab_size"], (1, 1024), generator=gen).tolist(),
                 SamplingParams(max_tokens=4, ignore_eos=True))
    fill_graph(llm, prompts)
    timed("a 1,024-token prompt served")
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        x @ x
    torch.cuda.synchronize()
    timed("200 matmuls")
    for i in range(4):
        recapture()
        timed(f"captured anew ({i + 5})")


def main() -> None:
    for name in sys.argv[1:] or ["qwen3-8b"]:
        with TemporaryDirectory() as tmp:
            probe_target(name, Path(tmp))
        gc.collect()  # the engine and its parts refer to each other
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
