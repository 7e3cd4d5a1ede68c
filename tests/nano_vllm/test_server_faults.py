"""The server under bad input and faults, with real clients over loopback (raw sockets and http.client).

Every malformed request gets an HTTP response with OpenAI's error object (never a closed connection), a
rejected request never reaches the engine, a dropped one leaves it, SIGTERM drains, and a soak of 64
clients mixing normal, streamed, dropped and malformed requests ends with every KV block free, no thread
left behind and `/health` ok. Waits are on conditions with generous deadlines; no timing is asserted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from server_client import (
    DEADLINE_S,
    assert_openai_error,
    conn,
    gate_steps,
    get,
    parse,
    post,
    raw,
    read_all,
    request_bytes,
    sse,
    start,
    stop,
    wait_for,
    wait_idle,
)

from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.serve.engine_loop import EngineLoop
from shared.dist import find_free_port

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def loop(qwen3_ckpt):
    loop = EngineLoop(LLMEngine(EngineConfig(model=qwen3_ckpt, max_model_len=128, max_num_seqs=16))).start()
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def server(loop):
    srv, thread = start(loop, max_body_bytes=64 * 1024)
    yield srv
    stop(srv, thread)


@pytest.fixture(scope="module")
def impatient(loop):
    """A server with a short read timeout, for the tests that wait for it to expire."""
    srv, thread = start(loop, read_timeout_s=2.0)
    yield srv
    stop(srv, thread)


@pytest.fixture
def queued(loop, monkeypatch):
    """The request ids the engine received during the test."""
    ids: list[str] = []
    add = loop.engine.add_request
    monkeypatch.setattr(loop.engine, "add_request", lambda *a, **k: ids.append(k.get("request_id")) or add(*a, **k))
    return ids


@pytest.fixture
def gate(loop, monkeypatch):
    """Engine steps wait until the test opens this gate (see `gate_steps`)."""
    gate = gate_steps(loop, monkeypatch)
    yield gate
    gate.set()


# ---------------------------------------------------------------------------------------------- bad bodies
@pytest.mark.parametrize("path,body,param,message", [
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages",
     "'text' must be a string"),
    (CHAT, {"messages": [{"role": "user", "content": ["hi"]}]}, "messages", "must be an object"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "only 'text' parts"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": "x"},
     "stream_options", "stream_options"),
    (COMPLETIONS, {"prompt": [1, 2], "stream": True, "stream_options": "x"}, "stream_options", "stream_options"),
    (COMPLETIONS, {"prompt": [1, 2], "stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    (COMPLETIONS, {"prompt": [1, 2], "model": ["test-model"]}, "model", "valid string"),
    (COMPLETIONS, {"prompt": [1, 2], "temperature": "0.5"}, "temperature", "valid number"),
    (COMPLETIONS, {"prompt": [1, 2], "stream": "yes"}, "stream", "valid boolean"),
    (COMPLETIONS, {"prompt": [1, 2], "max_tokens": 2.0}, "max_tokens", "valid integer"),
    (COMPLETIONS, {"prompt": [1, 2], "max_token": 2}, "max_token", "Unrecognized request argument"),
    (COMPLETIONS, {"prompt": [["a"]]}, "prompt", "list of token ids"),
    (COMPLETIONS, {"prompt": []}, "prompt", "prompt is empty"),
    (COMPLETIONS, {"prompt": [1, 2], "n": 0}, "n", "n must be an int >= 1"),
    (COMPLETIONS, {"prompt": [1, 2], "n": True}, "n", "valid integer"),
    (COMPLETIONS, {"prompt": [[1], [2]], "n": 9}, "n", "max_num_seqs: 16"),
    (COMPLETIONS, {"prompt": [1, 2], "logprobs": 21}, "logprobs", "max_logprobs: 20"),
    (COMPLETIONS, {"prompt": [1, 2], "logprobs": -1}, "logprobs", ">= 0"),
    (COMPLETIONS, {"prompt": [1, 2], "stop": ""}, "stop", "empty string"),
    (COMPLETIONS, {"prompt": [1, 2], "stop": ["a", 3]}, "stop", "valid string"),
    (COMPLETIONS, {"prompt": [1, 2], "max_tokens": 0}, "max_tokens", "allowed with echo"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs",
     "needs logprobs: true"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "max_logprobs: 20"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo", "Unrecognized"),
    (COMPLETIONS, {"prompt": [1, "2"]}, "prompt", "list of token ids"),
    (CHAT, {"messages": []}, "messages", "non-empty"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages", "Unrecognized"),
])  # fmt: skip
def test_bad_bodies_get_400_naming_the_field_and_queue_nothing(server, loop, queued, path, body, param, message):
    status, err = post(server, path, body)
    assert_openai_error(status, err, 400, param, message)
    assert not queued


@pytest.mark.parametrize("field,value", [
    ("best_of", 3), ("suffix", "x"), ("logit_bias", {"1": 5}), ("presence_penalty", 0.5), ("frequency_penalty", 1),
])  # fmt: skip
def test_unsupported_completion_fields_are_400(server, queued, field, value):
    status, err = post(server, COMPLETIONS, {"prompt": [1, 2], field: value})
    assert_openai_error(status, err, 400, field, "not supported by this server")
    assert not queued


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function"}]), ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}), ("functions", [{}]), ("parallel_tool_calls", False),
])  # fmt: skip
def test_unsupported_chat_fields_are_400(server, queued, field, value):
    status, err = post(server, CHAT, {"messages": [{"role": "user", "content": "hi"}], field: value})
    assert_openai_error(status, err, 400, field, "not supported by this server")
    assert not queued


def test_no_op_values_of_unsupported_fields_are_accepted(server, loop):
    body = {"prompt": [1, 2], "max_tokens": 2, "n": 1, "best_of": 1, "logprobs": None, "echo": False, "stop": [],
            "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "user": "u"}
    status, out = post(server, COMPLETIONS, body)
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    status, out = post(server, CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                 {"type": "text", "text": "b"}]}],
                                      "max_tokens": 2, "tools": [], "tool_choice": "none"})
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    wait_idle(loop, server)


def test_malformed_json_bodies(server, queued):
    for body, message in [(b"[" * 50_000, "nested too deeply"), (b'{"prompt": [1, 2', "malformed JSON"),
                          (b"\xff\xfe{", "malformed JSON"), (b'{"prompt": [1' + b"0" * 5000 + b"]}", "malformed JSON"),
                          (b"", "malformed JSON"), (b"[1, 2]", "JSON object")]:
        status, err = post(server, COMPLETIONS, None, raw=body)
        assert_openai_error(status, err, 400, message=message)
    assert not queued


# ----------------------------------------------------------------------------------------- bad HTTP framing
@pytest.mark.parametrize("length,want,message", [
    ("abc", 400, "malformed HTTP request"), ("-1", 400, "malformed HTTP request"),
    ("1000000000000", 413, "server.max_body_bytes"), (str(64 * 1024 + 1), 413, "server.max_body_bytes"),
])  # fmt: skip
def test_bad_content_length(server, queued, length, want, message):
    data = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n").encode()
    assert_openai_error(*parse(raw(server, data)), want, message=message)
    assert not queued


def test_chunked_body_over_the_limit_is_413(server, queued):
    chunk = b"x" * 40_000
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") * 2 + b"0\r\n\r\n")
    assert_openai_error(*parse(raw(server, data)), 413, message="server.max_body_bytes")
    assert not queued


def test_garbage_request_line_and_oversized_headers(server, queued):
    assert_openai_error(*parse(raw(server, b"\x00\x01garbage\r\n\r\n")), 400, message="malformed HTTP request")
    huge = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
    assert_openai_error(*parse(raw(server, huge)), 400, message="malformed HTTP request")
    assert not queued


def test_method_and_route_errors_are_json(server):
    status, err = post(server, COMPLETIONS, {"prompt": [1]}, method="PUT")
    assert_openai_error(status, err, 405, message="POST")
    status, err = post(server, "/v1/nothing", {})
    assert_openai_error(status, err, 404)
    status, err = post(server, "/health", {})
    assert_openai_error(status, err, 405)


# ------------------------------------------------------------------------------- slow, idle and many clients
@pytest.mark.slow  # ~3-13 s; runs in the repository suite, not again in the package's fork
def test_half_sent_headers_and_body_get_408(impatient, queued):
    socks = [socket.create_connection(impatient.server_address[:2], timeout=DEADLINE_S) for _ in range(2)]
    socks[0].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    socks[1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b'{"prompt": ')
    for s, what in zip(socks, ("headers", "body")):
        with s:
            assert_openai_error(*parse(read_all(s)), 408, message=f"the request {what} did not arrive within")
    assert not queued


@pytest.mark.slow  # ~3-13 s; runs in the repository suite, not again in the package's fork
def test_300_half_requests_do_not_block_others(impatient, loop):
    socks = []
    try:
        for _ in range(300):
            s = socket.create_connection(impatient.server_address[:2], timeout=DEADLINE_S)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        status, out = post(impatient, COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 2})  # served meanwhile
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        for s in socks:  # each is answered 408 and closed
            assert_openai_error(*parse(read_all(s)), 408)
    finally:
        for s in socks:
            s.close()
    wait_for(lambda: not impatient.uvicorn.server_state.connections, "every connection to close")
    wait_idle(loop, impatient)


def test_connections_over_the_limit_get_503(loop):
    srv, thread = start(loop, max_connections=3, first_byte_timeout_s=DEADLINE_S)  # the idle three stay
    idle = [socket.create_connection(srv.server_address[:2], timeout=DEADLINE_S) for _ in range(3)]
    try:
        wait_for(lambda: len(srv.uvicorn.server_state.connections) == 3, "three open connections")
        status, err = post(srv, COMPLETIONS, {"prompt": [1, 2], "max_tokens": 1})
        assert_openai_error(status, err, 503, message="server.max_connections")
        idle.pop().close()
        wait_for(lambda: len(srv.uvicorn.server_state.connections) == 2, "a connection to close")
        assert post(srv, COMPLETIONS, {"prompt": [1, 2], "max_tokens": 1})[0] == 200
    finally:
        for s in idle:
            s.close()
        stop(srv, thread)


# ---------------------------------------------------------------------------- clients that leave or half-close
def test_half_closed_client_is_told_and_its_request_leaves_the_engine(server, loop, gate):
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 50}).encode()
    status, err = parse(raw(server, request_bytes(COMPLETIONS, body), shut_wr=True))
    assert_openai_error(status, err, 400, message="half-close")
    gate.set()
    wait_idle(loop, server)


def test_client_gone_before_its_body_is_complete_queues_nothing(server, queued):
    with socket.create_connection(server.server_address[:2], timeout=DEADLINE_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    status, out = post(server, COMPLETIONS, {"prompt": [1], "max_tokens": 1})  # the server has moved on
    assert status == 200 and len(queued) == 1, (status, out, queued)


@pytest.mark.parametrize("stream", [False, True])
def test_dropped_client_is_aborted_while_the_engine_is_stuck(server, loop, gate, stream):
    aborted = []
    abort = loop.engine.abort_request
    loop.engine.abort_request = lambda rid: aborted.append(rid) or abort(rid)
    try:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 100, "stream": stream}).encode()
        s = socket.create_connection(server.server_address[:2], timeout=DEADLINE_S)
        s.sendall(request_bytes(COMPLETIONS, body))
        wait_for(lambda: loop.num_active == 1, "the request to reach the engine")
        s.close()  # no token was ever sent to this client
        wait_for(lambda: not server.api.active, "the server to notice the disconnect")
        gate.set()
        wait_idle(loop, server)
    finally:
        loop.engine.abort_request = abort
    assert len(aborted) == 1


# ------------------------------------------------------------------------------------------ drain and death
def test_drain_finishes_streams_and_refuses_new_requests(loop, gate):
    srv, thread = start(loop)
    c = conn(srv)
    c.request("POST", COMPLETIONS, json.dumps({"prompt": [1, 2, 3], "max_tokens": 6, "stream": True}))
    resp = c.getresponse()  # headers are sent before the first step
    wait_for(lambda: loop.num_active == 1, "the stream to be in the engine")
    stopper = threading.Thread(target=srv.shutdown)
    stopper.start()
    wait_for(lambda: srv.api.draining, "the drain to start")
    assert_openai_error(*post(srv, COMPLETIONS, {"prompt": [1], "max_tokens": 1}), 503, message="shutting down")
    status, _, health = get(srv, "/health")
    assert status == 503 and b"shutting down" in health
    gate.set()
    chunks = sse(resp.read())
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and len(chunks) == 6
    stopper.join(DEADLINE_S)
    thread.join(DEADLINE_S)
    assert not thread.is_alive()
    srv.server_close()
    wait_idle(loop)


@pytest.mark.parametrize("stream", [True, False])
def test_drain_timeout_ends_requests_with_an_error(loop, gate, stream):
    srv, thread = start(loop)
    c = conn(srv)
    c.request("POST", COMPLETIONS, json.dumps({"prompt": [1, 2, 3], "max_tokens": 60, "stream": stream}))
    wait_for(lambda: loop.num_active == 1, "the request to be in the engine")
    srv.shutdown(drain_timeout_s=0.01)  # returns once the server has stopped
    resp = c.getresponse()
    if stream:
        events = [json.loads(e[6:]) for e in resp.read().decode().split("\n") if e.startswith("data: {")]
        assert events[-1]["error"]["type"] == "service_unavailable" and "drain timeout" in events[-1]["error"]["message"]
    else:
        assert_openai_error(resp.status, json.loads(resp.read()), 503, message="drain timeout")
    thread.join(DEADLINE_S)
    srv.server_close()
    gate.set()
    wait_idle(loop)


@pytest.mark.slow  # a server process of its own (~7 s): run once, not again in the fork test
def test_sigterm_drains_then_exits(qwen3_ckpt, tmp_path):
    port = find_free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "nano_vllm.serve", f"model={qwen3_ckpt}", f"port={port}",
                             "served_model_name=m", "engine.max_model_len=256", f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: proc.poll() is not None or _listening(port), "the server to listen")
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        s = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
        s.sendall(request_bytes(COMPLETIONS, body))
        first = s.recv(65536)
        assert b" 200 " in first.split(b"\r\n")[0]
        proc.send_signal(signal.SIGTERM)  # 200 tokens are far from done: the drain lets them finish
        data = (first + read_all(s)).decode()
        s.close()
        assert proc.wait(DEADLINE_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [line[6:] for line in data.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert sum(1 for e in events[:-1]) == 200
    assert "server stopped" in proc.stdout.read()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------------ soak
@pytest.mark.slow  # ~3-13 s; runs in the repository suite, not again in the package's fork
def test_soak_64_clients_with_aborts_and_malformed_requests(loop):
    """64 client threads, 8 requests each (512 in all): normal, streamed, dropped mid-stream, dropped while
    waiting, and malformed requests, drawn at random. No 5xx, no request without a response, and afterwards
    every KV block free, no thread left, `/health` ok."""
    srv, thread = start(loop)
    baseline = threading.active_count()
    failures: list[str] = []
    malformed = [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        request_bytes(COMPLETIONS, b'{"prompt": [1, 2'),
        request_bytes(COMPLETIONS, b"[" * 5000),
        request_bytes(CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}'),
        request_bytes(COMPLETIONS, b'{"prompt": [1], "stream": true, "stream_options": "x"}'),
        request_bytes(COMPLETIONS, b'{"prompt": [1], "n": 0}'),
        request_bytes(COMPLETIONS, b"{}", method="PUT"),
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n",
    ]

    def client(i: int) -> None:
        rng = random.Random(i)
        for _ in range(8):
            kind = rng.choice(["complete", "complete", "stream", "stream", "drop_stream", "drop_wait", "malformed"])
            body = {"prompt": [rng.randrange(4096) for _ in range(rng.randint(1, 40))],
                    "max_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.8]), "seed": i,
                    "stream": kind in ("stream", "drop_stream")}
            try:
                if kind == "malformed":
                    status = int(raw(srv, rng.choice(malformed)).split(b" ", 2)[1])
                    ok = 400 <= status < 500
                elif kind.startswith("drop"):
                    with socket.create_connection(srv.server_address[:2], timeout=DEADLINE_S) as s:
                        s.sendall(request_bytes(COMPLETIONS, json.dumps(body).encode()))
                        ok = kind == "drop_wait" or b"200" in s.recv(64)
                elif kind == "stream":
                    status, data = post(srv, COMPLETIONS, body)
                    chunks = sse(data)
                    ok = status == 200 and chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
                else:
                    status, out = post(srv, COMPLETIONS, body)
                    ok = status == 200 and 1 <= out["usage"]["completion_tokens"] <= body["max_tokens"]
            except Exception as e:
                ok, kind = False, f"{kind}: {type(e).__name__}: {e}"
            if not ok:
                failures.append(kind)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(DEADLINE_S * 3)
    assert not any(t.is_alive() for t in clients), "a client hung"
    assert not failures, failures[:5]
    wait_idle(loop, srv)
    wait_for(lambda: threading.active_count() <= baseline, "client and server threads to end")
    status, _, health = get(srv, "/health")
    assert status == 200 and json.loads(health) == {"status": "ok"}
    stop(srv, thread)

