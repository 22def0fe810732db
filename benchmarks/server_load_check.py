"""Load check of `flashdraft serve` on this machine: N streaming chat requests at concurrency C
through the official `openai` client against a real server on a local port. Counts completed,
errored and lost requests and prints latency percentiles; one JSON line at the end.

    python benchmarks/server_load_check.py [--requests 256] [--concurrency 32] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import percentile as pct  # noqa: E402
from timing import report  # noqa: E402

from flashdraft.bench.datasets import load_prompts  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one(client, prompt, args, sem, res):
    async with sem:
        t0 = time.perf_counter()
        times, text, reason = [], "", None
        try:
            stream = await client.chat.completions.create(
                model=args.model_name, messages=prompt, max_tokens=args.max_tokens, temperature=0.0, stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    times.append(time.perf_counter())
                    text += chunk.choices[0].delta.content
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
            res.append({"ok": reason in ("stop", "length"), "ttft": times[0] - t0 if times else None,
                        "e2e": time.perf_counter() - t0,
                        "itl": [b - a for a, b in zip(times, times[1:])], "reason": reason, "chars": len(text)})
        except Exception as e:  # counted, never hidden
            res.append({"ok": False, "error": repr(e)})


async def run(args, base):
    # held-out ShareGPT first turns short enough for a 2-core CPU (the longest run to 27k tokens)
    prompts = [p.messages for p in load_prompts("sharegpt") if len(p.messages[0]["content"]) <= 2000]
    prompts = prompts[: args.requests]
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=args.concurrency)))
    sem, res = asyncio.Semaphore(args.concurrency), []
    t0 = time.perf_counter()
    await asyncio.gather(*(one(client, p, args, sem, res) for p in prompts))
    return res, time.perf_counter() - t0, len(prompts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model-name", default="smollm2-135m-instruct")
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "flashdraft", "serve", "--no-spec", "--port", str(port),
                               "--max-num-seqs", str(args.concurrency), "--log-level", "warning"])
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        res, wall, sent = asyncio.run(run(args, f"http://127.0.0.1:{port}/v1"))
    finally:
        server.terminate()
        server.wait(timeout=30)
    ok = [r for r in res if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    e2e = [r["e2e"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    summary = {"sent": sent, "completed": len(ok), "errored": sum(not r["ok"] for r in res),
               "lost": sent - len(res), "wall_s": wall, "req_per_s": len(ok) / wall,
               "ttft_ms": {q: 1e3 * pct(ttft, q) for q in (50, 95, 99)},
               "itl_ms": {q: 1e3 * pct(itl, q) for q in (50, 95, 99)},
               "e2e_s": {q: pct(e2e, q) for q in (50, 95, 99)}, "mean_e2e_s": statistics.mean(e2e) if e2e else None}
    errors = [r.get("error") for r in res if not r["ok"]]
    report(f"{sent} requests at concurrency {args.concurrency}, max_tokens {args.max_tokens}: "
           f"{summary['completed']} completed, {summary['errored']} errored, {summary['lost']} lost, {wall:.1f}s wall",
           [{"latency": k, "p50": summary[k][50], "p95": summary[k][95], "p99": summary[k][99]}
            for k in ("ttft_ms", "itl_ms", "e2e_s")],
           {"bench": "server_load_check", **summary, "first_error": errors[0] if errors else None}, device="cpu")
    sys.exit(0 if summary["completed"] == sent else 1)


if __name__ == "__main__":
    main()
