"""What `LLM.generate` returns, in vLLM's shape — one `RequestOutput` per prompt holding `CompletionOutput`s —
and the progress bar it shows meanwhile."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nano_vllm.logprobs import Logprob
from nano_vllm.sequence import Sequence

TokenLogprobs = dict[int, Logprob]  # one position: {token id: Logprob}, the scored token first


@dataclass
class CompletionOutput:
    """One generated continuation (vLLM's name)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    # the stop string, or the stop token id (not EOS), that ended it
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked for
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt, vLLM-shaped; `.text` / `.token_ids` are the first output's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)
    # one per prompt token (None for the first), when asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @classmethod
    def of(cls, seqs: Sequence | list[Sequence], texts: str | list[str], prompt: str | None = None,
           tokenizer: Any = None) -> RequestOutput:
        """The output of one request — `seqs`, its n samples (one Sequence, or a list), with their
        detokenized `texts` — with the first one's TTFT / TPOT in `metrics`. `tokenizer` fills the
        `decoded_token` of the log-probabilities."""
        seqs = [seqs] if isinstance(seqs, Sequence) else seqs
        texts = [texts] if isinstance(texts, str) else texts
        first = seqs[0]
        metrics, times = {}, first.token_times
        if times:
            metrics["ttft"] = times[0] - first.arrival_time
            if len(times) > 1:
                metrics["tpot"] = (times[-1] - times[0]) / (len(times) - 1)
        outputs = []
        for j, (seq, text) in enumerate(zip(seqs, texts)):
            logprobs = None
            if seq.logprobs is not None:  # (an overlapped step may have scored one token past the end)
                logprobs = [_decoded(e, tokenizer) for e in seq.logprobs[: seq.num_output_tokens]]
            cumulative = None if logprobs is None else sum(
                e[t].logprob for e, t in zip(logprobs, seq.output_token_ids))
            outputs.append(CompletionOutput(j, text, seq.output_token_ids, seq.finish_reason,
                                            stop_reason(seq), logprobs, cumulative))
        prompt_logprobs = None
        if first.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = [None if e is None else _decoded(e, tokenizer) for e in first.prompt_logprobs]
        return cls(first.request_id, prompt, first.prompt_token_ids, outputs,
                   all(s.is_finished for s in seqs), first.num_cached_tokens, metrics, prompt_logprobs)


def stop_reason(seq: Sequence) -> int | str | None:
    """vLLM's `stop_reason` of a finished sequence: the stop string or the stop token id (not EOS) that
    ended it, else None."""
    if seq.stop_checker is not None and seq.stop_checker.matched is not None:
        return seq.stop_checker.matched
    stops = seq.sampling_params.stop_token_ids or ()
    return seq.stop_token_id if seq.stop_token_id in stops else None


def _decoded(entry: TokenLogprobs, tokenizer: Any) -> TokenLogprobs:
    """`entry` with each token's text filled in (special tokens included, as vLLM shows them)."""
    if tokenizer is not None:
        for tid, lp in entry.items():
            if lp.decoded_token is None:
                lp.decoded_token = tokenizer.decode([tid], skip_special_tokens=False)
    return entry


class Progress:
    """vLLM's "Processed prompts" bar (tqdm) with the output tokens/s so far; does nothing when disabled."""

    def __init__(self, total: int, enabled: bool = True):
        self.bar, self.t0, self.generated = None, time.perf_counter(), 0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)

    def update(self, stepped: list[Sequence], finished: list[Sequence]) -> None:
        """After an engine step: `stepped` sequences got a token, `finished` ones are done."""
        self.generated += len(stepped)
        if self.bar is not None:
            rate = self.generated / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
            self.bar.update(len(finished))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
