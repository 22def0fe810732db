"""Per-prompt acceptance of a drafter: one greedy batch over a prompt set on the embedded SmolLM2
(or --model), each request's tau, the pooled tau, quartiles, and the prompts with the lowest tau,
each checked against plain decoding (same tokens) so a low tau is never a silent logic error; and
the pooled tau by prompt length (chat-template tokens: under 128, 128-511, 512 or more).

    python benchmarks/per_prompt_tau.py [--dataset sharegpt] [--num-prompts 120] [--max-tokens 128]
        [--min-prompt-tokens 0] [--draft DIR] [--lowest 5] [--device cpu] [--json out.json]

--min-prompt-tokens N keeps, of the first --num-prompts prompts, those of N tokens or more. Prints the
lowest prompts as a table and one JSON line of the figures above; --json writes every prompt's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import log, report  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402


def pooled(metrics: list[dict]) -> float:
    """Tokens committed per verify step over several requests (accepted drafts plus one per step)."""
    drafts = sum(m["num_drafts"] for m in metrics)
    return (sum(m["num_accepted_tokens"] for m in metrics) + drafts) / drafts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--num-prompts", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lowest", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--min-prompt-tokens", type=int, default=0,
                    help="keep only the prompts of at least this many chat-template tokens")
    ap.add_argument("--json", default=None, help="write every prompt's tau and metrics here")
    args = ap.parse_args()
    if args.num_prompts < 2:
        ap.error(f"--num-prompts must be at least 2 for quartiles, got {args.num_prompts}")
    convs = [p.messages for p in load_prompts(args.dataset, args.num_prompts)]
    kw = {"model": args.model, "device": args.device, "dtype": args.dtype}
    llm = LLM(draft=args.draft, speculative_min_acceptance_length=None, **kw)  # no gate: the drafter's tau
    if args.min_prompt_tokens > 0:
        convs = [c for c in convs if len(llm.engine.apply_chat_template(c)) >= args.min_prompt_tokens]
        if len(convs) < 2:
            raise SystemExit(f"{len(convs)} of the first {args.num_prompts} prompts have "
                             f"{args.min_prompt_tokens} tokens or more: too few for quartiles")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.time()
    outs = llm.chat(convs, [params] * len(convs))
    wall = time.time() - t0
    rows = sorted(((o.metrics["acceptance_length"], i, o) for i, o in enumerate(outs) if o.metrics.get("num_drafts")),
                  key=lambda r: r[0])
    taus = [t for t, _, _ in rows]
    if len(taus) < 2:
        raise SystemExit(f"only {len(taus)} of {len(outs)} requests ran a verify step: no per-prompt tau to compare")
    drafts = sum(o.metrics["num_drafts"] for _, _, o in rows)
    q = statistics.quantiles(taus, n=4)
    tau = pooled([o.metrics for _, _, o in rows])
    log(f"{len(taus)} prompts x {args.max_tokens} tokens in {wall:.0f}s")
    by_len = {}
    for name, lo, hi in (("under 128", 0, 128), ("128-511", 128, 512), ("512+", 512, float("inf"))):
        part = [o.metrics for _, _, o in rows if lo <= o.metrics["num_prompt_tokens"] < hi]
        if part:
            by_len[name] = {"tau": pooled(part), "prompts": len(part)}
    plain = LLM(draft=None, **kw)
    low = rows[: args.lowest]
    ref = plain.chat([convs[i] for _, i, _ in low], [params] * len(low))
    lowest = [{"tau": t, "same_as_plain": o.token_ids == r.token_ids, "prompt": repr(convs[i][0]["content"][:60]),
               "output": repr(o.text[:60])} for (t, i, o), r in zip(low, ref)]
    report(f"pooled tau {tau:.2f} over {drafts} verify steps of {len(taus)} prompts; per prompt: quartiles "
           f"{q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f}, below 2: {sum(t < 2 for t in taus)}, 3.5 or more: "
           f"{sum(t >= 3.5 for t in taus)}; by prompt tokens: "
           + ", ".join(f"{k} {v['tau']:.2f} ({v['prompts']})" for k, v in by_len.items())
           + f"; the {len(low)} lowest:", lowest,
           {"bench": "per_prompt_tau", "dataset": args.dataset, "prompts": len(taus), "max_tokens": args.max_tokens,
            "pooled_tau": tau, "verify_steps": drafts, "quartiles": q, "by_prompt_tokens": by_len, "lowest": lowest},
           device=args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"prompt": convs[i][0]["content"], "tau": t, "text": o.text, "metrics": o.metrics}
                       for t, i, o in rows], f, indent=1)


if __name__ == "__main__":
    main()
