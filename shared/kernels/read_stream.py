"""A kernel that only reads: the read-only stream ceiling of `shared.bench.measure_read_bandwidth`.

Each program walks the buffer with a stride of the grid, adds every 32-bit word it loads into a register
tile, and writes one word at the end: the traffic is the buffer's bytes read, nothing else. Decode steps
read their weights and K/V the same way, so this, not a copy (a write per read), bounds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _read_stream(words, out, n, BLOCK: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(words + offs, mask=offs < n, other=0)
    tl.store(out + pid, tl.sum(acc, axis=0))


def read_stream(words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Sum (mod 2^32) of each program's share of `words` (int32, contiguous) into `out` (one per program)."""
    _read_stream[(out.numel(),)](words, out, words.numel(), BLOCK=4096, num_warps=8)
    return out
