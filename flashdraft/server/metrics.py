"""Prometheus metrics, one CollectorRegistry per app. Engine-wide numbers come from the engine
thread's snapshot (a scrape never touches the engine); names follow vLLM's with a `flashdraft:`
prefix, e.g. `flashdraft:spec_decode_num_drafts_total`."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flashdraft.server.async_engine import AsyncEngine

P = "flashdraft:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class EngineCollector(Collector):
    def __init__(self, aengine: AsyncEngine, model_name: str):
        self.aengine = aengine
        self.model_name = model_name

    def _one(self, family: type, name: str, doc: str, value: float) -> Metric:
        m = family(P + name, doc, labels=["model_name"])
        m.add_metric([self.model_name], value)
        return m

    def collect(self) -> Iterator[Metric]:
        s = self.aengine.snapshot
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._one(g, "num_requests_running", "Requests in the running batch.", s["running"])
        yield self._one(g, "num_requests_waiting", "Requests waiting to be scheduled.", s["waiting"])
        yield self._one(g, "kv_cache_used_blocks", "KV cache blocks in use.", s["kv_used_blocks"])
        yield self._one(g, "kv_cache_total_blocks", "KV cache blocks in all.", s["kv_total_blocks"])
        yield self._one(g, "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                        s["kv_used_blocks"] / max(1, s["kv_total_blocks"]))
        yield self._one(c, "engine_steps", "Engine steps (batched forwards).", s["stats"].get("num_steps", 0))
        yield self._one(c, "num_preemptions", "Requests preempted to free KV blocks.",
                        s["stats"].get("num_preemptions", 0))
        yield self._one(c, "generation_tokens", "Generated tokens.", s["stats"].get("num_generated_tokens", 0))
        yield self._one(c, "prompt_tokens", "Prompt tokens of finished requests.", s["prompt_tokens"])
        yield self._one(c, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                        s["prefix_cache_queries"])
        yield self._one(c, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s["prefix_cache_hits"])
        done = CounterMetricFamily(P + "request_success", "Finished requests by finish reason.",
                                   labels=["model_name", "finished_reason"])
        for reason in sorted({"stop", "length", "abort"} | set(s["finished"])):
            done.add_metric([self.model_name, reason], s["finished"].get(reason, 0))
        yield done
        spec = s["spec"]
        yield self._one(c, "spec_decode_num_drafts", "Speculative drafts proposed.", spec.get("num_drafts", 0))
        yield self._one(c, "spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.get("num_draft_tokens", 0))
        yield self._one(c, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                        spec.get("num_accepted_tokens", 0))
        yield self._one(c, "spec_decode_num_paused_steps",
                        "Engine steps decoded without drafts while speculative_disable_batch_size or more ran.",
                        spec.get("paused_steps", 0))
        yield self._one(c, "spec_decode_num_gated_steps",
                        "Request steps decoded without drafts by an acceptance gate: the request's recent "
                        "acceptance length below speculative_min_acceptance_length, or (the default) the "
                        "batch's below the break-even of the step costs.", spec.get("gated_steps", 0))
        per_pos = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for pos, n in enumerate(spec.get("accepted_per_position", [])):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos


class ServerMetrics:
    def __init__(self, aengine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(aengine, model_name))
        self.http_requests = Counter(P + "http_requests", "HTTP requests by endpoint and status code.",
                                     ["endpoint", "status"], registry=self.registry)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                             ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)

    def observe(self, metrics: dict) -> None:
        if "e2e_s" in metrics:
            self.e2e.observe(metrics["e2e_s"])
        if "ttft_s" in metrics:
            self.ttft.observe(metrics["ttft_s"])
