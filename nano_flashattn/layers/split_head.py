"""Split head axis — a performance layer: FlashAttention-2's forward and backward (Algorithms 1 and 2) for
head_dims that are a sum of two powers of two, without padding the tile's head axis.

The paper path (forward.py, backward.py) pads a tile's head axis to the next power of two, because Triton's
tiles have power-of-two shapes: head_dim 96 runs the products of 128, a third of every Q K^T and P V
tensor-core instruction spent on zeros. Here a head_dim D = D0 + D1 (D0 the largest power of two below D,
D1 = D - D0 a power of two >= 16: 48, 80, 96, 144, 160, 192) is held as two tiles along the head axis, and
every product over it is two products:

    S  = Q0 K0^T + Q1 K1^T                   (contraction over the head axis: two dots into one S)
    O0 = P V0,   O1 = P V1                   (the head axis is an output axis: two accumulators)

and in the backward likewise dQ, dK, dV in two parts each, dP = dO0 V0^T + dO1 V1^T. Everything else is
the paper path's: online softmax in base 2, tiles split into masked / unmasked runs (`tile_range`), varlen,
GQA, paged K/V in the forward, the deterministic two-kernel backward without atomics (and its GQA expansion),
the same preprocess kernel. Importing this module registers both launchers (dispatch.py's "forward" and
"backward" points) for the head_dims above, behind the Hopper layers; every other call runs the paper
path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .. import configs
from ..backward import launch_dkdv_then_dq, preprocess
from ..checks import HEAD_DIMS, next_pow2
from ..configs import Config
from ..dispatch import REGISTRY
from ..forward import (
    LN2_C,
    LOG2E,
    dot_precision,
    kv_offsets,
    launch_forward,
    load_tile,
    seq_bounds,
    tile_range,
    visible,
)


def split(head_dim: int) -> tuple[int, int] | None:
    """(D0, D1) with D0 + D1 = head_dim, D0 the largest power of two below head_dim and D1 a power of two
    >= 16 (tl.dot's smallest contraction); None when head_dim has no such split."""
    d0 = next_pow2(head_dim) // 2
    d1 = head_dim - d0
    return (d0, d1) if 16 <= d1 < d0 and d1 & (d1 - 1) == 0 else None


SPLIT_HEAD_DIMS = tuple(d for d in HEAD_DIMS if split(d))  # 48, 80, 96, 144, 160, 192


def _parts(head_dim: int) -> tuple[int, int]:
    parts = split(head_dim)
    if parts is None:
        raise ValueError(f"head_dim {head_dim} (q.shape[-1]) has no two-part split; the split kernels take "
                         f"{SPLIT_HEAD_DIMS}")
    return parts

# Launch configs of the split kernels, 16-bit inputs, by head_dim; a head_dim without an entry takes the
# paper path's entry for its padded width (configs.py), which the split tiles fit with room to spare.
# tools/flashattn_sweep.py measures these for the head_dims this layer runs and prints the tables.
# Tuned on an H200, 2026-12-01, commit d8677e9: `python tools/flashattn_sweep.py --sweep-head-dims 64 96`.
FWD_CONFIGS: dict[int, Config] = {96: (128, 64, 4, 3)}
BWD_CONFIGS: dict[int, tuple[Config, Config]] = {96: ((64, 64, 4, 3), (128, 32, 4, 3))}


def fwd_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> Config:
    cfg = FWD_CONFIGS.get(head_dim) if device.type == "cuda" and dtype != torch.float32 else None
    return cfg or configs.fwd_config(head_dim, dtype, device)


def bwd_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[Config, Config]:
    cfg = BWD_CONFIGS.get(head_dim) if device.type == "cuda" and dtype != torch.float32 else None
    return cfg or configs.bwd_config(head_dim, dtype, device)


@triton.jit
def load_halves(base, rows, rows_ok, D0: tl.constexpr, D1: tl.constexpr, MASKED: tl.constexpr,
                TRANS: tl.constexpr):
    """The two parts [0, D0) and [D0, D0 + D1) of the head axis of rows `rows` (element offsets of the row
    starts), as (rows, D) tiles, or (D, rows) with TRANS; rows outside rows_ok read 0 when MASKED."""
    d0, d1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
    if TRANS:
        x0 = load_tile(base + rows[None, :] + d0[:, None], rows_ok[None, :], rows_ok[None, :], MASKED, False)
        x1 = load_tile(base + rows[None, :] + d1[:, None], rows_ok[None, :], rows_ok[None, :], MASKED, False)
    else:
        x0 = load_tile(base + rows[:, None] + d0[None, :], rows_ok[:, None], rows_ok[:, None], MASKED, False)
        x1 = load_tile(base + rows[:, None] + d1[None, :], rows_ok[:, None], rows_ok[:, None], MASKED, False)
    return x0, x1


@triton.jit
def store_halves(base, rows, rows_ok, x0, x1, D0: tl.constexpr, D1: tl.constexpr):
    d0, d1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
    tl.store(base + rows[:, None] + d0[None, :], x0.to(base.dtype.element_ty), mask=rows_ok[:, None])
    tl.store(base + rows[:, None] + d1[None, :], x1.to(base.dtype.element_ty), mask=rows_ok[:, None])


@triton.jit
def _fwd_tiles(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, bt_row, offs_m, lo, hi, n, shift, lo_w, hi_w,
               qk_scale, stride_kt, stride_kp, D0: tl.constexpr, D1: tl.constexpr, BLOCK_N: tl.constexpr,
               PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """forward.fwd_tiles (Algorithm 1, lines 6-11) with the head axis in two parts."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv = kv_offsets(offs_n, bt_row, n, stride_kt, stride_kp, PAGED, PAGE_SIZE)
        k0_t, k1_t = load_halves(k_base, kv, offs_n < n, D0, D1, MASKED, True)
        s = tl.dot(q0, k0_t, input_precision=DOT_PRECISION)  # line 8, S = Q0 K0^T + Q1 K1^T
        s = tl.dot(q1, k1_t, s, input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where(visible(offs_m, offs_n, shift, lo_w, hi_w, n), s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: p stays 0, never NaN
            p = tl.math.exp2(s - m_use[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v0, v1 = load_halves(v_base, kv, offs_n < n, D0, D1, MASKED, False)
        p = p.to(v0.dtype)
        acc0 = tl.dot(p, v0, acc0 * alpha[:, None], input_precision=DOT_PRECISION)  # line 10, per part
        acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc0, acc1, l_i, m_i


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group", "window_left", "window_right", "stride_bt",
                               "stride_lse_h"])
def _split_fwd_kernel(Q, K, V, Out, LSE, cu_seqlens_q, cu_seqlens_k, block_table, seqlen_q, seqlen_k, group,
                      qk_scale, window_left, window_right, stride_qt, stride_qh, stride_kt, stride_kh,
                      stride_kp, stride_bt, stride_lse_h, D0: tl.constexpr, D1: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr, PAGED: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, REVERSE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """forward._fwd_kernel (Algorithm 1, lines 4-15) with the head axis in two parts."""
    pid_m = tl.program_id(0)
    if REVERSE:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < q_len
    q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
    q0, q1 = load_halves(q_base, offs_m * stride_qt, row_ok, D0, D1, True, False)
    if PAGED:
        k_off = (h // group) * stride_kh
        bt_row = block_table + b.to(tl.int64) * stride_bt
    else:
        k_off = k_start.to(tl.int64) * stride_kt + (h // group) * stride_kh
        bt_row = block_table
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, D0], tl.float32)
    acc1 = tl.zeros([BLOCK_M, D1], tl.float32)
    diag = k_len - q_len
    lo, full_lo, full_hi, hi = tile_range(start_m, tl.minimum(start_m + BLOCK_M, q_len), shift=diag,
                                          lo_w=window_left, hi_w=window_right, n=k_len, BLOCK=BLOCK_N)
    for run in tl.static_range(3):  # the left window edge (masked), the visible middle, the diagonal/end
        acc0, acc1, l_i, m_i = _fwd_tiles(
            acc0, acc1, l_i, m_i, q0, q1, K + k_off, V + k_off, bt_row, offs_m,
            lo=lo if run == 0 else full_lo if run == 1 else full_hi,
            hi=full_lo if run == 0 else full_hi if run == 1 else hi, n=k_len, shift=diag, lo_w=window_left,
            hi_w=window_right, qk_scale=qk_scale, stride_kt=stride_kt, stride_kp=stride_kp, D0=D0, D1=D1,
            BLOCK_N=BLOCK_N, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE, MASKED=run != 1, DOT_PRECISION=DOT_PRECISION)
    empty = l_i == 0.0
    l_i = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * LN2_C)
    store_halves(Out + q_start.to(tl.int64) * stride_qt + h * stride_qh, offs_m * stride_qt, row_ok,
                 acc0 / l_i[:, None], acc1 / l_i[:, None], D0, D1)
    tl.store(LSE + h * stride_lse_h + q_start + offs_m, lse, mask=row_ok)


@triton.jit
def _dkdv_tiles(dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, lse_base, delta_base, offs_n, lo, hi,
                q_len, shift, lo_w, hi_w, qk_scale, stride_qt, D0: tl.constexpr, D1: tl.constexpr,
                BLOCK_M: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """backward._dkdv_tiles (Algorithm 2, lines 8-17, rows = keys) with the head axis in two parts."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        ok = offs_m < q_len
        q0_t, q1_t = load_halves(q_base, offs_m * stride_qt, ok, D0, D1, MASKED, True)
        do0, do1 = load_halves(do_base, offs_m * stride_qt, ok, D0, D1, MASKED, False)
        lse2 = load_tile(lse_base + offs_m, ok, ok, MASKED, False)
        delta = load_tile(delta_base + offs_m, ok, ok, MASKED, False)
        s_t = tl.dot(k0, q0_t, input_precision=DOT_PRECISION)  # line 10: S^T = K0 Q0^T + K1 Q1^T
        s_t = tl.dot(k1, q1_t, s_t, input_precision=DOT_PRECISION)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])  # line 11
        if MASKED:
            p_t = tl.where(visible(offs_n, offs_m, shift, lo_w, hi_w, q_len), p_t, 0.0)
        pd = p_t.to(do0.dtype)
        dv0 = tl.dot(pd, do0, dv0, input_precision=DOT_PRECISION)  # line 12, per part
        dv1 = tl.dot(pd, do1, dv1, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v0, tl.trans(do0), input_precision=DOT_PRECISION)  # line 13: dO0 V0^T + dO1 V1^T
        dp_t = tl.dot(v1, tl.trans(do1), dp_t, input_precision=DOT_PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q0_t.dtype)  # line 14
        dk0 = tl.dot(ds_t, tl.trans(q0_t), dk0, input_precision=DOT_PRECISION)  # line 16, per part
        dk1 = tl.dot(ds_t, tl.trans(q1_t), dk1, input_precision=DOT_PRECISION)
    return dk0, dk1, dv0, dv1


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group", "window_left", "window_right"])
def _split_dkdv_kernel(Q, K, V, DO, LSE2, Delta, DK, DV, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, group,
                       qk_scale, scale, window_left, window_right, stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_lse_h, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """backward._bwd_dkdv_kernel (Algorithm 2, lines 6-18) with the head axis in two parts."""
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN)
    start_n = tl.program_id(0) * BLOCK_N
    if start_n >= k_len:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < k_len
    kv_off = k_start.to(tl.int64) * stride_kt + hk * stride_kh
    k0, k1 = load_halves(K + kv_off, offs_n * stride_kt, n_ok, D0, D1, True, False)
    v0, v1 = load_halves(V + kv_off, offs_n * stride_kt, n_ok, D0, D1, True, False)
    dk0, dv0 = tl.zeros([BLOCK_N, D0], tl.float32), tl.zeros([BLOCK_N, D0], tl.float32)
    dk1, dv1 = tl.zeros([BLOCK_N, D1], tl.float32), tl.zeros([BLOCK_N, D1], tl.float32)
    diag = k_len - q_len
    lo, full_lo, full_hi, hi = tile_range(start_n, tl.minimum(start_n + BLOCK_N, k_len), shift=-diag,
                                          lo_w=window_right, hi_w=window_left, n=q_len, BLOCK=BLOCK_M)
    for g in range(group):
        h = hk * group + g
        q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
        do_base = DO + q_start.to(tl.int64) * stride_qt + h * stride_qh
        lse_base, delta_base = LSE2 + h * stride_lse_h + q_start, Delta + h * stride_lse_h + q_start
        for run in tl.static_range(3):
            dk0, dk1, dv0, dv1 = _dkdv_tiles(
                dk0, dk1, dv0, dv1, k0, k1, v0, v1, q_base, do_base, lse_base, delta_base, offs_n,
                lo=lo if run == 0 else full_lo if run == 1 else full_hi,
                hi=full_lo if run == 0 else full_hi if run == 1 else hi, q_len=q_len, shift=-diag,
                lo_w=window_right, hi_w=window_left, qk_scale=qk_scale, stride_qt=stride_qt, D0=D0, D1=D1,
                BLOCK_M=BLOCK_M, MASKED=run != 1, DOT_PRECISION=DOT_PRECISION)
    store_halves(DK + kv_off, offs_n * stride_kt, n_ok, dk0 * scale, dk1 * scale, D0, D1)
    store_halves(DV + kv_off, offs_n * stride_kt, n_ok, dv0, dv1, D0, D1)


@triton.jit
def _dq_tiles(dq0, dq1, q0, q1, do0, do1, lse2, delta, k_base, v_base, offs_m, lo, hi, k_len, shift, lo_w,
              hi_w, qk_scale, stride_kt, D0: tl.constexpr, D1: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """backward._dq_tiles (Algorithm 2, line 15, with lines 10-14 recomputed) with the head axis in two
    parts."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ok = offs_n < k_len
        k0_t, k1_t = load_halves(k_base, offs_n * stride_kt, ok, D0, D1, MASKED, True)
        v0_t, v1_t = load_halves(v_base, offs_n * stride_kt, ok, D0, D1, MASKED, True)
        s = tl.dot(q0, k0_t, input_precision=DOT_PRECISION)
        s = tl.dot(q1, k1_t, s, input_precision=DOT_PRECISION)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(visible(offs_m, offs_n, shift, lo_w, hi_w, k_len), p, 0.0)
        dp = tl.dot(do0, v0_t, input_precision=DOT_PRECISION)
        dp = tl.dot(do1, v1_t, dp, input_precision=DOT_PRECISION)
        ds = (p * (dp - delta[:, None])).to(k0_t.dtype)
        dq0 = tl.dot(ds, tl.trans(k0_t), dq0, input_precision=DOT_PRECISION)
        dq1 = tl.dot(ds, tl.trans(k1_t), dq1, input_precision=DOT_PRECISION)
    return dq0, dq1


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group", "window_left", "window_right"])
def _split_dq_kernel(Q, K, V, DO, LSE2, Delta, DQ, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, group,
                     qk_scale, scale, window_left, window_right, stride_qt, stride_qh, stride_kt, stride_kh,
                     stride_lse_h, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """backward._bwd_dq_kernel with the head axis in two parts."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN)
    start_m = tl.program_id(0) * BLOCK_M
    if start_m >= q_len:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    q_off = q_start.to(tl.int64) * stride_qt + h * stride_qh
    q0, q1 = load_halves(Q + q_off, offs_m * stride_qt, m_ok, D0, D1, True, False)
    do0, do1 = load_halves(DO + q_off, offs_m * stride_qt, m_ok, D0, D1, True, False)
    lse2 = tl.load(LSE2 + h * stride_lse_h + q_start + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(Delta + h * stride_lse_h + q_start + offs_m, mask=m_ok, other=0.0)
    k_off = k_start.to(tl.int64) * stride_kt + (h // group) * stride_kh
    dq0, dq1 = tl.zeros([BLOCK_M, D0], tl.float32), tl.zeros([BLOCK_M, D1], tl.float32)
    diag = k_len - q_len
    lo, full_lo, full_hi, hi = tile_range(start_m, tl.minimum(start_m + BLOCK_M, q_len), shift=diag,
                                          lo_w=window_left, hi_w=window_right, n=k_len, BLOCK=BLOCK_N)
    for run in tl.static_range(3):
        dq0, dq1 = _dq_tiles(
            dq0, dq1, q0, q1, do0, do1, lse2, delta, K + k_off, V + k_off, offs_m,
            lo=lo if run == 0 else full_lo if run == 1 else full_hi,
            hi=full_lo if run == 0 else full_hi if run == 1 else hi, k_len=k_len, shift=diag,
            lo_w=window_left, hi_w=window_right, qk_scale=qk_scale, stride_kt=stride_kt, D0=D0, D1=D1,
            BLOCK_N=BLOCK_N, MASKED=run != 1, DOT_PRECISION=DOT_PRECISION)
    store_halves(DQ + q_off, offs_m * stride_qt, m_ok, dq0 * scale, dq1 * scale, D0, D1)


def split_forward(q, k, v, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, block_table, scale,
                  window_left, window_right, config=None):
    """forward.attention_forward (Algorithm 1) for a head_dim in SPLIT_HEAD_DIMS; same arguments, same
    results (out, lse)."""
    head_dim = q.shape[2]
    d0, d1 = _parts(head_dim)
    return launch_forward(_split_fwd_kernel, q, k, v, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k,
                          block_table, scale, window_left, window_right,
                          config or fwd_config(head_dim, q.dtype, q.device), D0=d0, D1=d1)


def split_backward(do, q, k, v, out, lse, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, scale,
                   window_left, window_right, config=None):
    """backward.attention_backward (Algorithm 2: preprocess, dK/dV kernel, dQ kernel, GQA expansion) for a
    head_dim in SPLIT_HEAD_DIMS; same arguments, same results (dq, dk, dv)."""
    total_q, head_dim = q.shape[0], q.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if total_q == 0 or batch == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    d0, d1 = _parts(head_dim)
    (m1, n1, warps1, stages1), (m2, n2, warps2, stages2) = config or bwd_config(head_dim, q.dtype, q.device)
    do, delta, lse2 = preprocess(do, q, out, lse)
    common = dict(Q=q, DO=do, LSE2=lse2, Delta=delta, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  seqlen_q=seqlen_q, seqlen_k=seqlen_k, qk_scale=scale * LOG2E, scale=scale,
                  window_left=window_left, window_right=window_right, stride_qt=q.stride(0),
                  stride_qh=q.stride(1), stride_lse_h=lse.stride(0), D0=d0, D1=d1,
                  VARLEN=cu_seqlens_q is not None, DOT_PRECISION=dot_precision(q.dtype))
    return launch_dkdv_then_dq(_split_dkdv_kernel, _split_dq_kernel, q, k, v, dq, dk, dv, common, batch,
                               (m1, n1, warps1, stages1), (m2, n2, warps2, stages2))


def applies(q: torch.Tensor, **arguments) -> bool:
    """The calls this layer runs: a head_dim with a two-part split (every mask, varlen, GQA, paged K/V)."""
    return q.shape[-1] in SPLIT_HEAD_DIMS


def enable() -> Callable[[], None]:
    """Run the split kernels for the calls `applies` accepts (on import); returns `disable`."""
    REGISTRY.register("forward", split_forward, applies)
    REGISTRY.register("backward", split_backward, applies)
    return disable


def disable() -> None:
    """Hand every call back to the paper path."""
    REGISTRY.remove("forward", __name__)
    REGISTRY.remove("backward", __name__)


def enabled() -> bool:
    return REGISTRY.registered("forward", __name__)


enable()
