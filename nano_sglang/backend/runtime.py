"""`Runtime`: an `SGLEngine` stepped by its own thread, which any number of frontend threads submit to.

The frontend (nano_sglang.lang) runs every program state on its own thread; their requests must meet in
the same engine steps, and the same radix tree, for batching and prefix sharing to happen. nano_vllm's
`EngineLoop` does exactly that for its server; `Runtime` speaks `Handle`s to it instead of HTTP streams.
The engine runs nano_vllm's performance layers by default (CUDA graphs, the kernel warm-up, ...;
`performance_layers=False` among the engine arguments runs the paper path alone); the runtime adds CUDA
graphs for the steps jump-forward makes (`MIXED_CUDAGRAPH_SIZES`).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from nano_sglang.constrained import Constraint
from nano_sglang.engine import SGLEngine
from nano_sglang.scheduler import CacheAwareConfig
from nano_sglang.sequence import SGLSequence
from nano_vllm.config import EngineConfig
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.serve.engine_loop import EngineLoop

# Token counts at which the runtime's engine captures CUDA graphs for steps that are not pure decode (unless
# `mixed_cudagraph_sizes` is given): jump-forward makes many small extend steps, and an eager step is
# host-bound (~28 ms against ~9 ms for a graph step on the llama3-8b shape, BENCHMARKS.md).
MIXED_CUDAGRAPH_SIZES = (64, 128, 256, 512)


@dataclass
class Handle:
    """A submitted request as seen by the frontend: stream deltas with `events`, or `wait()`."""

    request_id: str
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # lists of new token ids; None = end
    done: threading.Event = field(default_factory=threading.Event)
    seq: SGLSequence | None = None
    error: str | None = None
    finish_reason: str | None = None  # "stop", "length" (max_tokens or max_model_len), "abort", "error"
    sent: int = 0

    def wait(self, timeout: float | None = None) -> SGLSequence:
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        if self.error is not None:
            raise RuntimeError(f"request {self.request_id} failed: {self.error}")
        return self.seq

    def stream(self) -> Iterator[list[int]]:
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

    def _add(self, handle: Handle, prompt_token_ids: list[int], params: SamplingParams,
             kwargs: dict) -> SGLSequence:
        with self._lock:
            handle.seq = super()._add(handle, prompt_token_ids, params, kwargs)
        return handle.seq

    def _step(self) -> tuple[list[SGLSequence], list[SGLSequence]]:
        with self._lock:
            return super()._step()

    def _emit(self, handle: Handle, seq: SGLSequence) -> None:
        new = seq.output_token_ids[handle.sent:]
        handle.sent += len(new)
        if new:
            handle.events.put(new)
        if seq.is_finished:
            self._end(handle, seq.finish_reason)

    def _end(self, handle: Handle, reason: str | None, error: str | None = None) -> None:
        handle.finish_reason, handle.error = reason, error
        handle.done.set()
        handle.events.put(None)


class Runtime:
    """An `SGLEngine` stepped by its own thread (nano_vllm's `EngineLoop`): frontend threads `submit` and
    wait on their handles, so concurrent programs share every step (and the radix tree)."""

    def __init__(self, model: str = "tiny", policy: str | CacheAwareConfig = "lpm", **engine_args):
        pol = CacheAwareConfig(policy) if isinstance(policy, str) else policy
        config = EngineConfig(model=str(model), **engine_args)
        if config.mixed_cudagraph_sizes is None:
            config = config.replace(mixed_cudagraph_sizes=tuple(
                s for s in MIXED_CUDAGRAPH_SIZES if s <= config.max_num_batched_tokens))
        self.engine = SGLEngine(config, pol)
        self.tokenizer = self.engine.tokenizer
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._loop = _HandleLoop(self.engine, self._lock).start()
        self.thread = self._loop.thread

    def submit(self, prompt_ids: list[int], params: SamplingParams, **kwargs) -> Handle:
        """Queue a request. A bad constraint raises ValueError here, in the caller's thread; a request the
        engine refuses (a prompt too long, a bad `score_from`) ends its handle with the error."""
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
