"""The HTTP backend: the same sweep against a running OpenAI-compatible server (the official `openai`
client, streaming). The plain arm sends `speculative: false` (a flashdraft extension; vLLM's name).

Timings are taken on the client: TTFT is the first chunk with text. Output token counts come from the
streamed `usage`. ITL is the interval between streamed chunks, since a chunk's token count is unknown.
Drafting counters come from each request's final chunk (`metrics`, flashdraft) or, failing that, from
the difference of the server's Prometheus `*spec_decode_*` counters over the arm (flashdraft, vLLM).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import Callable

import httpx
import openai

from flashdraft.bench.datasets import Prompt
from flashdraft.bench.runner import ArmRun, BenchError, Workload
from flashdraft.bench.stats import RequestResult, spec_delta, sum_spec

SPEC_KEYS = ("acceptance_length", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
             "accepted_per_position", "acceptance_histogram")
PROMETHEUS = {"spec_decode_num_drafts": "num_drafts", "spec_decode_num_draft_tokens": "num_draft_tokens",
              "spec_decode_num_accepted_tokens": "num_accepted_tokens"}
SAMPLE = re.compile(r"^([\w:]+?)(?:_total)?(\{[^}]*\})?\s+(\S+)")


def api_base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class RemoteBackend:
    def __init__(self, url: str, prompts: list[Prompt], chat: bool, workload: Workload, model: str | None = None,
                 api_key: str | None = None, timeout_s: float = 600.0):
        if not prompts:
            raise ValueError("no prompts to run")
        self.base_url = api_base(url)
        self.root = self.base_url[: -len("/v1")]
        self.prompts = prompts
        self.chat = chat
        self.workload = workload
        self.api_key = api_key or "EMPTY"
        self.timeout_s = timeout_s
        self.model = model or self.served_models()[0]

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=self.timeout_s)

    def served_models(self) -> list[str]:
        try:
            with openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=30) as c:
                names = [m.id for m in c.models.list()]
        except openai.APIError as e:
            raise BenchError(f"cannot list models at {self.base_url}: {e}") from None
        if not names:
            raise BenchError(f"{self.base_url}/models lists no model")
        return names

    def prometheus_spec(self) -> dict | None:
        try:
            r = httpx.get(self.root + "/metrics", timeout=10, headers={"Authorization": f"Bearer {self.api_key}"})
        except httpx.HTTPError:
            return None
        return parse_prometheus(r.text) if r.status_code == 200 else None

    def warmup(self, speculative: bool, concurrency: int = 1) -> None:
        indices = [i % len(self.prompts) for i in range(concurrency)]
        asyncio.run(self._arm(speculative, concurrency, indices, None, min(16, self.workload.max_tokens)))

    def run(self, speculative: bool, concurrency: int, on_done: Callable[[], None] | None = None) -> ArmRun:
        before = self.prometheus_spec() if speculative else None
        results, wall = asyncio.run(self._arm(speculative, concurrency, range(len(self.prompts)), on_done, None))
        spec = None
        if speculative:
            if results and all(r.spec is not None for r in results):
                spec = sum_spec([r.spec for r in results])
            elif before is not None and (after := self.prometheus_spec()) is not None:
                spec = spec_delta(before, after)
        return ArmRun(results, wall, spec)

    async def _arm(self, speculative: bool, concurrency: int, indices, on_done: Callable[[], None] | None,
                   max_tokens: int | None) -> tuple[list[RequestResult], float]:
        pending = deque(indices)
        results: list[RequestResult] = []
        async with self.client() as client:
            async def worker() -> None:
                while pending:
                    results.append(await self.request(client, pending.popleft(), speculative, max_tokens))
                    if on_done is not None:
                        on_done()

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(pending)))))
            return results, time.perf_counter() - t0

    async def request(self, client: openai.AsyncOpenAI, index: int, speculative: bool,
                      max_tokens: int | None) -> RequestResult:
        p = self.prompts[index]
        params = self.workload.params(index, speculative, max_tokens)
        extra = {}
        if not speculative:
            extra["speculative"] = False
        if params.ignore_eos:
            extra["ignore_eos"] = True
        common = dict(model=self.model, max_tokens=params.max_tokens, temperature=params.temperature,
                      seed=params.seed, stream=True, stream_options={"include_usage": True},
                      extra_body=extra or None)
        times: list[float] = []
        pieces: list[str] = []
        usage, metrics, finish = None, None, None
        t0 = time.perf_counter()
        try:
            if self.chat:
                stream = await client.chat.completions.create(messages=p.messages, **common)
            else:
                stream = await client.completions.create(prompt=p.text, **common)
            async for chunk in stream:
                now = time.perf_counter() - t0
                usage = chunk.usage or usage
                m = (chunk.model_extra or {}).get("metrics")
                metrics = m if isinstance(m, dict) else metrics
                for choice in chunk.choices:
                    piece = choice.delta.content if self.chat else choice.text
                    if piece:
                        times.append(now)
                        pieces.append(piece)
                    finish = choice.finish_reason or finish
        except openai.APIError as e:
            raise BenchError(f"request to {self.base_url} failed: {e}") from None
        e2e = time.perf_counter() - t0
        spec = None
        if speculative and metrics and "num_drafts" in metrics:
            spec = {k: metrics.get(k) for k in SPEC_KEYS}
        return RequestResult(index=index, prompt_tokens=usage.prompt_tokens if usage else 0,
                             output_tokens=usage.completion_tokens if usage else len(times),
                             ttft_s=times[0] if times else None, e2e_s=e2e, chunk_times_s=times, chunk_tokens=None,
                             output="".join(pieces), finish_reason=finish, spec=spec)


def parse_prometheus(text: str) -> dict | None:
    """Sum the `*:spec_decode_*` counters over all label sets; None when the server exports none."""
    out = {v: 0 for v in PROMETHEUS.values()}
    per_pos: dict[int, int] = {}
    found = False
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if line.startswith("#") or m is None:
            continue
        name, labels, value = m.group(1).split(":")[-1], m.group(2) or "", m.group(3)
        try:
            v = int(float(value))
        except ValueError:
            continue
        if name in PROMETHEUS:
            out[PROMETHEUS[name]] += v
            found = True
        elif name == "spec_decode_num_accepted_tokens_per_pos" and (pos := re.search(r'position="(\d+)"', labels)):
            per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0) + v
    if not found:
        return None
    out["accepted_per_position"] = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out
