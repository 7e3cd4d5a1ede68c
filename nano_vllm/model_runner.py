"""The model runner: shared.model over a paged KV cache, one scheduler step at a time.

One step, as `execute` runs it:

1. `prepare` packs the scheduled sequences into one batch without padding (§4.3): the tokens whose K/V
   the step computes, their positions, the cache row ("slot") each one's K/V goes to, cumulative lengths
   and the block tables — a `StepInputs` of host lists.
2. `run` forwards the batch through the one model with `PagedAttention` installed as its attention call
   (§4.1: K/V are written into blocks, then read back through the block tables): by replaying a captured
   CUDA graph when one fits the step, else eagerly (`forward`). It returns the logits of the rows that
   sample.
3. `sample` draws the next tokens on the device (nano_vllm.sampler); reading them back is the step's one
   wait for the GPU.

Performance layers (nano_vllm/layers/, through `config.REGISTRY`) change a new runner at two points:
"runner" once its model is loaded (fused projections, the GEMV, fused sampling, the overlap layer's
token ring), "graphs" once its KV cache is allocated (the CUDA graphs `run` replays). The KV cache is
sized by nano_vllm.kv_cache (§5); tensor parallelism (§4.6) is a subclass, nano_vllm.tp.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from nano_flashattn import trusted_metadata
from nano_vllm.attention import AttentionContext, PagedAttention, check_head_dim
from nano_vllm.block_tables import fill_block_tables  # (re-exported: the CUDA-graph layer's too)
from nano_vllm.config import EngineConfig, apply_layers
from nano_vllm.kivi import install_kivi
from nano_vllm.kv_cache import decide_num_blocks, kv_block_bytes, load_engine_model
from nano_vllm.logprobs import StepLogprobs, prompt_logprob_rows
from nano_vllm.sampler import Sampler, SamplingTensors, seed64
from nano_vllm.scheduler import SchedulerOutput
from shared.config import ModelConfig
from shared.model import CausalLM

NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32}


@dataclass
class StepInputs:
    """One step's inputs as host lists: what `prepare` builds, a tensor-parallel rank 0 broadcasts and a
    CUDA graph copies into its static buffers. Sequence i computes tokens [cu_seqlens_q[i], cu_seqlens_q[i+1])
    of the packed batch and attends to keys [cu_seqlens_k[i], cu_seqlens_k[i+1]) (its cached ones first)."""

    token_ids: list[int]
    positions: list[int]
    # cache row of each token: block * block_size + offset (the scratch row: no write)
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    cu_seqlens_k: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # rows whose logits are returned, in this order
    is_decode: bool  # every sequence computes one token: q is (batch, 1), Flash-Decoding
    # some key was cached before this step (else attention reads the new K/V directly)
    paged: bool = True
    # in a paged mixed step, the leading sequences whose rows the decode kernel attends (one-token
    # decodes; a verifying runner's k + 1 row chains too: see `prepare`)
    num_decodes: int = 0
    # copy-on-write (src, dst) blocks, done first
    copies: list[tuple[int, int]] = field(default_factory=list)
    # rows whose hidden states score prompt tokens (`SamplingParams.prompt_logprobs`): run eagerly
    prompt_rows: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.block_tables)

    @property
    def context_lens(self) -> list[int]:
        return [b - a for a, b in itertools.pairwise(self.cu_seqlens_k)]

    @property
    def cu_seqlens_q_attn(self) -> list[int]:
        """`cu_seqlens_q` for the varlen kernel: the leading decodes are empty there (their start is moved
        to their end) because the decode kernel attends their rows (`AttentionContext.decode_lens`)."""
        lead = self.cu_seqlens_q[self.num_decodes]
        return [max(c, lead) for c in self.cu_seqlens_q] if lead else self.cu_seqlens_q

    @property
    def decode_rows(self) -> tuple[list[int], list[int]]:
        """The decode kernel's rows: each one's key count and sequence (`AttentionContext.decode_lens`);
        row r of leading sequence j sees the keys up to its own."""
        q, k = self.cu_seqlens_q, self.cu_seqlens_k
        rows = [(j, r) for j in range(self.num_decodes) for r in range(q[j], q[j + 1])]
        return [k[j + 1] - k[j] - q[j + 1] + 1 + r for j, r in rows], [j for j, _ in rows]


class StepGraphs(Protocol):
    """Captured CUDA graphs `run` replays instead of the eager forward, for the steps that they fit."""

    def fits(self, inputs: StepInputs) -> bool: ...
    def replay(self, inputs: StepInputs) -> torch.Tensor | None: ...


class ModelRunner:
    """Runs one engine step on one device (one tensor-parallel rank)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 tp_rank: int = 0, tp_size: int = 1, device: torch.device | None = None):
        self.config, self.model_config, self.max_model_len = config, model_config, max_model_len
        self.block_size, self.vocab_size = config.block_size, model_config.vocab_size
        self.device = device or config.torch_device
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_kv_heads = model_config.num_key_value_heads // tp_size
        check_head_dim(model_config.head_dim, self.device)
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}  # seeded requests' own random streams
        self.cudagraphs: list[StepGraphs] = []  # tried in order before the eager forward
        # the sequences that ask for log-probabilities (nano_vllm.logprobs); this step's prompt rows to
        # score and, after the forward, their hidden states
        self.scored_seqs: weakref.WeakSet = weakref.WeakSet()
        self.scored_prompt_rows, self.prompt_hidden = [], None
        with config.layers_context():  # performance_layers=False: no layer, here or in the kernels
            self.model = self.load_model().eval()
            # the layers change the model, so before the KV cache is sized
            self.layers_applied = apply_layers("runner", self)
            self.block_bytes = kv_block_bytes(model_config, self.block_size, self.num_kv_heads,
                                              config)
            self.num_blocks = decide_num_blocks(self)
            self.allocate_kv_cache(self.num_blocks)
            self.layers_applied += apply_layers("graphs", self)

    def load_model(self) -> CausalLM:
        """The one model on this device (the tensor-parallel runner loads its shard instead)."""
        return load_engine_model(self.config, self.model_config, self.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The block pool of §4.1 — K and V of every layer, (2, layers, blocks, block_size, kv_heads,
        head_dim) — installed in the model as its attention call (`PagedAttention`). One block more at the
        end is scratch: padded rows and already-cached tokens write there, so a store needs no mask.
        An FP8 pool (`kv_cache_dtype="fp8"`) has K and V scales per layer: 1.0, vLLM's for a model
        without calibrated scales (a value is its E4M3 code; past ±448 it clamps). A KIVI pool ("kivi2",
        "kivi4") holds bytes: packed codes, fp16 scales and zeros, and beside it each sequence's open key
        group in 16 bits (`kv_pool`: nano_vllm.kivi)."""
        cfg, dtype = self.model_config, self.config.kv_torch_dtype
        self.scratch_slot = num_blocks * self.block_size
        if self.config.kivi_bits is not None:
            return install_kivi(self, num_blocks)
        layers = cfg.num_hidden_layers
        self.kv_cache = torch.zeros(2, layers, num_blocks + 1, self.block_size, self.num_kv_heads,
                                    cfg.head_dim, dtype=dtype, device=self.device)
        fp8 = dtype == torch.float8_e4m3fn
        self.kv_scales = torch.ones(2, layers, 1, device=self.device) if fp8 else None
        self.model.set_attention(PagedAttention(self.kv_cache, self.kv_scales))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write (§4.4): duplicate whole blocks, all layers, K and V (as bytes: any dtype)."""
        src, dst = (torch.tensor(blocks, device=self.device) for blocks in zip(*copies))
        cache = self.kv_cache.view(torch.uint8)
        cache[:, :, dst] = cache[:, :, src]

    # ------------------------------------------------------------------ inputs (§4.3)
    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Pack the step's sequences into one batch: sequence i computes its tokens
        [num_computed_tokens, + num_new_tokens[i]), whose K/V go to the slots its block table names.
        A KIVI cache first gives each open key group its 16-bit residual entry (`KIVIPool.plan`)."""
        if self.config.kivi_bits is not None:
            self.kv_pool.plan(out)
        bs, scratch = self.block_size, self.scratch_slot
        ids, positions, slots, cu_k, tables = [], [], [], [0], []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start, table = seq.num_computed_tokens, seq.block_table
            if n == 1:  # a decode (hundreds per step): no ranges built
                ids.append(seq.token_ids[start])
                positions.append(start)
                # A fully cached prompt recomputes its last token only for its logits: K/V go to scratch.
                cached = start < seq.num_cached_tokens
                slots.append(scratch if cached else table[start // bs] * bs + start % bs)
            else:
                ids += seq.token_ids[start : start + n]
                positions += range(start, start + n)
                slots += self._slots(seq, start, start + n)
            cu_k.append(cu_k[-1] + start + n)
            tables.append(table)
        cu_q = list(itertools.accumulate(out.num_new_tokens, initial=0))
        is_decode = len(ids) == len(tables)
        paged = cu_k[-1] > cu_q[-1]  # some sequence starts past 0: earlier keys are in the cache
        # The running decodes lead a mixed step (the scheduler puts them first). A verifying runner's
        # (nano_specdec) chains of k + 1 rows go to the decode kernel too, a row per query and key count.
        lead, short = 0, 1 if self.config.kivi_bits else getattr(self, "sample_rows_per_seq", 1)
        while paged and not is_decode and lead < len(tables) and out.num_new_tokens[lead] <= short:
            lead += 1
        sample_rows = [cu_q[i + 1] - 1 for i, s in enumerate(out.samples) if s]
        self.scored_prompt_rows = prompt_logprob_rows(out, cu_q, self.scored_seqs)
        prompt_rows = [row for _, row, _ in self.scored_prompt_rows]
        return StepInputs(ids, positions, slots, cu_q, cu_k, tables, sample_rows, is_decode,
                          paged or is_decode, lead, out.copies, prompt_rows)

    def _slots(self, seq, start: int, end: int) -> list[int]:
        """Cache rows (block * block_size + offset) of tokens [start, end) of `seq`; a token whose K/V are
        already cached (only a fully cached prompt's last token is recomputed) writes to the scratch row."""
        first = min(max(start, seq.num_cached_tokens), end)
        pos = np.arange(first, end)
        blocks = np.asarray(seq.block_table)[pos // self.block_size]
        rows = blocks * self.block_size + pos % self.block_size
        return [self.scratch_slot] * (first - start) + rows.tolist()

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, through pinned memory on CUDA so the copy is asynchronous."""
        pinned = host.pin_memory() if self.device.type == "cuda" else host
        return pinned.to(self.device, non_blocking=True)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        # Through numpy: it converts a list of ints ~3x faster than torch.tensor, several times per step.
        host = np.fromiter(values, NUMPY_DTYPES[dtype], len(values))
        return self._to_device(torch.from_numpy(host))

    def attention_context(self, inputs: StepInputs) -> AttentionContext:
        """The step's paged-attention metadata as device tensors (what every layer's attention reads)."""
        slots = self._tensor(inputs.slot_mapping, torch.long)
        tables = None
        if inputs.paged:
            padded = np.zeros((inputs.num_seqs, max(map(len, inputs.block_tables))), np.int32)
            fill_block_tables(padded, inputs.block_tables)
            tables = self._to_device(torch.from_numpy(padded))
        if inputs.is_decode:
            return AttentionContext(slot_mapping=slots, is_decode=True, block_tables=tables,
                                    context_lens=self._tensor(inputs.context_lens, torch.int32))
        cu_q, cu_k, nd = inputs.cu_seqlens_q_attn, inputs.cu_seqlens_k, inputs.num_decodes
        lens, seqs = inputs.decode_rows  # a chain's rows all read its sequence's block table
        by_row = None if not nd else tables[:nd] if len(seqs) == nd else tables[
            self._tensor(seqs, torch.long)]
        max_q = max(1, *(b - a for a, b in itertools.pairwise(cu_q)))
        # fresh: the sequences after the decodes start at 0, their keys are their new tokens
        fresh, q_t = cu_k[-1] - cu_k[nd] == cu_q[-1] - cu_q[nd], self._tensor(cu_q, torch.int32)
        return AttentionContext(
            slot_mapping=slots, block_tables=tables, cu_seqlens_q=q_t, max_seqlen_q=max_q,
            cu_seqlens_k=q_t if fresh else self._tensor(cu_k, torch.int32), fresh=fresh,
            max_seqlen_k=max_q if fresh else max(inputs.context_lens),
            decode_lens=self._tensor(lens, torch.int32) if nd else None, decode_tables=by_row)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Forward one step; returns the logits of `inputs.sample_rows` (None when there are none)."""
        if inputs.copies:
            self.copy_blocks(inputs.copies)
        graphs = None if inputs.prompt_rows else next(  # prompt rows to score run eagerly
            (g for g in self.cudagraphs if g.fits(inputs)), None)
        with self.config.layers_context():
            return self.forward(inputs) if graphs is None else graphs.replay(inputs)

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The eager step: the model over the packed batch, then the LM head on the rows that sample."""
        ids = self._tensor(inputs.token_ids, torch.long)
        positions = self._tensor(inputs.positions, torch.long)
        ctx = self.attention_context(inputs)
        # The block tables and lengths come from the block manager: skip nano_flashattn's value checks,
        # which would sync with the GPU in every layer.
        with trusted_metadata():
            if inputs.is_decode:  # q: (batch, 1)
                hidden = self.model.model(ids[:, None], positions[:, None], ctx)[:, -1]
            else:  # q: (1, num_tokens), the sequences packed
                hidden = self.model.model(ids[None], positions[None], ctx)[0]
        if inputs.prompt_rows:
            self.prompt_hidden = hidden[self._tensor(inputs.prompt_rows, torch.long)]
        if not inputs.sample_rows:
            return None
        return self.model.compute_logits(hidden[self._tensor(inputs.sample_rows, torch.long)])

    # ------------------------------------------------------------------ sampling
    def sample(self, logits: torch.Tensor, out: SchedulerOutput) -> torch.Tensor:
        """The next token of each sequence that samples this step, as a device tensor (no sync): the argmax
        for greedy requests, else a draw from softmax(logits / temperature) cut to top-k / top-p, from the
        request's own generator when it has a seed (nano_vllm.sampler)."""
        seqs = [s for s, f in zip(out.seqs, out.samples) if f]
        st = SamplingTensors.build([s.sampling_params for s in seqs],
                                   [self._generator(s) for s in seqs], self.vocab_size, self.device)
        return self.sampler.sample(logits, st)

    def _generator(self, seq) -> torch.Generator | None:
        sp = seq.sampling_params
        if sp.seed is None or sp.greedy:
            return None
        if seq.seq_id not in self.generators:
            generator = torch.Generator(device=self.device).manual_seed(seed64(sp.seed))
            self.generators[seq.seq_id] = generator
        return self.generators[seq.seq_id]

    def release(self, seq) -> None:
        """Forget per-request state of a finished sequence."""
        self.generators.pop(seq.seq_id, None)

    def execute(self, out: SchedulerOutput) -> list[int]:
        """One scheduled step end to end: inputs, forward, sampling (and the log-probabilities requests ask
        for, nano_vllm.logprobs); returns the sampled token ids."""
        logits = self.run(self.prepare(out))
        tokens = None if logits is None else self.sample(logits, out)
        scores = StepLogprobs.of(self, out, logits, tokens)
        ids = [] if tokens is None else tokens.tolist()
        if scores is not None:
            scores.attach()
        return ids
