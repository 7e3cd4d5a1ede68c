"""What `LLM.generate` returns, in vLLM's shape: one `RequestOutput` per prompt holding `CompletionOutput`s."""

from __future__ import annotations

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
