"""Overlapped scheduling — a performance layer: the host schedules and prepares step t+1 while the device
runs step t (SGLang's overlap scheduler, vLLM's async scheduling).

In the paper path a step is schedule → prepare → launch → wait for the sampled tokens → postprocess, and
the device idles through everything but the launch and the wait. Step t+1's batch, though, depends on step
t's tokens only through their *values* (its decodes feed them back in), not their count: every sequence
that samples gets exactly one token. So step t+1 can be scheduled and launched with a placeholder for each
token step t samples, and the placeholder resolved on the device:

* `FutureTokens` is a ring of device slots. Step t's sampled tokens are written to slots s..s+B-1; in
  the host's token lists a token not yet known is the placeholder id -(slot + 1) (token ids are never
  negative). The embedding lookup resolves placeholders on the device (a forward pre-hook on
  `embed_tokens`, installed at load time, so captured CUDA graphs include it): step t+1 reads step t's
  tokens without the host ever holding them.
* One `engine.step()` call, with step t in flight (launched by the previous call):
  1. `scheduler.postprocess(out_t, placeholders)` — the paper path's own bookkeeping, with placeholders for
     tokens: sequences advance by their chunk, a placeholder is appended for each token drawn, and a
     sequence that reaches `max_tokens` or `max_model_len` finishes now (its length is known), so it is
     never scheduled again and no token is lost or added;
  2. schedule step t+1 (its decodes read their placeholder as their last token) and launch it: prepare,
     forward, sample; the tokens go to the ring and, asynchronously, to pinned host memory;
  3. resolve step t: wait for its tokens — the device is busy with step t+1 meanwhile — write them over
     the placeholders and finish every sequence that drew EOS or a stop token. Such a sequence already
     sits in step t+1; its token from there is dropped (step 1 of the next call skips finished sequences).
     A sequence preempted by step t+1's scheduling (§4.5) keeps its token and recomputes later, as usual.
  4. return step t's (sequences that got a token, finished sequences), as `LLMEngine.step` does.
  When step t+1 will run eagerly on a runner that has CUDA graphs (a prefill without mixed-step graphs),
  step 3 moves before its launch: that launch is host-bound, the device would finish step t while the host
  is still launching, and a new request's first token would wait for the whole launch.
  Between calls no placeholder is visible: a sequence's `token_ids` hold real tokens only, so the server's
  streams, `abort_request` (which frees the blocks at once: the work still queued on the device writes
  into them before anything scheduled later can) and `output_of` see what they see without the layer.
* Prefix caching (§4.4) hashes a block when the step that fills it is scheduled; a block whose last token
  is a placeholder is hashed again once the token is known.

Installed on an engine (its `step` and `has_unfinished_requests`, on that instance) by an "engine" hook,
the ring on its runner by a "runner" hook: on CUDA unless `EngineConfig.async_scheduling` is False,
anywhere when True; greedy outputs and stop conditions are exactly the paper path's. It needs nano_vllm's
own `ModelRunner.prepare` / `execute` and `Scheduler.postprocess` (a scheduler that reads the sampled
tokens in postprocess, such as constrained decoding, needs them at once) and one device: by default it
stays off where these do not hold; asked for (True), it is a ValueError.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nano_vllm.config import REGISTRY
from nano_vllm.logprobs import StepLogprobs
from nano_vllm.model_runner import ModelRunner, StepInputs
from nano_vllm.scheduler import Scheduler, SchedulerOutput
from nano_vllm.sequence import Sequence, SequenceStatus
from shared.kernels import HAS_TRITON, use_triton


class FutureTokens:
    """Device slots for tokens sampled but not yet read back; id -(slot + 1) names slot `slot`."""

    def __init__(self, num_slots: int, device: torch.device):
        self.ring = torch.zeros(num_slots, dtype=torch.long, device=device)

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` with every placeholder replaced by the token in its slot (on the device, no sync): one
        Triton kernel on CUDA (torch's five — compare, negate, clamp, gather, select — took 5.9 µs of a
        batch-1 decode graph, the kernel 1.4; H100, 2026-12-07), `resolve_torch` elsewhere."""
        if use_triton(ids) and ids.is_contiguous():
            return self.resolve_triton(ids)
        return self.resolve_torch(ids)

    def resolve_torch(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(ids < 0, self.ring[(-1 - ids).clamp_(min=0)], ids)

    def resolve_triton(self, ids: torch.Tensor) -> torch.Tensor:
        out, n = torch.empty_like(ids), ids.numel()
        _resolve_kernel[(triton.cdiv(n, RESOLVE_BLOCK),)](ids, self.ring, out, n, BLOCK=RESOLVE_BLOCK)
        return out


RESOLVE_BLOCK = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])
    def _resolve_kernel(IDS, RING, OUT, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        ids = tl.load(IDS + offs, mask=ok, other=0)
        future = ids < 0
        token = tl.load(RING + tl.where(future, -1 - ids, 0), mask=ok & future, other=0)
        tl.store(OUT + offs, tl.where(future, token, ids), mask=ok)


def install_future_tokens(runner: ModelRunner) -> None:
    """The "runner" hook: give the runner a FutureTokens ring (two steps of `max_num_seqs` rows) resolved
    by its embedding lookup."""
    runner.future_tokens = FutureTokens(2 * runner.config.max_num_seqs, runner.device)
    runner.model.model.embed_tokens.register_forward_pre_hook(
        lambda module, args: (runner.future_tokens.resolve(args[0]), *args[1:]))


@dataclass
class _Flight:
    """A launched step: what it schedules, its placeholders, and its tokens on their way to the host."""

    out: SchedulerOutput
    sampled: list[Sequence]  # the sequences that draw a token, in row order
    placeholders: list[int]
    positions: list[int]  # where each placeholder goes in its sequence's token_ids
    host: torch.Tensor | None = None  # the tokens, copied asynchronously
    ready: torch.cuda.Event | None = None
    finished: list[Sequence] = field(default_factory=list)  # finished by length in its postprocess
    scores: StepLogprobs | None = None  # log-probabilities the step's requests ask for


class OverlapScheduler:
    """The overlapped `step()` of one engine (see the module docstring)."""

    def __init__(self, engine: Any):
        runner = engine.model_runner
        if type(runner).execute is not ModelRunner.execute or type(runner).prepare is not ModelRunner.prepare:
            raise ValueError(f"async_scheduling needs nano_vllm's ModelRunner.prepare / execute; "
                             f"{type(runner).__name__} overrides them")
        if type(engine.scheduler).postprocess is not Scheduler.postprocess:
            raise ValueError(f"async_scheduling needs nano_vllm's Scheduler.postprocess; "
                             f"{type(engine.scheduler).__name__} overrides it")
        self.engine = engine
        self.future: FutureTokens = runner.future_tokens
        self.rows = engine.config.max_num_seqs
        cuda = runner.device.type == "cuda"
        self.host_tokens = [torch.empty(self.rows, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if cuda else [None, None]
        self.num_launched = 0
        self.inflight: _Flight | None = None

    def install(self) -> OverlapScheduler:
        self.engine.step = self.step
        self.engine.has_unfinished_requests = self.has_unfinished_requests
        return self

    def has_unfinished_requests(self) -> bool:
        return self.inflight is not None or self.engine.scheduler.has_unfinished()

    def step(self) -> tuple[list[Sequence], list[Sequence]]:
        """Postprocess the step in flight with placeholders, schedule and launch the next one, then resolve
        the one in flight; returns its (sequences that got a token, finished sequences)."""
        engine = self.engine
        scheduler = engine.scheduler
        if type(scheduler).postprocess is not Scheduler.postprocess:
            raise ValueError(f"async_scheduling needs nano_vllm's Scheduler.postprocess; "
                             f"{type(scheduler).__name__} overrides it")
        flight, self.inflight = self.inflight, None
        result: tuple[list[Sequence], list[Sequence]] = [], []
        try:
            if flight is not None:
                flight.finished = scheduler.postprocess(flight.out, flight.placeholders)
            out = scheduler.schedule()
            if out.seqs:
                runner = engine.model_runner
                inputs = runner.prepare(out)
                if flight is not None and self._host_bound(inputs):
                    # An eager step's launch keeps the host busy longer than the device takes for the step
                    # in flight, so overlapping gains nothing and would hold step t's tokens (a new
                    # request's first token, say) back until that launch ends: resolve step t first.
                    result, flight = self._resolve(flight), None
                self.inflight = self._launch(out, inputs)
            elif flight is None:
                if scheduler.has_unfinished():
                    raise RuntimeError("scheduler made no progress: the KV cache cannot fit any waiting request")
                return [], []
            return self._resolve(flight) if flight is not None else result
        except BaseException:
            # As LLMEngine.step: the blocks the failed steps fill are hashed but may never be written.
            engine.block_manager.reset_prefix_cache()
            if flight is not None:
                _drop_placeholders(flight)
            self.inflight = None
            raise

    def _host_bound(self, inputs: StepInputs) -> bool:
        """Whether the step runs eagerly on a runner that replays CUDA graphs for the steps they fit (a
        prefill, say, without mixed-step graphs): its launch, op by op from Python, is host-bound."""
        runner = self.engine.model_runner
        return bool(runner.cudagraphs) and not any(g.fits(inputs) for g in runner.cudagraphs)

    def _launch(self, out: SchedulerOutput, inputs: StepInputs) -> _Flight:
        """Forward and sample `out` (prepared as `inputs`) on the device; the tokens go to the ring and,
        asynchronously, to pinned host memory. Nothing here waits for the device."""
        runner = self.engine.model_runner
        sampled = [s for s, f in zip(out.seqs, out.samples) if f]
        logits = runner.run(inputs)
        if logits is None:
            return _Flight(out, [], [], [], scores=StepLogprobs.of(runner, out, None, None))
        tokens = runner.sample(logits, out)
        scores = StepLogprobs.of(runner, out, logits, tokens)
        n = len(sampled)
        if n > self.rows:
            raise RuntimeError(f"a step samples {n} rows, more than max_num_seqs ({self.rows})")
        half = self.num_launched % 2  # step t+1 reads step t's slots while writing its own
        self.num_launched += 1
        base = half * self.rows
        self.future.ring[base : base + n].copy_(tokens)
        host = self.host_tokens[half][:n]
        host.copy_(tokens, non_blocking=True)
        ready = self.events[half]
        if ready is not None:
            ready.record()
        return _Flight(out, sampled, [-(base + i + 1) for i in range(n)], [s.num_tokens for s in sampled],
                       host, ready, scores=scores)

    def _resolve(self, flight: _Flight) -> tuple[list[Sequence], list[Sequence]]:
        """Write the step's tokens over its placeholders and finish the sequences they stop."""
        if flight.ready is not None:
            flight.ready.synchronize()
        tokens = flight.host.tolist() if flight.host is not None else []
        if flight.scores is not None:
            flight.scores.attach()
        engine, now = self.engine, time.perf_counter()
        scheduler, by_length = engine.scheduler, {id(s) for s in flight.finished}
        stepped, finished = [], []
        for seq, placeholder, pos, token in zip(flight.sampled, flight.placeholders, flight.positions, tokens):
            if pos >= len(seq.token_ids) or seq.token_ids[pos] != placeholder:
                continue  # finished (stop token one step earlier, or aborted) before it was appended
            seq.token_ids[pos] = token
            seq.token_times[pos - seq.num_prompt_tokens] = now
            self._rehash(seq, pos)
            stepped.append(seq)
            reason = scheduler._stop_reason(seq, token)
            if id(seq) in by_length:  # finished by length in postprocess; a stop token is still "stop"
                seq.finish_reason = "stop" if reason == "stop" else seq.finish_reason
                seq.finish_time = now
            elif reason is not None:
                queue = scheduler.running if seq.status is SequenceStatus.RUNNING else scheduler.waiting
                queue.remove(seq)
                scheduler._finish(seq, reason)
            else:
                continue
            engine.model_runner.release(seq)
            finished.append(seq)
        engine.num_steps += 1
        return stepped, finished

    def _rehash(self, seq: Sequence, pos: int) -> None:
        """A block whose last token is `pos` was hashed with its placeholder when the step filling it was
        scheduled: hash it again with the token."""
        bm = self.engine.block_manager
        bs = bm.block_size
        if bm.cache is None or (pos + 1) % bs or pos // bs >= len(seq.block_table):
            return
        bm.cache.evict(seq.block_table[pos // bs])
        bm.cache_blocks(seq, pos + 1)


def _drop_placeholders(flight: _Flight) -> None:
    """Take the placeholders of a step that will never be resolved back out of its sequences."""
    for seq, placeholder, pos in zip(flight.sampled, flight.placeholders, flight.positions):
        if pos == len(seq.token_ids) - 1 and seq.token_ids[pos] == placeholder:
            seq.token_ids.pop()
            seq.token_times.pop()


def install_overlap(engine: Any) -> None:
    """The "engine" hook: overlapped steps."""
    OverlapScheduler(engine).install()


def _wanted(config: Any, device: torch.device) -> bool:
    return config.wants("async_scheduling", device) and config.tensor_parallel_size == 1


def _own_steps(runner: ModelRunner, scheduler: Any = None) -> bool:
    """Whether the runner (and the scheduler) step as nano_vllm's do, which the overlap needs."""
    kind = type(runner)
    return (kind.prepare is ModelRunner.prepare and kind.execute is ModelRunner.execute
            and (scheduler is None or type(scheduler).postprocess is Scheduler.postprocess))


# Asked for (True), the layer installs where it does not fit, and OverlapScheduler names why.
REGISTRY.register("runner", install_future_tokens, applies=lambda runner: _wanted(
    runner.config, runner.device) and (runner.config.async_scheduling is True or _own_steps(runner)))
REGISTRY.register("engine", install_overlap, applies=lambda engine: _wanted(
    engine.config, engine.model_runner.device) and (engine.config.async_scheduling is True
                                                    or _own_steps(engine.model_runner, engine.scheduler)))
