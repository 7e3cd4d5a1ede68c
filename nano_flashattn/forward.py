"""FlashAttention-2 forward pass (Dao 2023, arXiv 2307.08691, Algorithm 1), in Triton.

One program owns one tile of BLOCK_M query rows of one head and keeps it in registers (Algorithm 1,
line 4: "load Q_i from HBM to on-chip SRAM"); K and V stream through in tiles of BLOCK_N rows
(lines 6-9) and the output is normalised once, at the end (line 12). The softmax is the "online
softmax" of section 3.1.1: per row we keep the running maximum m and running sum l of the
*unnormalised* exponentials, and rescale the accumulator by exp(m_old - m_new) when the maximum grows.

Two tricks from the paper's CUDA code that keep the inner loop short:
  * base 2: exp(x) = exp2(x * log2(e)), and log2(e) is folded into the softmax scale, so a score costs
    one FMA (s * qk_scale - m) and one exp2 (the GPU's native MUFU.EX2);
  * masks only where needed (section 3.1.1, "causal masking"): a tile whose every (query, key) pair is
    visible runs without any mask arithmetic; only the tiles crossing the causal diagonal, the window
    edges or the end of the sequence pay for it. `_tile_range` splits the key axis into the three runs.

The same loop serves dense batches, packed variable-length batches (cu_seqlens) and K/V read from a
paged cache (block_table), and Flash-Decoding (decode.py) runs it over one slice of the keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import cdiv

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): converts the kernel's base-2 log-sum-exp back to natural log
LOG2E_C, LN2_C = tl.constexpr(LOG2E), tl.constexpr(LN2)  # the same, as compile-time constants for kernels


@triton.jit
def tile_range(r0, r1, shift, lo_w, hi_w, n, BLOCK: tl.constexpr):
    """Split the column axis for the row tile [r0, r1) into masked / unmasked / masked runs.

    Column c is visible from row r iff 0 <= c < n and r + shift - lo_w <= c <= r + shift + hi_w.
    Returns (lo, full_lo, full_hi, hi): columns outside [lo, hi) are invisible to every row; the
    BLOCK-wide tiles in [full_lo, full_hi) are visible to every row and need no mask."""
    lo = tl.maximum(r0 + shift - lo_w, 0)
    hi = tl.minimum(r1 + shift + hi_w, n)
    full_lo = tl.maximum(r1 - 1 + shift - lo_w, 0)
    full_hi = tl.minimum(r0 + shift + hi_w + 1, n)
    lo = lo // BLOCK * BLOCK  # start tiles on BLOCK boundaries
    full_lo = tl.minimum(tl.maximum((full_lo + BLOCK - 1) // BLOCK * BLOCK, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi // BLOCK * BLOCK, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def visible(rows, cols, shift, lo_w, hi_w, n):
    """The mask of `tile_range` for a (rows x cols) tile."""
    c = cols[None, :]
    r = rows[:, None]
    return (c < n) & (c >= r + shift - lo_w) & (c <= r + shift + hi_w)


@triton.jit
def kv_offsets(offs_n, bt_row, n, stride_kt, stride_kp, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets of key/value rows `offs_n` of one sequence.

    Contiguous: row j is j * stride_kt past the sequence's first row. Paged (vLLM's PagedAttention):
    row j lives in page block_table[j // PAGE_SIZE], at slot j % PAGE_SIZE."""
    if PAGED:
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=offs_n < n, other=0).to(tl.int64)
        return page * stride_kp + (offs_n % PAGE_SIZE) * stride_kt
    else:
        return offs_n * stride_kt


@triton.jit
def fwd_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, offs_m, lo, hi, n, shift, lo_w, hi_w, qk_scale,
              stride_kt, stride_kp, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
              PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Algorithm 1, lines 6-10, over key tiles [lo, hi): S = Q K^T, online softmax, acc += P V.

    m_i is the running row max of the *base-2* scaled scores; l_i the running sum of exp2(s - m_i)."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv = kv_offsets(offs_n, bt_row, n, stride_kt, stride_kp, PAGED, PAGE_SIZE)
        if MASKED:
            k_t = tl.load(k_base + kv[None, :] + offs_d[:, None], mask=offs_n[None, :] < n, other=0.0)
        else:
            k_t = tl.load(k_base + kv[None, :] + offs_d[:, None])
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION)  # line 8: S_ij = Q_i K_j^T
        if MASKED:
            s = tl.where(visible(offs_m, offs_n, shift, lo_w, hi_w, n), s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no visible key yet keeps m = -inf; subtract 0 instead, so that
            # exp2(-inf - (-inf)) = NaN never happens and its p stays exactly 0
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # qk_scale > 0, so max commutes with it
            m_use = m_new
            p = tl.math.exp2(s * qk_scale - m_use[:, None])  # one FMA + one exp2 per score
        alpha = tl.math.exp2(m_i - m_use)  # line 9: rescale what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_base + kv[:, None] + offs_d[None, :], mask=offs_n[:, None] < n, other=0.0)
        else:
            v = tl.load(v_base + kv[:, None] + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # line 10
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(first row, length) of sequence b's queries and keys in the packed (tokens, heads, dim) tensors."""
    if VARLEN:
        q_start = tl.load(cu_seqlens_q + b)
        k_start = tl.load(cu_seqlens_k + b)
        return (
            q_start,
            tl.load(cu_seqlens_q + b + 1) - q_start,
            k_start,
            tl.load(cu_seqlens_k + b + 1) - k_start,
        )
    else:
        return b * seqlen_q, seqlen_q, b * seqlen_k, seqlen_k


# Lengths, the block table's row stride (the widest block table of an engine step) and the LSE's head stride
# (= the step's token count) change from call to call; Triton would compile a variant per "multiple of 16" /
# "equals 1" pattern of each, mid-serving (a ~1 s stall: an H200 serving run built one inside a timed rate).
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group", "window_left", "window_right", "stride_bt",
                               "stride_lse_h"])
def _fwd_kernel(Q, K, V, Out, LSE, cu_seqlens_q, cu_seqlens_k, block_table,
                seqlen_q, seqlen_k, group, qk_scale, window_left, window_right,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_kp, stride_bt, stride_lse_h,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr,
                PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, REVERSE: tl.constexpr,
                DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Algorithm 1 for one (query tile, head, sequence): grid (cdiv(max_seqlen_q, BLOCK_M), heads_q, batch)."""
    pid_m = tl.program_id(0)
    if REVERSE:  # causal: the last query tiles see the most keys; start them first so the tail is short
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    hk = h // group  # GQA/MQA: `group` query heads share one key/value head
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
    q = tl.load(
        q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=offs_m[:, None] < q_len, other=0.0
    )
    if PAGED:
        k_off = hk * stride_kh
        bt_row = block_table + b.to(tl.int64) * stride_bt
    else:
        k_off = k_start.to(tl.int64) * stride_kt + hk * stride_kh
        bt_row = block_table  # unused
    k_base = K + k_off
    v_base = V + k_off

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # bottom-right alignment: query i sits at key position i + (k_len - q_len)
    diag = k_len - q_len
    r1 = tl.minimum(start_m + BLOCK_M, q_len)
    lo, full_lo, full_hi, hi = tile_range(start_m, r1, diag, window_left, window_right, k_len, BLOCK_N)
    # left window edge (masked), the fully visible middle (no mask), the diagonal / sequence end (masked)
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, offs_m, lo, full_lo, k_len, diag,
                              window_left, window_right, qk_scale, stride_kt, stride_kp,
                              HEAD_DIM, BLOCK_N, PAGED, PAGE_SIZE, True, DOT_PRECISION)  # fmt: skip
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, offs_m, full_lo, full_hi, k_len, diag,
                              window_left, window_right, qk_scale, stride_kt, stride_kp,
                              HEAD_DIM, BLOCK_N, PAGED, PAGE_SIZE, False, DOT_PRECISION)  # fmt: skip
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, offs_m, full_hi, hi, k_len, diag,
                              window_left, window_right, qk_scale, stride_kt, stride_kp,
                              HEAD_DIM, BLOCK_N, PAGED, PAGE_SIZE, True, DOT_PRECISION)  # fmt: skip

    # line 12: O_i = diag(l_i)^-1 acc; line 13: L_i = m_i + log(l_i). A row that saw no key: O = 0, L = -inf.
    empty = l_i == 0.0
    l_i = tl.where(empty, 1.0, l_i)
    out = acc / l_i[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * LN2_C)
    row_ok = offs_m < q_len
    o_base = Out + q_start.to(tl.int64) * stride_qt + h * stride_qh
    tl.store(
        o_base + offs_m[:, None] * stride_qt + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(LSE + h * stride_lse_h + q_start + offs_m, lse, mask=row_ok)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision products (tl.dot defaults to TF32 on GPUs); others: native MMA
    return "ieee" if dtype == torch.float32 else "tf32"


# (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs by head_dim, tuned on an H200 (see
# BENCHMARKS.md); `python -m nano_flashattn.bench --sweep` re-tunes this table in its own process.
FWD_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    32: (128, 64, 8, 3),
    64: (128, 64, 8, 3),  # H200 sweep 2026-11-30: 8 warps beat 4 by 5%; 128-wide K tiles lost 16%
    128: (128, 64, 8, 3),  # (128, 128, 8, 3) within 4%; 4 warps 32% slower
    256: (64, 64, 4, 2),
}


def fwd_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    if device.type != "cuda":
        return 16, 16, 4, 1  # Triton interpreter: small tiles keep CPU tests fast and exercise many tiles
    if dtype == torch.float32:  # no fp32 tensor-core path (ieee): smaller tiles fit registers
        return (64, 32, 4, 2) if head_dim <= 128 else (32, 32, 4, 1)
    return FWD_CONFIGS[head_dim]


def attention_forward(q, k, v, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, block_table, scale,
                      window_left, window_right, config=None):  # fmt: skip
    """Launch Algorithm 1. q: (total_q, Hq, D); k, v: (total_k, Hk, D), or (pages, page_size, Hk, D)
    with block_table. Dense batches pass cu_seqlens None and seqlen_q/k per sequence; varlen batches
    pass the max lengths. Returns out (total_q, Hq, D) and lse (Hq, total_q) fp32."""
    total_q, heads_q, head_dim = q.shape
    heads_k = k.shape[-2]
    out = torch.empty_like(q)
    lse = torch.empty(heads_q, total_q, dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0:
        return out, lse
    block_m, block_n, num_warps, num_stages = config or fwd_config(head_dim, q.dtype, q.device)
    paged = block_table is not None
    page_size = k.shape[1] if paged else 1
    grid = (cdiv(seqlen_q, block_m), heads_q, batch)
    _fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table,
        seqlen_q, seqlen_k, heads_q // heads_k, scale * LOG2E, window_left, window_right,
        q.stride(-3), q.stride(-2), k.stride(-3), k.stride(-2), k.stride(0) if paged else 0,
        block_table.stride(0) if paged else 0, lse.stride(0),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, VARLEN=cu_seqlens_q is not None, PAGED=paged,
        PAGE_SIZE=page_size, REVERSE=window_right == 0, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out, lse
