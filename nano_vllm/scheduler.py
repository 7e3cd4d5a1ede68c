"""The scheduler: continuous batching under a token budget, chunked prefill, preemption by recomputation.

vLLM (arXiv 2309.06180) §4.5: requests are served first-come-first-served; when the KV cache runs out,
the *latest* arrived requests are preempted, all of their blocks at once ("all-or-nothing", a sequence
needs all its K/V to continue), and later recomputed — their prompt plus the tokens generated so far
are prefilled again, which is cheap because a prefill is one parallel pass (the paper's "recomputation";
we do not implement its swapping to CPU). Preempted requests resume in arrival order, before new ones.

Continuous (iteration-level) batching (Orca, OSDI'22) re-forms the batch every step. Each step has a
budget of `max_num_batched_tokens`; running sequences go first — decodes (1 token each), then the next
chunk of prompts being prefilled — and waiting sequences fill the rest, their prompts split into chunks
that fit (chunked prefill, Sarathi-Serve, arXiv 2403.02369). So one step mixes decodes and prefill
chunks, and a long prompt never stalls the decodes of everyone else.

The scheduler knows nothing about models: it moves `Sequence`s between queues and asks the
`BlockManager` for slots. nano_distserve builds its prefill-only / decode-only instances on the same
`schedule()` / `postprocess()` pair.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from nano_vllm.block_manager import BlockManager
from nano_vllm.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True


@dataclass
class SchedulerOutput:
    """One step's work: sequence `seqs[i]` computes tokens [num_computed, num_computed + num_new_tokens[i])."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    # copy-on-write (src, dst) blocks, done first
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    # Whether sequence i reaches its last token this step, so its next token is sampled (fixed at
    # scheduling time: an abort during the step resets the sequence).
    samples: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.samples = [s.num_computed_tokens + n == s.num_tokens
                        for s, n in zip(self.seqs, self.num_new_tokens)]

    @property
    def is_decode(self) -> bool:
        """Every sequence computes exactly one token (the CUDA-graph path)."""
        return all(n == 1 for n in self.num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def _by_arrival(seq: Sequence) -> int:
    return seq.seq_id


class Scheduler:
    """FCFS continuous-batching scheduler over one BlockManager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: set[int] | None = None):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = set(eos_token_ids or ())
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival; the last one is preempted first
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(f"prompt has {seq.num_tokens} tokens, more than max_model_len "
                             f"({self.config.max_model_len})")
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_by_arrival)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is and free its blocks (a client went away)."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.finish_time = time.perf_counter()

    def _preempt(self, seq: Sequence) -> None:
        """§4.5 recomputation: drop all K/V of `seq`; it re-enters the waiting queue by arrival order."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_by_arrival)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        bm, budget = self.block_manager, self.config.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}  # insertion-ordered
        num_preempted = 0
        # 1. Running sequences: decodes first (they are latency-critical), then prefill chunks in progress.
        order = [s for s in self.running if s.num_uncomputed_tokens == 1]
        order += [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted a moment ago to make room for an earlier arrival
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0:
                break
            while not bm.allocate_slots(seq, n):
                victim = self.running[-1]  # latest arrival: FCFS, all-or-nothing
                # it may have been scheduled earlier in this pass
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                scheduled[seq] = n
                budget -= n
        # Hash the blocks these steps fill only now: a sequence scheduled and then preempted within the
        # pass above must not leave hashes of blocks that nobody computes.
        bs = bm.block_size
        for seq, n in scheduled.items():
            if (seq.num_computed_tokens + n) // bs > seq.num_computed_tokens // bs:  # a block fills
                bm.cache_blocks(seq, seq.num_computed_tokens + n)
        # 2. Waiting sequences, in arrival order, while budget, sequence slots and blocks last. Nothing new
        # is admitted in a step that had to preempt: memory is short, running requests come first.
        while (self.waiting and num_preempted == 0 and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            # a request for prompt log-probabilities computes every prompt token's logits
            cached = bm.match_prefix(seq) if seq.sampling_params.prompt_logprobs is None else []
            # A fully cached prompt still runs its last token: its logits give the first output token.
            start = min(len(cached) * bm.block_size, seq.num_tokens - 1)
            n = seq.num_tokens - start
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            if not bm.allocate_slots(seq, n, cached, num_computed_tokens=start):
                break
            # now, so an identical prompt later in this loop shares them
            bm.cache_blocks(seq, start + n)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_by_arrival)
            scheduled[seq] = n
            budget -= n
        return SchedulerOutput(list(scheduled), list(scheduled.values()), bm.take_copies(),
                               num_preempted)

    def postprocess(self, out: SchedulerOutput, sampled: list[int],
                    now: float | None = None) -> list[Sequence]:
        """Advance every scheduled sequence by its chunk; append the sampled tokens (one per sequence that
        reached its last token, in order) and finish sequences that are done. Returns the finished ones."""
        now = time.perf_counter() if now is None else now
        tokens, finished = iter(sampled), []
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens)):
            # None: a chunk short of the prompt's end
            token = next(tokens) if out.samples[i] else None
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += n
            if token is None:
                continue
            seq.append_token(token, now)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling_params
        if ((not sp.ignore_eos and token in self.eos_token_ids)
                or (sp.stop_token_ids and token in sp.stop_token_ids)):
            seq.stop_token_id = token  # in token_ids, not in the text (`Sequence.text_token_ids`)
            return "stop"
        # a stop string (tokenizer.StopChecker); a placeholder token (< 0) is checked once it is known
        if seq.stop_checker is not None and token >= 0 and seq.stop_checker.step(token):
            return "stop"
        if seq.num_output_tokens >= sp.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None
