"""Where the shipped pair's GPU step goes: the decode graph and the whole DFlash step graph (and its post
graph) of each concurrency's bucket, each replayed over a real step's inputs (the decode graph's: a step of
the same requests with their drafts paused), timed with CUDA events and split
by kernel with the torch profiler (duration, and what each kernel adds to the stream's span: with PDL a
kernel starts before its predecessor ends, so its duration overstates it).

    python benchmarks/device/pair_kernels.py smollm2.gguf humaneval.jsonl 1,8,32 [TREE_SIZES]

TREE_SIZES (e.g. 0,15): the whole step of each size's engine, 0 the drafter's chain (the default); a
token tree's step graph holds its acceptance and the accepted rows' moves, so it has no post graph.
Prints a table of every graph's ms a replay and one JSON line with each graph's costliest kernels;
PAIR_KERNELS_TRACE=DIR writes one replay's kernels in order (start, duration, gap) per graph.
"""
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from e2e_step import fill_graph  # noqa: E402
from timing import cuda_ms, kernel_spans, kernel_table, log, report  # noqa: E402

from flashdraft import LLM  # noqa: E402
from flashdraft.bench.command import tokenize  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402

SHIPPED = str(ROOT / "flashdraft" / "drafters" / "smollm2-135m-dflash")
TOP = int(os.environ.get("PAIR_KERNELS_TOP", "12"))


def split(replay, label: str, c: int, replays: int = 20) -> dict:
    """One graph's ms a replay (CUDA events) and its kernels (profiler), the TOP costliest logged."""
    ms = cuda_ms(replay, replays)
    kernels, events = kernel_table(replay, replays)
    if os.environ.get("PAIR_KERNELS_TRACE"):  # one replay's kernels in order: start, duration, gap after the last end
        _write_sequence(events, Path(os.environ["PAIR_KERNELS_TRACE"]) / (f"{label}, c={c}".replace(" ", "_") + ".tsv"))
    launches = sum(k["calls"] for k in kernels)
    log(f"== {label}, c={c}: {ms:.3f} ms a replay, {launches:.0f} kernels")
    for k in kernels[:TOP]:
        log(f"  {k['us']:8.1f} us ({k['added_us']:7.1f} added) x{k['calls']:4.0f}  {k['kernel']}")
    return {"graph": label, "c": c, "ms": round(ms, 3), "kernels": round(launches), "top": kernels[:TOP]}


def _write_sequence(events, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines, prev_end, t0 = ["start_us\tdur_us\tgap_us\tkernel"], None, None
    for start, end, key in kernel_spans(events):
        if prev_end is not None and start - prev_end > 10.0 and t0 is not None:
            break  # the next replay: one is enough
        t0 = start if t0 is None else t0
        gap = 0.0 if prev_end is None else start - prev_end
        lines.append(f"{start - t0:.2f}\t{end - start:.2f}\t{gap:.2f}\t{key[:70]}")
        prev_end = end if prev_end is None else max(prev_end, end)
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    gguf, ds, concs = sys.argv[1], sys.argv[2], [int(c) for c in sys.argv[3].split(",")]
    trees = [int(t) for t in sys.argv[4].split(",")] if len(sys.argv) > 4 else [0]
    rows: list[dict] = []
    for tree in trees:
        llm = LLM(gguf, draft=SHIPPED, device="cuda", dtype="bfloat16", speculative_min_acceptance_length=None,
                  speculative_tree_size=tree or None)
        eng, sp = llm.engine, llm.engine.spec
        _, ids, _ = tokenize(eng, load_prompts(ds, max(concs)), True, 256)
        name = f"tree of {tree}" if tree else "DFlash"
        for c in concs:
            if tree == trees[0]:  # the decode graph over a real step's inputs too: its requests paused
                sp.policy.pause_at = 1
                fill_graph(llm, ids[:c])
                sp.policy.pause_at = None
            fill_graph(llm, ids[:c])
            bucket = 1 << (c - 1).bit_length()
            key = sp.graphs.key("dflash-tree" if tree else "dflash")
            step = eng.runner.graphs[(key, bucket, sp.block_size)]
            if tree == trees[0]:
                rows.append(split(eng.runner.graphs[(("decode", sp.tap_layers), bucket, 1)].replay, "decode", c))
            rows.append(split(step.replay, f"{name} step", c))
            if step.buffers.post is not None:
                rows.append(split(step.buffers.post.replay, f"{name} post graph", c))
        del llm, eng, sp
        torch.cuda.empty_cache()
    report(f"the shipped pair's graphs over {ds}'s prompts: ms a replay", rows,
           {"bench": "pair_kernels", "dataset": ds, "graphs": rows}, columns=["graph", "c", "ms", "kernels"])


if __name__ == "__main__":
    main()
