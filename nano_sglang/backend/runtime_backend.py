"""`RuntimeBackend`: the frontend's primitives on the in-process `Runtime` (SGLang, arXiv 2312.07104, §2).

`generate(text, Gen)` yields text deltas, `score_choices(text, choices)` scores `select`'s choices and
`cache_prefix(text)` sends a fork's hint. Text is tokenized here, once per primitive; a `select` prompt is
the prefix's ids followed by each choice's own ids, so every choice shares the prefix in the radix tree.
"""

from __future__ import annotations

from collections.abc import Generator

from nano_sglang.backend.runtime import Runtime
from nano_sglang.lang import Gen
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.tokenizer import IncrementalDetokenizer


def cut_at_stop(text: str, stop) -> tuple[str, bool]:
    """`text` up to the first of the `stop` strings, and whether one was found."""
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

    def generate(self, text: str, g: Gen) -> Generator[str, None, str | None]:
        """Yield the text deltas of `g` after `text`; return the finish reason ("stop" at EOS, the end of
        a constraint's match or a stop string; "length" at max_tokens or max_model_len)."""
        ids = self._encode(text)
        params = SamplingParams(temperature=g.temperature, max_tokens=g.max_tokens)
        handle = self.runtime.submit(ids, params, regex=g.regex, json_schema=g.json_schema,
                                     jump_forward=g.jump_forward)
        detok, out, sent = IncrementalDetokenizer(self.tokenizer), [], ""
        for new in handle.stream():
            out += new
            delta = detok.step(out)
            full, stopped = cut_at_stop(sent + delta, g.stop)
            if full[len(sent):]:
                yield full[len(sent):]
            sent = full
            if stopped:
                self.runtime.abort(handle)
                return "stop"
        full, stopped = cut_at_stop(self.tokenizer.decode(out), g.stop)
        if full[len(sent):] and full.startswith(sent):
            yield full[len(sent):]
        return "stop" if stopped else handle.finish_reason

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
