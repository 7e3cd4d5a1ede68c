"""A proposal's draft forwards after the first, in one CUDA graph — a performance layer.

`DraftModelProposer.propose` runs k draft forwards (Leviathan Algorithm 1, the loop over M_q), each
prepared on the host and read back, since its token is the next forward's input. After the first (which
also catches up on the tokens accepted since the last proposal) the other k − 1 are one-token decodes of
every sequence. `DraftChain` captures them, per decode batch size, as one graph over the draft runner's
decode-graph buffers (nano_vllm/layers/cudagraph.py), in which each forward's argmax is written into the
next forward's input on the device — and, for EAGLE, its f̂ into the next row's feature. The first
forward's argmax (the first drafts) is not read back either: it goes into the chain's input on the device.
The host reserves the slots of all k − 1 positions first and reads all k drafts back once.

It takes a proposal whose sequences are all greedy and all get the full k, at most max_num_seqs of them;
any other takes the paper path's loop (same drafts). Delete this file and every proposal takes the loop.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from nano_specdec.config import REGISTRY
from nano_vllm.layers.cudagraph import DecodeCudaGraphs, StaticBuffer, fill_block_tables, token_rows


class DraftChain:
    """The k − 1 chained decode forwards of a draft runner (module docstring)."""

    def __init__(self, proposer: Any, steps: int):
        self.proposer, self.steps = proposer, steps
        runner = proposer.runner
        self.decode = next(g for g in runner.cudagraphs if isinstance(g, DecodeCudaGraphs))
        self.max_bs, self.page = runner.config.max_num_seqs, runner.block_size
        # per step and row: position, slot; the key count
        self.where = StaticBuffer.full(runner, (2, steps, self.max_bs), torch.long)
        for t in (self.where.host, self.where.device):  # the capture's warm-up run writes K/V to scratch
            t[1].fill_(runner.scratch_slot)
        self.lens = StaticBuffer.full(runner, (steps, self.max_bs), torch.int32, 1)
        self.drafts = torch.zeros(steps, self.max_bs, dtype=torch.long, device=runner.device)
        self.eagle = getattr(proposer, "draft", None)  # EAGLE's layer: f̂ is the next row's feature
        with torch.inference_mode():  # the runner's buffers are inference tensors: written in place here
            self.graphs = {bs: self.decode.capture_rows(self.decode.tokens.device, bs,
                                                        functools.partial(self._body, bs))
                           for bs in sorted(self.decode.graphs, reverse=True)}

    def _body(self, bs: int) -> None:
        ids, positions, slots = token_rows(self.decode.tokens.device, bs)
        for j in range(self.steps):
            if self.eagle is not None:
                self.proposer.buf[:bs] = self.eagle.out[:bs]
            positions.copy_(self.where.device[0, j, :bs])
            slots.copy_(self.where.device[1, j, :bs])
            self.decode.context_lens.device[:bs].copy_(self.lens.device[j, :bs])
            self.decode._body(bs, greedy=False)  # the draft runner's decode step: logits of every row
            self.drafts[j, :bs] = self.decode.logits[:bs].argmax(-1)
            ids.copy_(self.drafts[j, :bs])

    def run(self, live: list, logits: torch.Tensor) -> bool:
        """The proposal whose first forward gave `logits` (a row per sequence, no draft appended yet): its
        argmax, the first drafts, stays on the device and feeds the chain, and all k drafts are read back
        at once; False where the chain does not take it, leaving the sequences as the loop expects them."""
        batch, steps = [d for d, _ in live], self.steps
        if not batch or len(batch) > self.max_bs or any(
                not d.params.greedy or k - len(d.drafts) != steps + 1 for d, k in live):
            return False
        bm = self.proposer.block_manager
        for d in batch:  # placeholders for the k drafts, so the block manager reserves their slots
            d.num_computed_tokens = d.num_tokens
            d.token_ids += [0] * steps
        reserved = [bm.allocate_slots(d, steps) for d in batch]
        if not all(reserved):  # (blocks reserved past a sequence's tokens go back at its next sync)
            for d in batch:
                del d.token_ids[len(d.token_ids) - steps :]
            return False
        first = logits.argmax(-1)
        bs = min(s for s in self.graphs if s >= len(batch))
        self.decode.host_free.synchronize()
        ids, where = token_rows(self.decode.tokens.host, bs).numpy(), self.where.host.numpy()
        lens = self.lens.host.numpy()
        ids[0, len(batch) : bs], where[0, :, len(batch) : bs] = 0, 0  # padding rows: one key, scratch slot
        where[1, :, len(batch) : bs], lens[:, len(batch) : bs] = self.proposer.runner.scratch_slot, 1
        for i, d in enumerate(batch):
            start = d.num_computed_tokens  # the first draft's position (its token: `first`, below)
            for j in range(steps):
                p = start + j
                where[0, j, i], where[1, j, i] = p, d.block_table[p // self.page] * self.page + p % self.page
                lens[j, i] = p + 1
        width = max(len(d.block_table) for d in batch)
        tables = [d.block_table for d in batch] + [[0]] * (bs - len(batch))
        fill_block_tables(self.decode.block_tables.host[:bs, :width].numpy(), tables)
        self.decode.tokens.upload(slice(bs))  # the ids row of token_rows(bs)
        self.decode.tokens.device[: len(batch)] = first  # after the upload, in stream order
        self.where.upload(slice(None), slice(None), slice(bs))
        self.lens.upload(slice(None), slice(bs))
        self.decode.block_tables.upload(slice(bs), slice(width))
        self.decode.host_free.record()
        if self.eagle is not None:
            self.eagle.features = self.proposer.buf
        with self.proposer.runner.config.layers_context():
            self.graphs[bs].replay()
        drafts = torch.cat([first[None], self.drafts[:, : len(batch)]]).T.tolist()  # the one read-back
        for d, more in zip(batch, drafts):
            del d.token_ids[len(d.token_ids) - steps :]
            d.token_ids += more
            d.drafts += more
            d.num_computed_tokens = d.num_tokens - 1
        return True


def install_draft_chain(engine: Any) -> None:
    """The "proposer" hook: chain the k − 1 later forwards of a proposal of a draft runner with graphs."""
    engine.proposer.chain = DraftChain(engine.proposer, engine.speculative_config.num_speculative_tokens - 1)


def _applies(engine: Any) -> bool:
    runner = getattr(engine.proposer, "runner", None)
    return runner is not None and engine.speculative_config.num_speculative_tokens > 1 and any(
        isinstance(g, DecodeCudaGraphs) for g in runner.cudagraphs)


REGISTRY.register("proposer", install_draft_chain, applies=_applies)
