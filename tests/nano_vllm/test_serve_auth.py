"""The server's API key (vLLM's `api_key`, serve/auth.py): every `/v1` path needs `Authorization: Bearer
<key>` once a key is set and is answered 401 in OpenAI's error shape otherwise; `/health` and `/metrics`
stay open; the key comes from the config, a file or NANO_VLLM_API_KEY and never shows in the output, an
error message, a repr or `/metrics`; binding a non-loopback address without a key is warned about."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
from server_client import DEADLINE_S, assert_openai_error, conn, sse, stop, wait_for, wait_idle

from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine
from nano_vllm.serve.auth import (
    ENV_VAR,
    INCORRECT,
    MISSING,
    APIKeyAuth,
    is_loopback,
    resolve_api_key,
    warn_if_exposed,
)
from nano_vllm.serve.engine_loop import EngineLoop
from nano_vllm.serve.server import make_server

ROOT = Path(__file__).resolve().parents[2]
# fixed, so that pytest-xdist workers collect the same parameters, and found nowhere else in the
# repository, so finding it in any output means it leaked
KEY = "sk-nano-3f9c2e7b1d8a4c6e9b0f5a2d7c1e8b4f"
MODELS, COMPLETIONS, CHAT = "/v1/models", "/v1/completions", "/v1/chat/completions"
ROUTES = [("GET", MODELS, None), ("POST", COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 2}),
          ("POST", CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture(scope="module")
def loop(qwen3_ckpt):
    loop = EngineLoop(LLMEngine(EngineConfig(model=qwen3_ckpt, max_model_len=64, max_num_seqs=8))).start()
    yield loop
    loop.stop()


def _start(loop: EngineLoop, api_key: str | None):
    srv = make_server(loop, "test-model", port=0, api_key=api_key)
    thread = threading.Thread(target=srv.serve_forever, daemon=True, name="test-uvicorn")
    thread.start()
    wait_for(lambda: srv.uvicorn.started, "the server to start")
    return srv, thread


@pytest.fixture(scope="module")
def keyed(loop):
    srv, thread = _start(loop, KEY)
    yield srv
    stop(srv, thread)


def _call(srv, method: str, path: str, body=None, auth: str | None = None):
    """(status, headers, body: parsed JSON or bytes)."""
    c = conn(srv)
    headers = {"Content-Type": "application/json"} | ({"Authorization": auth} if auth is not None else {})
    c.request(method, path, None if body is None else json.dumps(body), headers)
    resp = c.getresponse()
    data = resp.read()
    c.close()
    is_json = resp.getheader("Content-Type") == "application/json"
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(data) if is_json else data


def _refused(result, message: str, code: str | None) -> None:
    status, headers, body = result
    err = assert_openai_error(status, body, 401, message=message)
    assert err["type"] == "invalid_request_error" and err["code"] == code and err["param"] is None
    assert headers["www-authenticate"] == "Bearer"
    assert KEY not in json.dumps(body)


def test_without_a_key_the_server_is_open_as_before(loop):
    srv, thread = _start(loop, None)
    try:
        assert not srv.requires_api_key
        for method, path, body in ROUTES:
            assert _call(srv, method, path, body)[0] == 200, path
        assert _call(srv, "GET", MODELS, auth="Bearer anything")[0] == 200  # a key sent anyway is ignored
    finally:
        stop(srv, thread)
    wait_idle(loop)


@pytest.mark.parametrize("method,path,body", ROUTES, ids=["models", "completions", "chat"])
def test_every_v1_route_needs_the_key(keyed, loop, method, path, body):
    _refused(_call(keyed, method, path, body), MISSING, None)  # no header: OpenAI's "didn't provide"
    _refused(_call(keyed, method, path, body, auth="Bearer "), MISSING, None)
    _refused(_call(keyed, method, path, body, auth=f"Basic {KEY}"), MISSING, None)  # not Bearer auth
    _refused(_call(keyed, method, path, body, auth=KEY), MISSING, None)
    _refused(_call(keyed, method, path, body, auth="Bearer sk-wrong"), INCORRECT, "invalid_api_key")
    _refused(_call(keyed, method, path, body, auth=f"Bearer {KEY}x"), INCORRECT, "invalid_api_key")
    _refused(_call(keyed, method, path, body, auth=f"Bearer {KEY[:-1]}"), INCORRECT, "invalid_api_key")
    for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme in any case, as vLLM and OpenAI take it
        status, _, out = _call(keyed, method, path, body, auth=f"{scheme} {KEY}")
        assert status == 200, out
    wait_idle(loop, keyed)


def test_streaming_with_the_key(keyed, loop):
    status, _, data = _call(keyed, "POST", COMPLETIONS, {"prompt": [1, 2], "max_tokens": 3, "stream": True},
                            auth=f"Bearer {KEY}")
    assert status == 200 and len(sse(data)) == 3
    wait_idle(loop, keyed)


def test_health_and_metrics_stay_open_and_never_show_the_key(keyed):
    status, _, body = _call(keyed, "GET", "/health")
    assert status == 200 and body == {"status": "ok"}
    status, _, text = _call(keyed, "GET", "/metrics")
    assert status == 200 and b"vllm:num_requests_running" in text and KEY.encode() not in text


def test_only_v1_paths_are_guarded_as_vllm_does(keyed):
    # outside /v1 an unknown path is a 404 with or without a key; under the /v1 prefix it is a 401 first
    assert_openai_error(*_call(keyed, "GET", "/nowhere")[::2], 404)
    _refused(_call(keyed, "GET", "/v1/nowhere"), MISSING, None)
    _refused(_call(keyed, "GET", "/v1"), MISSING, None)
    assert_openai_error(*_call(keyed, "GET", "/v1/nowhere", auth=f"Bearer {KEY}")[::2], 404)


def test_the_key_is_kept_only_as_a_digest(keyed):
    auth = keyed.uvicorn.config.app
    assert isinstance(auth, APIKeyAuth) and keyed.requires_api_key
    assert KEY not in repr(auth) and KEY not in repr(vars(auth)) and KEY not in repr(vars(keyed))


def test_the_official_openai_client(keyed, loop):
    openai = pytest.importorskip("openai", reason="pip install openai to run the official client")
    host, port = keyed.server_address[:2]
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["test-model"]
    out = client.completions.create(model="test-model", prompt="ab", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2
    wrong = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model="test-model", prompt="ab", max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    wait_idle(loop, keyed)


# ----------------------------------------------------------------------------------- where the key comes from
def test_the_key_from_the_config_a_file_or_the_environment(tmp_path):
    path = tmp_path / "key"
    path.write_text(f"  {KEY}\n\n")  # the whole file, stripped
    assert resolve_api_key(environ={}) is None
    assert resolve_api_key(KEY, environ={}) == KEY
    assert resolve_api_key(api_key_file=str(path), environ={}) == KEY
    assert resolve_api_key(api_key_file=path, environ={}) == KEY
    assert resolve_api_key(environ={ENV_VAR: KEY}) == KEY
    # the config (the key or its file) is explicit: it wins over the environment
    assert resolve_api_key("sk-config", environ={ENV_VAR: KEY}) == "sk-config"
    assert resolve_api_key(api_key_file=str(path), environ={ENV_VAR: "sk-env"}) == KEY


@pytest.mark.parametrize("case", ["both", "missing", "directory", "empty", "blank", "binary", "not a path"])
def test_a_bad_key_file_is_a_clear_error_naming_it(tmp_path, case):
    path = tmp_path / "key"
    if case in ("empty", "blank", "binary", "both"):
        path.write_bytes({"empty": b"", "blank": b" \n\t\n", "binary": b"\xff\xfe" + KEY.encode(),
                          "both": KEY.encode()}[case])
    elif case == "directory":
        path.mkdir()
    args = {"both": (KEY, str(path)), "not a path": (None, 3)}.get(case, (None, str(path)))
    want = TypeError if case == "not a path" else ValueError
    with pytest.raises(want) as e:
        resolve_api_key(*args, environ={})
    message = str(e.value)
    assert KEY not in message and "api_key" in message
    if case not in ("both", "not a path"):
        assert str(path) in message, message
    if case == "both":
        assert "api_key_file" in message and "not both" in message


@pytest.mark.parametrize("key,source", [
    ("", "api_key"), (1234, "api_key"), (True, "api_key"), (f" {KEY}", "api_key"), (f"{KEY}\n", "api_key"),
    (f"{KEY}é", "api_key"), ("", ENV_VAR), (f"{KEY} ", ENV_VAR)])
def test_a_key_that_no_header_can_carry_is_refused_at_start(key, source):
    kwargs = {"environ": {ENV_VAR: key}} if source == ENV_VAR else {"api_key": key, "environ": {}}
    with pytest.raises((TypeError, ValueError)) as e:
        resolve_api_key(**kwargs)
    assert source in str(e.value) and KEY not in str(e.value)
    with pytest.raises((TypeError, ValueError)):
        APIKeyAuth(None, key)


def test_build_reads_the_key_and_never_prints_it(qwen3_ckpt, tmp_path, monkeypatch, capfd, caplog):
    from hydra import compose, initialize_config_module

    from nano_vllm.serve.server import build

    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    overrides = [f"model={qwen3_ckpt}", "port=0", "engine.max_model_len=64", "served_model_name=t"]
    for extra, env in (([f"api_key_file={path}"], None), ([], KEY), ([f"api_key='{KEY}'"], "sk-env")):
        if env is not None:
            monkeypatch.setenv(ENV_VAR, env)
        with initialize_config_module(config_module="nano_vllm.configs", version_base=None):
            cfg = compose(config_name="serve", overrides=overrides + extra)
        server, loop = build(cfg)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            wait_for(lambda s=server: s.uvicorn.started, "the server to start")
            assert server.requires_api_key
            _refused(_call(server, "GET", MODELS, auth="Bearer sk-env"), INCORRECT, "invalid_api_key")
            assert _call(server, "GET", MODELS, auth=f"Bearer {KEY}")[0] == 200
        finally:
            stop(server, thread)
            loop.stop()
    out, err = capfd.readouterr()
    assert KEY not in out + err + caplog.text


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.10", "example.com", "::ffff:10.0.0.1"])
def test_a_non_loopback_address_without_a_key_is_warned_about(host):
    assert not is_loopback(host)
    with pytest.warns(UserWarning, match="without an API key") as record:
        assert warn_if_exposed(host, None)
    assert "api_key_file" in str(record[0].message) and ENV_VAR in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_exposed(host, KEY)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST",
                                  "::ffff:127.0.0.1"])
def test_loopback_addresses_are_not_warned_about(host):
    assert is_loopback(host)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_exposed(host, None)


@pytest.mark.slow
def test_a_failed_start_does_not_print_the_key(tmp_path):
    """Hydra reports a job's exception with the command line's overrides; the server reports its own."""
    proc = subprocess.run([sys.executable, "-m", "nano_vllm.serve", "model=/nonexistent/checkpoint",
                           f"api_key={KEY}", "port=99999", f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode != 0
    assert any(line.startswith("ValueError: port must be") for line in proc.stderr.splitlines()), proc.stderr
    assert KEY not in proc.stdout + proc.stderr
    assert not (tmp_path / ".hydra").exists()  # Hydra keeps no copy of the overrides
