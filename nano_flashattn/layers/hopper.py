"""Hopper (sm_90) forward and backward: FlashAttention-2's Algorithms 1 and 2 with the memory path of
FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608), as a performance layer over `forward.py` and
`backward.py`.

Same mathematics as the paper path (online softmax in base 2, log2(e) folded into the scale, masks only on
the tiles that need them: `forward.tile_range` splits the key axis into masked / unmasked / masked runs);
what changes in the forward is how tiles move and how the loop is scheduled, each a compile-time knob of
`HopperConfig`:

* TMA (FA3 §3.1, "producer-consumer asynchrony"): Q, K and V tiles arrive by the Tensor Memory Accelerator
  through tensor descriptors made on the device, one per (sequence, head) whose shape ends at the
  sequence end: loads past it read zeros and the O store past it is clipped by the hardware, so dense and
  packed variable-length batches need no row masks on loads or stores.
* warp specialisation (FA3 §3.1): `tl.range(..., warp_specialize=True)` lets Triton split the key loop into
  a producer (TMA) and consumer warpgroups (wgmma + softmax). Triton 3.9, for sm_90, splits only a
  kernel's single loop without branches, at num_warps=4 (the consumers then take 8 more):
  `two_phase=False` gives it that loop, masking every tile; elsewhere the flag compiles to the plain
  kernel. Packed batches run without it (their grid needs an early exit, a branch).
* two query halves (FA3 §3.2, "intra-warpgroup overlapping"): `split_m` runs the tile as two independent
  BLOCK_M / 2 halves that share each K/V tile, so the softmax of one half can overlap the other's GEMMs.
* the K/V pipeline depth (`num_stages`) and multi-buffering of the accumulator.

`hopper_ws.py` takes dense head_dim 128 forwards ahead of this one (FA3's warp specialisation in Gluon, which
Triton's `tl.range(warp_specialize=True)` above cannot express for this loop).

`hopper_forward` takes and returns exactly what `forward.attention_forward` does (out, and the natural-log
LSE as (heads_q, total_q) fp32); `enable()` registers it at the "forward" point (dispatch.py) for the calls
`applies` accepts (CUDA sm_90, fp16/bf16, contiguous rows, no paged KV; head_dims ENABLED_HEAD_DIMS =
64/96/128); head_dim 96 is held as 64 + 32 parts, each product over the head axis two products
(split_head.py's split). Every program makes its own descriptors, one per (sequence, head); a dense batch of
whole tiles up to HOST_DESCRIPTORS_UP_TO keys (head_dim 64's forward: any length) reads through descriptors
made once on the host instead.
`tools/flashattn_hopper_probe.py` checks which knobs this Triton compiles on the GPU at hand and times them
against cuDNN. `use_tma=False` swaps the descriptors for plain pointer loads, the same arithmetic.

`hopper_backward` is the paper path's deterministic two-kernel backward (no atomics, same sums in the same
order) with its streamed tiles loaded by TMA: Q_i and dO_i in the dK/dV kernel, K_j and V_j in the dQ
kernel; head_dim 96 is held as 64 + 32 parts (split_head.py's split, one descriptor per part).
`enable_backward()` registers it for the calls `backward_applies` accepts (CUDA sm_90, fp16/bf16, head_dim
64/96/128). Both register on import (the forward at head_dims 64, 96 and 128, where it measured faster than
the paper path and split_head); `disable()` / `disable_backward()` hand their calls back.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..backward import launch_dkdv_then_dq, preprocess
from ..checks import cdiv, next_pow2
from ..dispatch import REGISTRY
from ..forward import LN2_C, LOG2E, seq_bounds, tile_range, visible
from ..launch import is_sm90, tma_ready

HEAD_DIMS = (64, 96, 128)
DTYPES = (torch.float16, torch.bfloat16)
HAS_TENSOR_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor")
try:
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_HOST_DESCRIPTORS = True
except ImportError:  # an older Triton: every program makes its own descriptors
    HAS_HOST_DESCRIPTORS = False


@dataclass(frozen=True)
class HopperConfig:
    """Launch knobs of `_hopper_fwd_kernel` (all compile-time)."""

    block_m: int = 128  # query rows per program (split in two halves when split_m)
    block_n: int = 128  # key rows per loop step
    num_warps: int = 8
    num_stages: int = 2  # K/V tiles in flight (the software pipeline's depth)
    warp_specialize: bool = False  # producer / consumer warps (applied with two_phase=False, num_warps=4)
    split_m: bool = False  # two independent BLOCK_M / 2 query halves per K/V tile
    two_phase: bool = True  # masked / unmasked / masked key loops; False: one loop, every tile masked
    disallow_acc_multi_buffer: bool = False  # tl.range's knob, on the unmasked key loop
    use_tma: bool = True  # tensor-descriptor (TMA) loads and O store; False: pointer loads
    host_descriptors: bool = True  # HOST_DESCRIPTORS_UP_TO's batches: descriptors made once on the host

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0 and value & (value - 1) == 0):
                raise ValueError(f"HopperConfig.{name} must be a positive power of two, got {value!r}")
        if not (isinstance(self.num_stages, int) and self.num_stages > 0):
            raise ValueError(f"HopperConfig.num_stages must be a positive int, got {self.num_stages!r}")
        if self.block_m < (32 if self.split_m else 16) or self.block_n < 16:
            raise ValueError(f"HopperConfig: block_m >= {32 if self.split_m else 16} and block_n >= 16 "
                             f"(tl.dot's smallest tile per half), got {self.block_m} and {self.block_n}")


# The fastest of 3-5 tile / stage variants per head_dim against the default forward (the paper path; split_head
# at 96) at the bench's shapes (hidden 2048, 16k tokens, 4k and 16k, causal and not; H200, 2026-12-02):
# 128 x 128 x 3 stages at 128 (1.10-1.19x the paper path), 128 x 64 x 3 at 96 (1.07-1.11x split_head's),
# 128 x 64 x 3 at 64 (0.96-1.02x with per-program descriptors; with host-made ones at 4k, 1.05-1.07x, so
# `enable()` takes head_dim 64 too). 256-row tiles at 16 warps ran 0.75-0.89x (hd64) and 0.82-0.90x (hd128)
# of these, split query halves 0.38-0.41x (hd64).
DEFAULT_CONFIGS: dict[int, HopperConfig] = {
    64: HopperConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    96: HopperConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    128: HopperConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
}
ENABLED_HEAD_DIMS = (64, 96, 128)  # where the layer measured faster than the default forward
# Descriptors made on the host, once a call (FA3's way), instead of by every program on the device (each a
# write to global memory and a tensormap fence before its first load): dense batches whose lengths are whole
# tiles, up to this many keys. Measured (H200, 2026-12-02, hidden 2048, 16k tokens, medians of three
# interleaved runs): at 4k +3-7% forward, +1-3% backward (hd96 / 128); at 16k, where a program's loop is
# four times longer, -1-5%: there the device-made ones stay.
HOST_DESCRIPTORS_DEFAULT = 8192
HOST_DESCRIPTORS_UP_TO = HOST_DESCRIPTORS_DEFAULT  # the bench's --no-host-descriptors sets 0
# ...except head_dim 64's forward, which reads through them at every length: at 16k +3% over the device-made
# ones, causal and not (H200, 2026-12-02, medians of three alternating runs; hd96 -1..+1%, hd128 +1.5% in
# that run but -1..-5% in the one above).
HOST_DESCRIPTORS_ANY_LENGTH = (64,)
INTERPRETER_CONFIG = HopperConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
# Backward tiles by head_dim: ((BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel, the same of
# the dQ kernel). Measured on an H200, 2026-12-02, each of tools/flashattn_sweep.py's dK/dV and dQ
# candidates with the other kernel's tile held, at 4k and 16k, causal and not (the best worst ratio to SDPA
# flash): 64 and 128 keep the paper path's tables (configs.BWD_CONFIGS); 96 keeps split_head's dK/dV tile
# and takes a 64 x 64 dQ tile (1.20x SDPA flash at its worst shape, against 1.09x with split_head's). dQ
# tiles streaming 128 K/V rows ran 0.67-0.94x of it at 96, 2 stages for both kernels 0.95-1.04x. With
# host-made descriptors, 2 stages for the dQ kernel alone: 1.22-1.38x SDPA flash against 1.19-1.39x
# (H200, 2026-12-02, docs/results/nano_flashattn_hd96_bwd_tiles.json).
BWD_CONFIGS: dict[int, tuple[tuple[int, int, int, int], tuple[int, int, int, int]]] = {
    64: ((32, 128, 4, 3), (64, 64, 4, 3)),
    96: ((64, 64, 4, 3), (64, 64, 4, 2)),
    128: ((64, 128, 8, 3), (128, 64, 8, 3)),
}


@triton.jit
def _rows(desc, base, row0, n, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr,
          col=0):
    """Rows [row0, row0 + BLOCK) of one sequence's (n, HEAD_DIM) slice; rows past n read 0 (what TMA does).
    A host descriptor spans every sequence and head: row0 then counts from the batch's first row and `col`
    is the head's first column."""
    if USE_TMA:
        x = desc.load([row0, col])
    else:
        r = row0 + tl.arange(0, BLOCK)
        x = tl.load(base + r[:, None].to(tl.int64) * stride_t + tl.arange(0, HEAD_DIM)[None, :],
                    mask=r[:, None] < n, other=0.0)
    return x


@triton.jit
def _store_rows(desc, base, x, row0, n, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                USE_TMA: tl.constexpr, col=0):
    if USE_TMA:
        desc.store([row0, col], x)  # clipped at the descriptor's shape: rows past n are not written
    else:
        r = row0 + tl.arange(0, BLOCK)
        tl.store(base + r[:, None].to(tl.int64) * stride_t + tl.arange(0, HEAD_DIM)[None, :], x,
                 mask=r[:, None] < n)


@triton.jit
def _step(acc, acc_b, l_i, m_i, q, q_b, k, k_b, v, v_b, offs_m, offs_n, qk_scale, shift, lo_w, hi_w, n,
          MASKED: tl.constexpr, D1: tl.constexpr):
    """Algorithm 1, lines 8-10, for one query tile and one K/V tile (k row-major: S = q k^T); with D1 > 0 the
    head axis is two parts (S = q k^T + q_b k_b^T, O and O_b updated by the same P)."""
    s = tl.dot(q, tl.trans(k))
    if D1 > 0:
        s = tl.dot(q_b, tl.trans(k_b), s)
    if MASKED:
        s = tl.where(visible(offs_m, offs_n, shift, lo_w, hi_w, n), s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: p stays 0
        p = tl.math.exp2(s - m_use[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
        p = tl.math.exp2(s * qk_scale - m_use[:, None])  # one FMA + one exp2 per score
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    if D1 > 0:
        acc_b = tl.dot(p.to(v.dtype), v_b, acc_b * alpha[:, None])
    return acc, acc_b, l_i, m_new


@triton.jit
def _kv_loop(acc0, acc0b, l0, m0, acc1, acc1b, l1, m1, q0, q0b, q1, q1b, kd0, kd1, vd0, vd1, k_base, v_base,
             stride_kt, offs_m0, offs_m1, lo, hi, n, shift, lo_w, hi_w, qk_scale, D0: tl.constexpr,
             D1: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SPLIT_M: tl.constexpr,
             WARP_SPECIALIZE: tl.constexpr, DISALLOW_ACC_MULTI_BUFFER: tl.constexpr, USE_TMA: tl.constexpr,
             k_row=0, k_col=0):
    """Algorithm 1, lines 6-11, over key tiles [lo, hi); a second query half (SPLIT_M) shares each K/V
    tile. k_row, k_col: the sequence's first row and the kv head's first column in a host descriptor."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE,
                            disallow_acc_multi_buffer=DISALLOW_ACC_MULTI_BUFFER):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, k_b = _load_parts(kd0, kd1, k_base, k_row + start_n, n, stride_kt, BLOCK_N, D0, D1, USE_TMA, k_col)
        v, v_b = _load_parts(vd0, vd1, v_base, k_row + start_n, n, stride_kt, BLOCK_N, D0, D1, USE_TMA, k_col)
        acc0, acc0b, l0, m0 = _step(acc0, acc0b, l0, m0, q0, q0b, k, k_b, v, v_b, offs_m0, offs_n, qk_scale,
                                    shift, lo_w, hi_w, n, MASKED, D1)
        if SPLIT_M:
            acc1, acc1b, l1, m1 = _step(acc1, acc1b, l1, m1, q1, q1b, k, k_b, v, v_b, offs_m1, offs_n,
                                        qk_scale, shift, lo_w, hi_w, n, MASKED, D1)
    return acc0, acc0b, l0, m0, acc1, acc1b, l1, m1


@triton.jit
def _finish(acc, acc_b, l_i, m_i, od0, od1, o_base, LSE, offs_m, row0, q_len, stride_qt, HALF_M: tl.constexpr,
            D0: tl.constexpr, D1: tl.constexpr, USE_TMA: tl.constexpr, q_row=0, q_col=0):
    """Algorithm 1, lines 12-15: O = acc / l, L = m + log l (natural log); a row with no key: O = 0,
    L = -inf."""
    empty = l_i == 0.0
    l_i = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * LN2_C)
    _store_rows(od0, o_base, (acc / l_i[:, None]).to(o_base.dtype.element_ty), q_row + row0, q_len, stride_qt,
                HALF_M, D0, USE_TMA, q_col)
    if D1 > 0:
        _store_rows(od1, o_base + D0, (acc_b / l_i[:, None]).to(o_base.dtype.element_ty), q_row + row0, q_len,
                    stride_qt, HALF_M, D1, USE_TMA, q_col)
    tl.store(LSE + offs_m, lse, mask=offs_m < q_len)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group", "window_left", "window_right",
                               "stride_lse_h"])
def _hopper_fwd_kernel(Q, K, V, Out, LSE, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, group, qk_scale,
                       window_left, window_right, stride_qt, stride_qh, stride_kt, stride_kh, stride_lse_h,
                       D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       VARLEN: tl.constexpr, REVERSE: tl.constexpr, SPLIT_M: tl.constexpr,
                       TWO_PHASE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                       DISALLOW_ACC_MULTI_BUFFER: tl.constexpr, USE_TMA: tl.constexpr, QD0=None, QD1=None,
                       KD0=None, KD1=None, VD0=None, VD1=None, OD0=None, OD1=None,
                       HOST_DESC: tl.constexpr = False):
    """One BLOCK_M query tile of one head of one sequence; grid (cdiv(max_seqlen_q, BLOCK_M), heads_q,
    batch). The head axis is D0 (+ D1: 96 = 64 + 32, as the backward). HOST_DESC: Q/K/V/O through the
    host-made descriptors QD0 ... OD1 (per head axis part, over every row and head) instead of four made on
    the device by each program."""
    HALF_M: tl.constexpr = BLOCK_M // 2 if SPLIT_M else BLOCK_M
    h, b = tl.program_id(1), tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN)
    # causal (REVERSE): the heaviest query tiles first, so the tail of the grid is short
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0) if REVERSE else tl.program_id(0)) * BLOCK_M
    # a dense grid has no tile past its sequence; warp specialisation fails on the early exit's branch
    if VARLEN:  # noqa: SIM102 (a compile-time branch: no early exit is compiled for dense batches)
        if start_m >= q_len:
            return
    q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
    o_base = Out + q_start.to(tl.int64) * stride_qt + h * stride_qh
    kv_off = k_start.to(tl.int64) * stride_kt + (h // group) * stride_kh
    k_base, v_base = K + kv_off, V + kv_off
    # one descriptor per (sequence, head, head-axis part): its shape ends where the sequence ends
    if HOST_DESC:  # no partial tiles (the launcher checks): a tile never crosses into the next sequence
        qd0, qd1, od0, od1, kd0, kd1, vd0, vd1 = QD0, QD1, OD0, OD1, KD0, KD1, VD0, VD1
        q_row, q_col, k_row, k_col = q_start, h * (D0 + D1), k_start, (h // group) * (D0 + D1)
    else:
        qd0, qd1 = _descs(q_base, q_len, stride_qt, HALF_M, D0, D1, USE_TMA)
        od0, od1 = _descs(o_base, q_len, stride_qt, HALF_M, D0, D1, USE_TMA)
        kd0, kd1 = _descs(k_base, k_len, stride_kt, BLOCK_N, D0, D1, USE_TMA)
        vd0, vd1 = _descs(v_base, k_len, stride_kt, BLOCK_N, D0, D1, USE_TMA)
        q_row, q_col, k_row, k_col = 0, 0, 0, 0
    offs_m0 = start_m + tl.arange(0, HALF_M)
    offs_m1 = offs_m0 + HALF_M
    q0, q0b = _load_parts(qd0, qd1, q_base, q_row + start_m, q_len, stride_qt, HALF_M, D0, D1, USE_TMA, q_col)
    acc0 = tl.zeros([HALF_M, D0], tl.float32)
    acc0b = acc0
    if D1 > 0:
        acc0b = tl.zeros([HALF_M, D1], tl.float32)
    l0 = tl.zeros([HALF_M], tl.float32)
    m0 = tl.full([HALF_M], float("-inf"), tl.float32)
    if SPLIT_M:
        q1, q1b = _load_parts(qd0, qd1, q_base, q_row + start_m + HALF_M, q_len, stride_qt, HALF_M, D0, D1,
                              USE_TMA, q_col)
    else:
        q1, q1b = q0, q0b  # unused
    acc1, acc1b, l1, m1 = acc0, acc0b, l0, m0

    diag = k_len - q_len  # bottom-right alignment, as the paper path
    r1 = tl.minimum(start_m + BLOCK_M, q_len)
    lo, full_lo, full_hi, hi = tile_range(start_m, r1, shift=diag, lo_w=window_left, hi_w=window_right,
                                          n=k_len, BLOCK=BLOCK_N)
    if TWO_PHASE:  # as forward.py: left window edge (masked), fully visible middle, diagonal / end (masked)
        acc0, acc0b, l0, m0, acc1, acc1b, l1, m1 = _kv_loop(
            acc0, acc0b, l0, m0, acc1, acc1b, l1, m1, q0, q0b, q1, q1b, kd0, kd1, vd0, vd1, k_base, v_base,
            stride_kt, offs_m0, offs_m1, lo, full_lo, k_len, diag, window_left, window_right, qk_scale, D0, D1,
            BLOCK_N, True, SPLIT_M, False, False, USE_TMA, k_row, k_col)
        acc0, acc0b, l0, m0, acc1, acc1b, l1, m1 = _kv_loop(
            acc0, acc0b, l0, m0, acc1, acc1b, l1, m1, q0, q0b, q1, q1b, kd0, kd1, vd0, vd1, k_base, v_base,
            stride_kt, offs_m0, offs_m1, full_lo, full_hi, k_len, diag, window_left, window_right, qk_scale, D0,
            D1, BLOCK_N, False, SPLIT_M, WARP_SPECIALIZE, DISALLOW_ACC_MULTI_BUFFER, USE_TMA, k_row,
            k_col)
        acc0, acc0b, l0, m0, acc1, acc1b, l1, m1 = _kv_loop(
            acc0, acc0b, l0, m0, acc1, acc1b, l1, m1, q0, q0b, q1, q1b, kd0, kd1, vd0, vd1, k_base, v_base,
            stride_kt, offs_m0, offs_m1, full_hi, hi, k_len, diag, window_left, window_right, qk_scale, D0, D1,
            BLOCK_N, True, SPLIT_M, False, False, USE_TMA, k_row, k_col)
    else:  # one loop, every tile masked: Triton warp-specialises only a kernel's single, branch-free loop
        acc0, acc0b, l0, m0, acc1, acc1b, l1, m1 = _kv_loop(
            acc0, acc0b, l0, m0, acc1, acc1b, l1, m1, q0, q0b, q1, q1b, kd0, kd1, vd0, vd1, k_base, v_base,
            stride_kt, offs_m0, offs_m1, lo, hi, k_len, diag, window_left, window_right, qk_scale, D0, D1,
            BLOCK_N, True, SPLIT_M, WARP_SPECIALIZE, DISALLOW_ACC_MULTI_BUFFER, USE_TMA, k_row, k_col)

    lse_base = LSE + h * stride_lse_h + q_start
    _finish(acc0, acc0b, l0, m0, od0, od1, o_base, lse_base, offs_m0, start_m, q_len, stride_qt, HALF_M, D0, D1,
            USE_TMA, q_row, q_col)
    if SPLIT_M:
        _finish(acc1, acc1b, l1, m1, od0, od1, o_base, lse_base, offs_m1, start_m + HALF_M, q_len, stride_qt,
                HALF_M, D0, D1, USE_TMA, q_row, q_col)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the descriptors `tl.make_tensor_descriptor` writes on the device."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_allocator() -> None:
    """Device-made descriptors need triton's allocator; set ours unless the caller set one (per thread)."""
    try:
        from triton.runtime import _allocation

        unset = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):  # a Triton without the context variable: set it every time
        unset = True
    if unset:
        triton.set_allocator(_scratch)


def hopper_forward(q, k, v, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, block_table, scale,
                   window_left, window_right, config: HopperConfig | tuple | None = None):
    """FA2 Algorithm 1 with FA3's TMA loads and scheduling knobs; the arguments and results of
    `forward.attention_forward` (paged KV excepted: `block_table` must be None). config: a HopperConfig, or
    the paper path's (BLOCK_M, BLOCK_N, num_warps, num_stages) with the other knobs at their defaults."""
    if block_table is not None:
        raise ValueError("block_table: the Hopper forward reads contiguous K/V only; use the paper path")
    total_q, heads_q, head_dim = q.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} for the Hopper forward, got {head_dim}")
    d0, d1 = head_parts(head_dim)
    interpret = q.device.type != "cuda"
    cfg = config or (INTERPRETER_CONFIG if interpret else DEFAULT_CONFIGS[head_dim])
    if isinstance(cfg, tuple) and len(cfg) == 4:
        cfg = HopperConfig(block_m=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
    if not isinstance(cfg, HopperConfig):
        raise TypeError(f"config must be a HopperConfig or a (BLOCK_M, BLOCK_N, num_warps, num_stages) tuple, "
                        f"got {type(cfg).__name__}")
    out = torch.empty_like(q)
    lse = torch.empty(heads_q, total_q, dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0:
        return out, lse
    if cfg.warp_specialize and cu_seqlens_q is not None:  # packed batches keep the early exit (see kernel)
        cfg = dataclasses.replace(cfg, warp_specialize=False)
    block_q = cfg.block_m // 2 if cfg.split_m else cfg.block_m
    descs = _host_descs(cfg.use_tma and cfg.host_descriptors, cu_seqlens_q, (seqlen_q, cfg.block_m),
                        (seqlen_k, cfg.block_n), d0, d1, any_length=head_dim in HOST_DESCRIPTORS_ANY_LENGTH,
                        QD=(q, block_q), OD=(out, block_q),
                        KD=(k, cfg.block_n), VD=(v, cfg.block_n))
    host = bool(descs)
    if cfg.use_tma and not interpret and not host:
        _ensure_allocator()
    _hopper_fwd_kernel[(cdiv(seqlen_q, cfg.block_m), heads_q, batch)](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, heads_q // k.shape[-2],
        scale * LOG2E, window_left, window_right, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        lse.stride(0), D0=d0, D1=d1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        VARLEN=cu_seqlens_q is not None, REVERSE=window_right == 0, SPLIT_M=cfg.split_m,
        TWO_PHASE=cfg.two_phase,
        WARP_SPECIALIZE=cfg.warp_specialize, DISALLOW_ACC_MULTI_BUFFER=cfg.disallow_acc_multi_buffer,
        USE_TMA=cfg.use_tma, HOST_DESC=host, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **descs,
    )
    return out, lse


def _host_descs(enabled: bool, cu_seqlens_q, q_tiles: tuple[int, int], k_tiles: tuple[int, int], d0: int,
                d1: int, any_length: bool = False, **tensors: tuple[torch.Tensor, int]) -> dict:
    """The kernels' host-made descriptors, or {} where they do not apply: a dense batch (no cu_seqlens)
    whose lengths are whole tiles (q_tiles, k_tiles: (seqlen, tile rows); a tile then never crosses into the
    next sequence) of at most HOST_DESCRIPTORS_UP_TO keys (any_length: of any length, unless that bound is
    0). For each `NAME=(tensor, block rows)`, NAME0
    (and NAME1): per head axis part, one descriptor over the whole (rows, heads * head_dim) view (part 1's
    view starts d0 columns in), made once per call (FA3 passes its TMA descriptors as kernel parameters
    the same way)."""
    (seqlen_q, tile_q), (seqlen_k, tile_k) = q_tiles, k_tiles
    if not (enabled and HAS_HOST_DESCRIPTORS and cu_seqlens_q is None and seqlen_q % tile_q == 0
            and seqlen_k % tile_k == 0 and HOST_DESCRIPTORS_UP_TO > 0
            and (any_length or max(seqlen_q, seqlen_k) <= HOST_DESCRIPTORS_UP_TO)):
        return {}
    descs = {}
    for name, (t, block) in tensors.items():
        flat = t.view(t.shape[0], -1)
        descs[name + "0"] = TensorDescriptor.from_tensor(flat, [block, d0])
        if d1:
            descs[name + "1"] = TensorDescriptor.from_tensor(flat[:, d0:], [block, d1])
    return descs


# ------------------------------------------------------------------ backward (Algorithm 2) with TMA loads
#
# The paper path's two kernels (backward.py: dK/dV over key tiles, then dQ over query tiles, no atomics) with
# the streamed tiles (Q_i and dO_i in the dK/dV kernel, K_j and V_j in the dQ kernel) loaded by TMA as
# row-major tiles; a transposed operand (S^T = K_j Q_i^T) is a transposed view of the tile in shared memory,
# which wgmma reads for free. The head axis is one power-of-two part (D1 = 0) or two, D0 + D1 (96 = 64 + 32,
# split_head.py's split: every product over the head axis is two products), with one descriptor per part.
# Both kernels in one launch (the dK/dV and dQ programs of a head side by side in one grid: no second launch,
# no idle tail between the passes) gave bit-identical gradients but measured 0.93-0.97x of the two launches at
# head_dim 64 and 128 and 0.98-1.02x at 96 (H200, 2026-12-02): the fused kernel holds the larger program's
# registers and shared memory in every program. Not kept.


@triton.jit
def _load_parts(d0, d1, base, row0, n, stride_t, BLOCK: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                USE_TMA: tl.constexpr, col=0):
    """Rows [row0, row0 + BLOCK) of one sequence's head axis parts [0, D0) and [D0, D0 + D1) (the second
    returned as the first when D1 = 0, unused)."""
    x0 = _rows(d0, base, row0, n, stride_t, BLOCK, D0, USE_TMA, col)
    x1 = x0
    if D1 > 0:  # a host descriptor of part 1 starts D0 columns in: the same `col`
        x1 = _rows(d1, base + D0, row0, n, stride_t, BLOCK, D1, USE_TMA, col)
    return x0, x1


@triton.jit
def _descs(base, n, stride_t, BLOCK: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, USE_TMA: tl.constexpr):
    """One tensor descriptor per head axis part of one sequence's (n, D0 + D1) rows (the bases without
    TMA)."""
    if USE_TMA:
        d0 = tl.make_tensor_descriptor(base, shape=[n, D0], strides=[stride_t, 1], block_shape=[BLOCK, D0])
        d1 = d0
        if D1 > 0:
            d1 = tl.make_tensor_descriptor(base + D0, shape=[n, D1], strides=[stride_t, 1],
                                           block_shape=[BLOCK, D1])
    else:
        d0, d1 = base, base
    return d0, d1


@triton.jit
def _store_parts(base, x0, x1, rows, n, stride_t, D0: tl.constexpr, D1: tl.constexpr):
    """Store rows `rows` (< n) of the head axis parts [0, D0) and [D0, D0 + D1)."""
    row_ptrs = base + rows[:, None].to(tl.int64) * stride_t
    tl.store(row_ptrs + tl.arange(0, D0)[None, :], x0.to(base.dtype.element_ty), mask=rows[:, None] < n)
    if D1 > 0:
        tl.store(row_ptrs + D0 + tl.arange(0, D1)[None, :], x1.to(base.dtype.element_ty),
                 mask=rows[:, None] < n)


@triton.jit
def _dkdv_tiles(dk0, dk1, dv0, dv1, k0, k1, v0, v1, qd0, qd1, dod0, dod1, q_base, do_base, lse_base,
                delta_base, offs_n, lo, hi, q_len, shift, lo_w, hi_w, qk_scale, stride_qt, D0: tl.constexpr,
                D1: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr, q_row=0,
                q_col=0):
    """backward._dkdv_tiles: Algorithm 2, lines 8-17, for one key tile K_j, V_j over the query tiles
    [lo, hi)."""
    for start_m in tl.range(lo, hi, BLOCK_M):  # line 8
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q0, q1 = _load_parts(qd0, qd1, q_base, q_row + start_m, q_len, stride_qt, BLOCK_M, D0, D1, USE_TMA,
                             q_col)  # line 9
        do0, do1 = _load_parts(dod0, dod1, do_base, q_row + start_m, q_len, stride_qt, BLOCK_M, D0, D1, USE_TMA,
                               q_col)
        if MASKED:
            lse2 = tl.load(lse_base + offs_m, mask=offs_m < q_len, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=offs_m < q_len, other=0.0)
        else:  # a fully visible tile lies inside the sequence
            lse2 = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        s_t = tl.dot(k0, tl.trans(q0))  # line 10: S^T (keys, queries) = K0 Q0^T (+ K1 Q1^T)
        if D1 > 0:
            s_t = tl.dot(k1, tl.trans(q1), s_t)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])  # line 11: P = exp(S - L), recomputed
        if MASKED:
            p_t = tl.where(visible(offs_n, offs_m, shift, lo_w, hi_w, q_len), p_t, 0.0)
        pd = p_t.to(do0.dtype)
        dv0 = tl.dot(pd, do0, dv0)  # line 12: dV_j += P^T dO_i, per part
        dp_t = tl.dot(v0, tl.trans(do0))  # line 13: dP = dO_i V_j^T
        if D1 > 0:
            dv1 = tl.dot(pd, do1, dv1)
            dp_t = tl.dot(v1, tl.trans(do1), dp_t)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q0.dtype)  # line 14: dS = P o (dP - D_i)
        dk0 = tl.dot(ds_t, q0, dk0)  # line 16: dK_j += dS^T Q_i, per part
        if D1 > 0:
            dk1 = tl.dot(ds_t, q1, dk1)
    return dk0, dk1, dv0, dv1


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group", "window_left", "window_right",
                               "stride_lse_h"])
def _bwd_dkdv_kernel(Q, K, V, DO, LSE2, Delta, DK, DV, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, group,
                     qk_scale, scale, window_left, window_right, stride_qt, stride_qh, stride_kt, stride_kh,
                     stride_lse_h, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr, QD0=None, QD1=None,
                     DOD0=None, DOD1=None, KD0=None, KD1=None, VD0=None, VD1=None,
                     HOST_DESC: tl.constexpr = False):
    """backward._bwd_dkdv_kernel (Algorithm 2, lines 6-18): one key tile of one kv head of one sequence,
    its query heads' Q and dO streamed by TMA (HOST_DESC: through QD0 ... DOD1, made on the host)."""
    hk, b = tl.program_id(1), tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN)
    start_n = tl.program_id(0) * BLOCK_N
    if start_n >= k_len:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kv_base = k_start.to(tl.int64) * stride_kt + hk * stride_kh
    k0, k1 = _load_parts(K, K, K + kv_base, start_n, k_len, stride_kt, BLOCK_N, D0, D1, False)  # line 6
    v0, v1 = _load_parts(V, V, V + kv_base, start_n, k_len, stride_kt, BLOCK_N, D0, D1, False)
    dk0, dv0 = tl.zeros([BLOCK_N, D0], tl.float32), tl.zeros([BLOCK_N, D0], tl.float32)  # line 7
    dk1, dv1 = dk0, dv0
    if D1 > 0:
        dk1, dv1 = tl.zeros([BLOCK_N, D1], tl.float32), tl.zeros([BLOCK_N, D1], tl.float32)
    diag = k_len - q_len  # the transposed view of the forward's mask, as backward.py
    lo, full_lo, full_hi, hi = tile_range(start_n, tl.minimum(start_n + BLOCK_N, k_len), shift=-diag,
                                          lo_w=window_right, hi_w=window_left, n=q_len, BLOCK=BLOCK_M)
    for g in range(group):  # every query head that reads this kv head adds into the same dK, dV
        h = hk * group + g
        q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
        do_base = DO + q_start.to(tl.int64) * stride_qt + h * stride_qh
        if HOST_DESC:
            qd0, qd1, dod0, dod1, q_row, q_col = QD0, QD1, DOD0, DOD1, q_start, h * (D0 + D1)
        else:
            qd0, qd1 = _descs(q_base, q_len, stride_qt, BLOCK_M, D0, D1, USE_TMA)
            dod0, dod1 = _descs(do_base, q_len, stride_qt, BLOCK_M, D0, D1, USE_TMA)
            q_row, q_col = 0, 0
        lse_base, delta_base = LSE2 + h * stride_lse_h + q_start, Delta + h * stride_lse_h + q_start
        for run in tl.static_range(3):  # masked / unmasked / masked query runs (forward.tile_range)
            dk0, dk1, dv0, dv1 = _dkdv_tiles(
                dk0, dk1, dv0, dv1, k0, k1, v0, v1, qd0, qd1, dod0, dod1, q_base, do_base, lse_base,
                delta_base,
                offs_n, lo if run == 0 else full_lo if run == 1 else full_hi,
                full_lo if run == 0 else full_hi if run == 1 else hi, q_len, -diag, window_right, window_left,
                qk_scale, stride_qt, D0, D1, BLOCK_M, run != 1, USE_TMA, q_row, q_col)
    _store_parts(DK + kv_base, dk0 * scale, dk1 * scale, offs_n, k_len, stride_kt, D0, D1)  # line 18
    _store_parts(DV + kv_base, dv0, dv1, offs_n, k_len, stride_kt, D0, D1)


@triton.jit
def _dq_tiles(dq0, dq1, q0, q1, do0, do1, lse2, delta, kd0, kd1, vd0, vd1, k_base, v_base, offs_m, lo, hi,
              k_len, shift, lo_w, hi_w, qk_scale, stride_kt, D0: tl.constexpr, D1: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr, k_row=0, k_col=0):
    """backward._dq_tiles: Algorithm 2, line 15, dQ_i += dS_ij K_j over the key tiles [lo, hi), with P and
    dS recomputed (lines 10-14)."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k0, k1 = _load_parts(kd0, kd1, k_base, k_row + start_n, k_len, stride_kt, BLOCK_N, D0, D1, USE_TMA,
                             k_col)
        v0, v1 = _load_parts(vd0, vd1, v_base, k_row + start_n, k_len, stride_kt, BLOCK_N, D0, D1, USE_TMA,
                             k_col)
        s = tl.dot(q0, tl.trans(k0))  # line 10
        if D1 > 0:
            s = tl.dot(q1, tl.trans(k1), s)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])  # line 11
        if MASKED:
            p = tl.where(visible(offs_m, offs_n, shift, lo_w, hi_w, k_len), p, 0.0)
        dp = tl.dot(do0, tl.trans(v0))  # line 13
        if D1 > 0:
            dp = tl.dot(do1, tl.trans(v1), dp)
        ds = (p * (dp - delta[:, None])).to(k0.dtype)  # line 14
        dq0 = tl.dot(ds, k0, dq0)  # line 15, per part
        if D1 > 0:
            dq1 = tl.dot(ds, k1, dq1)
    return dq0, dq1


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group", "window_left", "window_right",
                               "stride_lse_h"])
def _bwd_dq_kernel(Q, K, V, DO, LSE2, Delta, DQ, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, group,
                   qk_scale, scale, window_left, window_right, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_lse_h, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr, QD0=None, QD1=None,
                   DOD0=None, DOD1=None, KD0=None, KD1=None, VD0=None, VD1=None, HOST_DESC: tl.constexpr = False):
    """backward._bwd_dq_kernel: one query tile of one head of one sequence, K and V streamed by TMA
    (HOST_DESC: through KD0 ... VD1, made on the host)."""
    h, b = tl.program_id(1), tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN)
    start_m = tl.program_id(0) * BLOCK_M
    if start_m >= q_len:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    q_off = q_start.to(tl.int64) * stride_qt + h * stride_qh
    q0, q1 = _load_parts(Q, Q, Q + q_off, start_m, q_len, stride_qt, BLOCK_M, D0, D1, False)
    do0, do1 = _load_parts(DO, DO, DO + q_off, start_m, q_len, stride_qt, BLOCK_M, D0, D1, False)
    lse2 = tl.load(LSE2 + h * stride_lse_h + q_start + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(Delta + h * stride_lse_h + q_start + offs_m, mask=m_ok, other=0.0)
    kv_off = k_start.to(tl.int64) * stride_kt + (h // group) * stride_kh
    if HOST_DESC:
        kd0, kd1, vd0, vd1, k_row, k_col = KD0, KD1, VD0, VD1, k_start, (h // group) * (D0 + D1)
    else:
        kd0, kd1 = _descs(K + kv_off, k_len, stride_kt, BLOCK_N, D0, D1, USE_TMA)
        vd0, vd1 = _descs(V + kv_off, k_len, stride_kt, BLOCK_N, D0, D1, USE_TMA)
        k_row, k_col = 0, 0
    dq0 = tl.zeros([BLOCK_M, D0], tl.float32)
    dq1 = dq0
    if D1 > 0:
        dq1 = tl.zeros([BLOCK_M, D1], tl.float32)
    diag = k_len - q_len
    lo, full_lo, full_hi, hi = tile_range(start_m, tl.minimum(start_m + BLOCK_M, q_len), shift=diag,
                                          lo_w=window_left, hi_w=window_right, n=k_len, BLOCK=BLOCK_N)
    for run in tl.static_range(3):
        dq0, dq1 = _dq_tiles(
            dq0, dq1, q0, q1, do0, do1, lse2, delta, kd0, kd1, vd0, vd1, K + kv_off, V + kv_off, offs_m,
            lo if run == 0 else full_lo if run == 1 else full_hi,
            full_lo if run == 0 else full_hi if run == 1 else hi, k_len, diag, window_left, window_right,
            qk_scale, stride_kt, D0, D1, BLOCK_N, run != 1, USE_TMA, k_row, k_col)
    _store_parts(DQ + q_off, dq0 * scale, dq1 * scale, offs_m, q_len, stride_qt, D0, D1)


def head_parts(head_dim: int) -> tuple[int, int]:
    """(D0, D1) of the backward's head axis: (head_dim, 0) for a power of two, else D0 the largest power of
    two below it and D1 the rest (split_head.py's split: 96 = 64 + 32)."""
    if head_dim not in BWD_CONFIGS:
        raise ValueError(f"head_dim must be one of {tuple(BWD_CONFIGS)} for the Hopper backward, "
                         f"got {head_dim}")
    d0 = next_pow2(head_dim) if head_dim & (head_dim - 1) == 0 else next_pow2(head_dim) // 2
    return d0, head_dim - d0


def bwd_config(head_dim: int, dtype: torch.dtype, device: torch.device):
    """The backward's launch configs: BWD_CONFIGS on a GPU, 16-row tiles under the interpreter."""
    if device.type != "cuda":
        return (16, 16, 4, 1), (16, 16, 4, 1)
    return BWD_CONFIGS[head_dim]


def hopper_backward(do, q, k, v, out, lse, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, scale,
                    window_left, window_right, config=None, use_tma: bool = True,
                    host_descriptors: bool = True):
    """backward.attention_backward (Algorithm 2: preprocess, the dK/dV kernel, the dQ kernel, the GQA
    expansion) with the streamed tiles loaded by TMA; same arguments, same results (dq, dk, dv).
    config: ((BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel, the same of the dQ kernel);
    default: BWD_CONFIGS."""
    total_q, head_dim = q.shape[0], q.shape[2]
    d0, d1 = head_parts(head_dim)
    if q.dtype not in DTYPES:
        raise ValueError(f"q.dtype must be one of {DTYPES} for the Hopper backward, got {q.dtype}")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if total_q == 0 or batch == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    cfg1, cfg2 = config or bwd_config(head_dim, q.dtype, q.device)
    do, delta, lse2 = preprocess(do, q, out, lse)  # line 4: D = rowsum(dO o O), and L in base 2
    # the streamed tiles: Q, dO in the dK/dV kernel, K, V in the dQ kernel
    descs = _host_descs(use_tma and host_descriptors, cu_seqlens_q, (seqlen_q, cfg1[0]), (seqlen_k, cfg2[1]),
                        d0, d1, QD=(q, cfg1[0]), DOD=(do, cfg1[0]), KD=(k, cfg2[1]), VD=(v, cfg2[1]))
    host = bool(descs)
    if not host and use_tma and q.is_cuda:
        _ensure_allocator()
    common = dict(Q=q, DO=do, LSE2=lse2, Delta=delta, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  seqlen_q=seqlen_q, seqlen_k=seqlen_k, qk_scale=scale * LOG2E, scale=scale,
                  window_left=window_left, window_right=window_right, stride_qt=q.stride(0),
                  stride_qh=q.stride(1), stride_lse_h=lse.stride(0), D0=d0, D1=d1,
                  VARLEN=cu_seqlens_q is not None, USE_TMA=use_tma, HOST_DESC=host, **descs)
    return launch_dkdv_then_dq(_bwd_dkdv_kernel, _bwd_dq_kernel, q, k, v, dq, dk, dv, common, batch, cfg1,
                               cfg2)


def applies(q, k, v, block_table=None, head_dims: tuple[int, ...] = HEAD_DIMS, **arguments) -> bool:
    """The calls `hopper_forward` takes: CUDA sm_90, fp16/bf16, head_dim in head_dims (of 64/96/128),
    contiguous q/k/v of one dtype, no paged KV cache, and a Triton with tensor descriptors."""
    return (HAS_TENSOR_DESCRIPTORS and block_table is None and q.is_cuda and q.dtype in DTYPES
            and k.dtype == q.dtype and v.dtype == q.dtype and q.shape[-1] in head_dims
            and is_sm90(q.device) and all(tma_ready(t) for t in (q, k, v)) and k.stride() == v.stride())


def enable(config: HopperConfig | None = None) -> Callable[[], None]:
    """Register `hopper_forward` as the "forward" kernel for the calls `applies` accepts (flash_attn_func and
    flash_attn_varlen_func without a block table, then run it on sm_90): head_dims ENABLED_HEAD_DIMS with
    DEFAULT_CONFIGS, or every head_dim of HEAD_DIMS with `config`. Returns the function that removes it;
    enabling again replaces the earlier registration."""
    if config is not None and not isinstance(config, HopperConfig):
        raise TypeError(f"config must be a HopperConfig or None, got {type(config).__name__}")
    disable()
    launch = functools.partial(hopper_forward, config=config) if config else hopper_forward
    head_dims = HEAD_DIMS if config else ENABLED_HEAD_DIMS
    REGISTRY.register("forward", launch, functools.partial(applies, head_dims=head_dims))
    return disable


def disable() -> None:
    """Remove the registration `enable` made (a no-op when there is none)."""
    REGISTRY.remove("forward", __name__)


def enabled() -> bool:
    return REGISTRY.registered("forward", __name__)


def backward_applies(q, k, v, do, **arguments) -> bool:
    """The calls `hopper_backward` takes: CUDA sm_90, fp16/bf16, head_dim 64/96/128, contiguous q/k/v of one
    dtype (and dO of it), and a Triton with tensor descriptors."""
    return do.dtype == q.dtype and applies(q, k, v, head_dims=tuple(BWD_CONFIGS))


def enable_backward() -> Callable[[], None]:
    """Register `hopper_backward` as the "backward" kernel for the calls `backward_applies` accepts (every
    flash_attn_* backward on sm_90 at head_dim 64/96/128, ahead of the split_head layer at 96). Returns the
    function that removes it; enabling again replaces the earlier registration."""
    disable_backward()
    REGISTRY.register("backward", hopper_backward, backward_applies)
    return disable_backward


def disable_backward() -> None:
    """Remove the registration `enable_backward` made (a no-op when there is none)."""
    REGISTRY.remove("backward", __name__)


def backward_enabled() -> bool:
    return REGISTRY.registered("backward", __name__)


enable()  # registered on import: the forward and the backward where they apply
enable_backward()
