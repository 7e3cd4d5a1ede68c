"""Clients for the server tests over loopback: http.client for well-formed requests, raw sockets for the
rest, and waits on conditions (never fixed sleeps) with generous deadlines for a loaded 2-core machine.

A module with a unique name rather than conftest, so `from server_client import ...` cannot pick up another
package's conftest when the whole suite runs in one process.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable

from nano_vllm.serve.engine_loop import EngineLoop
from nano_vllm.serve.http_server import HTTPConfig
from nano_vllm.serve.server import make_server

DEADLINE_S = 120.0  # for any wait: long enough for a machine under load, short enough to fail a hang


def wait_for(cond: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def start(loop: EngineLoop, name: str = "test-model", **http_config):
    """A server on a free loopback port, serving in a thread; stop it with `stop`."""
    srv = make_server(loop, name, port=0, config=HTTPConfig(**http_config))
    thread = threading.Thread(target=srv.serve_forever, daemon=True, name="test-uvicorn")
    thread.start()
    wait_for(lambda: srv.uvicorn.started, "the server to start")
    return srv, thread


def stop(srv, thread: threading.Thread) -> None:
    srv.shutdown()
    srv.server_close()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "the server thread did not stop"


class StepGate:
    """Engine steps wait for a turn: `allow(n)` lets n more steps run, `set()` lets every step run. A request
    stays in flight (or at a chosen token) for exactly as long as a test needs, on any machine."""

    def __init__(self):
        self._cond = threading.Condition()
        self._budget, self._open = 0, False

    def allow(self, n: int) -> None:
        with self._cond:
            self._budget += n
            self._cond.notify_all()

    def set(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def wait_turn(self) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._open or self._budget > 0, DEADLINE_S), "no step allowed"
            if not self._open:
                self._budget -= 1


def gate_steps(loop: EngineLoop, monkeypatch, record: list | None = None) -> StepGate:
    """Make `loop`'s engine steps wait on a `StepGate` (and append the running batch's size to `record`
    before each). Open the gate before the test ends."""
    gate, step = StepGate(), loop.engine.step

    def gated():
        gate.wait_turn()
        if record is not None:
            record.append(len(loop.engine.scheduler.running) + len(loop.engine.scheduler.waiting))
        return step()

    monkeypatch.setattr(loop.engine, "step", gated)
    return gate


def wait_idle(loop: EngineLoop, srv=None) -> None:
    """Every request has left the engine and every KV block is free again; with `srv`, first every request
    task of that server has ended (a request whose client is gone may still be on its way to the engine)."""
    if srv is not None:
        wait_for(lambda: not srv.uvicorn.server_state.tasks and not srv.api.active, "the server's requests to end")
    bm = loop.engine.block_manager
    wait_for(lambda: not loop.num_pending_commands and not loop.num_active and not loop.engine.has_unfinished_requests()
             and bm.num_free_blocks == bm.num_blocks, "the engine to go idle with every KV block free")


def conn(srv) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(*srv.server_address[:2], timeout=DEADLINE_S)


def post(srv, path: str, body, raw: bytes | None = None, method: str = "POST") -> tuple[int, dict | bytes]:
    c = conn(srv)
    c.request(method, path, raw if raw is not None else json.dumps(body), {"Content-Type": "application/json"})
    resp = c.getresponse()
    data = resp.read()
    c.close()
    return resp.status, (json.loads(data) if resp.getheader("Content-Type") == "application/json" else data)


def get(srv, path: str) -> tuple[int, str, bytes]:
    c = conn(srv)
    c.request("GET", path)
    resp = c.getresponse()
    data = resp.read()
    c.close()
    return resp.status, resp.getheader("Content-Type") or "", data


def sse(data: bytes) -> list:
    """The JSON events of an SSE body, which must end with `[DONE]`."""
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", data[-300:]
    return [json.loads(e) for e in events[:-1]]


def request_bytes(path: str, body: bytes, extra_headers: str = "", method: str = "POST") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n{extra_headers}\r\n").encode() + body


def raw(srv, data: bytes, shut_wr: bool = False) -> bytes:
    """Send `data` as is on a new connection and read until the server closes it."""
    with socket.create_connection(srv.server_address[:2], timeout=DEADLINE_S) as s:
        s.sendall(data)
        if shut_wr:
            s.shutdown(socket.SHUT_WR)
        return read_all(s)


def read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def parse(response: bytes) -> tuple[int, dict]:
    """(status, JSON body) of a raw HTTP response that carries a JSON body with Content-Length."""
    assert response, "the server closed the connection without a response"
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    assert headers[b"content-type"] == b"application/json", head
    return status, json.loads(body[:int(headers[b"content-length"])])


def assert_openai_error(status: int, body, want_status: int, param: str | None = None,
                        message: str | None = None) -> dict:
    """`body` is OpenAI's error object with status `want_status` (and `param`, a `message` substring)."""
    assert status == want_status, (status, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if message is not None:
        assert message in err["message"], err
    return err
