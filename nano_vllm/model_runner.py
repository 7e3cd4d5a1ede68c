"""The model runner: shared.model over a paged KV cache, one scheduler step at a time.

* Loads the one model (an HF checkpoint or a preset with random weights) and installs `PagedAttention`
  with `model.set_attention` — the model itself is unchanged (§4.1: attention reads K/V through blocks).
* Sizes the KV cache: on CUDA from the memory left after the weights and a profiling pass at the full
  token budget (`gpu_memory_utilization`), on a CPU from `num_kv_blocks` / `kv_cache_memory_bytes`.
* Turns a `SchedulerOutput` into flat tensors: token ids, positions, slot mapping, block tables,
  cumulative lengths (§4.3: the step's sequences are packed into one batch, no padding).
* Decode steps replay CUDA graphs captured for batch sizes 1, 2, 4, 8, 16, 32, ... max_num_seqs (the
  batch is padded up to the next captured size), which removes the per-kernel launch overhead that
  dominates small decode batches. Other steps of up to `mixed_cudagraph_sizes[-1]` tokens replay a graph
  captured at the next token count (padded tokens belong to no sequence; the batch is padded with empty
  sequences up to max_num_seqs); anything else runs eagerly.
* Samples on the device (nano_vllm.sampler) and returns the sampled token ids.

Tensor parallelism (§4.6) shards the model with nano_vllm.tp; every rank runs this class, rank 0 also
samples.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from nano_flashattn import trusted_metadata
from nano_vllm.attention import AttentionContext, PagedAttention, check_head_dim
from nano_vllm.config import EngineConfig
from nano_vllm.sampler import Sampler, SamplingTensors
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.scheduler import SchedulerOutput
from shared.checkpoint import load_model
from shared.config import PRESETS, ModelConfig
from shared.model import CausalLM, build_model

CPU_KV_CACHE_BYTES = 1 << 30  # default KV cache budget on a CPU (when not given)
NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32}


def load_engine_model(config: EngineConfig, model_config: ModelConfig, device: torch.device) -> CausalLM:
    """An HF checkpoint directory through shared.checkpoint, or a preset with seeded random weights."""
    if config.model in PRESETS:
        return build_model(model_config, device=device, dtype=config.torch_dtype, seed=config.seed)
    return load_model(config.model, device=device, dtype=config.torch_dtype)


def cudagraph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 (nano-vllm's ladder) up to max_num_seqs, which is always included."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


class ModelRunner:
    """Runs one engine step on one device (one tensor-parallel rank)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 tp_rank: int = 0, tp_size: int = 1, device: torch.device | None = None):
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.device = device or config.torch_device
        self.tp_rank, self.tp_size = tp_rank, tp_size
        check_head_dim(model_config.head_dim, self.device)
        if tp_size > 1:
            from nano_vllm.tp import shard_model  # only tensor-parallel runs need torch.distributed

            model = load_engine_model(config, model_config, torch.device("cpu"))
            model = shard_model(model, tp_rank, tp_size).to(self.device)
        else:
            model = load_engine_model(config, model_config, self.device)
        self.model = model.eval()
        self.num_kv_heads = model_config.num_key_value_heads // tp_size
        self.vocab_size = model_config.vocab_size
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}
        self.num_blocks = self._decide_num_blocks()
        self._allocate_kv_cache(self.num_blocks)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode steps, by batch size
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # other steps, by token count
        self.prepare_seconds = 0.0
        self.num_eager_steps = 0  # steps that replayed no CUDA graph
        if self.device.type == "cuda" and not config.enforce_eager:
            self.capture_cudagraphs()

    # ------------------------------------------------------------------ KV cache
    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V (shared.accounting.kv_cache_bytes' formula)."""
        cfg = self.model_config
        return (2 * cfg.num_hidden_layers * self.block_size * self.num_kv_heads * cfg.head_dim
                * self.config.torch_dtype.itemsize)

    def _decide_num_blocks(self) -> int:
        cfg, needed = self.config, math.ceil(self.max_model_len / self.block_size)
        if cfg.num_kv_blocks is not None:
            num = cfg.num_kv_blocks
        elif cfg.kv_cache_memory_bytes is not None:
            num = cfg.kv_cache_memory_bytes // self.block_bytes
        elif self.device.type == "cuda":
            num = self._profile_num_blocks()
        else:
            num = min(cfg.max_num_seqs * needed, CPU_KV_CACHE_BYTES // self.block_bytes)
        if self.tp_size > 1:  # every rank must agree, or block ids would mean different things
            from nano_vllm.tp import all_reduce_min

            num = all_reduce_min(num, self.device)
        if num < needed:
            raise ValueError(f"the KV cache holds {num} blocks of {self.block_size} tokens, fewer than one "
                             f"max_model_len ({self.max_model_len}) sequence needs ({needed}); give it more "
                             f"memory or lower max_model_len")
        return num

    @torch.inference_mode()
    def _profile_num_blocks(self) -> int:
        """§5 of the paper: profile the peak activation memory of the largest step, then give everything
        else the engine may use to KV blocks."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = self.config.max_num_batched_tokens
        seq_len = min(self.max_model_len, tokens)
        lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        self._allocate_kv_cache(1)  # a dummy cache: the profiling pass attends to k, v directly
        ids = torch.zeros(1, tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])[None]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=self.device)
        slots = torch.full((tokens,), 0, dtype=torch.long, device=self.device)
        ctx = AttentionContext(slot_mapping=slots, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq_len,
                               max_seqlen_k=seq_len)
        hidden = self.model.model(ids, positions, ctx)
        logits = self.model.compute_logits(hidden[0, cu[1:] - 1][: self.config.max_num_seqs])
        self.sampler.sample(logits, SamplingTensors.build(  # the sampler's vocab-sized temporaries too
            [SamplingParams(temperature=1.0, top_k=2)] * logits.shape[0], [None] * logits.shape[0],
            self.vocab_size, self.device))
        del hidden, logits, ids, positions, slots, ctx
        torch.cuda.synchronize(self.device)
        stats = torch.cuda.memory_stats(self.device)
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        torch.cuda.empty_cache()  # so that `used` below counts weights and contexts, not cached activations
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free  # everything on the GPU now, this process's and anyone else's
        budget = total * self.config.gpu_memory_utilization - used - (peak - current)
        return max(int(budget) // self.block_bytes, 0)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        # One extra block at the end is scratch: writes of padded rows (CUDA graphs) and of tokens whose
        # K/V are already cached land there, so storing is a plain index_copy_ without masks.
        cfg = self.model_config
        self.scratch_slot = num_blocks * self.block_size
        self.kv_cache = torch.zeros(2, cfg.num_hidden_layers, num_blocks + 1, self.block_size, self.num_kv_heads,
                                    cfg.head_dim, dtype=self.config.torch_dtype, device=self.device)
        self.model.set_attention(PagedAttention(self.kv_cache))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write (§4.4): duplicate whole blocks, all layers, K and V."""
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    # ------------------------------------------------------------------ inputs
    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Copy a host tensor to the device, through pinned memory on CUDA so the copy is asynchronous."""
        return (host.pin_memory() if self.device.type == "cuda" else host).to(self.device, non_blocking=True)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        # Through numpy: it converts a list of ints ~3x faster than torch.tensor, several times per step.
        return self._to_device(torch.from_numpy(np.fromiter(values, NUMPY_DTYPES[dtype], len(values))))

    def _slots(self, seq, start: int, end: int) -> list[int]:
        """Cache rows for tokens [start, end) of `seq`; tokens already cached go to the scratch row."""
        bs, table, slots = self.block_size, seq.block_table, []
        skip = min(max(seq.num_cached_tokens - start, 0), end - start)  # only a fully cached prompt's last token
        slots.extend([self.scratch_slot] * skip)
        pos = start + skip
        while pos < end:
            block, offset = divmod(pos, bs)
            n = min(bs - offset, end - pos)
            base = table[block] * bs + offset
            slots.extend(range(base, base + n))
            pos += n
        return slots

    def prepare(self, out: SchedulerOutput) -> dict[str, Any]:
        """The step's inputs as host lists (what a tensor-parallel rank 0 broadcasts)."""
        if out.is_decode:
            return self._prepare_decode(out)
        ids, positions, slots, cu_q, cu_k, tables = [], [], [], [0], [0], []
        any_cached = False  # False: nothing before this step is cached, attention reads the new K/V directly
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(self._slots(seq, start, start + n))
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + start + n)
            tables.append(seq.block_table)
            any_cached |= start > 0
        sample_rows = [cu_q[i + 1] - 1 for i, s in enumerate(out.samples) if s]
        # The leading one-token sequences (the running decodes) are attended by the decode kernel
        # (attention.AttentionContext.decode_lens): emptied in the varlen kernel's cu_seqlens_q.
        lead = 0
        if any_cached:
            while lead < len(out.seqs) and out.num_new_tokens[lead] == 1:
                lead += 1
        decode_lens = [cu_k[i + 1] - cu_k[i] for i in range(lead)]
        cu_q_attn = [max(c, lead) for c in cu_q] if lead else cu_q
        return {"ids": ids, "positions": positions, "slots": slots, "cu_q": cu_q, "cu_k": cu_k,
                "cu_q_attn": cu_q_attn, "decode_lens": decode_lens,
                "tables": tables, "paged": any_cached, "is_decode": out.is_decode,
                "sample_rows": sample_rows, "copies": out.copies}

    def _prepare_decode(self, out: SchedulerOutput) -> dict[str, Any]:
        """`prepare` for the hot path, a step in which every sequence computes one token (the same dict,
        built in one pass: at 256 sequences per step the host time of this function is on the clock)."""
        bs, scratch = self.block_size, self.scratch_slot
        ids, positions, slots, cu_k, tables = [], [], [], [0], []
        for seq in out.seqs:
            pos, table = seq.num_computed_tokens, seq.block_table
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            # A fully cached prompt recomputes its last token only for its logits: K/V go to scratch.
            slots.append(scratch if pos < seq.num_cached_tokens else table[pos // bs] * bs + pos % bs)
            cu_k.append(cu_k[-1] + pos + 1)
            tables.append(table)
        sample_rows = [i for i, s in enumerate(out.samples) if s]
        return {"ids": ids, "positions": positions, "slots": slots, "cu_q": list(range(len(ids) + 1)),
                "cu_k": cu_k, "tables": tables, "paged": True, "is_decode": True, "sample_rows": sample_rows,
                "copies": out.copies}

    @staticmethod
    def _fill_block_tables(out: np.ndarray, tables: list[list[int]]) -> None:
        """Write ragged block tables into the rows of `out` (batch, >= widest); entries past a row's length
        keep what they held (pages past a sequence's length are never read). numpy does the scatter: nested Python lists through torch.tensor
        cost ~2.5 ms at 256 x 64 blocks, this ~0.4 ms."""
        lens = np.fromiter(map(len, tables), np.int64, len(tables))
        out[np.arange(out.shape[1])[None, :] < lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), np.int32, int(lens.sum()))

    def _block_table_tensor(self, tables: list[list[int]]) -> torch.Tensor:
        """The step's block tables as one (batch, widest) int32 device tensor."""
        padded = np.zeros((len(tables), max(map(len, tables))), np.int32)
        self._fill_block_tables(padded, tables)
        return self._to_device(torch.from_numpy(padded))

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def run(self, inputs: dict[str, Any]) -> torch.Tensor | None:
        """Forward one step; returns the logits of the rows to sample (None when there are none)."""
        if inputs["copies"]:
            self.copy_blocks(inputs["copies"])
        if not inputs["ids"]:
            return None
        batch = len(inputs["cu_q"]) - 1
        mixed = None if inputs["is_decode"] else self._mixed_size(inputs)
        if inputs["is_decode"] and self.graphs and batch <= max(self.graphs):
            logits = self._replay_graph(inputs, batch)
        elif mixed is not None:
            return self._replay_mixed(inputs, mixed)
        else:
            self.num_eager_steps += 1
            # The block tables and lengths come from the block manager and the host lists above: skip
            # nano_flashattn's value checks, which would sync with the GPU in every layer.
            with trusted_metadata():
                hidden = self.model.model(*self._eager_inputs(inputs))
            rows = self._tensor(inputs["sample_rows"], torch.long)
            flat = hidden[:, -1] if inputs["is_decode"] else hidden[0]
            return self.model.compute_logits(flat[rows]) if inputs["sample_rows"] else None
        rows = inputs["sample_rows"]
        if len(rows) == batch:  # the usual decode step: every row samples
            return logits
        return logits[torch.tensor(rows, device=self.device)] if rows else None

    def _eager_inputs(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        ids = self._tensor(inputs["ids"], torch.long)
        positions = self._tensor(inputs["positions"], torch.long)
        slots = self._tensor(inputs["slots"], torch.long)
        tables = self._block_table_tensor(inputs["tables"]) if inputs["paged"] else None
        cu_k = inputs["cu_k"]
        if inputs["is_decode"]:
            lens = self._tensor([k1 - k0 for k0, k1 in itertools.pairwise(cu_k)], torch.int32)
            ctx = AttentionContext(slot_mapping=slots, is_decode=True, context_lens=lens, block_tables=tables)
            return ids[:, None], positions[:, None], ctx
        cu_attn, dec = inputs["cu_q_attn"], inputs["decode_lens"]
        ctx = AttentionContext(
            slot_mapping=slots, block_tables=tables, cu_seqlens_q=self._tensor(cu_attn, torch.int32),
            cu_seqlens_k=self._tensor(cu_k, torch.int32),
            max_seqlen_q=max(1, max(b - a for a, b in itertools.pairwise(cu_attn))),
            max_seqlen_k=max(b - a for a, b in itertools.pairwise(cu_k)),
            decode_lens=self._tensor(dec, torch.int32) if dec else None)
        return ids[None], positions[None], ctx

    # ------------------------------------------------------------------ CUDA graphs
    def _decode_logits(self, ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return self.model.compute_logits(self.model.model(ids[:, None], positions[:, None], ctx)[:, -1])

    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        """Capture one graph per decode batch size, largest first, all in one memory pool. Each graph reads
        its inputs from static buffers (the g_* tensors) and writes the logits into `g_logits`."""
        max_bs = self.config.max_num_seqs
        width = math.ceil(self.max_model_len / self.block_size)
        dev = self.device
        self.g_inputs = torch.zeros(3, max_bs, dtype=torch.long, device=dev)  # ids, positions, slots
        self.g_ids, self.g_positions, self.g_slots = self.g_inputs
        self.g_slots.fill_(self.scratch_slot)
        self.g_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.g_tables = torch.zeros(max_bs, width, dtype=torch.int32, device=dev)
        # Pinned host twins the inputs are written into, so one replay costs three async copies and no
        # allocation. Reusing them every step is safe because every step ends by reading the sampled
        # tokens back (a sync), after which the previous step's copies have completed. (A tensor-parallel
        # worker does not sample, but its next inputs arrive only after rank 0 has its tokens, which needs
        # the worker's all-reduces of this step, which follow its copies on the same stream.)
        pin = dev.type == "cuda"
        self.h_inputs = torch.zeros(3, max_bs, dtype=torch.long, pin_memory=pin)
        self.h_lens = torch.ones(max_bs, dtype=torch.int32, pin_memory=pin)
        self.h_tables = torch.zeros(max_bs, width, dtype=torch.int32, pin_memory=pin)
        self.g_logits = torch.zeros(max_bs, self.vocab_size, dtype=self.config.torch_dtype, device=dev)
        self._graph_pool = None
        for bs in reversed(cudagraph_batch_sizes(max_bs)):
            ctx = AttentionContext(slot_mapping=self.g_slots[:bs], is_decode=True, context_lens=self.g_lens[:bs],
                                   block_tables=self.g_tables[:bs])
            self.graphs[bs] = self._capture(functools.partial(self._decode_graph_body, bs, ctx))
        sizes = self.config.mixed_cudagraph_sizes or ()
        if sizes:
            # Mixed steps: token inputs padded to the captured count, cumulative lengths (queries, keys)
            # padded to max_num_seqs + 1 with empty sequences, the rows to sample padded with row 0. The
            # block tables and the logits are the decode graphs' buffers (one step runs at a time).
            self.m_inputs = torch.zeros(3, sizes[-1], dtype=torch.long, device=dev)  # ids, positions, slots
            self.m_cu = torch.zeros(2, max_bs + 1, dtype=torch.int32, device=dev)  # cu_seqlens_q, cu_seqlens_k
            self.m_rows = torch.zeros(min(sizes[-1], max_bs), dtype=torch.long, device=dev)
            # key counts of the leading one-token sequences (decode kernel), 0 past them
            self.m_declens = torch.zeros(min(sizes[-1], max_bs), dtype=torch.int32, device=dev)
            self.hm_inputs = torch.zeros(3, sizes[-1], dtype=torch.long, pin_memory=pin)
            self.hm_cu = torch.zeros(2, max_bs + 1, dtype=torch.int32, pin_memory=pin)
            self.hm_rows = torch.zeros(min(sizes[-1], max_bs), dtype=torch.long, pin_memory=pin)
            self.hm_declens = torch.zeros(min(sizes[-1], max_bs), dtype=torch.int32, pin_memory=pin)
            for n in reversed(sizes):
                self.mixed_graphs[n] = self._capture(functools.partial(self._mixed_graph_body, n))

    def _decode_graph_body(self, bs: int, ctx: AttentionContext) -> None:
        self.g_logits[:bs] = self._decode_logits(self.g_ids[:bs], self.g_positions[:bs], ctx)

    def _mixed_graph_body(self, n: int) -> None:
        """A step of `n` packed tokens over max_num_seqs sequences (most of them empty), paged attention
        through the block tables (everything a step attends to is in the cache once it has written its own
        K/V), logits of min(n, max_num_seqs) rows. max_seqlen_q = n sizes the kernel's grid: tiles past a
        sequence's length return at once."""
        ids, positions, slots = self.m_inputs[:, :n]
        rows = min(n, self.config.max_num_seqs)
        ctx = AttentionContext(slot_mapping=slots, block_tables=self.g_tables, cu_seqlens_q=self.m_cu[0],
                               cu_seqlens_k=self.m_cu[1], max_seqlen_q=n, max_seqlen_k=self.max_model_len,
                               decode_lens=self.m_declens[:rows])
        with trusted_metadata():  # no value checks: they would read the lengths back (a sync, not capturable)
            hidden = self.model.model(ids[None], positions[None], ctx)
        self.g_logits[:rows] = self.model.compute_logits(hidden[0, self.m_rows[:rows]])

    def _capture(self, body: Callable[[], None]):
        """A CUDA graph of `body` (which reads the static inputs and writes `g_logits`), in the shared pool."""
        body()  # warm-up first: Triton compiles (and caches) its kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self._graph_pool):
            body()
        self._graph_pool = self._graph_pool or graph.pool()
        torch.cuda.synchronize(self.device)
        return graph

    def _replay_graph(self, inputs: dict[str, Any], batch: int) -> torch.Tensor:
        bs = min(s for s in self.graphs if s >= batch)
        # Padded rows [batch, bs) write to the scratch row and attend to one key of block 0: harmless.
        ins, lens = self.h_inputs.numpy(), self.h_lens.numpy()
        ins[0, :batch], ins[1, :batch], ins[2, :batch] = inputs["ids"], inputs["positions"], inputs["slots"]
        ins[:2, batch:bs], ins[2, batch:bs], lens[batch:bs] = 0, self.scratch_slot, 1
        cu_k = np.fromiter(inputs["cu_k"], np.int32, batch + 1)
        lens[:batch] = cu_k[1:] - cu_k[:-1]
        # Only the columns this batch uses: pages past a row's length are never read, stale ones included.
        tables = inputs["tables"]
        width = max(len(t) for t in tables)
        self._fill_block_tables(self.h_tables[:bs, :width].numpy(), tables + [[0]] * (bs - batch))
        self.g_inputs[:, :bs].copy_(self.h_inputs[:, :bs], non_blocking=True)
        self.g_lens[:bs].copy_(self.h_lens[:bs], non_blocking=True)
        self.g_tables[:bs, :width].copy_(self.h_tables[:bs, :width], non_blocking=True)
        self.graphs[bs].replay()
        return self.g_logits[:batch]

    def _mixed_size(self, inputs: dict[str, Any]) -> int | None:
        """The captured token count a non-decode step is padded to, or None (run it eagerly)."""
        n, rows = len(inputs["ids"]), len(inputs["sample_rows"])
        fits = [s for s in self.mixed_graphs if s >= n and min(s, self.config.max_num_seqs) >= rows]
        return min(fits) if fits and len(inputs["cu_q"]) - 1 <= self.config.max_num_seqs else None

    def _replay_mixed(self, inputs: dict[str, Any], size: int) -> torch.Tensor | None:
        n, batch, rows = len(inputs["ids"]), len(inputs["cu_q"]) - 1, inputs["sample_rows"]
        ins, cu, hr = self.hm_inputs.numpy(), self.hm_cu.numpy(), self.hm_rows.numpy()
        ins[0, :n], ins[1, :n], ins[2, :n] = inputs["ids"], inputs["positions"], inputs["slots"]
        ins[:2, n:size], ins[2, n:size] = 0, self.scratch_slot  # padded tokens: no sequence, K/V to scratch
        cu_attn = inputs["cu_q_attn"]
        cu[0, : batch + 1], cu[1, : batch + 1] = cu_attn, inputs["cu_k"]
        cu[0, batch + 1 :], cu[1, batch + 1 :] = cu_attn[-1], inputs["cu_k"][-1]  # empty sequences
        num_rows = min(size, self.config.max_num_seqs)
        hr[: len(rows)], hr[len(rows) : num_rows] = rows, 0
        dec, hd = inputs["decode_lens"], self.hm_declens.numpy()
        hd[: len(dec)], hd[len(dec) : num_rows] = dec, 0
        width = max(len(t) for t in inputs["tables"])
        self._fill_block_tables(self.h_tables[:batch, :width].numpy(), inputs["tables"])
        self.m_inputs[:, :size].copy_(self.hm_inputs[:, :size], non_blocking=True)
        self.m_cu.copy_(self.hm_cu, non_blocking=True)
        self.m_rows[:num_rows].copy_(self.hm_rows[:num_rows], non_blocking=True)
        self.m_declens[:num_rows].copy_(self.hm_declens[:num_rows], non_blocking=True)
        self.g_tables[:batch, :width].copy_(self.h_tables[:batch, :width], non_blocking=True)
        self.mixed_graphs[size].replay()
        return self.g_logits[: len(rows)] if rows else None

    # ------------------------------------------------------------------ sampling
    def sample(self, logits: torch.Tensor, out: SchedulerOutput) -> list[int]:
        seqs = [s for s, flag in zip(out.seqs, out.samples) if flag]
        gens = [self._generator(s) for s in seqs]
        st = SamplingTensors.build([s.sampling_params for s in seqs], gens, self.vocab_size, self.device)
        return self.sampler.sample(logits, st).tolist()

    def _generator(self, seq) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None or seq.sampling_params.greedy:
            return None
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = self.generators[seq.seq_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    def release(self, seq) -> None:
        """Forget per-request state of a finished sequence."""
        self.generators.pop(seq.seq_id, None)

    def execute(self, out: SchedulerOutput) -> list[int]:
        """Run one scheduled step end to end: inputs, forward, sampling. Returns the sampled tokens."""
        logits = self.run(self.timed_prepare(out))
        return [] if logits is None else self.sample(logits, out)

    def timed_prepare(self, out: SchedulerOutput) -> dict[str, Any]:
        """`prepare`, its wall time added to `prepare_seconds` (host time the GPU may sit idle for)."""
        t0 = time.perf_counter()
        inputs = self.prepare(out)
        self.prepare_seconds += time.perf_counter() - t0
        return inputs
