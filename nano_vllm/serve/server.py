"""An OpenAI-compatible HTTP server (FastAPI on uvicorn, as vLLM and SGLang serve): `/v1/completions` and
`/v1/chat/completions` (both with SSE streaming), `/v1/models`, `/health`, `/metrics`.

Requests are validated (`protocol.py`) before anything is queued, then handed to the one `EngineLoop`
thread, so concurrent requests share every engine step; tokens come back through the asyncio loop. The
work a request's size decides — parsing its JSON, rendering the chat template, tokenizing — runs on a
thread of its own, never on the asyncio loop, and a text prompt too long for `max_model_len` tokens
whatever its tokens is refused before it is tokenized (request_prep.py): `/health` answers while huge
bodies are processed. A request is in the engine only while its client is there: a disconnect (noticed at once,
whether or not tokens are flowing), a cancelled task or a failed drain aborts it, which frees its KV
blocks at the next step.
The HTTP layer (`http_server.py`) adds what uvicorn leaves out: a body-size limit, read timeouts, a
connection limit, JSON errors for malformed HTTP, and a graceful drain on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from omegaconf import DictConfig, OmegaConf
from starlette.exceptions import HTTPException as StarletteHTTPException

from nano_vllm.config import EngineConfig, engine_args_from
from nano_vllm.engine import LLMEngine
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.serve.engine_loop import EngineLoop, RequestStream, StreamEvent
from nano_vllm.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from nano_vllm.serve.request_prep import RequestPreparation
from nano_vllm.serve.server_metrics import ServerMetrics
from nano_vllm.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from nano_vllm.serve.http_server import HTTPConfig, HTTPServer

LIVENESS_POLL_S = 1.0  # how often a request with no news checks that the engine loop still runs
_GONE, _SHUTDOWN = "client disconnected", "server is shutting down"  # events the server itself posts


class _Stream(RequestStream):
    """A request's tokens, posted by the engine thread into this server's asyncio loop."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], aloop: asyncio.AbstractEventLoop):
        super().__init__(request_id, prompt_token_ids)
        self.aloop, self.queue = aloop, asyncio.Queue()
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_token = False  # it ended at an EOS or stop token (the last output token)

    def put(self, event: StreamEvent | str) -> None:  # called on the engine thread
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            self.aloop.call_soon_threadsafe(self.queue.put_nowait, event)


class OpenAIServer(RequestPreparation):
    """What the routes share: the engine loop, its tokenizer, the served model's name, the metrics, and the
    requests in flight (which a drain waits for). Requests are checked and tokenized by the methods of
    `RequestPreparation` (request_prep.py)."""

    def __init__(self, loop: EngineLoop, model_name: str, drain_timeout_s: float = 30.0,
                 health_stall_s: float = 60.0):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = loop.engine.tokenizer
        self.model_name = model_name
        self.max_model_len = loop.engine.max_model_len
        RequestPreparation.__init__(self)
        self.health_stall_s = health_stall_s
        self.metrics = ServerMetrics(self.engine, model_name, self.stall)
        self.active: set[_Stream] = set()
        self.drain_timeout_s = drain_timeout_s
        self.draining, self._drain_deadline, self._drain_forced = False, 0.0, False
        self.app = build_app(self)

    # ------------------------------------------------------------------ state
    def unavailable(self) -> str | None:
        """Why new requests are refused (503), or None."""
        if self.draining:
            return _SHUTDOWN
        if not self.loop.alive:
            return "the engine loop is not running" + (f": {self.loop.error}" if self.loop.error else "")
        return None

    def stall(self) -> tuple[bool, float]:
        """(stalled, seconds): whether the engine loop has died, or has held work for more than
        `health_stall_s` without completing a step; and how long it has held work without one."""
        seconds = self.loop.stalled_for()
        dead = self.loop.thread.ident is not None and not self.loop.thread.is_alive()
        return dead or seconds > self.health_stall_s, seconds

    def health(self) -> tuple[int, dict]:
        """`/health`: 200 `{"status": "ok"}`, else 503 with a status ("draining", "engine dead", "engine
        stalled") beside OpenAI's error object."""
        why = self.unavailable()
        if why is not None:
            status = "draining" if self.draining else "engine dead"
            return 503, {"status": status, **error_body(why, "service_unavailable")}
        stalled, seconds = self.stall()
        if stalled:
            why = (f"the engine loop has held work for {seconds:.1f} s without completing a step "
                   f"(server.health_stall_s: {self.health_stall_s:g})")
            return 503, {"status": "engine stalled", "stalled_s": round(seconds, 3),
                         **error_body(why, "service_unavailable")}
        return 200, {"status": "ok"}

    def begin_drain(self, timeout_s: float | None = None) -> None:
        """Refuse new requests; let those in flight finish for up to `timeout_s` (thread-safe)."""
        if not self.draining:
            self._drain_deadline = time.monotonic() + (self.drain_timeout_s if timeout_s is None else timeout_s)
            self.draining = True

    def drain_tick(self) -> bool:
        """Advance a drain (on the event loop): past its deadline, end the requests still in flight with an
        error. True once none is left."""
        if self.active and not self._drain_forced and time.monotonic() >= self._drain_deadline:
            self._drain_forced = True
            for stream in list(self.active):
                stream.queue.put_nowait(_SHUTDOWN)
        return not self.active

    def text_ids(self, stream: _Stream, params: SamplingParams) -> list[int]:
        """The output tokens whose text is shown: without the EOS / stop token that ended the request,
        unless `include_stop_str_in_output` (vLLM's rule; `Sequence.text_token_ids` offline)."""
        ids = stream.output_token_ids
        return ids[:-1] if stream.stop_token and not params.include_stop_str_in_output else ids

    # ------------------------------------------------------------------ running a request
    def open(self, ids: list[int], chat: bool) -> _Stream:
        """A stream for a validated request, counted as in flight (a drain waits for it) but not yet queued."""
        if (why := self.unavailable()) is not None:
            raise APIError(503, why, kind="service_unavailable")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = _Stream(rid, ids, asyncio.get_running_loop())
        self.active.add(stream)
        return stream

    @contextlib.asynccontextmanager
    async def running(self, stream: _Stream, params: SamplingParams, receive) -> AsyncIterator[Any]:
        """Queue `stream`'s request and yield its events (an async iterator); whatever ends the block (the
        last token, a disconnect, a cancellation, an error), the request leaves the engine."""
        timer = self.metrics.request(len(stream.prompt_token_ids), stream.request_id)
        watcher = asyncio.ensure_future(_watch_disconnect(receive, stream))
        try:
            self.loop.add(stream, stream.prompt_token_ids, params)
            yield self._events(stream, timer)
        finally:
            watcher.cancel()
            self.active.discard(stream)
            if not stream.finished:
                self.loop.abort(stream.request_id)
            timer.finish(stream.finish_reason if stream.finished else "abort")

    async def _events(self, stream: _Stream, timer) -> AsyncIterator[StreamEvent]:
        while True:
            try:
                event = await asyncio.wait_for(stream.queue.get(), LIVENESS_POLL_S)
            except asyncio.TimeoutError:
                if not self.loop.alive:
                    raise APIError(503, self.unavailable() or "the engine loop stopped",
                                   kind="service_unavailable") from None
                continue
            if event is _GONE:
                raise ConnectionResetError(_GONE)
            if event is _SHUTDOWN:
                raise APIError(503, f"{_SHUTDOWN}: the request did not finish within the drain timeout",
                               kind="service_unavailable")
            if event.error is not None:
                stream.finished, stream.finish_reason = True, "error"
                raise APIError(500, f"generation failed: {event.error}", kind="internal_server_error")
            stream.output_token_ids.extend(event.token_ids)
            timer.tokens(len(event.token_ids))
            if event.finished:
                stream.finished, stream.finish_reason = True, event.finish_reason
                stream.stop_token = event.stop_token
            yield event
            if event.finished:
                return

    def usage(self, stream: _Stream) -> dict:
        n_in, n_out = len(stream.prompt_token_ids), len(stream.output_token_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    async def complete(self, stream: _Stream, params: SamplingParams, chat: bool, receive) -> Response:
        reason = None
        try:
            async with self.running(stream, params, receive) as events:
                async for event in events:
                    reason = event.finish_reason
        except ConnectionResetError:
            return Response(status_code=499)  # nobody reads it: the connection is gone
        text = self.tokenizer.decode(self.text_ids(stream, params), params.skip_special_tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse({"id": stream.request_id, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model_name, "choices": [choice],
                             "usage": self.usage(stream)})

    async def sse(self, stream: _Stream, params: SamplingParams, chat: bool, include_usage: bool,
                  receive) -> AsyncIterator[str]:
        """The SSE body of a streaming request: a chunk per step, then usage if asked, then `[DONE]`. An error
        after the headers went out is reported in the stream, as OpenAI does."""
        base = {"id": stream.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)

        def chunk(text: str | None, reason: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

        try:
            async with self.running(stream, params, receive) as events:
                if chat:
                    yield chunk(None, None, role=True)
                async for event in events:
                    delta = detok.step(self.text_ids(stream, params), final=event.finished)
                    yield chunk(delta, event.finish_reason if event.finished else None)
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except ConnectionResetError:
            return
        if include_usage:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': self.usage(stream)})}\n\n"
        yield "data: [DONE]\n\n"


async def _watch_disconnect(receive, stream: _Stream) -> None:
    """Post _GONE into `stream` when the client disconnects (the request body has been read already, so the
    next ASGI message is the disconnect, whenever it comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    stream.queue.put_nowait(_GONE)


class _EventStream(StreamingResponse):
    """SSE whose generator runs under `aclosing`: a request ends in the engine as soon as the response does,
    never at garbage collection. (Disconnects are watched by `running`, not by Starlette's task group.)"""

    def __init__(self, api: OpenAIServer, stream: _Stream, body: AsyncIterator[str]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.api, self.stream = api, stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with contextlib.aclosing(self.body_iterator) as body:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                async for text in body:
                    await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.api.active.discard(self.stream)  # never started: it was never queued either


def build_app(api: OpenAIServer) -> FastAPI:
    """The routes, and OpenAI error objects for every error response (ours, FastAPI's and Starlette's)."""
    app = FastAPI(title="nano_vllm", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {e.detail}"
        if e.status_code == 405:
            message += f" (allowed: {(e.headers or {}).get('Allow', '')})"
        return JSONResponse(error_body(message, kind), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "internal_server_error"), 500)

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = api.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(api.metrics.render(), media_type=api.metrics.content_type)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": api.model_name, "object": "model", "created": int(time.time()), "owned_by": "nano_vllm",
            "max_model_len": api.max_model_len}]})

    async def generate(request: Request, model: type[CompletionRequest | ChatCompletionRequest]) -> Response:
        raw = await request.body()
        req, ids, params = await api.off_loop(api.prepare, raw, model)
        chat = model is ChatCompletionRequest
        stream = api.open(ids, chat)  # nothing await-ed from here to the engine: a drain cannot miss it
        if not req.stream:
            return await api.complete(stream, params, chat, request.receive)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return _EventStream(api, stream, api.sse(stream, params, chat, include_usage, request.receive))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest)

    return app


def make_server(loop: EngineLoop, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                config=None, sock: socket.socket | None = None):
    """An HTTP server bound to (host, port) (port 0: any free port), or listening on `sock` (from
    `http_server.listen`), serving `loop`'s engine; `config` is an `http_server.HTTPConfig` (limits,
    timeouts). `serve_forever()` runs it, `shutdown()` drains and stops it."""
    from nano_vllm.serve.http_server import HTTPConfig, HTTPServer

    config = config or HTTPConfig()
    api = OpenAIServer(loop, model_name, config.drain_timeout_s, config.health_stall_s)
    return HTTPServer(api, host, port, config, sock)


def http_config(cfg: DictConfig) -> HTTPConfig:
    """The `server:` group of a serve config (limits and timeouts of the HTTP layer)."""
    from nano_vllm.serve.http_server import HTTPConfig

    return HTTPConfig(**(OmegaConf.to_container(cfg.get("server") or {}, resolve=True) or {}))


def build(cfg: DictConfig) -> tuple[HTTPServer, EngineLoop]:
    """(http server, engine loop) for a serve config (configs/serve.yaml); the loop is started, the server
    not yet. The port is bound first, so a bad or busy one fails before the model is loaded. The engine is
    fast by default; `performance_layers: false` runs the paper path alone."""
    from nano_vllm.serve.http_server import listen

    http = http_config(cfg)
    args = engine_args_from(OmegaConf.to_container(cfg.engine, resolve=True) or {})
    if cfg.get("performance_layers") is not None:
        args["performance_layers"] = bool(cfg.performance_layers)
    sock = listen(str(cfg.host), cfg.port)
    try:
        loop = EngineLoop(LLMEngine(EngineConfig(model=str(cfg.model), **args))).start()
    except BaseException:
        sock.close()
        raise
    name = cfg.get("served_model_name") or str(cfg.model)
    return make_server(loop, name, str(cfg.host), sock.getsockname()[1], http, sock), loop
