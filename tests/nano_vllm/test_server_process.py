"""The server as an operator runs it: a real `python -m nano_vllm.serve` process on loopback, driven over HTTP.

One request must never wedge the engine (any int is a seed); `/health` and a gauge tell a stalled engine
loop; prompts are bounded before and tokenized off the event loop, so `/health` answers while huge bodies
are processed; a stop token's text is left out as vLLM leaves it; `/metrics` carries vLLM's V1 names and
the Grafana dashboard under docs/ references only series the server exports; silent connections are
closed and never keep `/health` or `/metrics` from answering; a bad or busy port and an unknown chat role
are named in the error.

The module's server runs `serve_with_hooks.py` — the module `nano_vllm.serve` as `__main__`, with hooks
that files in a directory drive (a step or the tokenizer waits while its file exists), so a test stalls
the engine or the tokenizer exactly as long as it needs. Waits are on conditions with generous deadlines;
no timing is asserted.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_client import DEADLINE_S, assert_openai_error, get, post, sse, wait_for

from nano_vllm import LLM, SamplingParams
from shared.dist import find_free_port

pytestmark = pytest.mark.slow  # a server process of its own (~10 s to start): once, not again in the fork
ROOT = Path(__file__).resolve().parents[2]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_MODEL_LEN, MAX_CONNECTIONS = 128, 8
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def served(qwen3_ckpt, tmp_path_factory):
    """(address, hook directory) of a server process on the tiny Qwen3 checkpoint: the fused sampling
    layer asked for (on a CPU it runs its torch reference, with the fused layer's seed fold), 8 connection
    slots, an 8 s first-byte timeout and a 3 s stall limit."""
    tmp = tmp_path_factory.mktemp("served")
    hooks, log = tmp / "hooks", tmp / "server.log"
    hooks.mkdir()
    port = find_free_port()
    args = [sys.executable, str(Path(__file__).with_name("serve_with_hooks.py")), str(hooks),
            f"model={qwen3_ckpt}", f"port={port}", "served_model_name=m", f"engine.max_model_len={MAX_MODEL_LEN}",
            "engine.max_num_seqs=16", "engine.fused_sampling=true", f"server.max_connections={MAX_CONNECTIONS}",
            "server.first_byte_timeout_s=8", "server.health_stall_s=3", f"hydra.run.dir={tmp / 'run'}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is not None or _listening(port), "the server to listen")
        assert proc.poll() is None, log.read_text()[-3000:]
        yield SimpleNamespace(server_address=("127.0.0.1", port)), hooks
    finally:
        for name in ("hold_steps", "hold_tokenizer"):
            (hooks / name).unlink(missing_ok=True)
        proc.terminate()
        try:
            proc.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            proc.kill()


def _health(srv) -> tuple[int, dict]:
    status, _, body = get(srv, "/health")
    return status, json.loads(body)


def _metrics(srv) -> dict[str, float]:
    """Every sample of a `/metrics` scrape: name (labels other than model_name folded in) -> value."""
    status, _, body = get(srv, "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


# ------------------------------------------------------------------------------------------------ item: seeds
@pytest.mark.parametrize("seed", [-1, 2**64 - 1, 2**70 + 3, -(2**70)])
def test_any_int_seed_completes(served, seed):
    srv, _ = served
    status, out = post(srv, COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "seed": seed})
    assert status == 200 and out["usage"]["completion_tokens"] == 4, out
    assert _health(srv) == (200, {"status": "ok"})


@pytest.mark.parametrize("seed", ["5", 1.5, True, [1]])
def test_a_seed_that_is_not_an_int_is_400(served, seed):
    status, err = post(served[0], COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "seed": seed})
    assert_openai_error(status, err, 400, "seed", "integer")


# ---------------------------------------------------------------------------------------- item: stalled engine
def test_a_stalled_engine_turns_health_503_and_the_gauge_on(served):
    srv, hooks = served
    assert _metrics(srv)["nano_vllm:engine_stalled"] == 0
    (hooks / "hold_steps").touch()
    result = {}
    request = threading.Thread(target=lambda: result.update(
        out=post(srv, COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})))
    try:
        request.start()
        wait_for(lambda: (hooks / "step_held").exists(), "a step to be held")
        wait_for(lambda: _health(srv)[0] == 503, "/health to report the stall")  # past health_stall_s (3 s)
        status, body = _health(srv)
        assert body["status"] == "engine stalled" and body["stalled_s"] > 3, body
        assert "server.health_stall_s" in body["error"]["message"]
        metrics = _metrics(srv)
        assert metrics["nano_vllm:engine_stalled"] == 1 and metrics["nano_vllm:engine_stalled_seconds"] > 3
        assert get(srv, "/v1/models")[0] == 200  # the server itself stays responsive
        assert request.is_alive()  # and the request is still held
    finally:
        (hooks / "hold_steps").unlink()
    request.join(DEADLINE_S)
    status, out = result["out"]
    assert status == 200 and out["usage"]["completion_tokens"] == 3
    wait_for(lambda: _health(srv) == (200, {"status": "ok"}), "/health to recover")
    assert _metrics(srv)["nano_vllm:engine_stalled"] == 0


# ------------------------------------------------------------------------------------------ item: huge prompts
def _encoded_lengths(hooks: Path) -> list[int]:
    return [int(p.read_text() or 0) for p in hooks.glob("encode-*")]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_huge_prompt_is_refused_without_tokenizing(served, path):
    srv, hooks = served
    huge = "lorem ipsum " * 300_000  # 3.6 MB, under the 4 MiB body limit
    body = {"prompt": huge} if path == COMPLETIONS else {"messages": [{"role": "user", "content": huge}]}
    status, err = post(srv, path, body)
    err = assert_openai_error(status, err, 400, "prompt" if path == COMPLETIONS else "messages",
                              f"maximum context length of {MAX_MODEL_LEN} tokens")
    assert f"max_model_len {MAX_MODEL_LEN}" in err["message"] and "not tokenized" in err["message"]
    assert all(n < len(huge) for n in _encoded_lengths(hooks))  # never handed to the tokenizer


def test_health_answers_while_prompts_are_tokenized(served):
    """Four long prompts are held inside the tokenizer (the hook), each on its own thread; `/health` and
    `/metrics` answer meanwhile; released, each is refused for its token count."""
    srv, hooks = served
    long = "the quick brown fox " * 500  # 10,000 characters: under the character bound, over 128 tokens
    before = len(_encoded_lengths(hooks))
    (hooks / "hold_tokenizer").touch()
    results: list = []
    clients = [threading.Thread(target=lambda: results.append(post(srv, COMPLETIONS, {"prompt": long})))
               for _ in range(4)]
    try:
        for c in clients:
            c.start()
        wait_for(lambda: len(_encoded_lengths(hooks)) - before == 4, "four prompts inside the tokenizer")
        assert _health(srv) == (200, {"status": "ok"})
        assert "vllm:num_requests_running" in get(srv, "/metrics")[2].decode()
        assert not results  # all four were still being tokenized when /health answered
    finally:
        (hooks / "hold_tokenizer").unlink()
    for c in clients:
        c.join(DEADLINE_S)
    assert len(results) == 4
    for status, err in results:
        assert_openai_error(status, err, 400, "prompt", f"maximum context length is {MAX_MODEL_LEN}")


# ------------------------------------------------------------------------------------------- item: stop tokens
@pytest.fixture(scope="module")
def greedy(qwen3_ckpt):
    """(prompt, the checkpoint's greedy tokens, tokenizer) from an offline LLM of the same checkpoint."""
    llm = LLM(qwen3_ckpt, max_model_len=MAX_MODEL_LEN)
    prompt = [11, 400, 9, 2211, 5]
    return prompt, llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].token_ids, \
        llm.tokenizer


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out(served, greedy, stream, include):
    srv, _ = served
    prompt, full, tok = greedy
    stop = full[3]
    k = full.index(stop)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop], "stream": stream,
            "include_stop_str_in_output": include}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, out = post(srv, COMPLETIONS, body)
    assert status == 200
    if stream:
        chunks = sse(out)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        reason, usage = next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and
                             c["choices"][0]["finish_reason"]), chunks[-1]["usage"]
    else:
        text, reason, usage = out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["usage"]
    assert reason == "stop" and usage["completion_tokens"] == k + 1  # the stop token counts, as in vLLM
    assert text == tok.decode(full[:k + 1] if include else full[:k]) and tok.decode(full[:k]) != tok.decode(full[:k + 1])


# ---------------------------------------------------------------------------------------------- item: metrics
V1_NAMES = ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_requests_running",
            "vllm:num_requests_waiting", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count",
            "vllm:iteration_tokens_total_count", "vllm:time_to_first_token_seconds_count",
            "vllm:e2e_request_latency_seconds_count", "vllm:request_prefill_time_seconds_count",
            "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
            "vllm:request_time_per_output_token_seconds_count"]


def test_metrics_carry_vllm_v1_names(served):
    srv, _ = served
    before = _metrics(srv)
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 the second request finds cached
    for _ in range(2):
        assert post(srv, COMPLETIONS, {"prompt": prompt, "max_tokens": 5, "temperature": 0})[0] == 200
    after = _metrics(srv)
    assert all(name in after for name in V1_NAMES), [n for n in V1_NAMES if n not in after]
    delta = {name: after[name] - before.get(name, 0) for name in V1_NAMES}
    assert delta["vllm:prefix_cache_queries_total"] >= 80 and delta["vllm:prefix_cache_hits_total"] >= 32
    assert delta["vllm:request_queue_time_seconds_count"] == 2 and delta["vllm:iteration_tokens_total_count"] >= 10
    assert delta["vllm:inter_token_latency_seconds_count"] == 8  # 4 per request: one per token after the first
    assert after["vllm:kv_cache_usage_perc"] == after["vllm:gpu_cache_usage_perc"]


def _dashboard_series() -> set[str]:
    dashboard = json.loads((ROOT / "docs" / "grafana" / "nano_vllm.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    assert exprs
    return {name for e in exprs for name in re.findall(r"\b(?:nano_)?vllm:[A-Za-z0-9_:]+", e)}


def test_grafana_dashboard_references_only_exported_series(served):
    srv, _ = served
    _, _, body = get(srv, "/metrics")
    exported = {line.split("{")[0].split(" ")[0] for line in body.decode().splitlines() if line and line[0] != "#"}
    referenced = _dashboard_series()
    assert {"vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds_bucket",
            "vllm:request_queue_time_seconds_bucket", "vllm:prefix_cache_hits_total"} <= referenced
    assert referenced <= exported, sorted(referenced - exported)


# ------------------------------------------------------------------------------------------ item: idle sockets
def test_silent_connections_are_closed_and_never_block_health(served):
    """Three times the connection slots held by sockets that never send a byte: /health and /metrics still
    answer (a request for the engine gets 503: every slot is taken), and the server closes every silent
    socket after the first-byte timeout, after which requests are served again."""
    srv, _ = served
    idle = [socket.create_connection(srv.server_address, timeout=DEADLINE_S) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        assert_openai_error(*post(srv, COMPLETIONS, {"prompt": [1, 2], "max_tokens": 1}), 503,
                            message="server.max_connections")
        assert _health(srv) == (200, {"status": "ok"})
        assert get(srv, "/metrics")[0] == 200
        for s in idle:  # closed by the server: EOF without a response
            assert s.recv(1024) == b""
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: post(srv, COMPLETIONS, {"prompt": [1, 2], "max_tokens": 1})[0] == 200, "a free slot")


# ------------------------------------------------------------------------------------ item: errors one can act on
def test_unknown_chat_role_is_400_naming_the_allowed_ones(served):
    status, err = post(served[0], CHAT, {"messages": [{"role": "robot", "content": "hi"}]})
    assert_openai_error(status, err, 400, "messages", "'robot' is not a supported role")
    assert "'system', 'developer', 'user', 'assistant'" in err["error"]["message"]


def _serve(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nano_vllm.serve", *overrides, f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=DEADLINE_S * 3)


def test_port_out_of_range_is_named(tmp_path, qwen3_ckpt):
    proc = _serve(tmp_path, f"model={qwen3_ckpt}", "port=99999")
    assert proc.returncode != 0
    error = [line for line in proc.stderr.splitlines() if line.startswith("ValueError")]
    assert error and "port must be an int in [0, 65535]" in error[0] and "99999" in error[0], proc.stderr[-2000:]


def test_busy_port_fails_before_the_model_is_loaded(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        proc = _serve(tmp_path, "model=/nonexistent/checkpoint", f"port={port}")
    assert proc.returncode != 0
    error = [line for line in proc.stderr.splitlines() if line.startswith("OSError")]
    assert error and f"port={port}" in error[0] and "another server is listening" in error[0], proc.stderr[-2000:]
    assert "LLMEngine" not in proc.stderr  # the model was never loaded
