"""Requests that process or read the target's logits (penalties, log-probabilities) under speculation, with
the shipped pair through the public API (`LLM.chat`): tokens against plain decoding of the same settings
(the same engine, `speculative=False`), log-probabilities against plain decoding's, and throughput beside
requests without processing. Such requests choose their tokens outside the step graphs and are never
launched behind an unread step, so their cost is host time; this measures it.

    python benchmarks/device/processed_pair.py smollm2.gguf mt_bench.jsonl [N] [MAX_TOKENS] [DTYPE]

Arms: base (greedy), logprobs (logprobs=1), penalties (repetition_penalty=1.1, frequency_penalty=0.3),
each with speculation on and off, N prompts one at a time (c=1) and in batches of 8 (c=8). Prints a table
of the arms and one JSON line."""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import log, report  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402

SHIPPED = str(ROOT / "flashdraft" / "drafters" / "smollm2-135m-dflash")
ARMS = {"base": {}, "logprobs": {"logprobs": 1}, "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.3}}


def run(llm, convs, kw, spec, c, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, speculative=spec, **kw)
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(convs), c):
        outs += llm.chat(convs[i: i + c], params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    drafts = sum(o.metrics.get("num_drafts", 0) for o in outs)
    tau = sum(o.metrics.get("acceptance_length", 0) * o.metrics.get("num_drafts", 0) for o in outs) / max(drafts, 1)
    return outs, {"tok_s": tokens / wall, "tau": tau}


def main() -> None:
    gguf, path = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    dtype = sys.argv[5] if len(sys.argv) > 5 else "bfloat16"
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][:n]
    convs = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    llm = LLM(gguf, draft=SHIPPED, device="cuda", dtype=dtype)
    for kw in ARMS.values():  # compiles and captures before the clock matters
        llm.chat(convs[:8], SamplingParams(max_tokens=16, **kw))
    summary = {}
    for c in (1, 8):
        for arm, kw in ARMS.items():
            llm.reset_prefix_cache()
            plain, p = run(llm, convs, kw, False, c, max_tokens)
            llm.reset_prefix_cache()
            spec, s = run(llm, convs, kw, True, c, max_tokens)
            same = sum(a.token_ids == b.token_ids for a, b in zip(spec, plain))
            line = {"c": c, "arm": arm, "dtype": dtype, "plain_tok_s": round(p["tok_s"], 1),
                    "spec_tok_s": round(s["tok_s"], 1), "speedup": round(s["tok_s"] / p["tok_s"], 3),
                    "tau": round(s["tau"], 3), "same_tokens": f"{same}/{len(spec)}"}
            if kw.get("logprobs") is not None:  # over each pair's common prefix of tokens
                diffs = [abs(x.logprob - y.logprob) for a, b in zip(spec, plain)
                         for x, y in zip(a.logprobs, b.logprobs) if x.token_id == y.token_id]
                firsts = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
                          for a, b in zip(spec, plain)]
                line |= {"logprob_max_diff": max(diffs), "logprob_median_diff": sorted(diffs)[len(diffs) // 2],
                         "first_mismatch": [f for f in firsts if f is not None]}
            summary[f"{arm}@{c}"] = line
            log(json.dumps(line))
    base = {c: summary[f"base@{c}"]["spec_tok_s"] for c in (1, 8)}
    report(f"the shipped pair, {dtype}, {len(convs)} MT-Bench prompts x {max_tokens} tokens: plain against DFlash",
           list(summary.values()),
           {"bench": "processed_pair", "dtype": dtype, "arms": summary,
            "spec_tok_s_vs_base": {k: round(v["spec_tok_s"] / base[v["c"]], 3) for k, v in summary.items()}},
           columns=["c", "arm", "plain_tok_s", "spec_tok_s", "speedup", "tau", "same_tokens", "logprob_max_diff"],
           device="cuda")


if __name__ == "__main__":
    main()
