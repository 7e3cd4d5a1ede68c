"""The OpenAI-compatible server with a real HTTP client (http.client): outputs equal to transformers,
streaming, 32 concurrent requests batched by one engine, cancellation mid-stream, bad sampling values
answered with 400, `/metrics` (Prometheus text, vLLM's names, one registry per server), a dead engine
thread, and the `server:` config group. Malformed HTTP, slow and abusive clients, drain and the soak are
in test_server_faults.py."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_client import (
    DEADLINE_S,
    assert_openai_error,
    conn,
    gate_steps,
    get,
    post,
    sse,
    start,
    stop,
    wait_for,
    wait_idle,
)
from vllm_checkpoints import random_prompts

from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.loadgen import Request, poisson_arrivals, run_http_open_loop
from nano_vllm.metrics import summarize
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.serve.engine_loop import EngineLoop


@pytest.fixture(scope="module")
def server(qwen3_ckpt):
    engine = LLMEngine(EngineConfig(model=qwen3_ckpt, max_model_len=128, max_num_seqs=32))
    loop = EngineLoop(engine).start()
    srv, thread = start(loop)
    yield srv, loop
    stop(srv, thread)
    loop.stop()


def test_health_and_models(server):
    srv, _ = server
    c = conn(srv)
    c.request("GET", "/health")
    resp = c.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
    c.request("GET", "/v1/models")  # same keep-alive connection
    resp = c.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["data"][0]["id"] == "test-model"


def test_completion_and_streaming_agree_with_transformers(server, qwen3_ckpt, hf_greedy):
    srv, loop = server
    prompt = random_prompts(10, [20])[0]
    want = hf_greedy(qwen3_ckpt, prompt, 12)
    status, body = post(srv, "/v1/completions", {"model": "test-model", "prompt": prompt, "max_tokens": 12,
                                                 "temperature": 0})
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == loop.engine.tokenizer.decode(want)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32}
    status, data = post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                 "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse(data)
    assert status == 200 and len(chunks) == 13  # one per token, then usage
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == body["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 12


def test_chat_completion_streaming(server):
    srv, _loop = server
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi there"}]
    status, body = post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["object"] == "chat.completion"
    text = body["choices"][0]["message"]["content"]
    status, data = post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0,
                                                      "stream": True})
    chunks = sse(data)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert chunks[-1]["object"] == "chat.completion.chunk" and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_32_concurrent_requests_are_batched(server, qwen3_ckpt, hf_greedy, monkeypatch):
    srv, loop = server
    prompts = random_prompts(11, [3 + 2 * i for i in range(32)])
    sizes: list[int] = []
    gate = gate_steps(loop, monkeypatch, record=sizes)  # no step until all 32 requests have arrived
    results: list = [None] * 32

    def one(i):
        results[i] = post(srv, "/v1/completions", {"prompt": prompts[i], "max_tokens": 6, "temperature": 0})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(srv.api.active) == 32, "all 32 requests to arrive")
    finally:
        gate.set()
        for t in threads:
            t.join()
    dec = loop.engine.tokenizer.decode
    for p, (status, body) in zip(prompts, results):
        assert status == 200 and body["choices"][0]["text"] == dec(hf_greedy(qwen3_ckpt, p, 6))
    assert max(sizes) >= 16, sizes  # many requests in flight in one engine step
    wait_idle(loop, srv)


def _count_aborts(loop, monkeypatch) -> list[str]:
    seen: list[str] = []
    abort = loop.engine.abort_request
    monkeypatch.setattr(loop.engine, "abort_request", lambda rid: seen.append(rid) or abort(rid))
    return seen


def test_cancel_mid_stream_frees_blocks(server, monkeypatch):
    srv, loop = server
    seen = _count_aborts(loop, monkeypatch)
    gate = gate_steps(loop, monkeypatch)
    gate.allow(3)  # three tokens, then the engine holds the request mid-stream
    sock = socket.create_connection(srv.server_address[:2], timeout=DEADLINE_S)
    body = json.dumps({"prompt": [1, 2, 3, 4, 5], "max_tokens": 100, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(65536)
    sock.close()  # mid-stream
    wait_for(lambda: not srv.api.active, "the server to notice the disconnect")
    gate.set()
    wait_idle(loop, srv)
    assert len(seen) == 1 and b"HTTP/1.1 200" in received


def test_disconnect_while_waiting_aborts_non_streaming_request(server, monkeypatch):
    srv, loop = server
    seen = _count_aborts(loop, monkeypatch)
    gate = gate_steps(loop, monkeypatch)
    sock = socket.create_connection(srv.server_address[:2], timeout=DEADLINE_S)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 100}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    wait_for(lambda: loop.num_active == 1, "the request to reach the engine")
    sock.close()
    wait_for(lambda: not srv.api.active, "the server to notice the disconnect")
    gate.set()
    wait_idle(loop, srv)
    assert len(seen) == 1


@pytest.mark.parametrize("body,param", [
    ({"prompt": list(range(1, 130))}, "prompt"),                      # longer than max_model_len (128)
    ({"prompt": [1, 2], "max_tokens": 200}, "max_tokens"),            # prompt + max_tokens too long
    ({"prompt": [1, 2], "temperature": -1}, "temperature"),
    ({"prompt": [1, 2], "top_p": 1.5}, "top_p"),
    ({"prompt": [1, 2], "top_k": -3}, "top_k"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2], "seed": "x"}, "seed"),
    ({"prompt": [1, 2], "n": 0}, "n"),
    ({"prompt": [1, 10**6]}, "prompt"),                               # id outside the vocabulary
    ({"prompt": 5}, "prompt"),
    ({"max_tokens": 3}, "prompt"),                                    # no prompt
])  # fmt: skip
def test_bad_requests_get_openai_errors(server, body, param):
    srv, _loop = server
    status, err = post(srv, "/v1/completions", body)
    assert status == 400 and err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param
    assert isinstance(err["error"]["message"], str) and err["error"]["message"]


def test_skip_special_tokens_reaches_the_detokenizer(server, monkeypatch):
    """vLLM's `skip_special_tokens` (default true) decides how the text of both paths is decoded."""
    srv, loop = server
    seen = []
    decode = loop.engine.tokenizer.decode

    def recording(ids, skip_special_tokens=True):
        seen.append(skip_special_tokens)
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(loop.engine.tokenizer, "decode", recording)
    for stream in (False, True):
        for flag in (None, False):
            seen.clear()
            body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, "stream": stream}
            if flag is not None:
                body["skip_special_tokens"] = flag
            status, _ = post(srv, "/v1/completions", body)
            assert status == 200 and seen and set(seen) == {flag is None}, (stream, flag, seen)
    status, err = post(srv, "/v1/completions", {"prompt": [1], "skip_special_tokens": "no"})
    assert_openai_error(status, err, 400, param="skip_special_tokens")


def test_malformed_json_unknown_model_and_bad_messages(server):
    srv, _loop = server
    status, err = post(srv, "/v1/completions", None, raw=b'{"prompt": [1, 2')
    assert status == 400 and "malformed JSON" in err["error"]["message"]
    status, err = post(srv, "/v1/completions", None, raw=b"[1, 2]")
    assert status == 400 and "JSON object" in err["error"]["message"]
    status, err = post(srv, "/v1/completions", {"model": "gpt-5", "prompt": [1]})
    assert status == 404 and err["error"]["param"] == "model"
    status, err = post(srv, "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and err["error"]["param"] == "messages"
    status, err = post(srv, "/v1/chat/completions", {"messages": [{"content": "no role"}]})
    assert status == 400 and err["error"]["param"] == "messages"
    status, _ = post(srv, "/v1/nothing", {})
    assert status == 404
    status, _body = post(srv, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})  # still serving
    assert status == 200


def test_http_open_loop_load_generator(server):
    srv, loop = server
    reqs = [Request(p, SamplingParams(temperature=0, max_tokens=5)) for p in random_prompts(12, [4, 9, 15, 6])]
    metrics, duration = run_http_open_loop(f"http://127.0.0.1:{srv.server_address[1]}", reqs,
                                           poisson_arrivals(4, rate=50.0, seed=0))
    row = summarize(metrics, duration, ttft_slo=60.0, tpot_slo=60.0)
    assert row["requests"] == 4 and row["output_tokens"] == 20 and row["slo_attainment"] == 1.0
    assert all(m.ttft is not None and m.ttft >= 0 and m.tpot >= 0 for m in metrics)
    wait_idle(loop, srv)


def test_engine_failure_fails_requests_in_flight_not_the_server(server, monkeypatch):
    srv, loop = server
    step = loop.engine.step
    calls = []

    def broken():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return step()

    monkeypatch.setattr(loop.engine, "step", broken)
    status, err = post(srv, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4})
    assert status == 500 and "injected failure" in err["error"]["message"]
    assert err["error"]["type"] == "internal_server_error"
    wait_idle(loop, srv)
    status, body = post(srv, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4


# ------------------------------------------------------------------------------------------------ /metrics
def _scrape(srv) -> dict[tuple[str, tuple], float]:
    """Every sample of `/metrics`, parsed by prometheus_client's own parser: {(name, labels): value}."""
    status, content_type, data = get(srv, "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(data.decode()) for s in fam.samples}


def _value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted({"model_name": "test-model", **labels}.items()))), 0.0)


def test_metrics_count_tokens_requests_and_latencies(server):
    srv, loop = server
    before = _scrape(srv)
    status, body = post(srv, "/v1/completions", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 7, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 7
    status, data = post(srv, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True})
    assert status == 200 and len(sse(data)) == 4
    wait_idle(loop, srv)
    after = _scrape(srv)

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == 5 + 3
    assert delta("vllm:generation_tokens_total") == 7 + 4
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:time_per_output_token_seconds_count") == 6 + 3  # one per token after the first
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:request_generation_tokens_sum") == 11 and delta("vllm:request_prompt_tokens_sum") == 8
    assert _value(after, "vllm:num_requests_running") == 0 and _value(after, "vllm:num_requests_waiting") == 0
    assert _value(after, "vllm:gpu_cache_usage_perc") == 0.0


def test_metrics_show_engine_state_and_aborts(server, monkeypatch):
    srv, loop = server
    gate = gate_steps(loop, monkeypatch)
    before = _scrape(srv)
    sock = socket.create_connection(srv.server_address[:2], timeout=DEADLINE_S)
    body = json.dumps({"prompt": list(range(1, 40)), "max_tokens": 50, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    try:
        wait_for(lambda: loop.num_active == 1, "the request to reach the engine")
        assert _value(_scrape(srv), "vllm:num_requests_waiting") == 1  # the gate holds the first step
        gate.allow(1)  # the prefill: 39 prompt tokens -> 3 blocks of 16
        wait_for(lambda: b"data: " in sock.recv(65536), "the first token")
        now = _scrape(srv)
        assert _value(now, "vllm:num_requests_running") == 1 and _value(now, "vllm:num_requests_waiting") == 0
        bm = loop.engine.block_manager
        assert _value(now, "vllm:gpu_cache_usage_perc") == pytest.approx(1 - bm.num_free_blocks / bm.num_blocks)
        assert _value(now, "vllm:gpu_cache_usage_perc") > 0
    finally:
        sock.close()
        wait_for(lambda: not srv.api.active, "the server to notice the disconnect")
        gate.set()
    wait_idle(loop, srv)
    after = _scrape(srv)
    assert _value(after, "vllm:request_success_total", finished_reason="abort") - \
        _value(before, "vllm:request_success_total", finished_reason="abort") == 1
    assert _value(after, "vllm:gpu_cache_usage_perc") == 0.0


def test_each_server_has_its_own_registry(server):
    srv, loop = server
    assert post(srv, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] == 200
    other, thread = start(loop, name="other")  # a second server in this process, on the same engine
    try:
        samples = _scrape(other)
        assert not any(labels and dict(labels).get("model_name") == "test-model" for _, labels in samples)
        assert samples[("vllm:generation_tokens_total", (("model_name", "other"),))] == 0
        assert _value(_scrape(srv), "vllm:generation_tokens_total") >= 2
    finally:
        stop(other, thread)
    wait_idle(loop, srv)


# ------------------------------------------------------------------------------------------ faults of our own
def test_dead_engine_loop_fails_requests_and_health(qwen3_ckpt, monkeypatch):
    loop = EngineLoop(LLMEngine(EngineConfig(model=qwen3_ckpt, max_model_len=64, max_num_seqs=4))).start()
    srv, thread = start(loop)
    try:
        assert get(srv, "/health")[0] == 200
        monkeypatch.setattr(loop.engine, "add_request", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bad")))
        status, err = post(srv, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert_openai_error(status, err, 500, message="RuntimeError: bad")  # one request fails, not the loop
        assert loop.alive
        monkeypatch.undo()
        monkeypatch.setattr(loop, "_emit", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))  # a bug
        status, err = post(srv, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert_openai_error(status, err, 500, message="boom")
        wait_for(lambda: not loop.thread.is_alive(), "the loop thread to die")
        status, _, health = get(srv, "/health")
        assert status == 503 and b"engine loop is not running" in health
        assert_openai_error(*post(srv, "/v1/completions", {"prompt": [1], "max_tokens": 1}), 503, message="boom")
    finally:
        stop(srv, thread)
        loop.stop()


# ---------------------------------------------------------------------------------------------- configuration
def test_server_config_keys_and_bad_values():
    from hydra import compose, initialize_config_module

    from nano_vllm.serve.http_server import HTTPConfig
    from nano_vllm.serve.server import http_config

    with initialize_config_module(config_module="nano_vllm.configs", version_base=None):
        cfg = compose(config_name="serve", overrides=["server.max_body_bytes=100", "server.drain_timeout_s=2.5"])
        assert http_config(cfg) == HTTPConfig(max_body_bytes=100, drain_timeout_s=2.5)
        assert http_config(compose(config_name="serve")) == HTTPConfig()  # serve.yaml states the defaults
        with pytest.raises(ValueError, match=r"server\.read_timeout_s must be a positive number, got -1"):
            http_config(compose(config_name="serve", overrides=["server.read_timeout_s=-1"]))
    with pytest.raises(ValueError, match=r"server\.max_connections must be a positive number, got 'x'"):
        HTTPConfig(max_connections="x")
    with pytest.raises(ValueError, match=r"server\.max_body_bytes must be a positive number, got True"):
        HTTPConfig(max_body_bytes=True)
