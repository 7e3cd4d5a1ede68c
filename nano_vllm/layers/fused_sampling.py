"""Sampling in one pass over the logits — a performance layer over nano_vllm.sampler.

The paper path's sampler draws a (batch, vocab) fp32 noise tensor from a torch generator, then divides,
takes logs, subtracts and reduces: about ten passes over batch × vocab fp32 values (at 512 rows of a 152k
vocabulary, ~300 MB each) and one kernel per seeded row. Here one Triton kernel reads each logit once and
keeps, per row, the argmax of

    score_i = logit_i / T + g_i,      g_i = -log(-log(u_i)),  u_i ∈ (0, 1) uniform

(the Gumbel-max trick: argmax of score_i is a draw from softmax(logits / T); the paper path's exponential
race, argmax p_i / E_i, is the same trick with E_i = -log u_i). The uniforms come from a counter-based hash
of (row key, token index) computed in the kernel, not from a generator, so nothing is materialised and no
state is kept. A row's key hashes its request's seed with the index of the output token being drawn: a seeded
request samples the same tokens whatever it is batched with and whether or not steps overlap; an
unseeded one gets a fresh random seed per step (from a generator seeded by `EngineConfig.seed`).

* greedy rows (temperature 0) take the plain argmax of the logits (no noise), first index on ties, as
  torch.argmax;
* rows with top-k / top-p: the paper path's mask (`sampler.apply_top_k_top_p`, one sort) on the
  temperature-scaled logits first, then the same kernel;
* nothing is read back: the result is a device tensor, so a step's one sync is the token transfer (which
  the overlap layer defers);
* the decode graphs of a few rows (nano_vllm.layers.cudagraph's GREEDY_IN_GRAPH) take each row's argmax
  with this kernel themselves (`runner.graph_greedy_fn`): a greedy step's `sample` returns those tokens and
  launches nothing.

On CUDA tensors the Triton kernel runs, elsewhere `sample_reference` (the same arithmetic in torch; tests
check the two agree under TRITON_INTERPRET=1). Applied to a runner (its `sample` method) by a "runner"
hook: on CUDA unless `EngineConfig.fused_sampling` is False, anywhere when True.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nano_flashattn.configs import num_sms
from nano_vllm.config import REGISTRY
from nano_vllm.sampler import SamplingTensors, apply_top_k_top_p, seed64
from nano_vllm.scheduler import SchedulerOutput
from shared.kernels import HAS_TRITON, use_triton

MASK32 = 0xFFFFFFFF
# A 32-bit integer hash (xorshift-multiply rounds) whose multipliers are below 2^31, so the torch
# reference can run it in int64 without overflow; the Weyl step spreads consecutive token indices.
MIX1, MIX2, WEYL = 0x21F0AAAD, 0x735A2D97, 0x61C88647
UNIFORM_BITS = 23  # u = (h >> 9 + 0.5) / 2^23: strictly inside (0, 1) in fp32, so log(-log u) is finite


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The hash on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * MIX1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX2) & MASK32
    return x ^ (x >> 15)


def row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-row 32-bit keys (int64) from per-row seeds (uint32 values) and token positions."""
    return _mix32(seeds ^ _mix32(offsets & MASK32))


def sample_reference(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                     offsets: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch: (B,) int64 argmax over the vocab of logit / T + Gumbel noise from the
    hash of (row key, index); T = 0 rows take the argmax of the logits. seeds, offsets: (B,) int64."""
    x = logits.float()
    greedy = temperatures == 0
    inv_t = torch.where(greedy, 1.0, 1.0 / torch.where(greedy, 1.0, temperatures))
    keys = row_keys(seeds, offsets)
    idx = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.int64)
    h = _mix32((keys[:, None] + idx[None, :] * WEYL) & MASK32)
    u = ((h >> (32 - UNIFORM_BITS)).float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))
    noise = -torch.log(-torch.log(u))
    score = x * inv_t[:, None] + noise * (~greedy).float()[:, None]
    return score.argmax(dim=-1)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _mix32_tl(x):
        x = x ^ (x >> 16)
        x = x * 0x21F0AAAD
        x = x ^ (x >> 15)
        x = x * 0x735A2D97
        return x ^ (x >> 15)

    @triton.jit(do_not_specialize=["vocab", "chunk"])
    def _sample_kernel(LOGITS, stride_row, TEMPS, SEEDS, OFFSETS, OUT, PART_S, PART_I, COUNTERS, vocab, chunk,
                       SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, GREEDY: tl.constexpr,
                       BLOCK_V: tl.constexpr):
        """Program (row, split) keeps the best score of logits [split·chunk, +chunk) of its row; with
        SPLITS > 1 it writes (score, index) to the workspace and the row's last split to arrive (a per-row
        counter, reset for the next call) picks the best of them. GREEDY: every row takes its argmax."""
        row, split = tl.program_id(0), tl.program_id(1)
        if GREEDY:
            inv_t, noise_on, key = 1.0, 0.0, 0
        else:
            t = tl.load(TEMPS + row)
            greedy = t == 0.0
            inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
            noise_on = tl.where(greedy, 0.0, 1.0)
            seed = (tl.load(SEEDS + row) & 0xFFFFFFFF).to(tl.uint32)
            offset = (tl.load(OFFSETS + row) & 0xFFFFFFFF).to(tl.uint32)
            key = _mix32_tl(seed ^ _mix32_tl(offset))
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK_V], tl.int32)
        row_ptr = LOGITS + row.to(tl.int64) * stride_row
        lo = split * chunk
        hi = tl.minimum(lo + chunk, vocab)
        for start in range(lo, hi, BLOCK_V):
            idx = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
            if GREEDY:
                score = x
            else:
                h = _mix32_tl(key + idx.to(tl.uint32) * 0x61C88647)
                u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
                score = x * inv_t - tl.log(-tl.log(u)) * noise_on
            better = score > best  # strictly: each lane keeps its first index among equal scores
            best = tl.where(better, score, best)
            best_idx = tl.where(better, idx, best_idx)
        top = tl.max(best, axis=0)
        token = tl.min(tl.where(best == top, best_idx, vocab), axis=0)  # first index of the maximum
        if SPLITS == 1:
            tl.store(OUT + row, token.to(tl.int64))
        else:
            tl.store(PART_S + row * SPLITS + split, top)
            tl.store(PART_I + row * SPLITS + split, token)
            tl.debug_barrier()
            if tl.atomic_add(COUNTERS + row, 1) == SPLITS - 1:  # acq_rel: the other splits' stores are visible
                tl.atomic_xchg(COUNTERS + row, 0)
                sp = tl.arange(0, BLOCK_S)
                ok = sp < SPLITS
                scores = tl.load(PART_S + row * SPLITS + sp, mask=ok, other=float("-inf"), cache_modifier=".cg")
                tokens = tl.load(PART_I + row * SPLITS + sp, mask=ok, other=vocab, cache_modifier=".cg")
                top = tl.max(scores, axis=0)  # splits are in index order: the smallest index wins ties
                tl.store(OUT + row, tl.min(tl.where(scores == top, tokens, vocab), axis=0).to(tl.int64))


SAMPLE_BLOCK_V = 1024
_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per-row arrival counters of the split kernel, zero between calls


def vocab_splits(rows: int, vocab: int, sms: int) -> int:
    """Programs per row: about two per SM when the batch is small (a batch-1 row of a 152k vocabulary read
    by one program takes ~9 µs, most of it latency), each reading whole BLOCK_V tiles, none left without
    one; one (the unsplit kernel) from sms / 2 rows up, where the rows alone fill the GPU."""
    if rows > sms // 2:
        return 1
    want = min(-(-2 * sms // max(rows, 1)), -(-vocab // SAMPLE_BLOCK_V))
    chunk = -(-vocab // (max(want, 1) * SAMPLE_BLOCK_V)) * SAMPLE_BLOCK_V
    return -(-vocab // chunk)


def sample_triton(logits: torch.Tensor, temperatures: torch.Tensor | None, seeds: torch.Tensor | None,
                  offsets: torch.Tensor | None, splits: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """`sample_reference` as one Triton kernel, each row's vocabulary read once by `splits` programs
    (`vocab_splits` when None); temperatures None: every row greedy (its argmax, nothing else read). The
    tokens go to `out` ((rows,) int64, contiguous) when given."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device) if out is None else out
    if not rows:
        return out
    if splits is None:
        splits = vocab_splits(rows, vocab, num_sms(logits.device))
    block_v = SAMPLE_BLOCK_V if splits > 1 else 2048  # unsplit: one program of 8 warps streams the row
    chunk = -(-vocab // (splits * block_v)) * block_v
    splits = -(-vocab // chunk)  # none empty
    parts, counters = (out, out), out
    if splits > 1:
        parts = (torch.empty(rows * splits, dtype=torch.float32, device=logits.device),
                 torch.empty(rows * splits, dtype=torch.int32, device=logits.device))
        counters = _COUNTERS.get(logits.device)
        if counters is None or counters.numel() < rows:
            counters = _COUNTERS[logits.device] = torch.zeros(max(rows, 1024), dtype=torch.int32,
                                                              device=logits.device)
    greedy = temperatures is None
    params = (logits, logits, logits) if greedy else (temperatures, seeds, offsets)
    _sample_kernel[(rows, splits)](logits, logits.stride(0), *params, out, *parts, counters, vocab, chunk,
                                   SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), GREEDY=greedy,
                                   BLOCK_V=block_v, num_warps=4 if splits > 1 else 8)
    return out


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax (the first index of its maximum, as torch.argmax): the split kernel on CUDA."""
    if use_triton(logits):
        return sample_triton(logits, None, None, None, out=out)
    return logits.argmax(dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  offsets: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits` (B, V): Triton on CUDA tensors, the torch reference elsewhere."""
    impl = sample_triton if use_triton(logits) else sample_reference
    return impl(logits, temperatures.float(), seeds, offsets)


def _seed32(seed: int) -> int:
    """Fold a request's seed (any int, taken as the paper path's 64 bits: `sampler.seed64`) into 32 bits:
    the low half, xor the high half times an odd constant (a seed below 2^32 is itself; -1 is not 0)."""
    seed = seed64(seed)
    return (seed & MASK32) ^ ((seed >> 32) * MIX1 & MASK32)


class FusedSampling:
    """A runner's `sample(logits, out)` with the fused kernel. Per row: temperature, seed (the request's,
    else a fresh draw), offset (which output token is drawn: 0 for the first, as a per-request generator
    would count)."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.rng = np.random.default_rng(runner.config.seed)

    def sample(self, logits: torch.Tensor, out: SchedulerOutput) -> torch.Tensor:
        seqs = [s for s, f in zip(out.seqs, out.samples) if f]
        params = [s.sampling_params for s in seqs]
        if all(p.temperature == 0.0 for p in params):
            ready = getattr(self.runner, "graph_greedy", None)  # taken inside the decode graph
            return ready[1] if ready is not None and ready[0] is logits else greedy_tokens(logits)
        fresh = self.rng.integers(0, 1 << 32, size=len(seqs), dtype=np.int64)
        host = np.empty((3, len(seqs)), dtype=np.float64)  # temperature, seed, offset: exact in fp64
        host[0] = [p.temperature for p in params]
        host[1] = [fresh[i] if p.seed is None else _seed32(p.seed) for i, p in enumerate(params)]
        host[2] = [s.num_output_tokens for s in seqs]
        dev = self.runner._to_device(torch.from_numpy(host))
        temps, seeds, offsets = dev[0].float(), dev[1].long(), dev[2].long()
        if any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) for p in params):
            st = SamplingTensors.build(params, [None] * len(seqs), self.runner.vocab_size, logits.device)
            scaled = logits.float() / torch.where(temps > 0, temps, 1.0)[:, None]
            logits = apply_top_k_top_p(scaled, st.top_ks if st.any_top_k else None,
                                       st.top_ps if st.any_top_p else None)
            temps = (temps > 0).float()  # already divided by T: the kernel adds the noise only
        return sample_tokens(logits, temps, seeds, offsets)


def apply_fused_sampling(runner: Any) -> None:
    """The "runner" hook: the runner samples with the fused kernel (its `sample` method replaced on this
    instance)."""
    runner.sample = FusedSampling(runner).sample
    runner.graph_greedy_fn = greedy_tokens  # the decode graphs of a few rows take the argmax themselves


REGISTRY.register("runner", apply_fused_sampling,
                  applies=lambda runner: runner.config.wants("fused_sampling", runner.device))
