"""Drafters: who proposes the k tokens the target verifies. One small interface, four proposers: two
here, Medusa's heads in medusa.py and EAGLE's draft layer in eagle.py.

`propose(seqs, ks)` gets the running sequences (their `token_ids` hold only accepted tokens) and how many
tokens each may get; it returns, per sequence, up to k_i draft tokens and the distribution each was drawn
from ([k_i, V]) — or None where the tokens were chosen deterministically (one-hot q, as
`sampling.verify_chains` reads None). `release(seq)` forgets a sequence (finished, aborted, preempted).
A proposer that drafts from the target's hidden states (Medusa, EAGLE) also has `observe(seq, start,
hidden)`: the verifying runner hands it, every step, the hidden states of the tokens of `seq` the step
computed from position `start` on (of a verification, only the accepted ones).

* `NgramProposer` — prompt lookup decoding (Saxena 2023): find the first earlier occurrence of the
  last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`, vLLM's names) in prompt +
  output and propose the tokens that followed it. The cost per step does not grow with the context: each
  sequence keeps an index {n-gram: where its first occurrence ended}, extended by the tokens appended
  since the last step, so a lookup is max − min + 1 dictionary reads, however long the prompt (the first
  lookup indexes the prompt once). Memory: (max − min + 1) entries per token.
* `DraftModelProposer` — classic speculative sampling (Leviathan §2.3, Chen §2): a small model of the
  same vocabulary, run by nano_vllm's own `ModelRunner` over its own paged KV cache (a second
  `BlockManager`), proposes k tokens one forward at a time with the request's sampling parameters,
  recording the probabilities it drew them from. Its K/V follow the target's accept / rollback: before
  each proposal the draft keeps the K/V of the tokens the request still holds and drops the rest.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import torch

from nano_vllm.block_manager import BlockManager
from nano_vllm.config import EngineConfig
from nano_vllm.model_runner import ModelRunner
from nano_vllm.sampler import apply_top_k_top_p, seed64
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.scheduler import SchedulerOutput
from nano_vllm.sequence import Sequence
from shared.config import ModelConfig

DRAFT_SEED = 0x9E3779B97F4A7C15  # a seeded request's draft stream differs from its target stream
Drafts = tuple[list[list[int]], list[torch.Tensor | None]]


def request_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Rows of logits as the distribution a request samples from: temperature, then top-k / top-p, as
    nano_vllm's sampler applies them (the p and q of Leviathan Algorithm 1). Not for greedy rows."""
    x = logits.float() / sp.temperature
    k, p = sp.top_k > 0 and sp.top_k < x.shape[-1], sp.top_p < 1.0
    if k or p:
        rows = x.shape[0]
        x = apply_top_k_top_p(x, torch.full((rows,), sp.top_k, device=x.device) if k else None,
                              torch.full((rows,), sp.top_p, device=x.device) if p else None)
    return x.softmax(-1)


class Proposer(Protocol):
    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> Drafts: ...
    def release(self, seq: Sequence) -> None: ...


class NgramProposer:
    """Prompt lookup decoding with an incremental n-gram index per sequence (module docstring)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.ns = range(prompt_lookup_max, prompt_lookup_min - 1, -1)  # longest match first
        # seq_id -> ({n-gram: end of its first occurrence}, tokens indexed so far)
        self.index: dict[int, tuple[dict[tuple[int, ...], int], list[int]]] = {}

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> Drafts:
        return [self.lookup(seq, k) for seq, k in zip(seqs, ks)], [None] * len(seqs)

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens that followed the first earlier occurrence of the longest suffix match (Saxena's
        reference takes the first match; the latest one, often just behind the suffix, leaves few tokens
        to propose on repetitive text)."""
        ids = seq.token_ids
        last, n_indexed = self.index.setdefault(seq.seq_id, ({}, [0]))
        # index every n-gram ending before the last token (so a match is an *earlier* occurrence)
        for end in range(n_indexed[0] + 1, len(ids)):
            for n in self.ns:
                if end >= n:
                    last.setdefault(tuple(ids[end - n : end]), end)
        n_indexed[0] = max(n_indexed[0], len(ids) - 1)
        for n in self.ns:
            end = last.get(tuple(ids[-n:])) if len(ids) >= n else None
            if end is not None:
                return ids[end : end + k]
        return []

    def release(self, seq: Sequence) -> None:
        self.index.pop(seq.seq_id, None)


class DraftSeq:
    """The draft model's view of one request: its tokens (accepted ones, then this step's drafts) and its
    own block table over the draft's KV pool — what nano_vllm's `prepare` and `BlockManager` read."""

    # no prompt log-probabilities: only the sampled rows are computed
    sampling_params = SamplingParams()

    def __init__(self, seq: Sequence):
        self.seq_id, self.params = seq.seq_id, seq.sampling_params
        self.token_ids: list[int] = []
        self.num_computed_tokens = self.num_cached_tokens = self.checked = 0
        self.block_table: list[int] = []
        self.drafts: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.generator: torch.Generator | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def release_blocks(bm: BlockManager, seq: Sequence | DraftSeq, num_tokens: int) -> None:
    """Give back the blocks of `seq` past those holding its first `num_tokens` tokens (rejected slots)."""
    keep = bm.blocks_for(num_tokens)
    for block in reversed(seq.block_table[keep:]):
        bm.pool.decref(block)
    del seq.block_table[keep:]


class DraftModelProposer:
    """A small model of the target's vocabulary on its own paged KV cache (module docstring)."""

    # a performance layer that runs a proposal's later forwards at once (layers/draft_chain.py)
    chain = None

    def __init__(self, config: EngineConfig, draft: str, draft_config: ModelConfig,
                 num_blocks: int, max_model_len: int):
        cfg = config.replace(model=draft, num_kv_blocks=num_blocks, kv_cache_memory_bytes=None,
                             async_scheduling=False, quantization=None)
        self.runner = self.make_runner(cfg, draft_config, max_model_len)
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, False)
        self.seqs: dict[int, DraftSeq] = {}

    def make_runner(self, cfg: EngineConfig, draft_config: ModelConfig,
                    max_model_len: int) -> ModelRunner:
        return ModelRunner(cfg, draft_config, max_model_len)

    def _sync(self, seq: Sequence) -> DraftSeq | None:
        """The draft's state for `seq`, rolled back to the K/V of tokens the request still holds (the
        drafts the target rejected are gone), with slots for the tokens to catch up on; None when the
        draft's KV pool is full (no proposal this step)."""
        d = self.seqs.get(seq.seq_id) or self.seqs.setdefault(seq.seq_id, DraftSeq(seq))
        # tokens before `checked` were the request's when the last proposal began
        valid = min(d.checked, d.num_computed_tokens)
        while valid < min(d.num_computed_tokens, seq.num_tokens) and \
                d.token_ids[valid] == seq.token_ids[valid]:
            valid += 1
        d.token_ids, d.checked = list(seq.token_ids), seq.num_tokens
        d.num_computed_tokens = min(d.num_computed_tokens, valid)
        release_blocks(self.block_manager, d, d.num_computed_tokens)
        d.drafts, d.probs = [], []
        fits = self.block_manager.allocate_slots(d, d.num_tokens - d.num_computed_tokens)
        return d if fits else None

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> Drafts:
        """k_i tokens for sequence i, one draft forward per token (Leviathan Algorithm 1, the loop over
        M_q): the first forward also computes the draft's K/V of the tokens accepted since last time."""
        synced = [self._sync(s) for s in seqs]
        live = [(d, k) for d, k in zip(synced, ks) if d is not None]
        while live:
            batch = [d for d, _ in live]
            logits = self._forward(batch)
            if self.chain is not None and self.chain.run(live, logits):  # the whole proposal, done
                break
            # the greedy requests' drafts, one read for the batch (none when every request samples)
            top = logits.argmax(-1).tolist() if any(d.params.greedy for d in batch) else []
            for j, d in enumerate(batch):
                d.num_computed_tokens = d.num_tokens
                token = top[j] if d.params.greedy else self._draw(d, logits[j : j + 1])
                d.token_ids.append(token)
                d.drafts.append(token)
            # the next forward computes the last draft's K/V: one slot more, or the sequence stops
            live = [(d, k) for d, k in live
                    if len(d.drafts) < k and self.block_manager.allocate_slots(d, 1)]
        return ([d.drafts if d else [] for d in synced],
                [torch.cat(d.probs) if d and d.probs else None for d in synced])

    def _forward(self, batch: list[DraftSeq]) -> torch.Tensor:
        """The draft's logits after each sequence's uncomputed tokens, one row per sequence."""
        out = SchedulerOutput(batch, [d.num_tokens - d.num_computed_tokens for d in batch])
        return self.runner.run(self.runner.prepare(out))

    def _draw(self, d: DraftSeq, logits: torch.Tensor) -> int:
        """A sampled request's draw from q (the draft's logits after its sampling), recorded for the
        verification (seeded requests from a draft generator of their own)."""
        sp = d.params
        if d.generator is None and sp.seed is not None:
            seed = seed64(sp.seed) ^ DRAFT_SEED
            d.generator = torch.Generator(self.runner.device).manual_seed(seed)
        q = request_probs(logits, sp)
        d.probs.append(q)
        return int(torch.multinomial(q, 1, generator=d.generator))

    def release(self, seq: Sequence) -> None:
        d = self.seqs.pop(seq.seq_id, None)
        if d is not None:
            self.block_manager.free(d)
