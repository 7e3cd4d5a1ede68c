"""What a timed run of the bench counts, read off an engine without changing what it computes.

`Probe(engine)` wraps bound methods of one engine instance (measurement code, as nano_vllm.serve's
metrics wrap `schedule`): `engine.step` (steps) and, on a speculating engine, `scheduler.postprocess`
(per scheduled sequence: the drafts it verified and the tokens it emitted) and `proposer.propose` (host
seconds spent drafting, a draft model's forwards included: its tokens come back to the host before the
verification).

τ is the mean number of tokens a decoding sequence emits per target forward: accepted drafts plus the one
token every forward adds, over every decode forward of the run (those without a draft count 1). A
prefill's first token is not a decode. Acceptance by position j is P(draft j accepted | draft j proposed).
"""

from __future__ import annotations

import time
from typing import Any

import torch


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Probe:
    """Counters of one engine since the last `reset()` (module docstring)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.reset()
        step = engine.step

        def counted_step(*args, **kwargs):
            self.steps += 1
            return step(*args, **kwargs)

        engine.step = counted_step
        proposer = getattr(engine, "proposer", None)
        if proposer is not None:  # a speculating engine (a plain one's steps are all it counts)
            sched = engine.scheduler
            postprocess = sched.postprocess

            def observed_postprocess(out, sampled, *args, **kwargs):
                self.observe(out, sampled)
                return postprocess(out, sampled, *args, **kwargs)

            sched.postprocess = observed_postprocess
            propose = proposer.propose

            def timed_propose(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return propose(*args, **kwargs)
                finally:
                    self.propose_s += time.perf_counter() - t0
                    self.proposals += 1

            proposer.propose = timed_propose

    def reset(self) -> None:
        self.steps = self.proposals = 0
        self.propose_s = 0.0
        self.kernels_built: int | None = None  # set by the bench's timed run
        self.decode_forwards = self.decode_tokens = self.verifications = 0
        self.drafted_by_position: list[int] = []
        self.accepted_by_position: list[int] = []

    def observe(self, out: Any, sampled: list[list[int]]) -> None:
        """One step's scheduled sequences and what each emitted (a speculating scheduler's postprocess
        gets, per scheduled sequence, its emitted tokens), before the scheduler appends them."""
        drafts = getattr(out, "drafts", None) or [()] * len(out.seqs)
        for seq, d, emitted in zip(out.seqs, drafts, sampled):
            if not emitted:
                continue
            if seq.num_output_tokens > 0:  # it has a first token already: a decode forward
                self.decode_forwards += 1
                self.decode_tokens += len(emitted)
            if d:
                self.verifications += 1
                grow = len(d) - len(self.drafted_by_position)
                if grow > 0:
                    self.drafted_by_position += [0] * grow
                    self.accepted_by_position += [0] * grow
                for j in range(len(d)):
                    self.drafted_by_position[j] += 1
                for j in range(min(len(emitted) - 1, len(d))):
                    self.accepted_by_position[j] += 1

    def summary(self, seconds: float) -> dict:
        """The run's counters: τ, acceptance (overall and by position), draft time against the run's."""
        drafted, accepted = sum(self.drafted_by_position), sum(self.accepted_by_position)
        return {
            "tau": self.decode_tokens / self.decode_forwards if self.decode_forwards else None,
            "acceptance %": 100 * accepted / drafted if drafted else None,
            # decode forwards that verified drafts (the others found none to propose)
            "verified %": 100 * self.verifications / self.decode_forwards if self.decode_forwards
            else None,
            "draft tokens": drafted,
            "accepted tokens": accepted,
            "steps": self.steps,
            "ms/step": 1e3 * seconds / max(self.steps, 1),
            "draft ms/step": 1e3 * self.propose_s / max(self.steps, 1),
            "draft % of time": 100 * self.propose_s / seconds if seconds > 0 else None,
            "kernels built while timed": self.kernels_built,
            "_acceptance_by_position": [a / d if d else None for a, d in
                                        zip(self.accepted_by_position, self.drafted_by_position)],
            "_drafted_by_position": list(self.drafted_by_position),
            "_accepted_by_position": list(self.accepted_by_position),
        }
