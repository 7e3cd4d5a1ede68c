"""`SGLModelRunner`: nano_vllm's model runner plus the two logits hooks SGLang's primitives need.

* Prompt scoring for `select` (SGLang, arXiv 2312.07104, §2): a request with `score_from = k` also gets
  the log-probability of each prompt token from position k on, computed in the same packed forward as
  everything else (the rows of its chunk are added to the rows whose logits are computed). The block
  manager never serves those tokens from the cache, so their logits exist.
* Constrained decoding (§4): a request with a `constraint` has every token its FSM cannot read masked out
  before sampling (greedy and sampled rows alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nano_sglang.sequence import SGLSequence
from nano_vllm.model_runner import ModelRunner, StepInputs
from nano_vllm.scheduler import SchedulerOutput


@dataclass
class SGLStepInputs(StepInputs):
    """nano_vllm's step inputs plus the prompt tokens scored this step: `scored[j] = (sequence, token)`,
    whose logits are the j-th of the returned rows (before the rows that sample)."""

    scored: list[tuple[SGLSequence, int]] = field(default_factory=list)


class SGLModelRunner(ModelRunner):
    """nano_vllm's model runner with prompt scoring and FSM masks (module docstring)."""

    def prepare(self, out: SchedulerOutput) -> SGLStepInputs:
        """nano_vllm's packed batch; the rows of prompt tokens being scored go first in `sample_rows`."""
        inputs = super().prepare(out)
        rows, scored = [], []
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_new_tokens)):
            if seq.score_from is None:
                continue
            start = seq.num_computed_tokens
            # the logits of position p score token p + 1
            first, end = max(start, seq.score_from - 1), min(start + n, seq.num_prompt_tokens - 1)
            for p in range(first, end):
                rows.append(inputs.cu_seqlens_q[i] + p - start)
                scored.append((seq, seq.token_ids[p + 1]))
        inputs.sample_rows = rows + inputs.sample_rows
        return SGLStepInputs(**vars(inputs), scored=scored)

    def execute(self, out: SchedulerOutput) -> list[int]:
        """nano_vllm's step, then: scored rows → `prompt_logprobs`; constrained rows masked by their FSM."""
        inputs = self.prepare(out)
        logits = self.run(inputs)
        if logits is None:
            return []
        k = len(inputs.scored)
        if k:
            logprobs = logits[:k].float().log_softmax(dim=-1)
            targets = torch.tensor([t for _, t in inputs.scored], device=logits.device)
            values = logprobs[torch.arange(k, device=logits.device), targets].tolist()
            for (seq, _), v in zip(inputs.scored, values):
                seq.prompt_logprobs.append(v)
            logits = logits[k:]
        if logits.shape[0] == 0:
            return []
        seqs = [s for s, f in zip(out.seqs, out.samples) if f]
        masked = [(i, s.constraint) for i, s in enumerate(seqs) if s.constraint is not None]
        # one fill for the whole batch, out of place: logits may be a CUDA graph's output buffer
        if masked:
            allowed = torch.stack([c.mask(logits.device) for _, c in masked])
            if len(masked) < len(seqs):  # the unconstrained rows allow every token
                rows = self._tensor([i for i, _ in masked], torch.long)
                everything = logits.new_ones(logits.shape, dtype=torch.bool)
                allowed = everything.index_put_((rows,), allowed)
            logits = logits.masked_fill(~allowed, float("-inf"))
        return self.sample(logits, out).tolist()
