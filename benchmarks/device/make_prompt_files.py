"""Write the prompt files the GPU pipeline reads (the prompt packages are not installed there):
train_prompts.jsonl (ShareGPT training split, first turns of at most 1,500 characters),
train_conversations.jsonl.gz (every human turn with its history, at most 3,000 characters in all),
train_conversations_long.jsonl.gz (the same, 3,001-8,000 characters: long contexts),
python_functions.jsonl.gz (code problems from this Python's standard library, `python_function_prompts`),
humaneval.jsonl, mt_bench.jsonl (first turns) and sharegpt_heldout.jsonl (first 200 held-out).

    python benchmarks/device/make_prompt_files.py DIR

Prints a table of the files written and one JSON line.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import report  # noqa: E402

from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.train.data import python_function_prompts, sharegpt_conversations, sharegpt_prompts  # noqa: E402


def write(path: Path, records: list[dict], written: list[dict]) -> None:
    """One JSON object a line (gzipped where the name says so), and the file's row in `written`."""
    text = "".join(json.dumps(r) + "\n" for r in records)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))  # 23 MB -> 5.5 MB for the training conversations
    else:
        path.write_text(text)
    written.append({"file": path.name, "records": len(records), "bytes": path.stat().st_size})


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "prompt-files")
    out.mkdir(parents=True, exist_ok=True)
    written: list[dict] = []
    prompts = lambda ps: [{"prompt": p} for p in ps]  # noqa: E731
    write(out / "train_prompts.jsonl", prompts(p for p in sharegpt_prompts("train") if len(p) <= 1500), written)
    every = sharegpt_conversations("all")
    for name, lo, hi in (("train_conversations", 0, 3000), ("train_conversations_long", 3001, 8000)):
        convs = [c for c in every if lo <= sum(len(m["content"]) for m in c) <= hi]
        write(out / f"{name}.jsonl.gz", [{"messages": c} for c in convs], written)
    write(out / "python_functions.jsonl.gz", prompts(python_function_prompts()), written)
    write(out / "sharegpt_heldout.jsonl", prompts(sharegpt_prompts("heldout")[:200]), written)
    for name, key in (("humaneval", "humaneval"), ("mt_bench", "mt-bench")):
        write(out / f"{name}.jsonl", prompts(p.messages[0]["content"] for p in load_prompts(key)), written)
    report(f"prompt files in {out}", written, {"bench": "make_prompt_files", "dir": str(out), "files": written},
           device="cpu")


if __name__ == "__main__":
    main()
