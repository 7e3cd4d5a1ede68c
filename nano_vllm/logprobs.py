"""Log-probabilities of output and prompt tokens (vLLM's `SamplingParams.logprobs` / `prompt_logprobs`).

What is returned is the model's raw distribution — `log_softmax` of the logits, before temperature and
top-k / top-p (vLLM's default `logprobs_mode`, and what an evaluation harness scores with) — for the token
that was sampled (or, for the prompt, the token that follows) plus the `k` most likely, each with its
rank (1 = the argmax). It is computed on the device, in the step that produces the logits, without
materialising log_softmax (log p = logit - logsumexp), and copied to pinned host memory behind the sampled
tokens, so reading it back waits for nothing the tokens did not (an overlapped step keeps overlapping).
While no request of the engine asks (`ModelRunner.scored_seqs` is empty), a step does nothing here.

Prompt tokens are scored from the hidden states of the prefill: row r of a step, at position p of its
sequence, holds the logits of prompt token p + 1. Their LM head runs in chunks of `SCORE_ROWS` rows, so
an 8k-token prompt never holds an (8k, vocabulary) fp32 tensor at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SCORE_ROWS = 1024  # prompt rows put through the LM head at once


@dataclass
class Logprob:
    """vLLM's `Logprob`: one token's log-probability, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def prompt_logprob_rows(out: Any, cu_seqlens_q: list[int], scored: Any) -> list[tuple[Any, int, int]]:
    """(sequence, row, position) of each row of the step whose logits score a prompt token: row `row`, at
    `position` of its sequence, gives the log-probabilities of prompt token `position + 1`. `scored`: the
    engine's sequences that ask for any log-probabilities (none: nothing to look at)."""
    rows = []
    if not scored:
        return rows
    for seq, n, q0 in zip(out.seqs, out.num_new_tokens, cu_seqlens_q):
        if seq.sampling_params.prompt_logprobs is not None:
            start = seq.num_computed_tokens
            rows += [(seq, q0 + p - start, p) for p in range(start, min(start + n, seq.num_prompt_tokens - 1))]
    return rows


def _score(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: [target, its log-probability, its rank, the k most likely ids, their log-probabilities]
    as one fp64 (rows, 3 + 2k) tensor (ids are exact in fp64), so one copy brings a block to the host.
    log p(x) = logit(x) - logsumexp(logits): the ranks and the top k come from the logits themselves, so
    no (rows, vocabulary) log_softmax is written."""
    logits = logits.float()
    lse = logits.logsumexp(dim=-1, keepdim=True)
    chosen = logits.gather(1, targets[:, None])
    rank = (logits > chosen).sum(dim=-1, keepdim=True) + 1
    top_lps, top_ids = logits.topk(k, dim=-1) if k else (logits[:, :0], targets[:, None][:, :0])
    cols = (targets[:, None], chosen - lse, rank, top_ids, top_lps - lse)
    return torch.cat([c.double() for c in cols], dim=1)


class _Staging:
    """Two pinned host buffers used in turn (a step's scores are read before the step after next writes):
    the device-to-host copies are asynchronous and allocate nothing per step (a pinned allocation can
    synchronise the device). Grows, rarely, to the largest step seen."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.float64)] * 2
        self.turn = 0

    def copy(self, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
        if not blocks or blocks[0].device.type != "cuda":
            return blocks
        self.turn ^= 1
        total = sum(b.numel() for b in blocks)
        if self.buffers[self.turn].numel() < total:
            self.buffers[self.turn] = torch.empty(2 * total, dtype=torch.float64, pin_memory=True)
        out, at = [], 0
        for b in blocks:
            out.append(self.buffers[self.turn][at: at + b.numel()].view(b.shape).copy_(b, non_blocking=True))
            at += b.numel()
        return out


class StepLogprobs:
    """One step's log-probabilities, computed on the device and copied to pinned host memory behind the
    step's tokens; `attach()` reads them into the sequences once the tokens are read (no wait of its own)."""

    def __init__(self) -> None:
        self.blocks: list[torch.Tensor] = []  # `_score`'s (rows, 3 + 2k) blocks
        self.entries: list[tuple[Any, int, bool, int, int]] = []  # (seq, position, prompt?, block, row)

    @classmethod
    @torch.inference_mode()
    def of(cls, runner: Any, out: Any, logits: torch.Tensor | None,
           tokens: torch.Tensor | None) -> StepLogprobs | None:
        """The step's scores, or None when no request of the step asks for any."""
        if not runner.scored_seqs:
            return None
        step, prompt_rows = cls(), runner.scored_prompt_rows
        if logits is not None:
            seqs = [s for s, f in zip(out.seqs, out.samples) if f]
            wanted = [i for i, s in enumerate(seqs) if s.sampling_params.logprobs is not None]
            if wanted:
                # through pinned memory, asynchronously: a plain torch.tensor(..., device=) would wait for
                # the step's forward (and, with overlapped steps, for the next step's)
                rows = runner._tensor(wanted, torch.long)
                k = max(seqs[i].sampling_params.logprobs for i in wanted)
                step.blocks.append(_score(logits[rows], tokens[rows], k))
                # the sampled token goes to position len(seq) (its placeholder's, with overlapped steps)
                step.entries += [(seqs[i], len(seqs[i]), False, 0, j) for j, i in enumerate(wanted)]
        if prompt_rows:
            hidden, seqs = runner.prompt_hidden, [s for s, _, _ in prompt_rows]
            targets = runner._tensor([s.token_ids[p + 1] for s, _, p in prompt_rows], torch.long)
            k = max(s.sampling_params.prompt_logprobs for s in seqs)
            for a in range(0, len(prompt_rows), SCORE_ROWS):
                b = min(a + SCORE_ROWS, len(prompt_rows))
                step.blocks.append(_score(runner.model.compute_logits(hidden[a:b]), targets[a:b], k))
                step.entries += [(s, p + 1, True, len(step.blocks) - 1, j - a)
                                 for j, (s, _, p) in enumerate(prompt_rows[a:b], start=a)]
            runner.scored_prompt_rows, runner.prompt_hidden = [], None
        if not step.entries:
            return None
        if not hasattr(runner, "logprob_staging"):
            runner.logprob_staging = _Staging()
        step.blocks = runner.logprob_staging.copy(step.blocks)
        return step

    def attach(self) -> None:
        """Store each score in its sequence: `seq.logprobs[i]` for output token i, `seq.prompt_logprobs[p]`
        for prompt token p, as {token id: Logprob}, the scored token first, then the top k by rank."""
        blocks = [b.tolist() for b in self.blocks]
        for seq, pos, is_prompt, block, row in self.entries:
            values = blocks[block][row]
            width = (len(values) - 3) // 2
            sp = seq.sampling_params
            k = sp.prompt_logprobs if is_prompt else sp.logprobs
            entry = {int(values[0]): Logprob(values[1], int(values[2]))}
            for r, (tid, lp) in enumerate(zip(values[3: 3 + k], values[3 + width: 3 + width + k]), 1):
                entry.setdefault(int(tid), Logprob(lp, r))
            if is_prompt:
                seq.prompt_logprobs[pos] = entry
            elif pos - seq.num_prompt_tokens == len(seq.logprobs):
                seq.logprobs.append(entry)  # (a token dropped with overlapped steps never comes here)
