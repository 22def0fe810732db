"""Where the shipped pair's GPU step goes: the decode graph and the whole DFlash step graph (and its post
graph) of each concurrency's bucket, each replayed over a real step's inputs (the decode graph's: a step of
the same requests with their drafts paused), timed with CUDA events and split
by kernel with the torch profiler (duration, and what each kernel adds to the stream's span: with PDL a
kernel starts before its predecessor ends, so its duration overstates it).

    python benchmarks/device/pair_kernels.py smollm2.gguf humaneval.jsonl 1,8,32 [TREE_SIZES]

TREE_SIZES (e.g. 0,15): the whole step of each size's engine, 0 the drafter's chain (the default); a
token tree's step graph holds its acceptance and the accepted rows' moves, so it has no post graph.
"""
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from e2e_step import critical_path, fill_graph, kernel_spans  # noqa: E402

from flashdraft import LLM  # noqa: E402
from flashdraft.bench.command import tokenize  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402

SHIPPED = str(ROOT / "flashdraft" / "drafters" / "smollm2-135m-dflash")


def replay_ms(replay, n: int) -> float:
    """Milliseconds a call of replay(), over n calls after one warm call, timed with CUDA events."""
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def split(replay, label: str, replays: int = 20, top: int = int(os.environ.get("PAIR_KERNELS_TOP", "12"))) -> None:
    from torch.profiler import ProfilerActivity, profile

    ms = replay_ms(replay, replays)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    added = critical_path(p.events())
    if os.environ.get("PAIR_KERNELS_TRACE"):  # one replay's kernels in order: start, duration, gap after the last end
        _write_sequence(p.events(), Path(os.environ["PAIR_KERNELS_TRACE"]) / (label.replace(" ", "_") + ".tsv"))
    rows = sorted(((e.device_time_total / replays, added.get(e.key, 0.0) / replays, e.count / replays, e.key[:80])
                   for e in p.key_averages() if e.device_time_total > 0), key=lambda r: -r[1])
    print(f"== {label}: {ms:.3f} ms a replay, {sum(r[2] for r in rows):.0f} kernels")
    for us, add, n, name in rows[:top]:
        print(f"  {us:8.1f} us ({add:7.1f} added) x{n:4.0f}  {name}")


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
    for tree in trees:
        llm = LLM(gguf, draft=SHIPPED, device="cuda", dtype="bfloat16", speculative_min_acceptance_length=None,
                  speculative_tree_size=tree or None)
        eng, sp = llm.engine, llm.engine.spec
        _, ids, _ = tokenize(eng, load_prompts(ds, max(concs)), True, 256)
        name = f"tree of {tree}" if tree else "DFlash"
        for c in concs:
            if tree == trees[0]:  # the decode graph over a real step's inputs too: its requests paused
                sp.pause_at = 1
                fill_graph(llm, ids[:c])
                sp.pause_at = None
            fill_graph(llm, ids[:c])
            bucket = 1 << (c - 1).bit_length()
            key = (("dflash-tree", sp.tap_layers) if tree else sp.verify_key("dflash", sp.num_draft))
            step = eng.runner.graphs[(key, bucket, sp.block_size)]
            if tree == trees[0]:
                split(eng.runner.graphs[(("decode", sp.tap_layers), bucket, 1)].replay, f"decode, c={c}")
            split(step.replay, f"{name} step, c={c}")
            if step.aux.get("post") is not None:
                split(step.aux["post"].replay, f"its post graph, c={c}")
        del llm, eng, sp
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
