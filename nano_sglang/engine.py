"""The SGLang runtime over nano_vllm: `SGLEngine` (stepped, one thread) and `Runtime` (an engine thread that
any number of frontend threads submit to).

`SGLEngine` is nano_vllm's `LLMEngine` with three parts swapped for SGLang's (arXiv 2312.07104):
`RadixBlockManager` (§3 RadixAttention), `CacheAwareScheduler` (§3 cache-aware scheduling) and
`SGLModelRunner` (prompt scoring for `select`, FSM masks for constrained decoding, §4). Everything else
— the paged KV pool, chunked prefill, preemption, kernels, sampling — is nano_vllm's.

    from nano_sglang.engine import SGLEngine
    from nano_vllm import EngineConfig, SamplingParams
    engine = SGLEngine(EngineConfig(model="tiny"), policy=CacheAwareConfig("lpm"))
    outs = engine.generate(["Hello", "Hello there"], SamplingParams(temperature=0, max_tokens=8))
    engine.generate(["Name: "], regex=r"[A-Z][a-z]{1,8}")
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from nano_sglang.block_manager import RadixBlockManager
from nano_sglang.constrained import Constraint, TokenIndex
from nano_sglang.model_runner import SGLModelRunner
from nano_sglang.scheduler import CacheAwareConfig, CacheAwareScheduler
from nano_vllm.config import EngineConfig
from nano_vllm.engine import LLMEngine, RequestOutput
from nano_vllm.engine_loop import EngineLoop
from nano_vllm.performance import with_performance_layers
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.sequence import Sequence

# Token counts at which SGLEngine captures CUDA graphs for steps that are not pure decode (unless the config
# names its own): jump-forward makes many small extend steps, and an eager step is host-bound (~28 ms
# against ~9 ms for a graph step on the llama3-8b shape, BENCHMARKS.md).
MIXED_CUDAGRAPH_SIZES = (64, 128, 256, 512)


class SGLEngine(LLMEngine):
    model_runner_cls = SGLModelRunner

    def __init__(self, config: EngineConfig, policy: CacheAwareConfig | None = None):
        if config.tensor_parallel_size != 1:
            raise ValueError("nano_sglang runs on one device: tensor_parallel_size must be 1")
        if config.mixed_cudagraph_sizes is None:
            config = config.replace(mixed_cudagraph_sizes=tuple(
                s for s in MIXED_CUDAGRAPH_SIZES if s <= config.max_num_batched_tokens))
        super().__init__(config)
        base = self.scheduler  # nano_vllm's, built by LLMEngine; keep its config and EOS ids
        self.block_manager = RadixBlockManager(self.model_runner.num_blocks, config.block_size,
                                               config.enable_prefix_caching)
        self.scheduler = CacheAwareScheduler(base.config, self.block_manager, base.eos_token_ids, policy)
        self._index: TokenIndex | None = None
        with_performance_layers(self)  # the kernel warm-up on CUDA, through the radix cache and scheduler

    @property
    def token_index(self) -> TokenIndex:
        if self._index is None:
            self._index = TokenIndex(self.tokenizer, self.model_config.vocab_size, self.scheduler.eos_token_ids)
        return self._index

    def add_request(self, prompt: str | Seq[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, *,
                    regex: str | None = None, json_schema: dict | None = None, jump_forward: bool = True,
                    score_from: int | None = None) -> Sequence:
        """nano_vllm's add_request plus a regex / JSON-schema constraint and prompt scoring (`score_from`:
        return the log-probabilities of prompt tokens [score_from, len)). Bad constraints raise ValueError
        before anything is queued or allocated."""
        constraint = None
        if regex is not None or json_schema is not None:
            constraint = Constraint.build(self.token_index, regex, json_schema, jump_forward)
        n = len(prompt) if not isinstance(prompt, str) else None
        if score_from is not None and n is not None and not 1 <= score_from < n:
            raise ValueError(f"score_from must be in [1, {n}), got {score_from}")
        seq = super().add_request(prompt, sampling_params, request_id, arrival_time)
        seq.constraint, seq.score_from, seq.prompt_logprobs = constraint, score_from, []
        return seq

    def generate(self, prompts: Seq[str | Seq[int]], sampling_params: SamplingParams | None = None,
                 **constraint) -> list[RequestOutput]:
        """Offline batch: run every prompt to completion (one SamplingParams, one optional constraint)."""
        seqs = [self.add_request(p, sampling_params, **constraint) for p in prompts]
        try:
            while self.has_unfinished_requests():
                self.step()
        except BaseException:
            for s in seqs:
                self.abort_request(s.request_id)
            raise
        return [self.output_of(s, p if isinstance(p, str) else None) for s, p in zip(seqs, prompts)]


# ---------------------------------------------------------------------- the engine thread
@dataclass
class Handle:
    """A submitted request as seen by the frontend: stream deltas with `events`, or `wait()`."""

    request_id: str
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # lists of new token ids; None = end
    done: threading.Event = field(default_factory=threading.Event)
    seq: Sequence | None = None
    error: str | None = None
    sent: int = 0

    def wait(self, timeout: float | None = None) -> Sequence:
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self.error is not None:
            raise RuntimeError(f"request {self.request_id} failed: {self.error}")
        return self.seq

    def stream(self):
        """Yield lists of new token ids as they are generated (jump-forward tokens arrive in one list)."""
        while True:
            item = self.events.get()
            if item is None:
                if self.error is not None:
                    raise RuntimeError(self.error)
                return
            yield item


class _HandleLoop(EngineLoop):
    """nano_vllm's engine thread speaking `Handle`s instead of `RequestStream`s. The engine's lock is held
    while it adds or steps, because frontend threads compile constraints on the same `token_index`."""

    idle_wait_s = 0.2

    def __init__(self, engine: SGLEngine, lock: threading.Lock):
        super().__init__(engine, name="nano_sglang-engine")
        self._lock = lock

    def _add(self, handle: Handle, prompt_token_ids: list[int], params: SamplingParams, kwargs: dict) -> Sequence:
        with self._lock:
            handle.seq = super()._add(handle, prompt_token_ids, params, kwargs)
        return handle.seq

    def _step(self) -> tuple[list[Sequence], list[Sequence]]:
        with self._lock:
            return super()._step()

    def _emit(self, handle: Handle, seq: Sequence) -> None:
        new = seq.output_token_ids[handle.sent:]
        handle.sent += len(new)
        if new:
            handle.events.put(new)
        if seq.is_finished:
            self._end(handle, seq.finish_reason)

    def _end(self, handle: Handle, reason: str | None, error: str | None = None) -> None:
        # A Handle has no finish reason of its own (the sequence has it); wait/stream only tell error from not.
        handle.error = error
        handle.done.set()
        handle.events.put(None)


class Runtime:
    """An `SGLEngine` stepped by its own thread (nano_vllm's `EngineLoop`): frontend threads `submit` and
    wait on their handles, so concurrent programs share every step (and the radix tree)."""

    def __init__(self, model: str = "tiny", policy: str | CacheAwareConfig = "lpm", **engine_args):
        pol = CacheAwareConfig(policy) if isinstance(policy, str) else policy
        self.engine = SGLEngine(EngineConfig(model=str(model), **engine_args), pol)
        self.tokenizer = self.engine.tokenizer
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._loop = _HandleLoop(self.engine, self._lock).start()
        self.thread = self._loop.thread

    def submit(self, prompt_ids: list[int], params: SamplingParams, **kwargs) -> Handle:
        """Queue a request; constraint and scoring errors raise here (ValueError), in the caller's thread."""
        if kwargs.get("regex") is not None or kwargs.get("json_schema") is not None:
            with self._lock:  # compile now, so a bad regex fails in the caller's thread
                Constraint.build(self.engine.token_index, kwargs.get("regex"), kwargs.get("json_schema"))
        handle = Handle(f"sgl-{next(self._ids)}")
        self._loop.add(handle, list(prompt_ids), params, **kwargs)
        return handle

    def abort(self, handle: Handle) -> None:
        self._loop.abort(handle.request_id)

    def shutdown(self) -> None:
        self._loop.stop()
