"""`SpecScheduler`: nano_vllm's scheduler, then drafts for the decodes; several tokens per sequence back.

A step is scheduled by nano_vllm's own `schedule()` (continuous batching, chunked prefill, prefix
caching, preemption — all unchanged). Then every sequence of the step that decodes (its one new token
is its last) gets up to k drafts from the proposer, within the step's leftover token budget, the room
left under `max_model_len` and its `max_tokens` (a token past either would be dropped anyway). The
drafts are appended to its tokens for this step only and their slots allocated, so nano_vllm's runner
packs `[last token, d_1 .. d_k]` as one k + 1 token chunk: the target scores them all in one forward
(Leviathan §3, the parallel run of M_p on the k prefixes). A sequence whose slots do not fit decodes
without drafts; prefill chunks never get any; a step holding a request that asks for log-probabilities
runs plain (each token's scores come from a step of its own).

`postprocess` takes the drafts back out and appends what verification emitted — the accepted drafts,
then the resampled or bonus token — one at a time through nano_vllm's `_stop_reason` (EOS, stop token
ids, stop strings, `max_tokens`, `max_model_len`), dropping whatever follows a stop. The sequence's
`num_computed_tokens` then covers its last token and the accepted drafts only: their K/V, written this
step, are the K/V of the tokens it now holds. Blocks past those give back their rejected slots. No block
is ever hashed with a draft in it: nano_vllm's `schedule()` hashed only up to the last real token, and
blocks filled by accepted drafts are hashed here, once their tokens are the request's (§4.4).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from nano_specdec.proposers import Proposer, release_blocks
from nano_specdec.stats import SpecDecodeStats
from nano_vllm.scheduler import Scheduler, SchedulerOutput
from nano_vllm.sequence import Sequence, SequenceStatus


@dataclass
class SpecSchedulerOutput(SchedulerOutput):
    """nano_vllm's step plus each sequence's drafts (appended to its tokens for this step) and the
    distributions they were drawn from ([k_i, V], or None: chosen deterministically)."""

    drafts: list[list[int]] = field(default_factory=list)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)


class SpecScheduler(Scheduler):
    """nano_vllm's FCFS scheduler with drafts for the decodes (module docstring). The engine sets
    `proposer` and `num_speculative_tokens` once both exist."""

    proposer: Proposer | None = None
    num_speculative_tokens = 0
    disable_by_batch_size: int | None = None  # more decodes in a step than this: no drafts (vLLM's)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stats = SpecDecodeStats()

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        budget = self.config.max_num_batched_tokens - out.num_tokens
        if self.proposer is None or any(s.sampling_params.logprobs is not None for s in out.seqs):
            return out
        decodes, ks = [], []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            sp = seq.sampling_params
            room = min(self.num_speculative_tokens, budget,
                       sp.max_tokens - seq.num_output_tokens - 1,
                       self.config.max_model_len - seq.num_tokens - 1)
            if n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens and room > 0:
                decodes.append(seq)
                ks.append(room)
                budget -= room
        if not decodes or len(decodes) > (self.disable_by_batch_size or len(decodes)):
            return out
        proposed, probs = self.proposer.propose(decodes, ks)
        by_seq = {id(s): (d, q) for s, d, q in zip(decodes, proposed, probs)}
        drafts, draft_probs, num_new = [], [], list(out.num_new_tokens)
        for i, seq in enumerate(out.seqs):
            d, q = by_seq.get(id(seq), ([], None))
            seq.token_ids += d
            if d and not self.block_manager.allocate_slots(seq, len(d) + 1):
                del seq.token_ids[-len(d):]  # no room in the KV cache: a plain decode
                d, q = [], None
            num_new[i] += len(d)
            drafts.append(d)
            draft_probs.append(q)
        return SpecSchedulerOutput(out.seqs, num_new, out.copies + self.block_manager.take_copies(),
                                   out.num_preempted, drafts, draft_probs)

    def postprocess(self, out: SchedulerOutput, sampled: list[list[int]],
                    now: float | None = None) -> list[Sequence]:
        """Advance every scheduled sequence and append its emitted tokens (`sampled[i]`: none for a
        prefill chunk, one for a plain decode, the accepted drafts and one more after a verification);
        finish the sequences that are done. Returns the finished ones."""
        now = time.perf_counter() if now is None else now
        drafts = getattr(out, "drafts", None) or [[] for _ in out.seqs]
        finished = []
        for seq, n, d, emitted in zip(out.seqs, out.num_new_tokens, drafts, sampled):
            if d:
                del seq.token_ids[-len(d):]
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            accepted = len(emitted) - 1 if d else 0
            if d:
                self.stats.add(len(d), accepted)
            seq.num_computed_tokens += n - len(d) + accepted
            reason = None
            for token in emitted:
                seq.append_token(token, now)
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    break  # tokens after a stop are dropped
            if d:
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                release_blocks(self.block_manager, seq, seq.num_computed_tokens)
                self.block_manager.cache_blocks(seq, seq.num_computed_tokens)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish(self, seq: Sequence, reason: str) -> None:
        if self.proposer is not None:
            self.proposer.release(seq)
        super()._finish(seq, reason)

    def _preempt(self, seq: Sequence) -> None:
        """§4.5 recomputation; the draft's state of the sequence goes too (it is rebuilt on return)."""
        if self.proposer is not None:
            self.proposer.release(seq)
        super()._preempt(seq)
