"""Time to first token of MT-Bench's second turns with the prefix cache on and off, and the turn's tau, through
the public API (`LLM.chat`), the shipped pair, one conversation at a time. For each question: turn 1 is
answered (greedy, its pages cached), then turn 2 (the conversation so far as its prefix) is answered
twice: with the cache as turn 1 left it, and after `reset_prefix_cache()`. The order alternates between
questions so that neither arm always runs second.

    python benchmarks/device/prefix_ttft.py smollm2.gguf mt_bench_turns.jsonl [N] [MAX_TOKENS] [DTYPE] [GATE]

GATE: auto (the default step gate) or off (every step verifies a whole block: the gate's choices follow
measured step times, so with it two runs of one prompt may verify at different steps and read different
tau from the same tokens).

mt_bench_turns.jsonl: one {"turns": [first, second]} a line (MT-Bench's question.jsonl has this field).
Prints a table of the two arms and one JSON line (each question's line goes to stderr)."""
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import log, report  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402

SHIPPED = str(ROOT / "flashdraft" / "drafters" / "smollm2-135m-dflash")


def main() -> None:
    gguf, path = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    dtype = sys.argv[5] if len(sys.argv) > 5 else "bfloat16"
    gate = {} if len(sys.argv) <= 6 or sys.argv[6] == "auto" else {"speculative_min_acceptance_length": None}
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()][:n]
    llm = LLM(gguf, draft=SHIPPED, device="cuda", dtype=dtype, **gate)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm = [{"role": "user", "content": rows[0]["turns"][0]}]
    llm.chat(warm, params)  # compiles and captures before the clock matters
    results = {"cached": [], "cold": []}
    for i, row in enumerate(rows):
        first = [{"role": "user", "content": row["turns"][0]}]
        answer = llm.chat(first, params)[0]
        second = first + [{"role": "assistant", "content": answer.text}, {"role": "user", "content": row["turns"][1]}]
        outs = {}
        for arm in (("cached", "cold") if i % 2 == 0 else ("cold", "cached")):
            if arm == "cold":
                llm.engine.reset_prefix_cache()
            else:  # turn 1's pages: answered again if a cold run came first and evicted nothing it needs
                llm.chat(first, params)
            outs[arm] = llm.chat(second, params)[0]
        for arm, out in outs.items():
            m = out.metrics
            results[arm].append({"ttft_ms": 1e3 * m["ttft_s"], "tau": m.get("acceptance_length", 0.0),
                                 "cached": m["num_cached_tokens"], "prompt": m["num_prompt_tokens"],
                                 "tokens": out.token_ids})
        c, k = results["cached"][-1], results["cold"][-1]
        log(f"{i:3d} prompt {c['prompt']:5d} cached {c['cached']:5d} | TTFT cached {c['ttft_ms']:7.2f} ms, cold "
            f"{k['ttft_ms']:7.2f} ms | tau {c['tau']:.3f} / {k['tau']:.3f} | same tokens "
            f"{c['tokens'] == k['tokens']}")
    summary = {arm: {"ttft_ms_median": statistics.median(r["ttft_ms"] for r in rs),
                     "ttft_ms_mean": statistics.mean(r["ttft_ms"] for r in rs),
                     "tau_mean": statistics.mean(r["tau"] for r in rs),
                     "cached_tokens_mean": statistics.mean(r["cached"] for r in rs),
                     "prompt_tokens_mean": statistics.mean(r["prompt"] for r in rs)} for arm, rs in results.items()}
    summary["same_tokens"] = sum(a["tokens"] == b["tokens"] for a, b in zip(results["cached"], results["cold"]))
    summary["same_tau"] = sum(a["tau"] == b["tau"] for a, b in zip(results["cached"], results["cold"]))
    summary["questions"] = len(rows)
    report(f"MT-Bench turn 2, {len(rows)} questions, {dtype}, gate {'off' if gate else 'auto'}: same tokens "
           f"{summary['same_tokens']}/{len(rows)}, same tau {summary['same_tau']}/{len(rows)}",
           [{"arm": arm, **summary[arm]} for arm in ("cached", "cold")], {"bench": "prefix_ttft", **summary},
           device="cuda")


if __name__ == "__main__":
    main()
