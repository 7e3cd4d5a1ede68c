"""An OpenAI-compatible HTTP server on the standard library: `/v1/completions`, `/v1/chat/completions`
(both with SSE streaming), `/v1/models`, `/health`.

One `ThreadingHTTPServer` thread per connection parses and validates the request, submits it to the
shared `EngineLoop` (so concurrent requests are batched by one engine) and relays its tokens. A client
that disconnects — noticed when a write fails, or when its socket reads EOF while we wait — has its
request aborted, which frees its KV blocks at the next step. Bad requests get HTTP 400 with OpenAI's
error body `{"error": {"message", "type", "param", "code"}}`, never a crash.
"""

from __future__ import annotations

import json
import select
import socket
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from nano_vllm.engine_loop import EngineLoop, RequestStream
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.tokenizer import IncrementalDetokenizer

POLL_S = 0.05  # how often a waiting handler checks whether its client is still there


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    for name, allowed in (("n", (None, 1)), ("best_of", (None, 1)), ("logprobs", (None, False, 0)),
                          ("echo", (None, False)), ("stop", (None, [], ""))):
        if body.get(name) not in allowed:
            raise APIError(400, f"{name}={body[name]!r} is not supported by this server", name)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    kwargs = {
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "top_k": body.get("top_k", -1), "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "ignore_eos": body.get("ignore_eos", False), "stop_token_ids": body.get("stop_token_ids"),
        "seed": body.get("seed"),
    }
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in ("stop_token_ids", "seed")}
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise APIError(400, str(e), str(e).split()[0]) from None


class OpenAIServer:
    """What the handlers share: the engine loop, the tokenizer and the served model's name."""

    def __init__(self, loop: EngineLoop, model_name: str):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = loop.engine.tokenizer
        self.model_name = model_name
        self.max_model_len = loop.engine.max_model_len

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "not_found_error")

    def prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise APIError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
        vocab = self.engine.model_config.vocab_size
        if not ids:
            raise APIError(400, "prompt is empty", "prompt")
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return ids

    def chat_prompt_ids(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "messages must be a non-empty list", "messages")
        clean = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, "each message must be an object with a string 'role'", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise APIError(400, "message content must be a string or a list of text parts", "messages")
            clean.append({"role": m["role"], "content": content})
        try:
            return self.prompt_ids(self.tokenizer.apply_chat_template(clean))
        except (ValueError, TypeError) as e:
            raise APIError(400, f"chat template failed: {e}", "messages") from None

    def check_length(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) + params.max_tokens > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"you requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                                f"{params.max_tokens} for the completion).", "max_tokens" if len(ids) <=
                           self.max_model_len else "prompt")

    def parse(self, body: Any, chat: bool) -> tuple[list[int], SamplingParams]:
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        self.check_model(body)
        if chat:
            ids = self.chat_prompt_ids(body.get("messages"))
        else:
            if "prompt" not in body:
                raise APIError(400, "missing required field 'prompt'", "prompt")
            ids = self.prompt_ids(body["prompt"])
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"prompt has {len(ids)} tokens; this model's maximum context length is "
                                f"{self.max_model_len} (prompt + at least one output token)", "prompt")
        # OpenAI's chat default is "as many as fit"; completions default to 16 (vLLM).
        params = _sampling_params(body, self.max_model_len - len(ids) if chat else 16)
        self.check_length(ids, params)
        return ids, params


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "nano_vllm"
    api: OpenAIServer  # set on the subclass made by make_server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise here
        pass

    # ------------------------------------------------------------------ responses
    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: APIError) -> None:
        self._json(e.status, {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": None}})

    def _sse(self, payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _client_gone(self) -> bool:
        """True when the client closed its side (readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # ------------------------------------------------------------------ routes
    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{
                "id": self.api.model_name, "object": "model", "created": int(time.time()), "owned_by": "nano_vllm",
                "max_model_len": self.api.max_model_len}]})
        else:
            self._error(APIError(404, f"no route GET {self.path}", kind="not_found_error"))

    def do_POST(self) -> None:
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            return self._error(APIError(404, f"no route POST {self.path}", kind="not_found_error"))
        try:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise APIError(400, f"malformed JSON body: {e}") from None
            ids, params = self.api.parse(body, chat)
        except APIError as e:
            return self._error(e)
        stream = self.api.loop.submit(ids, params)
        try:
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                self._stream(stream, chat, include_usage)
            else:
                self._complete(stream, chat)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.api.loop.abort(stream.request_id)  # the client went away: free its blocks
            self.close_connection = True

    def _events(self, stream: RequestStream):
        """The request's events; aborts it (and stops) if the client disconnects meanwhile. The socket is
        checked every POLL_S whether or not tokens flow: a non-streaming client is never written to."""
        last_check = time.monotonic()
        while True:
            event = stream.get(timeout=POLL_S)
            if time.monotonic() - last_check >= POLL_S:
                if self._client_gone():
                    raise ConnectionResetError("client disconnected")
                last_check = time.monotonic()
            if event is None:
                continue
            if event.error is not None:
                raise APIError(500, f"generation failed: {event.error}", kind="internal_server_error")
            yield event
            if event.finished:
                return

    def _usage(self, stream: RequestStream) -> dict:
        n_in, n_out = len(stream.prompt_token_ids), len(stream.output_token_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def _complete(self, stream: RequestStream, chat: bool) -> None:
        reason = None
        try:
            for event in self._events(stream):
                reason = event.finish_reason
        except APIError as e:
            return self._error(e)
        text = self.api.tokenizer.decode(stream.output_token_ids)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        self._json(200, {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": self.api.model_name, "choices": [choice], "usage": self._usage(stream)})

    def _stream(self, stream: RequestStream, chat: bool, include_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream ends when we close; no chunked encoding
        self.end_headers()
        self.close_connection = True
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": self.api.model_name}
        detok = IncrementalDetokenizer(self.api.tokenizer)

        def chunk(text: str | None, reason: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}
            return {**base, "choices": [{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}]}

        if chat:
            self._sse(chunk(None, None, role=True))
        try:
            for event in self._events(stream):
                delta = detok.step(stream.output_token_ids, final=event.finished)
                self._sse(chunk(delta, event.finish_reason if event.finished else None))
        except APIError as e:  # headers are sent: report the error in the stream, as OpenAI does
            self._sse({"error": {"message": e.message, "type": e.kind, "param": None, "code": None}})
        if include_usage:
            self._sse({**base, "choices": [], "usage": self._usage(stream)})
        self._sse("[DONE]")


def make_server(loop: EngineLoop, model_name: str, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server bound to (host, port) (port 0: any free port) serving `loop`'s engine."""
    handler = type("BoundHandler", (Handler,), {"api": OpenAIServer(loop, model_name)})
    return _Server((host, port), handler)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # listen backlog (socketserver's default 5 resets bursts of connections)
