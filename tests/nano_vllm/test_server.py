"""The OpenAI-compatible server with a real HTTP client (http.client): streaming, 32 concurrent requests
batched by one engine, cancellation mid-stream, and every bad request of the issue answered with 400."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
from vllm_checkpoints import random_prompts

from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.engine_loop import EngineLoop
from nano_vllm.loadgen import Request, poisson_arrivals, run_http_open_loop
from nano_vllm.metrics import summarize
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.server import make_server


@pytest.fixture(scope="module")
def server(qwen3_ckpt):
    engine = LLMEngine(EngineConfig(model=qwen3_ckpt, max_model_len=128, max_num_seqs=32))
    loop = EngineLoop(engine).start()
    srv = make_server(loop, "test-model", port=0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv, loop
    srv.shutdown()
    srv.server_close()
    loop.stop()


def _conn(srv) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(*srv.server_address[:2], timeout=60)


def _post(srv, path: str, body, raw: bytes | None = None) -> tuple[int, dict | bytes]:
    conn = _conn(srv)
    conn.request("POST", path, raw if raw is not None else json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, (json.loads(data) if resp.getheader("Content-Type") == "application/json" else data)


def _sse(data: bytes) -> list:
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _idle(loop: EngineLoop, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while loop.num_active or loop.engine.has_unfinished_requests():
        assert time.time() < deadline, "engine did not go idle"
        time.sleep(0.02)
    bm = loop.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_health_and_models(server):
    srv, _ = server
    conn = _conn(srv)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
    conn.request("GET", "/v1/models")  # same keep-alive connection
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["data"][0]["id"] == "test-model"


def test_completion_and_streaming_agree_with_transformers(server, qwen3_ckpt, hf_greedy):
    srv, loop = server
    prompt = random_prompts(10, [20])[0]
    want = hf_greedy(qwen3_ckpt, prompt, 12)
    status, body = _post(srv, "/v1/completions", {"model": "test-model", "prompt": prompt, "max_tokens": 12,
                                                 "temperature": 0})
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == loop.engine.tokenizer.decode(want)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32}
    status, data = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                 "stream": True, "stream_options": {"include_usage": True}})
    chunks = _sse(data)
    assert status == 200 and len(chunks) == 13  # one per token, then usage
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == body["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 12


def test_chat_completion_streaming(server):
    srv, _loop = server
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi there"}]
    status, body = _post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["object"] == "chat.completion"
    text = body["choices"][0]["message"]["content"]
    status, data = _post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0,
                                                      "stream": True})
    chunks = _sse(data)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert chunks[-1]["object"] == "chat.completion.chunk" and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_32_concurrent_requests_are_batched(server, qwen3_ckpt, hf_greedy):
    srv, loop = server
    prompts = random_prompts(11, [3 + 2 * i for i in range(32)])
    sizes, step = [], loop.engine.step

    def recording_step():
        sizes.append(len(loop.engine.scheduler.running))
        return step()

    loop.engine.step = recording_step
    try:
        results: list = [None] * 32

        def one(i):
            results[i] = _post(srv, "/v1/completions", {"prompt": prompts[i], "max_tokens": 6, "temperature": 0})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        loop.engine.step = step
    dec = loop.engine.tokenizer.decode
    for p, (status, body) in zip(prompts, results):
        assert status == 200 and body["choices"][0]["text"] == dec(hf_greedy(qwen3_ckpt, p, 6))
    assert max(sizes) >= 8, sizes  # many requests in flight in one engine step
    _idle(loop)


def _slow_steps(loop, monkeypatch, seconds=0.02):
    step = loop.engine.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(loop.engine, "step", slow)


def test_cancel_mid_stream_frees_blocks(server, monkeypatch):
    srv, loop = server
    _slow_steps(loop, monkeypatch)
    seen = []
    monkeypatch.setattr(loop.engine, "abort_request", lambda rid, f=loop.engine.abort_request: seen.append(rid) or f(rid))
    sock = socket.create_connection(srv.server_address[:2])
    body = json.dumps({"prompt": [1, 2, 3, 4, 5], "max_tokens": 100, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(65536)
    sock.close()  # mid-stream
    _idle(loop)
    assert len(seen) == 1 and b"HTTP/1.1 200" in received


def test_disconnect_while_waiting_aborts_non_streaming_request(server, monkeypatch):
    srv, loop = server
    _slow_steps(loop, monkeypatch)
    seen = []
    monkeypatch.setattr(loop.engine, "abort_request", lambda rid, f=loop.engine.abort_request: seen.append(rid) or f(rid))
    sock = socket.create_connection(srv.server_address[:2])
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 100}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    time.sleep(0.2)
    sock.close()
    _idle(loop)
    assert len(seen) == 1


@pytest.mark.parametrize("body,param", [
    ({"prompt": list(range(1, 130))}, "prompt"),                      # longer than max_model_len (128)
    ({"prompt": [1, 2], "max_tokens": 200}, "max_tokens"),            # prompt + max_tokens too long
    ({"prompt": [1, 2], "temperature": -1}, "temperature"),
    ({"prompt": [1, 2], "top_p": 1.5}, "top_p"),
    ({"prompt": [1, 2], "top_k": -3}, "top_k"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2], "seed": "x"}, "seed"),
    ({"prompt": [1, 2], "n": 2}, "n"),
    ({"prompt": [1, 10**6]}, "prompt"),                               # id outside the vocabulary
    ({"prompt": 5}, "prompt"),
    ({"max_tokens": 3}, "prompt"),                                    # no prompt
])  # fmt: skip
def test_bad_requests_get_openai_errors(server, body, param):
    srv, _loop = server
    status, err = _post(srv, "/v1/completions", body)
    assert status == 400 and err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param
    assert isinstance(err["error"]["message"], str) and err["error"]["message"]


def test_malformed_json_unknown_model_and_bad_messages(server):
    srv, _loop = server
    status, err = _post(srv, "/v1/completions", None, raw=b'{"prompt": [1, 2')
    assert status == 400 and "malformed JSON" in err["error"]["message"]
    status, err = _post(srv, "/v1/completions", None, raw=b"[1, 2]")
    assert status == 400 and "JSON object" in err["error"]["message"]
    status, err = _post(srv, "/v1/completions", {"model": "gpt-5", "prompt": [1]})
    assert status == 404 and err["error"]["param"] == "model"
    status, err = _post(srv, "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and err["error"]["param"] == "messages"
    status, err = _post(srv, "/v1/chat/completions", {"messages": [{"content": "no role"}]})
    assert status == 400 and err["error"]["param"] == "messages"
    status, _ = _post(srv, "/v1/nothing", {})
    assert status == 404
    status, _body = _post(srv, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})  # still serving
    assert status == 200


def test_http_open_loop_load_generator(server):
    srv, loop = server
    reqs = [Request(p, SamplingParams(temperature=0, max_tokens=5)) for p in random_prompts(12, [4, 9, 15, 6])]
    metrics, duration = run_http_open_loop(f"http://127.0.0.1:{srv.server_address[1]}", reqs,
                                           poisson_arrivals(4, rate=50.0, seed=0))
    row = summarize(metrics, duration, ttft_slo=60.0, tpot_slo=60.0)
    assert row["requests"] == 4 and row["output_tokens"] == 20 and row["slo_attainment"] == 1.0
    assert all(m.ttft is not None and m.ttft >= 0 and m.tpot >= 0 for m in metrics)
    _idle(loop)


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
    status, err = _post(srv, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4})
    assert status == 500 and "injected failure" in err["error"]["message"]
    assert err["error"]["type"] == "internal_server_error"
    _idle(loop)
    status, body = _post(srv, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4})
    assert status == 200 and body["usage"]["completion_tokens"] == 4
