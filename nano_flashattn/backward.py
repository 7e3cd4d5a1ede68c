"""FlashAttention-2 backward pass (Dao 2023, arXiv 2307.08691, Algorithm 2, section 3.1.2), in Triton.

Nothing of size seqlen^2 was saved by the forward: only O and the log-sum-exp L. The backward
recomputes P = exp(S - L) tile by tile (Algorithm 2, lines 10-11) and uses, per query row,

    dV = P^T dO,   dP = dO V^T,   dS = P o (dP - D),   dQ = scale * dS K,   dK = scale * dS^T Q,

where D_i = rowsum(dO_i o O_i) (line 4, "preprocess"; it equals rowsum(P o dP) by eq. in sec. 3.1.2).

Algorithm 2 parallelises over key tiles and adds each tile's share of dQ into HBM with atomics, which
makes dQ depend on the order programs finish. We trade a little recomputation for determinism, as
Triton's reference kernel does: one kernel owns a key tile and loops over the queries to produce
dK, dV; a second owns a query tile and loops over the keys to produce dQ. Every gradient element is
written by exactly one program, in a fixed order: bit-identical results run to run, no atomics.
GQA: the program for a key/value head loops over the `group` query heads that read it, so dK and dV
are summed inside one program, again without atomics. When that grid (key tiles x kv heads x batch)
would leave most SMs idle — one 2k-token sequence with 4 kv heads is 64-128 programs for 132 SMs, and
each loops over 8 query heads — K and V are instead expanded to one copy per query head, every query
head gets its own programs, and the group's fp32 partial dK, dV are summed afterwards (flash-attn's
"dk_expanded"): a few MB of temporaries for ~group x the parallelism, still deterministic.

Masking follows the forward (forward.py): fully visible tiles run without mask arithmetic, and a head_dim
that is not a power of two is padded to BLOCK_D with zeros on load, which add nothing to any product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .configs import block_d, bwd_config
from .forward import LOG2E, LOG2E_C, dot_precision, load_tile, seq_bounds, tile_range, visible


@triton.jit
def _bwd_preprocess(Out, DO, LSE, Delta, LSE2, total_q, stride_qt, stride_qh, stride_lse_h,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Algorithm 2, line 4: D = rowsum(dO o O); also L in base 2 for the exp2 in the other kernels.

    A row that saw no key (L = -inf) gets L2 = +inf, so that its recomputed P = exp2(S - L2) is 0."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < total_q
    ptrs = offs_m.to(tl.int64)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    tile_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(Out + ptrs, mask=tile_ok, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=tile_ok, other=0.0).to(tl.float32)
    tl.store(Delta + h * stride_lse_h + offs_m, tl.sum(o * do, axis=1), mask=row_ok)
    lse = tl.load(LSE + h * stride_lse_h + offs_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)
    tl.store(LSE2 + h * stride_lse_h + offs_m, lse2, mask=row_ok)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n, lo, hi, q_len,
                shift, lo_w, hi_w, qk_scale, stride_qt,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Algorithm 2, lines 8-17 for one key tile K_j, V_j, over the query tiles i in [lo, hi), in transposed
    form (rows = keys) so that dK_j and dV_j accumulate in registers. Line 15 (dQ) is `_dq_tiles`."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    pad_d: tl.constexpr = HEAD_DIM < BLOCK_D
    for start_m in range(lo, hi, BLOCK_M):  # line 8: for 1 <= i <= T_r
        offs_m = start_m + tl.arange(0, BLOCK_M)
        ok = offs_m < q_len
        # line 9: load Q_i (transposed), dO_i, L_i, D_i
        q_t = load_tile(q_base + offs_m[None, :] * stride_qt + offs_d[:, None],
                        ok[None, :], d_ok[:, None], MASKED, pad_d)
        do = load_tile(do_base + offs_m[:, None] * stride_qt + offs_d[None, :],
                       ok[:, None], d_ok[None, :], MASKED, pad_d)
        lse2 = load_tile(lse_base + offs_m, ok, ok, MASKED, False)
        delta = load_tile(delta_base + offs_m, ok, ok, MASKED, False)
        s_t = tl.dot(k, q_t, input_precision=DOT_PRECISION)  # line 10: S^T, (keys, queries)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])  # line 11: P = exp(S - L), recomputed
        if MASKED:
            p_t = tl.where(visible(offs_n, offs_m, shift, lo_w, hi_w, q_len), p_t, 0.0)
        # line 12: dV_j += P^T dO_i
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # line 13: dP = dO_i V_j^T
        ds_t = p_t * (dp_t - delta[None, :])  # line 14: dS = P o (dP - D_i)
        # line 16: dK_j += dS^T Q_i
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group", "window_left", "window_right"])
def _bwd_dkdv_kernel(Q, K, V, DO, LSE2, Delta, DK, DV, cu_seqlens_q, cu_seqlens_k,
                     seqlen_q, seqlen_k, group, qk_scale, scale, window_left, window_right,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_lse_h,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Algorithm 2, lines 6-18, for one key tile of one kv head of one sequence (line 5's loop is the grid:
    (cdiv(max_seqlen_k, BLOCK_N), heads_k, batch))."""
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                                                VARLEN)
    start_n = tl.program_id(0) * BLOCK_N
    if start_n >= k_len:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok, d_ok = offs_n[:, None] < k_len, offs_d < HEAD_DIM
    pad_d: tl.constexpr = HEAD_DIM < BLOCK_D
    kv_off = k_start.to(tl.int64) * stride_kt + hk * stride_kh
    kv_ptrs = kv_off + offs_n[:, None] * stride_kt + offs_d[None, :]
    k = load_tile(K + kv_ptrs, n_ok, d_ok[None, :], True, pad_d)  # line 6: K_j, V_j stay on chip
    v = load_tile(V + kv_ptrs, n_ok, d_ok[None, :], True, pad_d)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)  # line 7
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Transposed view of the forward's mask: key j is seen by query i iff
    # j - diag - right <= i <= j - diag + left.  Garbage key rows (j >= k_len) only feed their own,
    # unstored, dK/dV rows, so the query-side tile range ignores them.
    diag = k_len - q_len
    r1 = tl.minimum(start_n + BLOCK_N, k_len)
    lo, full_lo, full_hi, hi = tile_range(start_n, r1, shift=-diag, lo_w=window_right,
                                          hi_w=window_left, n=q_len, BLOCK=BLOCK_M)
    for g in range(group):  # every query head that reads this kv head adds into the same dK, dV
        h = hk * group + g
        q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
        do_base = DO + q_start.to(tl.int64) * stride_qt + h * stride_qh
        lse_base, delta_base = LSE2 + h * stride_lse_h + q_start, Delta + h * stride_lse_h + q_start
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n,
                             lo=lo, hi=full_lo, q_len=q_len, shift=-diag,
                             lo_w=window_right, hi_w=window_left, qk_scale=qk_scale,
                             stride_qt=stride_qt, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                             BLOCK_M=BLOCK_M, MASKED=True, DOT_PRECISION=DOT_PRECISION)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n,
                             lo=full_lo, hi=full_hi, q_len=q_len, shift=-diag,
                             lo_w=window_right, hi_w=window_left, qk_scale=qk_scale,
                             stride_qt=stride_qt, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                             BLOCK_M=BLOCK_M, MASKED=False, DOT_PRECISION=DOT_PRECISION)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n,
                             lo=full_hi, hi=hi, q_len=q_len, shift=-diag,
                             lo_w=window_right, hi_w=window_left, qk_scale=qk_scale,
                             stride_qt=stride_qt, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                             BLOCK_M=BLOCK_M, MASKED=True, DOT_PRECISION=DOT_PRECISION)
    dk = dk * scale  # S = scale * Q K^T, so dK picks up the scale once, at the end
    kv_ok = n_ok & d_ok[None, :]
    tl.store(DK + kv_ptrs, dk.to(DK.dtype.element_ty), mask=kv_ok)  # line 18: write dK_j, dV_j
    tl.store(DV + kv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, offs_m, lo, hi, k_len, shift, lo_w, hi_w,
              qk_scale, stride_kt,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Algorithm 2, line 15, dQ_i += dS_ij K_j, over the key tiles j in [lo, hi), with P and dS recomputed
    (lines 10-14)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    pad_d: tl.constexpr = HEAD_DIM < BLOCK_D
    for start_n in range(lo, hi, BLOCK_N):  # line 5's loop over key tiles j, from the query side
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ptrs = offs_n[None, :] * stride_kt + offs_d[:, None]
        ok = offs_n[None, :] < k_len
        # line 6: K_j, V_j (transposed)
        k_t = load_tile(k_base + ptrs, ok, d_ok[:, None], MASKED, pad_d)
        v_t = load_tile(v_base + ptrs, ok, d_ok[:, None], MASKED, pad_d)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION)  # line 10
        p = tl.math.exp2(s * qk_scale - lse2[:, None])  # line 11
        if MASKED:
            p = tl.where(visible(offs_m, offs_n, shift, lo_w, hi_w, k_len), p, 0.0)
        dp = tl.dot(do, v_t, input_precision=DOT_PRECISION)  # line 13
        ds = p * (dp - delta[:, None])  # line 14
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq, input_precision=DOT_PRECISION)  # line 15
    return dq


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group", "window_left", "window_right"])
def _bwd_dq_kernel(Q, K, V, DO, LSE2, Delta, DQ, cu_seqlens_q, cu_seqlens_k,
                   seqlen_q, seqlen_k, group, qk_scale, scale, window_left, window_right,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_lse_h,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dQ for one (query tile, head, sequence): grid (cdiv(max_seqlen_q, BLOCK_M), heads_q, batch)."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                                                VARLEN)
    start_m = tl.program_id(0) * BLOCK_M
    if start_m >= q_len:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok, d_ok = offs_m < q_len, offs_d < HEAD_DIM
    pad_d: tl.constexpr = HEAD_DIM < BLOCK_D
    q_ptrs = (q_start.to(tl.int64) * stride_qt + h * stride_qh
              + offs_m[:, None] * stride_qt + offs_d[None, :])
    q = load_tile(Q + q_ptrs, m_ok[:, None], d_ok[None, :], True, pad_d)
    do = load_tile(DO + q_ptrs, m_ok[:, None], d_ok[None, :], True, pad_d)
    lse2 = tl.load(LSE2 + h * stride_lse_h + q_start + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(Delta + h * stride_lse_h + q_start + offs_m, mask=m_ok, other=0.0)
    k_off = k_start.to(tl.int64) * stride_kt + (h // group) * stride_kh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    diag = k_len - q_len
    r1 = tl.minimum(start_m + BLOCK_M, q_len)
    lo, full_lo, full_hi, hi = tile_range(start_m, r1, shift=diag, lo_w=window_left,
                                          hi_w=window_right, n=k_len, BLOCK=BLOCK_N)
    k_base, v_base = K + k_off, V + k_off
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, offs_m,
                   lo=lo, hi=full_lo, k_len=k_len, shift=diag,
                   lo_w=window_left, hi_w=window_right, qk_scale=qk_scale, stride_kt=stride_kt,
                   HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=True,
                   DOT_PRECISION=DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, offs_m,
                   lo=full_lo, hi=full_hi, k_len=k_len, shift=diag,
                   lo_w=window_left, hi_w=window_right, qk_scale=qk_scale, stride_kt=stride_kt,
                   HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=False,
                   DOT_PRECISION=DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_base, v_base, offs_m,
                   lo=full_hi, hi=hi, k_len=k_len, shift=diag,
                   lo_w=window_left, hi_w=window_right, qk_scale=qk_scale, stride_kt=stride_kt,
                   HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, MASKED=True,
                   DOT_PRECISION=DOT_PRECISION)
    q_ok = m_ok[:, None] & d_ok[None, :]
    tl.store(DQ + q_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=q_ok)


def attention_backward(do, q, k, v, out, lse, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k,
                       scale, window_left, window_right, config=None):
    """Launch Algorithm 2 on packed (tokens, heads, dim) tensors. Returns dq, dk, dv.

    config: ((BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel, the same of the dQ kernel),
    default `configs.bwd_config`."""
    total_q, head_dim = q.shape[0], q.shape[2]
    # varlen: rows past cu_seqlens[-1] belong to no sequence and are left unwritten, as in the forward
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if total_q == 0 or batch == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    dkdv_config, dq_config = config or bwd_config(head_dim, q.dtype, q.device)
    do, delta, lse2 = preprocess(do, q, out, lse)
    common = dict(Q=q, DO=do, LSE2=lse2, Delta=delta,
                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  seqlen_q=seqlen_q, seqlen_k=seqlen_k, qk_scale=scale * LOG2E, scale=scale,
                  window_left=window_left, window_right=window_right,
                  stride_qt=q.stride(0), stride_qh=q.stride(1), stride_lse_h=lse.stride(0),
                  HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), VARLEN=cu_seqlens_q is not None,
                  DOT_PRECISION=dot_precision(q.dtype))
    return launch_dkdv_then_dq(_bwd_dkdv_kernel, _bwd_dq_kernel, q, k, v, dq, dk, dv, common, batch,
                               dkdv_config, dq_config)


def preprocess(do, q, out, lse):
    """Line 4 for every head and row: returns dO made contiguous (the kernels index it with q's strides),
    D and the base-2 L."""
    do, (total_q, heads_q, head_dim) = do.contiguous(), q.shape
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    pre_m = 128 if q.is_cuda else 16  # memory-bound: a padded head axis costs little
    _bwd_preprocess[(triton.cdiv(total_q, pre_m), heads_q)](
        Out=out, DO=do, LSE=lse, Delta=delta, LSE2=lse2, total_q=total_q,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_lse_h=lse.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=pre_m)
    return do, delta, lse2


def launch_dkdv_then_dq(dkdv_kernel, dq_kernel, q, k, v, dq, dk, dv, common: dict, batch: int,
                        cfg1, cfg2):
    """Algorithm 2's two passes without atomics: dK, dV over K/V tiles, then dQ over Q tiles (`common`: the
    kernels' shared keyword arguments, seqlen_q / seqlen_k among them). With GQA and too few K/V tiles to
    fill the GPU, K/V are expanded per query head and the fp32 partial dK/dV summed over the group after."""
    (m1, n1, warps1, stages1), (m2, n2, warps2, stages2) = cfg1, cfg2
    heads_q, heads_k, head_dim = q.shape[1], k.shape[1], k.shape[2]
    group, seqlen_q, seqlen_k = heads_q // heads_k, common["seqlen_q"], common["seqlen_k"]
    kv_programs = triton.cdiv(seqlen_k, n1) * heads_k * batch
    expand = group > 1 and kv_programs < configs.GQA_EXPAND_WAVES * configs.num_sms(q.device)
    # one copy of K/V per query head, fp32 partial dK/dV summed over the group (module docstring)
    if expand:
        k_x, v_x = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        dk_x = torch.empty(k_x.shape, dtype=torch.float32, device=k.device)
        dv_x = torch.empty_like(dk_x)
    else:
        k_x, v_x, dk_x, dv_x = k, v, dk, dv
    dkdv_kernel[(triton.cdiv(seqlen_k, n1), k_x.shape[1], batch)](
        K=k_x, V=v_x, DK=dk_x, DV=dv_x, group=1 if expand else group,
        stride_kt=k_x.stride(0), stride_kh=k_x.stride(1),
        BLOCK_M=m1, BLOCK_N=n1, num_warps=warps1, num_stages=stages1, **common)
    if expand:
        dk.copy_(dk_x.view(-1, heads_k, group, head_dim).sum(2))
        dv.copy_(dv_x.view(-1, heads_k, group, head_dim).sum(2))
    dq_kernel[(triton.cdiv(seqlen_q, m2), heads_q, batch)](
        K=k, V=v, DQ=dq, group=group, stride_kt=k.stride(0), stride_kh=k.stride(1),
        BLOCK_M=m2, BLOCK_N=n2, num_warps=warps2, num_stages=stages2, **common)
    return dq, dk, dv
