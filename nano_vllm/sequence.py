"""`Sequence`: one request's tokens, progress and KV blocks — the unit the scheduler moves between queues.

vLLM (arXiv 2309.06180) §4.2 maps each request's *logical* KV blocks to physical ones through a block
table; here that table is `Sequence.block_table`. Progress is counted in tokens rather than phases so
one mechanism covers a whole prompt, a prompt chunk, a recomputation after preemption (§4.5) and a
decode step: a step computes K/V for `token_ids[num_computed_tokens : num_computed_tokens + n]`.
"""

from __future__ import annotations

import enum
import itertools
import time

from nano_vllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued: new, or preempted and waiting to recompute
    RUNNING = "running"  # holds KV blocks; gets prefill chunks or decode steps
    FINISHED = "finished"


class Sequence:
    """A request being generated.

    token_ids: prompt followed by the tokens generated so far.
    num_computed_tokens: how many leading tokens have their K/V in the cache (computed or cache hits).
    num_cached_tokens: how many leading tokens came from the prefix cache at the last admission.
    block_table: physical block ids holding the K/V of token i in block `block_table[i // block_size]`.

    An engine that needs more per-request state subclasses it (`LLMEngine.sequence_cls`) and takes the
    extra fields as keyword arguments of its constructor.
    """

    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, arrival_time: float | None = None):
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.seq_id = next(Sequence._ids)  # also the arrival order: the scheduler's priority
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.sampling_params = sampling_params or SamplingParams()
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop" (EOS / stop token), "length", "abort"
        self.stop_token_id: int | None = None  # the EOS or stop token that ended it, if one did
        # stop strings (tokenizer.StopChecker), set by the engine when the request has some
        self.stop_checker = None
        # per output token / prompt token: {token id: Logprob}, when the request asks (logprobs.py)
        self.logprobs: list[dict] | None = None if self.sampling_params.logprobs is None else []
        self.prompt_logprobs = None if self.sampling_params.prompt_logprobs is None else (
            [None] * self.num_prompt_tokens)  # list[dict | None]: None for the first token
        self.num_preemptions = 0
        # Serving metrics (nano_vllm.metrics): arrival, each output token's time, finish.
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.token_times, self.finish_time = [], None  # list[float], float | None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, tokens={len(self)}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def text_token_ids(self) -> list[int]:
        """The output tokens whose text is shown: a stop token's is left out unless
        `include_stop_str_in_output` (vLLM's rule); `output_token_ids` keeps it."""
        if self.stop_token_id is None or self.sampling_params.include_stop_str_in_output:
            return self.output_token_ids
        return self.output_token_ids[:-1]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, now: float | None = None) -> None:
        self.token_ids.append(token_id)
        self.token_times.append(time.perf_counter() if now is None else now)
