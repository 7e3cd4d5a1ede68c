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
With an API key (`api_key`, `api_key_file` or NANO_VLLM_API_KEY; `auth.py`) every `/v1` path needs
`Authorization: Bearer <key>` (else 401); `/health` and `/metrics` stay open, for probes and Prometheus.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from omegaconf import DictConfig, OmegaConf
from starlette.exceptions import HTTPException as StarletteHTTPException

from nano_vllm.config import EngineConfig, engine_args_from
from nano_vllm.engine import LLMEngine
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.serve.auth import resolve_api_key, warn_if_exposed
from nano_vllm.serve.engine_loop import EngineLoop, RequestStream, StreamEvent
from nano_vllm.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from nano_vllm.serve.request_prep import RequestPreparation
from nano_vllm.serve.server_metrics import ServerMetrics
from nano_vllm.tokenizer import StopChecker

if TYPE_CHECKING:
    from nano_vllm.serve.http_server import HTTPConfig, HTTPServer

LIVENESS_POLL_S = 1.0  # how often a request with no news checks that the engine loop still runs
_GONE, _SHUTDOWN = "client disconnected", "server is shutting down"  # events the server itself posts


class _Stream(RequestStream):
    """One choice of a request: the tokens of its engine request, posted by the engine thread into the
    request's queue (which its choices share) in this server's asyncio loop; its text through a
    `StopChecker` (stop strings withheld while they may still complete); its log-probabilities."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], aloop: asyncio.AbstractEventLoop,
                 queue: asyncio.Queue, index: int, params: SamplingParams, checker: StopChecker):
        super().__init__(request_id, prompt_token_ids)
        self.aloop, self.queue = aloop, queue
        self.index, self.params, self.text = index, params, checker
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict] = []  # one per output token, when asked for
        self.prompt_logprobs: list[dict | None] | None = None
        self.timer: Any = None
        self.shown = 0  # characters of its text already streamed
        self.offset = 0  # the next token's text_offset (completions logprobs)
        self.echo: str | None = None  # the prompt, until a streamed echo has sent it

    def put(self, event: StreamEvent | str) -> None:  # called on the engine thread
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            self.aloop.call_soon_threadsafe(self.queue.put_nowait, (self, event))

    def absorb(self, event: StreamEvent) -> None:
        """Take an event's tokens: the text grows by those it shows (a final EOS / stop token's text only
        with `include_stop_str_in_output`, vLLM's rule)."""
        self.output_token_ids.extend(event.token_ids)
        self.logprobs += event.logprobs or []
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        shown = event.token_ids
        if event.finished:
            self.finished, self.finish_reason, self.stop_reason = True, event.finish_reason, event.stop_reason
            if event.stop_token and not self.params.include_stop_str_in_output:
                shown = shown[:-1]
        for token in shown:
            self.text.step(token)


class _Request:
    """A request's choices — one per prompt and per sample (index prompt * n + j) — and the queue their
    events arrive on (with a disconnect or a drain's end)."""

    def __init__(self, request_id: str, streams: list[_Stream], queue: asyncio.Queue, chat: bool,
                 echo: bool, scores_only: bool):
        self.id, self.streams, self.queue = request_id, streams, queue
        self.chat, self.echo, self.scores_only = chat, echo, scores_only
        # each prompt once (a prompt's samples share its list)
        self.prompts_ids = list({id(s.prompt_token_ids): s.prompt_token_ids for s in streams}.values())


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
                stream.queue.put_nowait(_SHUTDOWN)  # (the request's queue, once per choice)
        return not self.active

    # ------------------------------------------------------------------ running a request
    def open(self, prompts_ids: list[list[int]], params: SamplingParams, chat: bool,
             prompts: list[str | list[int]] | None = None, echo: bool = False,
             scores_only: bool = False) -> _Request:
        """The choices of a validated request (prompt * n + sample), counted as in flight (a drain waits
        for them) but not yet queued. Sample j draws with `params.child(j)` (seed + j)."""
        if (why := self.unavailable()) is not None:
            raise APIError(503, why, kind="service_unavailable")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        aloop, queue = asyncio.get_running_loop(), asyncio.Queue()
        streams = []
        for i, ids in enumerate(prompts_ids):
            prompt = (prompts or [None] * len(prompts_ids))[i]
            for j in range(params.n):
                # an echo shows each sample's prompt log-probabilities: every sample scores them
                child = params.child(j)
                if echo and j:
                    child = dataclasses.replace(child, prompt_logprobs=params.prompt_logprobs)
                index = i * params.n + j
                stream = _Stream(f"{rid}-{index}", ids, aloop, queue, index, child,
                                 StopChecker(self.tokenizer, child))
                if echo:
                    stream.echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(
                        ids, params.skip_special_tokens)
                streams.append(stream)
        self.active.update(streams)
        return _Request(rid, streams, queue, chat, echo, scores_only)

    @contextlib.asynccontextmanager
    async def running(self, req: _Request, receive) -> AsyncIterator[Any]:
        """Queue the request's choices and yield their (stream, event)s (an async iterator); whatever
        ends the block (the last token, a disconnect, a cancellation, an error), every choice leaves the
        engine."""
        for stream in req.streams:
            stream.timer = self.metrics.request(len(stream.prompt_token_ids), stream.request_id)
        watcher = asyncio.ensure_future(_watch_disconnect(receive, req.queue))
        try:
            for stream in req.streams:
                self.loop.add(stream, stream.prompt_token_ids, stream.params)
            yield self._events(req)
        finally:
            watcher.cancel()
            for stream in req.streams:
                self.active.discard(stream)
                if not stream.finished:
                    self.loop.abort(stream.request_id)
                stream.timer.finish(stream.finish_reason if stream.finished else "abort")

    async def _events(self, req: _Request) -> AsyncIterator[tuple[_Stream, StreamEvent]]:
        remaining = len(req.streams)
        while remaining:
            try:
                item = await asyncio.wait_for(req.queue.get(), LIVENESS_POLL_S)
            except asyncio.TimeoutError:
                if not self.loop.alive:
                    raise APIError(503, self.unavailable() or "the engine loop stopped",
                                   kind="service_unavailable") from None
                continue
            if item is _GONE:
                raise ConnectionResetError(_GONE)
            if item is _SHUTDOWN:
                raise APIError(503, f"{_SHUTDOWN}: the request did not finish within the drain timeout",
                               kind="service_unavailable")
            stream, event = item
            if event.error is not None:
                stream.finished, stream.finish_reason = True, "error"
                raise APIError(500, f"generation failed: {event.error}", kind="internal_server_error")
            stream.absorb(event)
            stream.timer.tokens(len(event.token_ids))
            remaining -= event.finished
            yield stream, event

    def usage(self, req: _Request) -> dict:
        """Each prompt's tokens counted once, every choice's output tokens."""
        n_in = sum(map(len, req.prompts_ids))
        n_out = 0 if req.scores_only else sum(len(s.output_token_ids) for s in req.streams)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    # ------------------------------------------------------------------ the response shapes
    @functools.cached_property
    def token_text(self):
        """A token's text as the log-probabilities show it (special tokens included), cached."""
        return functools.lru_cache(maxsize=1 << 16)(
            lambda token: self.tokenizer.decode([token], skip_special_tokens=False))

    def completion_logprobs(self, stream: _Stream, ids: list[int], entries: list[dict | None]) -> dict:
        """OpenAI's legacy completions `logprobs` of some tokens of a choice: the tokens, their
        log-probabilities, the top ones (with the token itself, vLLM's shape) and each token's character
        offset in the choice's text (counted on from `stream.offset`)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(ids, entries):
            text = self.token_text(token)
            out["tokens"].append(text)
            out["text_offset"].append(stream.offset)
            stream.offset += len(text)
            out["token_logprobs"].append(None if entry is None else entry[token].logprob)
            top = None
            if entry is not None:  # two ids of one text: the likelier
                top = {}
                for t, lp in entry.items():
                    top[self.token_text(t)] = max(lp.logprob, top.get(self.token_text(t), -math.inf))
            out["top_logprobs"].append(top)
        return out

    def chat_logprobs(self, ids: list[int], entries: list[dict], k: int) -> dict:
        """OpenAI's chat `logprobs`: per token its text, log-probability, UTF-8 bytes and the top k."""
        def item(token: int, logprob: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for token, entry in zip(ids, entries):
            top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)[:k]
            content.append({**item(token, entry[token].logprob),
                            "top_logprobs": [item(t, lp) for _, t, lp in top]})
        return {"content": content}

    def logprobs_of(self, req: _Request, stream: _Stream, ids: list[int], entries: list,
                    echo: bool = False) -> dict | None:
        """The `logprobs` of a choice's tokens `ids` (None when not asked for), its prompt's first when
        `echo`."""
        if stream.params.logprobs is None:
            return None
        if req.chat:
            return self.chat_logprobs(ids, entries, stream.params.logprobs)
        if echo:
            ids = stream.prompt_token_ids + ids
            entries = (stream.prompt_logprobs or [None] * len(stream.prompt_token_ids)) + list(entries)
        return self.completion_logprobs(stream, ids, entries)

    def choice(self, req: _Request, stream: _Stream) -> dict:
        """A finished choice of a non-streamed response."""
        ids = [] if req.scores_only else stream.output_token_ids
        text = "" if req.scores_only else stream.text.visible(final=True)
        out: dict[str, Any] = {"index": stream.index,
                               "finish_reason": "length" if req.scores_only else stream.finish_reason,
                               "stop_reason": None if req.scores_only else stream.stop_reason}
        logprobs = self.logprobs_of(req, stream, ids, stream.logprobs, echo=req.echo)
        if req.chat:
            out.update(message={"role": "assistant", "content": text}, logprobs=logprobs)
        else:
            out.update(text=(stream.echo or "") + text, logprobs=logprobs)
        return out

    async def complete(self, req: _Request, receive) -> Response:
        try:
            async with self.running(req, receive) as events:
                async for _ in events:
                    pass
        except ConnectionResetError:
            return Response(status_code=499)  # nobody reads it: the connection is gone
        choices = [self.choice(req, stream) for stream in req.streams]
        return JSONResponse({"id": req.id, "object": "chat.completion" if req.chat else "text_completion",
                             "created": int(time.time()), "model": self.model_name, "choices": choices,
                             "usage": self.usage(req)})

    async def sse(self, req: _Request, include_usage: bool, receive) -> AsyncIterator[str]:
        """The SSE body of a streaming request: a chunk per choice per step (its index says which), then
        usage if asked, then `[DONE]`. An error after the headers went out is reported in the stream, as
        OpenAI does."""
        base = {"id": req.id, "object": "chat.completion.chunk" if req.chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}

        def chunk(choice: dict) -> str:
            return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

        try:
            async with self.running(req, receive) as events:
                for stream in req.streams if req.chat else ():  # each choice opens with its role
                    yield chunk({"index": stream.index, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": None, "logprobs": None})
                async for stream, event in events:
                    yield chunk(self.delta(req, stream, event))
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except ConnectionResetError:
            return
        if include_usage:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': self.usage(req)})}\n\n"
        yield "data: [DONE]\n\n"

    def delta(self, req: _Request, stream: _Stream, event: StreamEvent) -> dict:
        """One streamed chunk's choice: the text `stream` may show now that it did not show before, and
        the log-probabilities of the event's tokens (an echo's prompt first, in the choice's first
        chunk)."""
        final = event.finished
        text = "" if req.scores_only else stream.text.visible(final)
        new, stream.shown = text[stream.shown:], max(stream.shown, len(text))
        ids = [] if req.scores_only else event.token_ids
        reason = ("length" if req.scores_only else event.finish_reason) if final else None
        echo, stream.echo = stream.echo, None
        logprobs = self.logprobs_of(req, stream, ids, event.logprobs or [], echo=echo is not None)
        if req.chat:
            return {"index": stream.index, "delta": {"content": new} if new else {},
                    "finish_reason": reason, "logprobs": logprobs}
        choice = {"index": stream.index, "text": (echo or "") + new, "finish_reason": reason,
                  "logprobs": logprobs}
        if final:
            choice["stop_reason"] = None if req.scores_only else event.stop_reason
        return choice


async def _watch_disconnect(receive, queue: asyncio.Queue) -> None:
    """Post _GONE into a request's `queue` when the client disconnects (the request body has been read
    already, so the next ASGI message is the disconnect, whenever it comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(_GONE)


class _EventStream(StreamingResponse):
    """SSE whose generator runs under `aclosing`: a request ends in the engine as soon as the response does,
    never at garbage collection. (Disconnects are watched by `running`, not by Starlette's task group.)"""

    def __init__(self, api: OpenAIServer, req: _Request, body: AsyncIterator[str]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.api, self.req = api, req

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with contextlib.aclosing(self.body_iterator) as body:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                async for text in body:
                    await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.api.active.difference_update(self.req.streams)  # never started: never queued either


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

    # vLLM's tokenizer routes (what lm-evaluation-harness's remote tokenizer calls), at the root as vLLM
    # serves them: the same tokenizer as the completions, so a client can split contexts exactly
    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(api.tokenizer_info())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse(await api.off_loop(api.tokenize, await request.body()))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(await api.off_loop(api.detokenize, await request.body()))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": api.model_name, "object": "model", "created": int(time.time()), "owned_by": "nano_vllm",
            "max_model_len": api.max_model_len}]})

    async def generate(request: Request, model: type[CompletionRequest | ChatCompletionRequest]) -> Response:
        raw = await request.body()
        req, ids, params = await api.off_loop(api.prepare, raw, model)
        chat = model is ChatCompletionRequest
        echo = not chat and req.echo
        # nothing await-ed from here to the engine: a drain cannot miss it
        running = api.open(ids, params, chat, None if chat else req.prompt, echo,
                           scores_only=echo and req.max_tokens == 0)
        if not req.stream:
            return await api.complete(running, request.receive)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return _EventStream(api, running, api.sse(running, include_usage, request.receive))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest)

    return app


def make_server(loop: EngineLoop, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                config=None, sock: socket.socket | None = None, api_key: str | None = None):
    """An HTTP server bound to (host, port) (port 0: any free port), or listening on `sock` (from
    `http_server.listen`), serving `loop`'s engine; `config` is an `http_server.HTTPConfig` (limits,
    timeouts); `api_key`: `/v1` paths need `Authorization: Bearer <api_key>` (auth.py; a non-loopback
    `host` without one is warned about). `serve_forever()` runs it, `shutdown()` drains and stops it."""
    from nano_vllm.serve.http_server import HTTPConfig, HTTPServer

    config = config or HTTPConfig()
    warn_if_exposed(host, api_key)
    api = OpenAIServer(loop, model_name, config.drain_timeout_s, config.health_stall_s)
    return HTTPServer(api, host, port, config, sock, api_key)


def http_config(cfg: DictConfig) -> HTTPConfig:
    """The `server:` group of a serve config (limits and timeouts of the HTTP layer)."""
    from nano_vllm.serve.http_server import HTTPConfig

    return HTTPConfig(**(OmegaConf.to_container(cfg.get("server") or {}, resolve=True) or {}))


def build(cfg: DictConfig, engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine
          ) -> tuple[HTTPServer, EngineLoop]:
    """(http server, engine loop) for a serve config (configs/serve.yaml); the loop is started, the server
    not yet. The port is bound first, so a bad or busy one fails before the model is loaded, and the API
    key (`api_key`, `api_key_file` or NANO_VLLM_API_KEY: auth.py) is read before that. The engine is
    fast by default; `performance_layers: false` runs the paper path alone. `engine_factory` builds the
    engine from the config's EngineConfig: LLMEngine, or a package on nano_vllm's subclass with its own
    arguments bound (`functools.partial`)."""
    from nano_vllm.serve.http_server import listen

    api_key = resolve_api_key(cfg.get("api_key"), cfg.get("api_key_file"))
    http = http_config(cfg)
    args = engine_args_from(OmegaConf.to_container(cfg.engine, resolve=True) or {})
    if cfg.get("performance_layers") is not None:
        args["performance_layers"] = bool(cfg.performance_layers)
    sock = listen(str(cfg.host), cfg.port)
    try:
        loop = EngineLoop(engine_factory(EngineConfig(model=str(cfg.model), **args))).start()
    except BaseException:
        sock.close()
        raise
    name = cfg.get("served_model_name") or str(cfg.model)
    return make_server(loop, name, str(cfg.host), sock.getsockname()[1], http, sock, api_key), loop


def serve_until_stopped(server: Any, loop: EngineLoop, banner: str, name: str) -> None:
    """Print `banner`, serve until interrupted, then close the socket, stop the loop (requests in flight
    drain) and shut the engine down."""
    print(banner, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # a second Ctrl-C during the drain
        pass
    finally:
        server.server_close()
        loop.stop()
        loop.engine.shutdown()
    print(f"{name}: server stopped", flush=True)
