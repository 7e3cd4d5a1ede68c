"""What the W4A16 layers share, not a layer itself: the SM count their grids are sized by, and split-K's
two ways to sum partial products in a fixed order.

Split-K partial sums go to a (SPLIT_K, M, N) fp32 buffer that `_split_k_sum_kernel` reduces (+ bias) in a
fixed order (`split_k_partials`, `split_k_reduce`): the result is the same on every run, which a captured
CUDA graph's replay is compared against, and every buffer's size depends only on shapes, so it is
capture-safe. fp32 atomics into a zeroed buffer would save the second launch but not the memset, and would
sum in a different order on every run. `split_k_epilogue` (the repacked kernels') keeps the fixed order
without the second launch: the slice that finishes a tile last, found by a self-resetting ticket counter,
does the sum.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shared.kernels.launch import cdiv


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere: the interpreter's stand-in)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@triton.jit
def _split_k_sum_kernel(P, BIAS, OUT, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(P + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=ok)


TICKETS = 1 << 16  # output tiles one launch of a kernel with `split_k_epilogue` may have


def split_k_tickets(device: torch.device) -> torch.Tensor:
    """The int32 counters `split_k_epilogue` takes tickets from, one buffer per device and stream: every launch
    leaves them at zero, so kernels that follow each other on a stream share it (CUDA-graph replays too)."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    if key not in _TICKETS:  # kept for good: a launch in flight may still count on it
        _TICKETS[key] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return _TICKETS[key]


_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}


@triton.jit
def split_k_epilogue(acc, offs, ok, OUT, PART, TICKETS, ticket, pid_k, MN, N, BIAS, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    """Store a program's fp32 sum `acc` over its slice of K (the slices: grid axis 1) for the output elements
    `offs` of an (M, N) output (MN = M·N; `ok` masks): the whole sum (+ bias) when SPLIT is False. Else its
    partial goes to PART (slice-major), and the slice that finishes a tile last (a ticket counter, acq_rel at
    GPU scope, taken after a barrier) sums the tile's partials in slice order — the same result on every run,
    whichever slice is last — adds the bias, stores, and resets the counter: no second launch and no memset."""
    if SPLIT:
        tl.store(PART + pid_k * MN + offs, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        if tl.atomic_add(TICKETS + ticket, 1) == tl.num_programs(1) - 1:
            acc = tl.zeros_like(acc)
            for s in range(tl.num_programs(1)):  # .cg: from L2, where the other slices' stores are
                acc += tl.load(PART + s * MN + offs, mask=ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(BIAS + offs % N, mask=ok, other=0.0).to(tl.float32)
            tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=ok)
            tl.atomic_xchg(TICKETS + ticket, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=ok)


def split_k_partials(out: torch.Tensor, split_k: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Where a split-K kernel writes: `out` itself when one program sums all of K and there is no bias,
    else a (split_k, M, N) fp32 buffer for `split_k_reduce`."""
    if split_k == 1 and bias is None:
        return out
    return torch.empty(split_k, *out.shape, device=out.device, dtype=torch.float32)


def split_k_reduce(partial: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """out = Σ_s partial[s] (+ bias), in a fixed order; nothing to do if the kernel wrote `out` directly."""
    if partial is not out:
        mn, block = out.numel(), 1024
        _split_k_sum_kernel[(cdiv(mn, block),)](partial, bias if bias is not None else partial, out, mn,
                                                out.shape[1], SPLIT_K=partial.shape[0],
                                                HAS_BIAS=bias is not None, BLOCK=block)
    return out
