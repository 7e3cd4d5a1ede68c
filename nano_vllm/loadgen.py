"""Workloads and the open-loop load generator, written once for nano_vllm, nano_sglang and nano_distserve.

*Open loop*: requests arrive on their own schedule (a Poisson process, or gamma-distributed gaps for
burstier traffic, as in vLLM's benchmark_serving), whether or not earlier ones have finished — the way
users hit a server, and the only way queueing delay shows up in TTFT. (A closed loop, "send the next one
when one finishes", hides overload.) Two drivers share one request format:

* `run_engine_open_loop(engine, requests, arrivals)` steps an in-process engine and adds each request
  when its time comes;
* `run_http_open_loop(base_url, requests, arrivals)` sends each request from its own thread at its time to
  an OpenAI-compatible `/v1/completions` endpoint (streaming) and times the SSE chunks.

Both return `nano_vllm.metrics.RequestMetrics`, summarised by `metrics.summarize`.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.parse
from dataclasses import dataclass

from nano_vllm.metrics import RequestMetrics
from nano_vllm.sampling_params import SamplingParams


@dataclass
class Request:
    prompt: str | list[int]
    sampling_params: SamplingParams


def nano_vllm_workload(num_seqs: int = 256, min_input_len: int = 100, max_input_len: int = 1024,
                       min_output_len: int = 100, max_output_len: int = 1024, vocab: int = 10000,
                       temperature: float = 0.6, seed: int = 0) -> list[Request]:
    """nano-vllm's bench.py workload, draw for draw: `random.seed(0)`, every prompt (length
    `randint(100, 1024)`, ids `randint(0, 10000)`) first, then every `max_tokens = randint(100, 1024)`;
    `ignore_eos=True`. The defaults give 256 requests and 133,966 output tokens."""
    rng = random.Random(seed)  # the same stream as random.seed(seed) + random.randint
    prompts = [[rng.randint(0, vocab) for _ in range(rng.randint(min_input_len, max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    return [Request(p, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m))
            for p, m in zip(prompts, max_tokens)]


def poisson_arrivals(num: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Arrival times (s from 0) of `num` requests at `rate` per second; gaps ~ Gamma(k=burstiness,
    mean 1/rate) — burstiness 1 is a Poisson process, < 1 burstier. rate = inf: all at time 0."""
    if rate == float("inf"):
        return [0.0] * num
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate}, {burstiness}")
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(num):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(t)
    return times


def run_engine_open_loop(engine, requests: list[Request], arrivals: list[float],
                         outputs: list | None = None) -> tuple[list[RequestMetrics], float]:
    """Drive an in-process LLMEngine open-loop; returns per-request metrics and the wall time. With
    `outputs` (a list), each request's generated token ids are appended to it, in request order."""
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    t0 = time.perf_counter()
    seqs, nxt = [None] * len(requests), 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < len(order) and t0 + arrivals[order[nxt]] <= now:
            i = order[nxt]
            seqs[i] = engine.add_request(requests[i].prompt, requests[i].sampling_params,
                                         arrival_time=t0 + arrivals[i])
            nxt += 1
        if engine.has_unfinished_requests():
            engine.step()
        elif nxt < len(order):  # idle until the next arrival
            time.sleep(max(0.0, t0 + arrivals[order[nxt]] - time.perf_counter()))
    wall = time.perf_counter() - t0
    if outputs is not None:
        outputs.extend(s.output_token_ids for s in seqs)
    return [RequestMetrics.from_sequence(s) for s in seqs], wall


def _body(req: Request, model: str | None) -> dict:
    sp = req.sampling_params
    body = {"prompt": req.prompt, "max_tokens": sp.max_tokens, "temperature": sp.temperature,
            "top_p": sp.top_p, "top_k": sp.top_k, "ignore_eos": sp.ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    if sp.seed is not None:
        body["seed"] = sp.seed
    if model is not None:
        body["model"] = model
    return body


def stream_completion(base_url: str, body: dict, timeout: float = 600.0) -> tuple[list[float], dict, list[dict]]:
    """POST a streaming /v1/completions request; returns (arrival time of each chunk, usage, chunks)."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("POST", url.path.rstrip("/") + "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        times, chunks, usage = [], [], {}
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                times.append(time.perf_counter())
                chunks.append(chunk)
        return times, usage, chunks
    finally:
        conn.close()


def run_http_open_loop(base_url: str, requests: list[Request], arrivals: list[float],
                       model: str | None = None) -> tuple[list[RequestMetrics], float]:
    """Send every request at its arrival time, each on its own thread, to an OpenAI-compatible server."""
    results: list[RequestMetrics | None] = [None] * len(requests)
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def one(i: int) -> None:
        try:
            time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            start = time.perf_counter()
            times, usage, chunks = stream_completion(base_url, _body(requests[i], model))
            n_out = usage.get("completion_tokens", len(times))
            reason = next((c["choices"][0].get("finish_reason") for c in reversed(chunks)
                           if c["choices"][0].get("finish_reason")), None)
            results[i] = RequestMetrics(str(i), start, times[0] if times else None,
                                        times[-1] if times else time.perf_counter(),
                                        usage.get("prompt_tokens", 0), n_out, reason)
        except BaseException as e:  # reported after all threads end
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, time.perf_counter() - t0  # type: ignore[return-value]
