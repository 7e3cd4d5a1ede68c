"""Where the frontend's primitives run: the in-process runtime or an OpenAI-compatible server.

Both offer `generate(text, Gen)` (yields text deltas), `score_choices(text, choices)` (`select`, §2) and
`cache_prefix(text)` (the fork hint). Text is tokenized here, once per primitive; a `select` prompt is the
prefix's ids followed by each choice's own ids, so every choice shares the prefix in the radix tree.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlparse

from nano_sglang.lang import Gen
from nano_sglang.runtime import Runtime
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.tokenizer import IncrementalDetokenizer


def _cut_at_stop(text: str, stop) -> tuple[str, bool]:
    for s in [stop] if isinstance(stop, str) else (stop or []):
        i = text.find(s)
        if i >= 0:
            return text[:i], True
    return text, False


class RuntimeBackend:
    """The in-process `Runtime` (SGLEngine on its own thread)."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.tokenizer = runtime.tokenizer

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def generate(self, text: str, g: Gen) -> Iterator[str]:
        ids = self._encode(text)
        params = SamplingParams(temperature=g.temperature, max_tokens=g.max_tokens)
        handle = self.runtime.submit(ids, params, regex=g.regex, json_schema=g.json_schema,
                                     jump_forward=g.jump_forward)
        detok, out, sent = IncrementalDetokenizer(self.tokenizer), [], ""
        for new in handle.stream():
            out += new
            delta = detok.step(out)
            full, stopped = _cut_at_stop(sent + delta, g.stop)
            if full[len(sent):]:
                yield full[len(sent):]
            sent = full
            if stopped:
                self.runtime.abort(handle)
                return
        full, _ = _cut_at_stop(self.tokenizer.decode(out), g.stop)
        if full[len(sent):] and full.startswith(sent):
            yield full[len(sent):]

    def score_choices(self, text: str, choices: list[str]) -> list[float]:
        """Length-normalised log-probability of each choice after `text` (mean over the choice's tokens),
        all choices submitted together so they batch and share the prefix."""
        prefix = self._encode(text)
        handles = []
        for c in choices:
            ids = prefix + self._encode(c)
            if len(ids) < 2 or len(ids) == len(prefix):
                raise ValueError(f"select: choice {c!r} has no tokens to score")
            handles.append(self.runtime.submit(ids, SamplingParams(temperature=0.0, max_tokens=1),
                                               score_from=max(len(prefix), 1)))
        scores = []
        for h in handles:
            lp = h.wait().prompt_logprobs
            scores.append(sum(lp) / len(lp))
        return scores

    def cache_prefix(self, text: str) -> None:
        ids = self._encode(text)
        if ids:  # fire and forget: the branches that follow hit its blocks
            self.runtime.submit(ids, SamplingParams(temperature=0.0, max_tokens=1))


class OpenAIBackend:
    """nano_vllm's (or any) OpenAI-compatible server: `POST /v1/completions` with streaming.
    `select` needs prompt log-probabilities (`echo` + `logprobs`), which nano_vllm's server does not offer,
    and constraints need the runtime's FSM masks: both raise NotImplementedError here."""

    def __init__(self, base_url: str, model: str | None = None, timeout: float = 120.0):
        u = urlparse(base_url)
        self.host, self.port, self.model, self.timeout = u.hostname, u.port or 80, model, timeout

    def _post(self, body: dict) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        if self.model is not None:
            body = {**body, "model": self.model}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"server error {resp.status}: {resp.read().decode(errors='replace')}")
        return resp

    def generate(self, text: str, g: Gen) -> Iterator[str]:
        if g.regex is not None or g.json_schema is not None:
            raise NotImplementedError("constrained gen needs the in-process runtime (RuntimeBackend)")
        resp = self._post({"prompt": text, "max_tokens": g.max_tokens, "temperature": g.temperature,
                           "stream": True})
        sent = ""
        try:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["text"]
                full, stopped = _cut_at_stop(sent + delta, g.stop)
                if full[len(sent):]:
                    yield full[len(sent):]
                sent = full
                if stopped:
                    return  # closing the connection aborts the request on the server
        finally:
            resp.close()

    def score_choices(self, text: str, choices: list[str]) -> list[float]:
        raise NotImplementedError("select needs prompt logprobs, which nano_vllm's server does not return")

    def cache_prefix(self, text: str) -> None:
        if text:
            self._post({"prompt": text, "max_tokens": 1, "temperature": 0.0}).read()
