"""CUDA graphs for the model runner — a performance layer: the same step, replayed instead of launched.

An eager step launches every kernel from the host (tens of µs each for Triton), so a small decode batch is
bound by launches; a replayed graph launches them all at once. `install_cudagraphs` is registered at the
"graphs" point (nano_vllm.config.REGISTRY) and runs on every CUDA runner unless `enforce_eager`:

* `DecodeCudaGraphs` — nano-vllm's: one graph per decode batch size 1, 2, 4, 8, then every 16 up to
  max_num_seqs; a batch replays the graph of the next size up (padded rows write K/V to the scratch slot
  and attend to one key of block 0, harmlessly).
* `MixedStepGraphs` — at each of `EngineConfig.mixed_cudagraph_sizes` (default `MIXED_CUDAGRAPH_SIZES`
  within the step budget, on one device): steps that are not pure decode (prefill chunks, short extends
  such as nano_sglang's jump-forward, decodes mixed with either) of up to that many tokens, padded with
  tokens of no sequence and with empty sequences up to max_num_seqs; paged attention throughout (a
  step's own K/V are in the cache once it has written them). A runner that scores several rows of a
  sequence (nano_specdec's verification: the last token and k drafts) says how many in
  `sample_rows_per_seq`; its graphs then keep that many logits rows a sequence, and the default sizes add
  its verification steps' token counts (k + 1 times each decode batch size).

A graph reads static device buffers; each step fills their pinned host twins with numpy and copies them
over asynchronously (`StaticBuffer`). The token ids, positions and slots of a graph of n rows are one
contiguous (3, n) block at the buffer's start (`token_rows`), so a step uploads them in one copy: a strided
slice would make torch stage it through pageable memory and launch a device-side scatter. Delete this file
and every step runs eagerly: same tokens, slower.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from nano_flashattn import trusted_metadata
from nano_vllm.attention import AttentionContext
from nano_vllm.config import REGISTRY, EngineConfig
from nano_vllm.model_runner import ModelRunner, StepGraphs, StepInputs, fill_block_tables

# The token counts of the mixed-step graphs when `mixed_cudagraph_sizes` is None (those within the step
# budget, one device: not measured across tensor-parallel ranks). An eager step is host-bound, and with
# overlapped scheduling a new request's first token waited for it: on an H200 (2026-12-01, the published
# workload replayed open-loop at 20 req/s, first engine of a process) TTFT P50 went from 42-76 ms without
# them to 12.7 ms, TPOT P50 from 6.5-9.3 to 3.1 ms.
MIXED_CUDAGRAPH_SIZES = (128, 256, 512, 1024, 1536, 2048)
# Decode graphs of up to this many rows also take each row's argmax, where a sampling layer offers the kernel
# (`runner.graph_greedy_fn`): a greedy step then launches nothing after the graph. At batch 1 on an H200
# (2026-12-07) the host spent ~130 µs a step launching the argmax, as long as a qwen3-0.6b step's device
# work lets it; a step that samples pays the argmax's few µs of device time instead.
GREEDY_IN_GRAPH = 8


def mixed_sizes(config: EngineConfig, rows_per_seq: int = 1) -> tuple[int, ...]:
    """The mixed-step graph sizes a runner of `config` captures (see MIXED_CUDAGRAPH_SIZES), with
    `rows_per_seq` times each decode batch size for a runner that verifies drafts."""
    if config.mixed_cudagraph_sizes is not None:
        return tuple(config.mixed_cudagraph_sizes)
    if config.tensor_parallel_size > 1:
        return ()
    verify = {rows_per_seq * b for b in cudagraph_batch_sizes(config.max_num_seqs)} if rows_per_seq > 1 else set()
    return tuple(sorted(s for s in {*MIXED_CUDAGRAPH_SIZES, *verify} if s <= config.max_num_batched_tokens))


def cudagraph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 (nano-vllm's ladder) up to max_num_seqs, which is always included."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


@dataclass
class StaticBuffer:
    """A graph's static input on the device and its pinned host twin.

    The twin is rewritten every step, so a step first waits until the previous step's copies out of it
    have run (`DecodeCudaGraphs.host_free`): with overlapped scheduling the host prepares step t+1 while
    step t — copies included — may still be queued. (Without it the wait is free: each step ends by
    reading its tokens back.)"""

    device: torch.Tensor
    host: torch.Tensor

    @classmethod
    def full(cls, runner: ModelRunner, shape: tuple[int, ...], dtype: torch.dtype,
             value: int = 0) -> StaticBuffer:
        host = torch.full(shape, value, dtype=dtype, pin_memory=runner.device.type == "cuda")
        return cls(host.to(runner.device), host)

    def upload(self, *index: slice | int) -> None:
        self.device[index].copy_(self.host[index], non_blocking=True)

    def part(self, start: int, stop: int | None, dtype: torch.dtype, shape: tuple[int, ...]) -> StaticBuffer:
        """Bytes [start, stop) of this (uint8) buffer as a buffer of `dtype` and `shape`: its own uploads,
        or the whole buffer's in one copy."""
        return StaticBuffer(*(t[start:stop].view(dtype).view(shape) for t in (self.device, self.host)))


def token_rows(buffer: torch.Tensor, n: int) -> torch.Tensor:
    """The (3, n) ids / positions / slot-mapping rows of a graph of `n` rows: the first 3n entries."""
    return buffer[: 3 * n].view(3, n)


class _NoEvent:
    def record(self) -> None: ...
    def synchronize(self) -> None: ...


class EagerReplay:
    """What a captured graph does on replay, for a runner without CUDA: its body run again on the static
    buffers. The CPU tests capture with it (`DecodeCudaGraphs.capture` patched to return one), so every
    piece of the graph paths but the capture itself runs: the body runs once when "captured", as the
    capture's warm-up does (in the caller's autograd mode: writing an inference tensor in place outside
    inference mode fails here as it does on a GPU); `replays` counts the replays."""

    def __init__(self, body: Callable[[], None]):
        body()
        self.body, self.replays = body, 0

    def replay(self) -> None:
        self.body()
        self.replays += 1


class DecodeCudaGraphs:
    """One graph per decode batch size, captured largest first in one memory pool; each writes its logits
    into the static `logits`."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        max_bs, width = runner.config.max_num_seqs, -(-runner.max_model_len // runner.block_size)
        # one staging buffer, so that a batch-1 step uploads its inputs in one copy: ids, positions and
        # slots (int64, token_rows), then the key counts (int32), then the block tables (int32)
        self.lens_at, self.tables_at = 3 * max_bs * 8, 3 * max_bs * 8 + max_bs * 4
        self.staging = StaticBuffer.full(runner, (self.tables_at + max_bs * width * 4,), torch.uint8)
        self.tokens = self.staging.part(0, self.lens_at, torch.long, (3 * max_bs,))
        self.context_lens = self.staging.part(self.lens_at, self.tables_at, torch.int32, (max_bs,))
        self.block_tables = self.staging.part(self.tables_at, None, torch.int32, (max_bs, width))
        for t in (self.context_lens.device, self.context_lens.host):
            t.fill_(1)
        self.logits = torch.zeros(max_bs, runner.vocab_size, dtype=runner.config.torch_dtype,
                                  device=runner.device)
        self.greedy_fn = getattr(runner, "graph_greedy_fn", None)  # (logits, out=) -> argmax rows
        self.greedy = torch.zeros(min(max_bs, GREEDY_IN_GRAPH), dtype=torch.long, device=runner.device)
        self.pool = None
        # recorded after each step's uploads from the host twins (a CPU runner: the tests' eager stand-in)
        self.host_free = torch.cuda.Event() if runner.device.type == "cuda" else _NoEvent()
        self.graphs = {bs: self.capture_rows(self.tokens.device, bs, functools.partial(self._body, bs))
                       for bs in reversed(cudagraph_batch_sizes(max_bs))}
        self.sizes = sorted(self.graphs)

    def _body(self, bs: int, greedy: bool = True) -> None:
        ids, positions, slots = token_rows(self.tokens.device, bs)
        ctx = AttentionContext(slot_mapping=slots, is_decode=True, context_lens=self.context_lens.device[:bs],
                               block_tables=self.block_tables.device[:bs])
        hidden = self.runner.model.model(ids[:, None], positions[:, None], ctx)
        self.logits[:bs] = self.runner.model.compute_logits(hidden[:, -1])
        if greedy and self.takes_greedy(bs):
            self.greedy_fn(self.logits[:bs], out=self.greedy[:bs])

    def takes_greedy(self, bs: int) -> bool:
        return self.greedy_fn is not None and bs <= GREEDY_IN_GRAPH

    def capture_rows(self, tokens: torch.Tensor, n: int, body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """`capture(body)` of a graph of `n` token rows, its rows set first to token 0 at position 0 writing
        K/V to the scratch slot (the capture runs the body)."""
        rows = token_rows(tokens, n)
        rows[:2].zero_()
        rows[2].fill_(self.runner.scratch_slot)
        return self.capture(body)

    def capture(self, body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """A CUDA graph of `body` in the shared pool (run once first: Triton compiles outside the capture)."""
        body()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            body()
        self.pool = self.pool or graph.pool()
        torch.cuda.synchronize(self.runner.device)
        return graph

    def fits(self, inputs: StepInputs) -> bool:
        return inputs.is_decode and inputs.num_seqs <= self.runner.config.max_num_seqs

    def replay(self, inputs: StepInputs) -> torch.Tensor | None:
        batch, rows, scratch = inputs.num_seqs, inputs.sample_rows, self.runner.scratch_slot
        bs = self.sizes[bisect.bisect_left(self.sizes, batch)]
        self.host_free.synchronize()
        ins, lens = token_rows(self.tokens.host, bs).numpy(), self.context_lens.host.numpy()
        ins[0, :batch], ins[1, :batch] = inputs.token_ids, inputs.positions
        ins[2, :batch] = inputs.slot_mapping
        ins[:2, batch:bs], ins[2, batch:bs], lens[batch:bs] = 0, scratch, 1
        cu_k = np.fromiter(inputs.cu_seqlens_k, np.int32, batch + 1)
        lens[:batch] = cu_k[1:] - cu_k[:-1]
        # Only the columns this batch uses: pages past a row's length are never read, stale ones included.
        width = max(map(len, inputs.block_tables))
        if bs == 1:  # one block-table row, no scatter; ids .. that row in one copy
            self.block_tables.host.numpy()[0, :width] = inputs.block_tables[0]
            self.staging.upload(slice(self.tables_at + 4 * width))
        else:
            fill_block_tables(self.block_tables.host[:bs, :width].numpy(),
                              inputs.block_tables + [[0]] * (bs - batch))
            self.staging.upload(slice(self.lens_at + 4 * bs))
            self.block_tables.upload(slice(bs), slice(width))
        self.host_free.record()
        self.graphs[bs].replay()
        self.runner.graph_greedy = None
        if len(rows) == batch and rows == list(range(batch)):  # the usual decode step: every row samples
            logits = self.logits[:batch]
            if self.takes_greedy(bs):  # the sampler takes these for a greedy step (these very logits)
                self.runner.graph_greedy = (logits, self.greedy[:batch])
            return logits
        return self.logits[torch.tensor(rows, device=self.runner.device)] if rows else None


class MixedStepGraphs:
    """Graphs of steps that are not pure decode, one per token count in `sizes`. They share the decode
    graphs' pool, block tables and logits (one step runs at a time)."""

    def __init__(self, runner: ModelRunner, decode: DecodeCudaGraphs, sizes: Seq[int]):
        self.runner, self.decode = runner, decode
        max_bs = runner.config.max_num_seqs
        self.row_cap = max_bs * getattr(runner, "sample_rows_per_seq", 1)  # logits rows a step may ask for
        self.max_rows = min(sizes[-1], self.row_cap)
        self.logits = decode.logits if self.max_rows <= len(decode.logits) else torch.zeros(
            self.max_rows, runner.vocab_size, dtype=runner.config.torch_dtype, device=runner.device)
        self.tokens = StaticBuffer.full(runner, (3 * sizes[-1],), torch.long)  # ids, positions, slots: token_rows
        self.cu_seqlens = StaticBuffer.full(runner, (2, max_bs + 1), torch.int32)  # q (attention's), k
        self.sample_rows = StaticBuffer.full(runner, (self.max_rows,), torch.long)  # padded with row 0
        # the decode kernel's rows (the leading one-token sequences', or a verifier's draft chains'):
        # key counts, 0 past them, and each row's sequence
        self.max_decodes = min(sizes[-1], self.row_cap)
        self.decode_rows = StaticBuffer.full(runner, (2, self.max_decodes), torch.int32)
        self.graphs = {n: decode.capture_rows(self.tokens.device, n, functools.partial(self._body, n))
                       for n in reversed(sizes)}

    def _body(self, n: int) -> None:
        """`n` packed tokens over max_num_seqs sequences (most of them empty), logits of min(n, row_cap)
        rows (row_cap: max_num_seqs times the runner's `sample_rows_per_seq`). max_seqlen_q = n sizes the kernel's grid: tiles past a sequence's length return at once."""
        ids, positions, slots = token_rows(self.tokens.device, n)
        rows, dec = min(n, self.row_cap), self.decode_rows.device[:, : min(n, self.max_decodes)]
        cu, tables = self.cu_seqlens.device, self.decode.block_tables.device
        ctx = AttentionContext(slot_mapping=slots, block_tables=tables,
                               cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=n,
                               max_seqlen_k=self.runner.max_model_len, decode_lens=dec[0],
                               decode_tables=tables.index_select(0, dec[1]))
        with trusted_metadata():  # no value checks: they would read the lengths back (a sync, not capturable)
            hidden = self.runner.model.model(ids[None], positions[None], ctx)
        logits = self.runner.model.compute_logits(hidden[0, self.sample_rows.device[:rows]])
        self.logits[:rows] = logits

    def _size(self, inputs: StepInputs) -> int | None:
        """The captured token count the step is padded to, or None (run it eagerly)."""
        n, rows = len(inputs.token_ids), len(inputs.sample_rows)
        if inputs.is_decode or inputs.num_seqs > self.runner.config.max_num_seqs:
            return None
        return min((s for s in self.graphs if s >= n and min(s, self.row_cap) >= rows), default=None)

    def fits(self, inputs: StepInputs) -> bool:
        return self._size(inputs) is not None

    def replay(self, inputs: StepInputs) -> torch.Tensor | None:
        size = self._size(inputs)
        n, batch, rows = len(inputs.token_ids), inputs.num_seqs, inputs.sample_rows
        self.decode.host_free.synchronize()
        ins, cu = token_rows(self.tokens.host, size).numpy(), self.cu_seqlens.host.numpy()
        ins[0, :n], ins[1, :n], ins[2, :n] = inputs.token_ids, inputs.positions, inputs.slot_mapping
        ins[:2, n:size], ins[2, n:size] = 0, self.runner.scratch_slot  # padding: no sequence, K/V to scratch
        cu_q, cu_k = inputs.cu_seqlens_q_attn, inputs.cu_seqlens_k
        cu[0, : batch + 1], cu[1, : batch + 1] = cu_q, cu_k
        cu[0, batch + 1 :], cu[1, batch + 1 :] = cu_q[-1], cu_k[-1]  # empty sequences
        num_rows = min(size, self.row_cap)
        hr, hd = self.sample_rows.host.numpy(), self.decode_rows.host.numpy()
        lens, seqs = inputs.decode_rows
        hr[: len(rows)], hr[len(rows) : num_rows] = rows, 0
        num_decodes = min(size, self.max_decodes)
        hd[0, : len(lens)], hd[1, : len(seqs)], hd[:, len(lens) : num_decodes] = lens, seqs, 0
        width = max(map(len, inputs.block_tables))
        fill_block_tables(self.decode.block_tables.host[:batch, :width].numpy(), inputs.block_tables)
        self.tokens.upload(slice(3 * size))
        self.cu_seqlens.upload()
        self.sample_rows.upload(slice(num_rows))
        self.decode_rows.upload(slice(None), slice(num_decodes))
        self.decode.block_tables.upload(slice(batch), slice(width))
        self.decode.host_free.record()
        self.graphs[size].replay()
        return self.logits[: len(rows)] if rows else None


@torch.inference_mode()
def capture_cudagraphs(runner: ModelRunner) -> list[StepGraphs]:
    """The decode graphs, and the mixed-step graphs when `mixed_sizes` names any."""
    decode = DecodeCudaGraphs(runner)
    sizes = mixed_sizes(runner.config, getattr(runner, "sample_rows_per_seq", 1))
    return [decode, MixedStepGraphs(runner, decode, sizes)] if sizes else [decode]


def install_cudagraphs(runner: ModelRunner) -> None:
    """The "graphs" hook: capture this runner's graphs for `ModelRunner.run` to replay."""
    runner.cudagraphs += capture_cudagraphs(runner)


REGISTRY.register("graphs", install_cudagraphs,
                  applies=lambda runner: runner.device.type == "cuda" and not runner.config.enforce_eager)
