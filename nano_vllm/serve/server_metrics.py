"""`/metrics`: the server's Prometheus metrics, under vLLM's names so existing dashboards and alerts work.

Engine state (running / waiting requests, KV-cache usage) is read at scrape time through `engine_state`,
the one place that looks inside the engine. Request-level metrics (token counters, TTFT, TPOT, latency)
are recorded by the server as each request's tokens reach it. Every server gets its own
`CollectorRegistry`, so several servers in one process (tests) never share or clash over a series.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

# vLLM's bucket edges, so histograms from both servers can be compared bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


@dataclass
class EngineState:
    num_requests_running: int
    num_requests_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (vLLM's `gpu_cache_usage_perc`: 1.0 means full)."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


def engine_state(engine) -> EngineState:
    """The scheduler's queues and the block manager's pool (paper §4.2, §4.5), read from another thread: only
    lengths and counters, each read atomically under the GIL; a scrape may mix two adjacent steps."""
    bm = engine.block_manager
    return EngineState(len(engine.scheduler.running), len(engine.scheduler.waiting), bm.num_blocks,
                       bm.num_free_blocks)


class _EngineCollector:
    """Gauges computed at scrape time (a gauge updated by the engine thread would need a hook in the engine)."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        state = engine_state(self.engine)
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in the running batch.", state.num_requests_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be scheduled.",
             state.num_requests_waiting),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage: fraction of KV blocks in use (1 = 100%).",
             state.kv_cache_usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ServerMetrics:
    """The Prometheus registry of one server and the request-level series it records."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prompt tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generated tokens.", m, registry=r)
        self.request_success = Counter("vllm:request_success", "Count of finished requests, by finish reason "
                                       "(stop, length, abort, error).", [*m, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token in seconds.", m,
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End to end request latency in seconds.", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", m,
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per request.", m, buckets=TOKEN_BUCKETS,
                                                   registry=r)
        r.register(_EngineCollector(engine, model_name))
        # Create every series now, so a scrape shows zeros from the start (as vLLM does), not gaps.
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e,
                       self.request_prompt_tokens, self.request_generation_tokens):
            metric.labels(model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)

    def request(self, num_prompt_tokens: int) -> RequestTimer:
        """Start timing one request (at its arrival, before it is queued)."""
        return RequestTimer(self, num_prompt_tokens)

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)


class RequestTimer:
    """One request's clock: TTFT at its first token, TPOT between later ones, the rest when it ends."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int):
        self.metrics, self.num_prompt_tokens = metrics, num_prompt_tokens
        self.arrival = self.last = time.perf_counter()
        self.num_generated = 0
        self.done = False

    def tokens(self, n: int) -> None:
        """`n` new tokens reached the server."""
        if n <= 0:
            return
        now, m, label = time.perf_counter(), self.metrics, self.metrics.model_name
        if self.num_generated == 0:
            m.ttft.labels(label).observe(now - self.arrival)
            m.prompt_tokens.labels(label).inc(self.num_prompt_tokens)
        else:
            m.tpot.labels(label).observe((now - self.last) / n)
        self.num_generated += n
        self.last = now
        m.generation_tokens.labels(label).inc(n)

    def finish(self, reason: str | None) -> None:
        """The request ended (once; later calls are ignored)."""
        if self.done:
            return
        self.done = True
        m, label = self.metrics, self.metrics.model_name
        m.request_success.labels(label, reason or "abort").inc()
        m.e2e.labels(label).observe(time.perf_counter() - self.arrival)
        m.request_prompt_tokens.labels(label).observe(self.num_prompt_tokens)
        m.request_generation_tokens.labels(label).observe(self.num_generated)
