"""Write the prompt files the GPU pipeline reads (the prompt packages are not installed there):
train_prompts.jsonl (ShareGPT training split, first turns of at most 1,500 characters),
train_conversations.jsonl.gz (every human turn with its history, at most 3,000 characters in all),
train_conversations_long.jsonl.gz (the same, 3,001-8,000 characters: long contexts),
python_functions.jsonl.gz (code problems from this Python's standard library, `python_function_prompts`),
humaneval.jsonl, mt_bench.jsonl (first turns) and sharegpt_heldout.jsonl (first 200 held-out).

    python benchmarks/device/make_prompt_files.py DIR
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from flashdraft.bench.datasets import load_prompts
from flashdraft.train.data import python_function_prompts, sharegpt_conversations, sharegpt_prompts


def write(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"{path}: {len(prompts)} prompts")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "prompt-files")
    out.mkdir(parents=True, exist_ok=True)
    write(out / "train_prompts.jsonl", [p for p in sharegpt_prompts("train") if len(p) <= 1500])
    every = sharegpt_conversations("all")
    for name, lo, hi in (("train_conversations", 0, 3000), ("train_conversations_long", 3001, 8000)):
        convs = [c for c in every if lo <= sum(len(m["content"]) for m in c) <= hi]
        lines = "".join(json.dumps({"messages": c}) + "\n" for c in convs)
        (out / f"{name}.jsonl.gz").write_bytes(gzip.compress(lines.encode()))  # 23 MB -> 5.5 MB for the first
        print(f"{out / name}.jsonl.gz: {len(convs)} conversations")
    code = python_function_prompts()
    lines = "".join(json.dumps({"prompt": p}) + "\n" for p in code)
    (out / "python_functions.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    print(f"{out / 'python_functions.jsonl.gz'}: {len(code)} prompts")
    write(out / "sharegpt_heldout.jsonl", sharegpt_prompts("heldout")[:200])
    for name, key in (("humaneval", "humaneval"), ("mt_bench", "mt-bench")):
        write(out / f"{name}.jsonl", [p.messages[0]["content"] for p in load_prompts(key)])


if __name__ == "__main__":
    main()
