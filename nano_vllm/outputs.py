"""What `LLM.generate` returns, in vLLM's shape — one `RequestOutput` per prompt holding `CompletionOutput`s —
and the progress bar it shows meanwhile."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nano_vllm.sequence import Sequence


@dataclass
class CompletionOutput:
    """One generated continuation (vLLM's name)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


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

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @classmethod
    def of(cls, seq: Sequence, text: str, prompt: str | None = None) -> RequestOutput:
        """The output of `seq` (its detokenized `text` given), with its TTFT / TPOT in `metrics`."""
        metrics, times = {}, seq.token_times
        if times:
            metrics["ttft"] = times[0] - seq.arrival_time
            if len(times) > 1:
                metrics["tpot"] = (times[-1] - times[0]) / (len(times) - 1)
        return cls(seq.request_id, prompt, seq.prompt_token_ids,
                   [CompletionOutput(0, text, seq.output_token_ids, seq.finish_reason)], seq.is_finished,
                   seq.num_cached_tokens, metrics)


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
