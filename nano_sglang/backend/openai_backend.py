"""`OpenAIBackend`: the frontend's `gen` and fork hints on nano_vllm's (or any) OpenAI-compatible server."""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import Generator, Iterator
from urllib.parse import urlparse

from nano_sglang.backend.runtime_backend import cut_at_stop
from nano_sglang.lang import Gen


class OpenAIBackend:
    """nano_vllm's (or any) OpenAI-compatible server: `POST /v1/completions` with streaming.
    `select` needs prompt log-probabilities (`echo` + `logprobs`), which nano_vllm's server does not offer,
    and constraints need the runtime's FSM masks: both raise NotImplementedError here."""

    def __init__(self, base_url: str, model: str | None = None, timeout: float = 120.0):
        u = urlparse(base_url)
        self.host, self.port, self.model, self.timeout = u.hostname, u.port or 80, model, timeout

    @contextlib.contextmanager
    def _post(self, body: dict) -> Iterator[http.client.HTTPResponse]:
        """POST /v1/completions; the response, read inside the block (the connection closes after it)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        if self.model is not None:
            body = {**body, "model": self.model}
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"server error {resp.status}: {resp.read().decode(errors='replace')}")
            yield resp
        finally:
            conn.close()

    def generate(self, text: str, g: Gen) -> Generator[str, None, str | None]:
        """Yield the text deltas of `g` after `text`; return the server's finish reason ("stop" for a stop
        string cut here)."""
        if g.regex is not None or g.json_schema is not None:
            raise NotImplementedError("constrained gen needs the in-process runtime (RuntimeBackend)")
        body = {"prompt": text, "max_tokens": g.max_tokens, "temperature": g.temperature, "stream": True}
        sent, reason = "", None
        with self._post(body) as resp:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                reason = choice.get("finish_reason") or reason
                full, stopped = cut_at_stop(sent + choice["text"], g.stop)
                if full[len(sent):]:
                    yield full[len(sent):]
                sent = full
                if stopped:
                    return "stop"  # closing the connection aborts the request on the server
        return reason

    def score_choices(self, text: str, choices: list[str]) -> list[float]:
        raise NotImplementedError("select needs prompt logprobs, which nano_vllm's server does not return")

    def cache_prefix(self, text: str) -> None:
        if text:
            with self._post({"prompt": text, "max_tokens": 1, "temperature": 0.0}) as resp:
                resp.read()
