"""Launch configurations of the kernels: tile sizes, warps and pipeline stages per head_dim and dtype.

The paper fixes none of these (Algorithm 1 only asks that the tiles fit on chip); they are measured. The
kernels pad the head axis of a tile to a power of two (`block_d`); the tables are keyed by head_dim, and
a head_dim without an entry of its own takes its padded width's (96 runs the 128 entry).
`tools/flashattn_sweep.py` re-measures the tables on a GPU and prints new ones to paste here; each table
says where and how its numbers were measured.

Under the Triton interpreter (CPU tensors) every kernel runs on small 16-row tiles, which keeps the tests
fast and exercises many tiles per sequence.
"""

from __future__ import annotations

import torch

from .checks import next_pow2

Config = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)

# Forward, 16-bit inputs, by head_dim.
# Tuned on an H200, 2026-11-30, commit 77cc019: `python -m nano_flashattn.bench --sweep` (head_dims 64, 128);
# head_dim 64 re-tuned on an H200, 2026-12-01, commit d8677e9: `python tools/flashattn_sweep.py
# --sweep-head-dims 64 96`.
FWD_CONFIGS: dict[int, Config] = {
    16: (128, 64, 8, 3),  # not measured: the 32 entry
    32: (128, 64, 8, 3),
    64: (128, 64, 8, 4),
    128: (128, 64, 8, 3),
    256: (64, 64, 4, 2),
}

# Backward, 16-bit inputs, by head_dim: (dK/dV kernel, whose key tile BLOCK_N stays resident;
# dQ kernel, whose query tile BLOCK_M stays resident).
# Tuned on an H200, 2026-11-30, commit 77cc019: `python -m nano_flashattn.bench --sweep` (head_dims 64, 128);
# head_dim 64 re-tuned on an H200, 2026-12-01: every pair of the sweep's candidates, causal, at 4k and 16k
# (the best smaller of the two speeds).
BWD_CONFIGS: dict[int, tuple[Config, Config]] = {
    16: ((32, 128, 4, 3), (128, 32, 4, 3)),  # not measured: the 32 entry
    32: ((32, 128, 4, 3), (128, 32, 4, 3)),
    64: ((32, 128, 4, 3), (64, 64, 4, 3)),
    128: ((64, 128, 8, 3), (128, 64, 8, 3)),
    256: ((32, 64, 4, 1), (64, 32, 4, 1)),
}

# GQA backward: expand K/V per query head when the kv-head grid has fewer than this many programs per SM.
# Tuned on an H200, 2026-11-30, commit 7a1a8ad: `python -m nano_megatron.bench` (1B shape, 8 q / 4 kv heads).
GQA_EXPAND_WAVES = 4

# Flash-Decoding split kernel, 16-bit caches, head_dim <= 128: (BLOCK_N, num_warps, num_stages) by
# (paged, padded head width: 64 for head_dim <= 64, else 128). A paged tile's page lookup feeds its K/V
# addresses, so the pipeline needs more stages to keep two K/V tiles in flight.
# Tuned on an H200, 2026-12-01, commit d8677e9: `python tools/flashattn_sweep.py --sweep-head-dims` (width
# 64 at head_dim 64, width 128 at head_dim 128). Contiguous width 128: (64, 4, 4) and (128, 4, 3) tie at
# head_dim 128, and head_dim 96 reads 3.95 TB/s with the latter against 3.54 with the former (batch 64 x 4k).
DECODE_CONFIGS: dict[tuple[bool, int], tuple[int, int, int]] = {
    (False, 64): (64, 4, 3), (False, 128): (128, 4, 3), (True, 64): (64, 4, 6), (True, 128): (128, 4, 5)}
# Paged, with at least MANY_PROGRAMS programs per SM (large ragged batches: each program streams few tiles,
# and a deep pipeline mostly fills and drains).
# Tuned on an H200, 2026-11-30, commit 7b90774: `python -m nano_vllm.bench` (16 q / 8 kv heads, page 16).
PAGED_MANY_PROGRAMS_CONFIG, MANY_PROGRAMS = (128, 4, 4), 4
# Over an FP8 cache (head_dim <= 128, 16-bit queries): the best of 12 (BLOCK_N, warps, stages) candidates at
# 64 x 16k (767 us against 804-1,349 for the others; 1 x 64k and 1 x 4k within 3% of their best), H100,
# 2026-12-07, llama3-8b heads, page 16; `python -m nano_quant.bench_kv kernel.sweep=true` times candidates.
# Not faster on the same card: 6 or 7 stages, (64, 4, 8 / 10), (256, 4, 3), a cap of 168 or 128 registers
# (more programs an SM, but spills: 5-20% slower); nano_quant's README says what the profiler showed.
FP8_DECODE_CONFIG = (128, 4, 5)
# Split count: aim for `waves` programs per SM, no slice shorter than `min_split_tiles` key tiles.
# Tuned on an H200, 2026-11-30, commit 77cc019: `python -m nano_flashattn.bench --sweep` (b1 x 64k, b64 x 4k).
DECODE_TUNING = {"waves": 1, "min_split_tiles": 4}
# Over an FP8 cache: two waves, no slice under two tiles. Measured on an H100, 2026-12-07 (CUDA-graph
# replays of `decode_forward`, llama3-8b / qwen3-0.6b heads, page 16, the FP8_DECODE_CONFIG tile): at one
# wave the batches that nearly fill the SMs once run one slice per (sequence, kv head), a pipeline of 4
# warps alone on its SM; a second wave gives 16 x 8k 135.6 -> 116.6 us, 8 x 8k 73.7 -> 71.3, 1 x 4k
# 19.6 -> 17.1 (16 slices), 1 x 64k 73.5 -> 71.8 (32 slices), and leaves 64 x 16k at one slice.
FP8_DECODE_TUNING = {"waves": 2, "min_split_tiles": 2}


def block_d(head_dim: int) -> int:
    """The tile's head axis: head_dim padded to a power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, next_pow2(head_dim))


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a small pretend GPU, so the tests take the split and GQA paths
    return torch.cuda.get_device_properties(device).multi_processor_count


def fwd_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> Config:
    if device.type != "cuda":
        return 16, 16, 4, 1
    if dtype == torch.float32:  # no fp32 tensor-core path (ieee products): smaller tiles fit registers
        return (64, 32, 4, 2) if head_dim <= 128 else (32, 32, 4, 1)
    return FWD_CONFIGS.get(head_dim) or FWD_CONFIGS[block_d(head_dim)]


def bwd_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[Config, Config]:
    if device.type != "cuda":
        return (16, 16, 4, 1), (16, 16, 4, 1)
    if dtype == torch.float32:
        return (32, 64, 4, 1), (64, 32, 4, 1)
    return BWD_CONFIGS.get(head_dim) or BWD_CONFIGS[block_d(head_dim)]


def decode_config(head_dim: int, dtype: torch.dtype, device: torch.device, paged: bool,
                  programs: int = 0, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel; `fp8`: over an FP8 cache."""
    if device.type != "cuda":
        return 16, 4, 1
    if dtype == torch.float32:
        return 32, 4, 2
    if head_dim > 128:
        return 32, 4, 3
    if fp8:  # a tile holds half the bytes: longer tiles keep as many bytes in flight
        return FP8_DECODE_CONFIG
    if paged and programs >= MANY_PROGRAMS * num_sms(device):
        return PAGED_MANY_PROGRAMS_CONFIG
    return DECODE_CONFIGS[paged, decode_width(head_dim)]


def decode_width(head_dim: int) -> int:
    """The DECODE_CONFIGS column of a head_dim <= 128: 64 up to 64, else 128."""
    return 64 if head_dim <= 64 else 128
