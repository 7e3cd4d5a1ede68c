"""`/metrics`: the server's Prometheus metrics, under vLLM's (V1) names so its dashboards and alerts work
(docs/grafana/nano_vllm.json is one built on them).

* Engine state, read at scrape time through `engine_state` (the one place that looks inside the engine):
  `vllm:num_requests_running` / `_waiting`, `vllm:kv_cache_usage_perc` (and its deprecated alias
  `vllm:gpu_cache_usage_perc`), `vllm:num_preemptions_total`, `vllm:cache_config_info`; and the engine
  loop's health: `nano_vllm:engine_stalled` (1 while the loop has held work for more than
  `server.health_stall_s` without completing a step, or has died) and `nano_vllm:engine_stalled_seconds`.
* Each step, seen as the scheduler returns it (`observe_steps` wraps the scheduler instance's `schedule`):
  `vllm:iteration_tokens_total` (tokens per step), the prefix cache's `vllm:prefix_cache_queries_total` /
  `vllm:prefix_cache_hits_total` (prompt tokens looked up / found, counted as a request is admitted), and
  each request's queue time (arrival in the engine to its first admission).
* Per request, as its tokens reach the server: token counters, TTFT, inter-token latency, TPOT, the
  queue / prefill / decode / inference / end-to-end times, prompt and generation lengths.

Every server gets its own `CollectorRegistry`, so several servers in one process (tests) never share or
clash over a series.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's bucket edges, so histograms from both servers can be compared bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class EngineState:
    num_requests_running: int
    num_requests_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (vLLM's `kv_cache_usage_perc`: 1.0 means full)."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


def engine_state(engine) -> EngineState:
    """The scheduler's queues and the block manager's pool (paper §4.2, §4.5), read from another thread: only
    lengths and counters, each read atomically under the GIL; a scrape may mix two adjacent steps."""
    bm, sched = engine.block_manager, engine.scheduler
    return EngineState(len(sched.running), len(sched.waiting), bm.num_blocks, bm.num_free_blocks,
                       int(getattr(sched, "num_preemptions", 0)))


class _EngineCollector:
    """Series computed at scrape time (one updated by the engine thread would need a hook in the engine)."""

    def __init__(self, engine, model_name: str, health: Callable[[], tuple[bool, float]] | None = None):
        self.engine, self.model_name, self.health = engine, model_name, health
        config = engine.config
        self.cache_config = {"block_size": str(config.block_size),
                             "num_gpu_blocks": str(engine.block_manager.num_blocks),
                             "enable_prefix_caching": str(bool(config.enable_prefix_caching))}

    def collect(self):
        state, m = engine_state(self.engine), [self.model_name]
        usage_doc = "KV-cache usage: fraction of KV blocks in use (1 = 100%)."
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in the running batch.", state.num_requests_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be scheduled.",
             state.num_requests_waiting),
            ("vllm:kv_cache_usage_perc", usage_doc, state.kv_cache_usage),
            ("vllm:gpu_cache_usage_perc", f"Deprecated: vllm:kv_cache_usage_perc. {usage_doc}", state.kv_cache_usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(m, value)
            yield family
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemptions.",
                                          labels=["model_name"])
        preemptions.add_metric(m, state.num_preemptions)
        yield preemptions
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache's configuration.",
                                 labels=["model_name", *self.cache_config])
        info.add_metric([*m, *self.cache_config.values()], 1.0)
        yield info
        if self.health is not None:
            stalled, seconds = self.health()
            for name, doc, value in (
                ("nano_vllm:engine_stalled", "1 while the engine loop has held work longer than "
                 "server.health_stall_s without completing a step, or has died; else 0.", float(stalled)),
                ("nano_vllm:engine_stalled_seconds", "Seconds the engine loop has held work without "
                 "completing a step (0 while it has none).", seconds),
            ):
                family = GaugeMetricFamily(name, doc, labels=["model_name"])
                family.add_metric(m, value)
                yield family


def observe_steps(scheduler, observer) -> None:
    """Call `observer.observe_step(out, admitted)` after each `schedule()` of this scheduler instance that
    schedules work (`admitted`: the sequences it admitted, new or resumed after a preemption). One wrapper
    per scheduler, holding its observers weakly, so servers that come and go on one engine do not pile up."""
    observers = vars(scheduler).get("_step_observers")
    if observers is None:
        observers = scheduler._step_observers = []
        schedule = scheduler.schedule

        def schedule_and_observe(*args, **kwargs):
            before = set(scheduler.running)
            out = schedule(*args, **kwargs)
            if out.seqs:
                admitted = [s for s in out.seqs if s not in before]
                for ref in list(observers):
                    if (obs := ref()) is not None:
                        obs.observe_step(out, admitted)
            return out

        scheduler.schedule = schedule_and_observe
    observers[:] = [r for r in observers if r() is not None] + [weakref.ref(observer)]


class ServerMetrics:
    """The Prometheus registry of one server and the request-level series it records."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine, model_name: str, health: Callable[[], tuple[bool, float]] | None = None):
        """`health()`, if given, returns (stalled, seconds without a step) of the engine loop."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prompt tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generated tokens.", m, registry=r)
        self.request_success = Counter("vllm:request_success", "Count of finished requests, by finish reason "
                                       "(stop, length, abort, error).", [*m, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Deprecated: "
                              "vllm:inter_token_latency_seconds. Time per output token in seconds.", m,
                              buckets=TPOT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", m,
                             buckets=TPOT_BUCKETS, registry=r)
        self.request_tpot = Histogram("vllm:request_time_per_output_token_seconds", "Mean time per output "
                                      "token of each request, in seconds.", m, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End to end request latency in seconds.", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        phase = {}
        for key, what in (("queue", "in the WAITING phase (arrival to first admission)"),
                          ("prefill", "in the PREFILL phase (admission to first token)"),
                          ("decode", "in the DECODE phase (first token to last)"),
                          ("inference", "in the RUNNING phase (admission to last token)")):
            phase[key] = Histogram(f"vllm:request_{key}_time_seconds", f"Time spent {what} for a request.", m,
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time, self.prefill_time = phase["queue"], phase["prefill"]
        self.decode_time, self.inference_time = phase["decode"], phase["inference"]
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens per engine step.", m,
                                          buckets=ITERATION_TOKEN_BUCKETS, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens "
                                      "looked up as a request is admitted.", m, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens found.", m,
                                   registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", m,
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per request.", m, buckets=TOKEN_BUCKETS,
                                                   registry=r)
        r.register(_EngineCollector(engine, model_name, health))
        # Create every series now, so a scrape shows zeros from the start (as vLLM does), not gaps.
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.itl,
                       self.request_tpot, self.e2e, *phase.values(), self.iteration_tokens,
                       self.prefix_queries, self.prefix_hits, self.request_prompt_tokens,
                       self.request_generation_tokens):
            metric.labels(model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)
        self._unscheduled: dict[str, RequestTimer] = {}  # request id -> timer, until first admitted
        observe_steps(engine.scheduler, self)

    def request(self, num_prompt_tokens: int, request_id: str | None = None) -> RequestTimer:
        """Start timing one request (at its arrival, before it is queued); with its `request_id`, its
        queue, prefill and inference times are recorded too."""
        timer = RequestTimer(self, num_prompt_tokens)
        if request_id is not None:
            timer.request_id = request_id
            self._unscheduled[request_id] = timer
        return timer

    def observe_step(self, out, admitted: list) -> None:
        """One scheduled step (on the engine thread): its tokens, the prefix-cache lookups of the sequences
        it admitted, and the queue time of those admitted for the first time."""
        label, now = self.model_name, time.perf_counter()
        self.iteration_tokens.labels(label).observe(out.num_tokens)
        for seq in admitted:
            self.prefix_queries.labels(label).inc(seq.num_tokens)
            self.prefix_hits.labels(label).inc(seq.num_cached_tokens)
            timer = self._unscheduled.pop(seq.request_id, None) if self._unscheduled else None
            if timer is not None:
                timer.scheduled = now
                self.queue_time.labels(label).observe(max(now - seq.arrival_time, 0.0))

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)


class RequestTimer:
    """One request's clock: TTFT at its first token, TPOT between later ones, the rest when it ends."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int):
        self.metrics, self.num_prompt_tokens = metrics, num_prompt_tokens
        self.arrival = self.last = time.perf_counter()
        self.request_id: str | None = None
        self.scheduled: float | None = None  # first admitted by the scheduler (set on the engine thread)
        self.first_token: float | None = None
        self.num_generated = 0
        self.done = False

    def tokens(self, n: int) -> None:
        """`n` new tokens reached the server."""
        if n <= 0:
            return
        now, m, label = time.perf_counter(), self.metrics, self.metrics.model_name
        if self.num_generated == 0:
            self.first_token = now
            m.ttft.labels(label).observe(now - self.arrival)
            m.prompt_tokens.labels(label).inc(self.num_prompt_tokens)
            if self.scheduled is not None:
                m.prefill_time.labels(label).observe(max(now - self.scheduled, 0.0))
        else:
            m.tpot.labels(label).observe((now - self.last) / n)
            m.itl.labels(label).observe((now - self.last) / n)
        self.num_generated += n
        self.last = now
        m.generation_tokens.labels(label).inc(n)

    def finish(self, reason: str | None) -> None:
        """The request ended (once; later calls are ignored)."""
        if self.done:
            return
        self.done = True
        m, label = self.metrics, self.metrics.model_name
        if self.request_id is not None:
            m._unscheduled.pop(self.request_id, None)
        m.request_success.labels(label, reason or "abort").inc()
        m.e2e.labels(label).observe(time.perf_counter() - self.arrival)
        if self.first_token is not None:
            m.decode_time.labels(label).observe(self.last - self.first_token)
            if self.num_generated > 1:
                m.request_tpot.labels(label).observe((self.last - self.first_token) / (self.num_generated - 1))
        if self.scheduled is not None and self.first_token is not None:
            m.inference_time.labels(label).observe(max(self.last - self.scheduled, 0.0))
        m.request_prompt_tokens.labels(label).observe(self.num_prompt_tokens)
        m.request_generation_tokens.labels(label).observe(self.num_generated)
