"""Compare drafters evaluated by `benchmarks/device/drafter_pipeline.py --phase eval` on the same
prompts: pooled tau per set and temperature (committed tokens / verify steps, over all prompts)
and, for each drafter against the first, a 95% interval of the difference from bootstrap draws of
the prompts (the same draw for both drafters: the prompts are paired).

    python benchmarks/eval_compare.py BASE/eval.json OTHER/eval.json [...] [--draws 2000] [--seed 0]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import report  # noqa: E402

DRAFTS, ACCEPTED = 2, 3  # columns of eval.json's per_prompt rows


def pooled_tau(rows: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
    """rows [prompts, 4]; idx [draws, prompts] of prompt indices -> tau per draw (or one value)."""
    d, a = rows[:, DRAFTS], rows[:, ACCEPTED]
    if idx is None:
        return (a.sum() + d.sum()) / d.sum()
    return (a[idx].sum(1) + d[idx].sum(1)) / d[idx].sum(1)


def compare(evals: list[dict], draws: int = 2000, seed: int = 0) -> dict:
    """evals: the "eval" objects of eval.json files. Returns {key: {"tau": [...], "diff": [[lo, hi], ...]}}
    where diff[i] is the interval of drafter i+1 minus drafter 0."""
    rng = np.random.default_rng(seed)
    out = {}
    for key in evals[0]:
        rows = [np.asarray(e[key]["per_prompt"], dtype=np.float64) for e in evals]
        if any(r.shape != rows[0].shape for r in rows):
            raise ValueError(f"{key}: the drafters were evaluated on different prompt counts")
        if any((r[:, 0] != rows[0][:, 0]).any() for r in rows):
            raise ValueError(f"{key}: prompt lengths differ: not the same prompts in the same order")
        idx = rng.integers(0, len(rows[0]), size=(draws, len(rows[0])))
        base = pooled_tau(rows[0], idx)
        out[key] = {"tau": [float(pooled_tau(r)) for r in rows],
                    "diff": [[float(x) for x in np.percentile(pooled_tau(r, idx) - base, [2.5, 97.5])]
                             for r in rows[1:]]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("evals", nargs="+", help="eval.json files; the first is the base")
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if len(args.evals) < 2:
        ap.error("give at least two eval.json files")
    evals = [json.loads(Path(p).read_text())["eval"] for p in args.evals]
    res = compare(evals, args.draws, args.seed)
    names = [Path(p).parent.name or p for p in args.evals]
    rows = [{"set": key, names[0]: round(r["tau"][0], 3),
             **{n: f"{tau:.3f} [{lo:+.3f}, {hi:+.3f}]" for n, tau, (lo, hi) in zip(names[1:], r["tau"][1:], r["diff"])}}
            for key, r in res.items()]
    report(f"pooled tau per set; each drafter after {names[0]}: its tau [95% interval of the difference]", rows,
           {"bench": "eval_compare", "files": args.evals, "draws": args.draws, "compare": res}, device="cpu")


if __name__ == "__main__":
    main()
