"""Flash-Decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"), in Triton.

At decode time there are only a few query rows per sequence, so FlashAttention's parallelism over
(query tiles x heads x batch) leaves most of the GPU idle when the batch is small and the context
long. Flash-Decoding adds a third axis: the keys are cut into `num_splits` slices and

  1. split (`_decode_split_kernel`): each program runs Algorithm 1's loop (`fwd_tiles`) over one slice
     and writes a partial output O_s, normalised within its slice, and that slice's log-sum-exp L_s;
  2. combine (`_combine_kernel`): O = sum_s exp(L_s - L) O_s with L = log sum_s exp(L_s),
     the same rescaling as the online softmax, applied once across slices.

Decoding reads the whole KV cache once and does little arithmetic per byte, so it is memory-bound:
the measure is bytes of K/V read per second. Two choices serve that:
  * GQA packing: one program handles *all* the query heads (and query tokens) that share a kv head,
    stacked as the rows of one tile, so each K/V byte is read once, not once per query head;
  * the split count (`num_splits=0`) is chosen so that batch x kv_heads x splits programs fill the SMs.

Paged caches (vLLM's PagedAttention) are read through `kv_offsets`: row j of sequence b lives in page
block_table[b, j // page_size]. With one page holding fewer rows than a tile (page 16, tile 64), a tile
gathers several pages, one 2*head_dim-byte row at a time; each row is still a contiguous read. The tile
configurations and the split heuristic's constants are measured (configs.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import NO_WINDOW, cdiv, next_pow2, scale_stride
from .configs import DECODE_TUNING, FP8_DECODE_TUNING, block_d, decode_config, num_sms
from .forward import LN2_C, LOG2E, dot_precision, fwd_tiles, load_tile

NO_WINDOW_C = tl.constexpr(NO_WINDOW)


@triton.jit(do_not_specialize=["seqlen_q", "group", "stride_bt"])
def _decode_split_kernel(Q, K, V, Out, LSE, cache_seqlens, block_table, K_scale, V_scale,
                         seqlen_q, group, qk_scale, window_right,
                         stride_qb, stride_qt, stride_qh,
                         stride_kb, stride_kt, stride_kh, stride_bt, stride_ks, stride_vs,
                         stride_ob, stride_ot, stride_oh, stride_os,
                         stride_lb, stride_lt, stride_lh, stride_ls,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, FP8_KV: tl.constexpr):
    """One key slice of one (kv head, row block, sequence): grid (num_splits, heads_k * row_blocks, batch).

    Tile row r stands for query head hk * group + r // seqlen_q at token r % seqlen_q. FP8_KV: K and V
    are E4M3 codes, kv head hk's values code * K_scale[hk * stride_ks] (V likewise; stride 0: one scale)."""
    split = tl.program_id(0)
    row_blocks = tl.cdiv(group * seqlen_q, BLOCK_M)
    hk = tl.program_id(1) // row_blocks
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    rows = (tl.program_id(1) % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * seqlen_q
    h = hk * group + rows // seqlen_q
    t = rows % seqlen_q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    pad_d: tl.constexpr = HEAD_DIM < BLOCK_D
    q_ptrs = (Q + b64 * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh
              + offs_d[None, :])
    q = load_tile(q_ptrs, row_ok[:, None], d_ok[None, :], True, pad_d)

    k_len = tl.load(cache_seqlens + b)
    if PAGED:
        k_off = hk * stride_kh
        bt_row = block_table + b64 * stride_bt
    else:
        k_off = b64 * stride_kb + hk * stride_kh
        bt_row = block_table  # unused
    # this sequence's keys cut into num_splits slices of whole tiles: a short context is split as
    # finely as a long one (the capacity, a bound known on the host, would leave all its keys to the
    # first slices)
    split_len = tl.cdiv(tl.cdiv(k_len, tl.num_programs(0)), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, k_len)
    # token t sits at key position t + k_len - seqlen_q (bottom-right aligned, as in the forward);
    # keys past the slice end `hi` are masked like keys past the sequence end
    diag = k_len - seqlen_q
    # the last key that token 0 (the first) may see
    full_hi = tl.minimum(hi, diag + window_right + 1)
    full_hi = tl.maximum(lo + (full_hi - lo) // BLOCK_N * BLOCK_N, lo)
    # FP8: fwd_tiles runs on the codes (widened to q's dtype in registers, exactly), and the scales
    # come out of both sums: S = Q (k_scale C_K)^T = (Q C_K^T) k_scale, folded into the softmax scale;
    # O = P (v_scale C_V) / l = (P C_V) v_scale / l, folded into the normalisation below
    k_scale, v_scale = 1.0, 1.0
    if FP8_KV:
        k_scale = tl.load(K_scale + hk * stride_ks)
        v_scale = tl.load(V_scale + hk * stride_vs)
        if q.dtype == tl.bfloat16:  # products in fp16: E4M3 widens to fp16 in one instruction
            # (to bf16 in several), exactly; fp16 holds q (|q| <= 65504) and P more finely than bf16
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base, v_base = K + k_off, V + k_off
    qk_scale = qk_scale * k_scale
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, t,
                              lo=lo, hi=full_hi, n=hi, shift=diag,
                              lo_w=NO_WINDOW_C, hi_w=window_right, qk_scale=qk_scale,
                              stride_kt=stride_kt, stride_kp=stride_kb,
                              HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                              PAGED=PAGED, PAGE_SIZE=PAGE_SIZE, MASKED=False,
                              DOT_PRECISION=DOT_PRECISION)
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, t,
                              lo=full_hi, hi=hi, n=hi, shift=diag,
                              lo_w=NO_WINDOW_C, hi_w=window_right, qk_scale=qk_scale,
                              stride_kt=stride_kt, stride_kp=stride_kb,
                              HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                              PAGED=PAGED, PAGE_SIZE=PAGE_SIZE, MASKED=True,
                              DOT_PRECISION=DOT_PRECISION)
    # an empty slice (past the sequence end) has weight exp(-inf) = 0 in the combine
    empty = l_i == 0.0
    l_i = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * LN2_C)
    o_ptrs = (Out + b64 * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh
              + split * stride_os)
    o_ok = row_ok[:, None] & d_ok[None, :]
    out = acc * v_scale / l_i[:, None]  # O_s = P C_V v_scale / l (v_scale = 1: 16-bit caches)
    tl.store(o_ptrs + offs_d[None, :], out.to(Out.dtype.element_ty), mask=o_ok)
    lse_ptrs = LSE + b64 * stride_lb + t * stride_lt + h * stride_lh + split * stride_ls
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def _combine_kernel(O_part, LSE_part, Out, LSE, num_splits,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the slices of one (sequence, token, head) row: O = sum_s exp(L_s - L) O_s, L = logsumexp_s L_s
    (the online softmax's rescaling, once across slices)."""
    r = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    ok = s < num_splits
    lse_s = tl.load(LSE_part + r * num_splits + s, mask=ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every slice empty (cache_seqlens 0): output 0
    w = tl.exp(lse_s - m)
    total = tl.sum(w, 0)
    empty = total == 0.0
    total = tl.where(empty, 1.0, total)
    o_ptrs = O_part + (r * num_splits + s)[:, None] * HEAD_DIM + offs_d[None, :]
    o_s = tl.load(o_ptrs, mask=ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(w[:, None] * o_s, 0) / total
    tl.store(Out + r * HEAD_DIM + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(LSE + r, tl.where(empty, float("-inf"), m + tl.log(total)))


def pick_num_splits(programs: int, max_len: int, block_n: int, sms: int, tuning=DECODE_TUNING):
    """Flash-Decoding's split count: enough programs for `waves` per SM, no slice under a few tiles."""
    target = tuning["waves"] * sms
    if programs >= target:
        return 1
    longest = cdiv(max_len, tuning["min_split_tiles"] * block_n)
    return max(1, min(target // programs, longest, 128))


def decode_forward(q, k_cache, v_cache, cache_seqlens, block_table, scale, causal, num_splits,
                   k_scale=None, v_scale=None, config=None, kernels=None, **launch):
    """Launch Flash-Decoding. q (B, Sq, Hq, D); caches (B, S, Hk, D) or (pages, page_size, Hk, D) with
    block_table, of q's dtype or float8_e4m3fn with flat fp32 k_scale, v_scale (1 or Hk elements).
    Returns out (B, Sq, Hq, D) and lse (B, Hq, Sq).

    config: (BLOCK_N, num_warps, num_stages) of the split kernel, default `configs.decode_config`.
    kernels, launch: a (split, combine) pair taking the same arguments, and Triton launch options for both
    (a performance layer's variants; default: the two kernels above)."""
    split_kernel, combine_kernel = kernels or (_decode_split_kernel, _combine_kernel)
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_k = k_cache.shape[2]
    group = heads_q // heads_k
    paged = block_table is not None
    # a bound on every sequence's length, known without a device sync
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    block_m = max(16, min(64, next_pow2(group * seqlen_q)))  # tl.dot wants >= 16 rows
    row_blocks = cdiv(group * seqlen_q, block_m)
    programs = batch * heads_k * row_blocks
    fp8 = k_scale is not None
    config = config or decode_config(head_dim, q.dtype, q.device, paged, programs, fp8)
    block_n, num_warps, num_stages = config
    if num_splits == 0:
        num_splits = pick_num_splits(programs, capacity, block_n, num_sms(q.device),
                                     FP8_DECODE_TUNING if fp8 else DECODE_TUNING)
    split_len = cdiv(cdiv(max(capacity, 1), num_splits), block_n) * block_n
    num_splits = cdiv(max(capacity, 1), split_len)  # drop slices that would start past the capacity
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, seqlen_q, heads_q, dtype=torch.float32, device=q.device)
    if num_splits == 1:  # write the final output directly; no combine
        o_part, lse_part, s_strides = out, lse, (0, 0)
    else:
        o_part = torch.empty(batch, seqlen_q, heads_q, num_splits, head_dim, dtype=torch.float32,
                             device=q.device)
        lse_part = torch.empty(batch, seqlen_q, heads_q, num_splits, dtype=torch.float32,
                               device=q.device)
        s_strides = (o_part.stride(3), lse_part.stride(3))
    if batch == 0:
        return out, lse.transpose(1, 2)
    split_kernel[(num_splits, heads_k * row_blocks, batch)](
        Q=q, K=k_cache, V=v_cache, Out=o_part, LSE=lse_part, cache_seqlens=cache_seqlens,
        block_table=block_table, K_scale=k_scale, V_scale=v_scale,
        seqlen_q=seqlen_q, group=group, qk_scale=scale * LOG2E,
        window_right=0 if causal else NO_WINDOW,
        stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
        stride_kb=k_cache.stride(0), stride_kt=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_bt=block_table.stride(0) if paged else 0,
        stride_ks=0 if k_scale is None else scale_stride(k_scale),
        stride_vs=0 if v_scale is None else scale_stride(v_scale),
        stride_ob=o_part.stride(0), stride_ot=o_part.stride(1), stride_oh=o_part.stride(2),
        stride_os=s_strides[0],
        stride_lb=lse_part.stride(0), stride_lt=lse_part.stride(1), stride_lh=lse_part.stride(2),
        stride_ls=s_strides[1],
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1,
        DOT_PRECISION=dot_precision(q.dtype), FP8_KV=k_scale is not None,
        num_warps=num_warps, num_stages=num_stages, **launch)
    if num_splits > 1:
        combine_kernel[(batch * seqlen_q * heads_q,)](
            O_part=o_part, LSE_part=lse_part, Out=out, LSE=lse, num_splits=num_splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_S=next_pow2(num_splits), **launch)
    return out, lse.transpose(1, 2)
