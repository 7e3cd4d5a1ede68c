"""The HTTP layer under the OpenAI routes: uvicorn (h11), plus the limits it leaves to the application.

uvicorn parses HTTP and answers what is malformed there (a bad `Content-Length`, a broken request line, an
oversized header) and closes idle keep-alive connections. Added here, each a few lines:
- a body-size limit (413) and a body read timeout (408), before the application sees a byte;
- a header read timeout (408): a connection must deliver a request's headers within `read_timeout_s`;
- a first-byte timeout: a new connection that sends nothing for `first_byte_timeout_s` is closed, so
  silent sockets cannot hold the connection slots (uvicorn's keep-alive timeout starts only after a
  first request);
- a connection limit: connections beyond `max_connections` get 503, except on `GET /health` and
  `GET /metrics`, which are served on any connection (monitoring sees a server that is full);
- a client's EOF (close or half-close) cancels its request; a half-closed client is told so (400);
- OpenAI's JSON error object on every one of these responses, instead of plain text;
- with an API key (auth.py), 401 on `/v1` paths without `Authorization: Bearer <key>`;
- a graceful drain on SIGTERM / SIGINT: new requests get 503, requests in flight finish (or, after
  `drain_timeout_s`, end with an error event), then the server exits. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import threading
from dataclasses import dataclass, fields
from http import HTTPStatus

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from nano_vllm.serve.auth import APIKeyAuth
from nano_vllm.serve.protocol import error_body


@dataclass
class HTTPConfig:
    """Limits and timeouts of the HTTP server (the `server:` group of `nano_vllm/configs/serve.yaml`).

    max_body_bytes: largest request body; a larger one (declared or sent) gets 413.
    read_timeout_s: a request's headers, and then its body, must each arrive within this many seconds (408).
    first_byte_timeout_s: a new connection that sends no byte within this many seconds is closed.
    keep_alive_timeout_s: an idle keep-alive connection is closed after this many seconds.
    max_connections: open connections beyond this many get 503 on their requests (but /health, /metrics).
    drain_timeout_s: on SIGTERM, how long requests in flight may run before they are ended with an error.
    health_stall_s: /health answers 503 once the engine loop has held work this many seconds without
        completing a step (a step that never returns).
    log_level: uvicorn's log level.
    """

    max_body_bytes: int = 4 * 1024 * 1024
    read_timeout_s: float = 30.0
    first_byte_timeout_s: float = 5.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 1024
    drain_timeout_s: float = 30.0
    health_stall_s: float = 60.0
    log_level: str = "warning"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "log_level" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                          or value <= 0):
                raise ValueError(f"server.{f.name} must be a positive number, got {value!r}")


def _error_response(status: int, message: str, kind: str = "invalid_request_error") -> bytes:
    """A complete HTTP/1.1 error response that closes the connection (for the protocol level, where no
    application runs)."""
    body = json.dumps(error_body(message, kind)).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


async def _send_error(send, status: int, message: str, kind: str = "invalid_request_error") -> None:
    body = json.dumps(error_body(message, kind)).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimits:
    """ASGI middleware: read the whole request body, within `max_body_bytes` (413) and `read_timeout_s` (408),
    before the application runs; the application then reads it from memory. A client that disconnects
    before its body is complete never reaches the application, so nothing is queued for it."""

    def __init__(self, app, max_body_bytes: int, read_timeout_s: float):
        self.app, self.max_body_bytes, self.read_timeout_s = app, max_body_bytes, read_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > limit:  # h11 has checked it is a non-negative int
            return await _send_error(send, 413, f"request body of {int(declared)} bytes is over the limit of "
                                                f"{limit} bytes (server.max_body_bytes)")
        chunks, size, more = [], 0, True
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await _send_error(send, 408, f"the request body did not arrive within "
                                                    f"{self.read_timeout_s} s (server.read_timeout_s)")
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await _send_error(send, 413, f"request body is over the limit of {limit} bytes "
                                                    "(server.max_body_bytes)")
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # only the disconnect is left to come
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


MONITORING_PATHS = ("/health", "/metrics")  # served on connections over the limit too


def _overloaded(app):
    """The application of a connection over `max_connections`: 503, but for GET /health and /metrics."""

    async def overloaded(scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] in MONITORING_PATHS:
            return await app(scope, receive, send)
        await _send_error(send, 503, "too many open connections (server.max_connections)", "service_unavailable")

    return overloaded


def listen(host: str, port) -> socket.socket:
    """A listening socket on (host, port), port 0 meaning any free one; a bad port is a ValueError and a
    port that cannot be bound (in use, not allowed) an OSError, each naming `port`."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535] (0: any free port), got {port!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as e:
        hint = " (another server is listening there; choose another port=)" if e.errno == errno.EADDRINUSE else ""
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise OSError(e.errno, f"cannot listen on {host}:{port} (port={port}): {reason}{hint}") from None


def protocol_class(config: HTTPConfig) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header read timeout, a connection limit and JSON 400s."""

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.header_timer: asyncio.TimerHandle | None = None
            if len(self.connections) > config.max_connections:
                self.app = _overloaded(self.app)  # 503 on this connection, but for /health and /metrics
            self.first_byte_timer: asyncio.TimerHandle | None = self.loop.call_later(
                config.first_byte_timeout_s, self._first_byte_timeout)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self.first_byte_timer is not None:
                self.first_byte_timer.cancel()
                self.first_byte_timer = None
            super().data_received(data)

        def _first_byte_timeout(self) -> None:
            self.first_byte_timer = None
            if not self.transport.is_closing():  # nothing came: a silent connection frees its slot
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # the next request's headers get the same time

        def connection_lost(self, exc) -> None:
            for timer in (self.header_timer, self.first_byte_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            self.header_timer = self.loop.call_later(config.read_timeout_s, self._header_timeout, self.cycle)

        def _header_timeout(self, cycle) -> None:
            if self.cycle is not cycle or self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                return  # a request's headers arrived in time
            if self.conn.trailing_data[0]:  # part of a request came, not all of its headers
                self.transport.write(_error_response(408, f"the request headers did not arrive within "
                                                          f"{config.read_timeout_s} s (server.read_timeout_s)"))
            self.transport.close()

        def eof_received(self) -> None:
            """The client closed its sending side. TCP cannot tell a half-close from a close, and a gone client
            must not hold KV blocks, so either way its request is cancelled (asyncio then closes the transport
            and the application sees a disconnect); a client that still reads is told why."""
            cycle = self.cycle
            if (cycle is not None and not cycle.response_started and not cycle.response_complete
                    and self.conn.their_state in (h11.DONE, h11.MUST_CLOSE)):  # the request is complete
                self.transport.write(_error_response(400, "the client closed its sending side (half-close) before "
                                                          "the response; a closed connection cancels its request"))

        def send_400_response(self, msg: str) -> None:
            self.transport.write(_error_response(400, f"malformed HTTP request: {msg.rstrip('.')}"))
            self.transport.close()

    return Protocol


class _Uvicorn(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT starts a drain instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, api):
        super().__init__(config)
        self.api = api

    def handle_exit(self, sig, frame) -> None:
        if self.api.draining:
            return super().handle_exit(sig, frame)  # a second signal: uvicorn's own (immediate) shutdown
        self.api.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if self.api.draining and self.api.drain_tick():
            self.should_exit = True
        return await super().on_tick(counter)


class HTTPServer:
    """The listening socket and the uvicorn server on it, with the interface of `socketserver`'s servers:
    `server_address`, `serve_forever()`, `shutdown()`, `server_close()`. The socket is bound here (or given,
    bound already by `listen`), so port 0 is resolved before serving starts. With `api_key`, paths under
    `/v1` need `Authorization: Bearer <api_key>` (auth.py), checked before a body is read."""

    def __init__(self, api, host: str, port: int, config: HTTPConfig, sock: socket.socket | None = None,
                 api_key: str | None = None):
        self.api, self.config = api, config
        self.requires_api_key = api_key is not None
        app = BodyLimits(api.app, config.max_body_bytes, config.read_timeout_s)
        if api_key is not None:
            app = APIKeyAuth(app, api_key)  # checks the key before the socket is taken
        self.socket = sock if sock is not None else listen(host, port)
        self.server_address = self.socket.getsockname()
        self.uvicorn = _Uvicorn(uvicorn.Config(
            app, http=protocol_class(config), ws="none", lifespan="off", loop="asyncio", log_config=None,
            log_level=config.log_level, access_log=False, timeout_keep_alive=config.keep_alive_timeout_s,
            timeout_graceful_shutdown=5), api)
        self._running = threading.Event()
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        """Serve until drained (SIGTERM / SIGINT in the main thread, or `shutdown()` from another)."""
        self._running.set()
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Drain (new requests get 503; those in flight get `drain_timeout_s`, default
        `config.drain_timeout_s`) and stop; returns when `serve_forever` has returned."""
        self.api.begin_drain(drain_timeout_s)
        if self._running.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()
