"""FlashAttention-2 forward pass (Dao 2023, arXiv 2307.08691, Algorithm 1), in Triton.

One program owns one tile Q_i of BLOCK_M query rows of one head and keeps it on chip (Algorithm 1, line 4);
K_j and V_j stream through in tiles of BLOCK_N rows (lines 6-11) and the output is normalised once, at the
end (line 12). The softmax is the online softmax of section 3.1.1: per row we keep the running maximum m and
the running sum l of the *unnormalised* exponentials, and rescale the accumulator by exp(m_old - m_new)
when the maximum grows.

Two choices of the paper's CUDA code keep the inner loop short:
  * base 2: exp(x) = exp2(x * log2(e)), with log2(e) folded into the softmax scale, so a score costs one
    FMA (s * qk_scale - m) and one exp2 (the GPU's native MUFU.EX2);
  * masks only where needed (section 3.1.1, "causal masking"): a tile whose every (query, key) pair is
    visible runs without mask arithmetic; only the tiles crossing the causal diagonal, the window edges or
    the sequence end pay for it. `tile_range` splits the key axis into the three runs.

A tile's head axis is BLOCK_D = head_dim rounded up to a power of two (Triton's tiles have power-of-two
shapes); when they differ, loads fill the padding with zeros, which adds nothing to Q K^T or P V, and stores
skip it. The same loop serves dense batches, packed variable-length batches (cu_seqlens), K/V read from a
paged cache (block_table), and Flash-Decoding (decode.py), which runs it over one slice of the keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import cdiv, scale_stride
from .configs import block_d, fwd_config

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): converts the kernel's base-2 log-sum-exp back to natural log
# the same, as compile-time constants for kernels
LOG2E_C, LN2_C = tl.constexpr(LOG2E), tl.constexpr(LN2)


@triton.jit
def load_tile(ptrs, rows_ok, d_ok, MASK_ROWS: tl.constexpr, PAD_D: tl.constexpr):
    """Load a tile of Q / K / V / dO rows, masking only what can lie outside the tensor: rows past the
    sequence end (MASK_ROWS) and the padded head axis (PAD_D: head_dim < BLOCK_D). Masked lanes read 0."""
    if MASK_ROWS:
        x = tl.load(ptrs, mask=rows_ok & d_ok if PAD_D else rows_ok, other=0.0)
    elif PAD_D:
        x = tl.load(ptrs, mask=d_ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


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
def tree_bits(tree, rows, cols, shift, n, stride_tr):
    """Tree attention (SpecInfer §4.2): the new rows are the last n - shift keys; key c before them is
    visible, new key t = c - shift is visible to new row r iff tree[r, t] (r's ancestors and itself)."""
    t = cols[None, :] - shift
    new = (t >= 0) & (rows[:, None] + shift < n)
    bit = tl.load(tree + rows[:, None] * stride_tr + t, mask=new, other=0)
    return (t < 0) | (bit != 0)


@triton.jit
def kv_offsets(offs_n, bt_row, n, stride_kt, stride_kp,
               PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets of key/value rows `offs_n` of one sequence.

    Contiguous: row j is j * stride_kt past the sequence's first row. Paged (vLLM's PagedAttention):
    row j lives in page block_table[j // PAGE_SIZE], at slot j % PAGE_SIZE."""
    if PAGED:
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=offs_n < n, other=0).to(tl.int64)
        return page * stride_kp + (offs_n % PAGE_SIZE) * stride_kt
    else:
        return offs_n * stride_kt


@triton.jit
def fwd_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, offs_m, lo, hi, n, shift, lo_w, hi_w,
              qk_scale, stride_kt, stride_kp,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
              DOT_PRECISION: tl.constexpr, tree=None, stride_tr=0, TREE: tl.constexpr = False):
    """Algorithm 1, lines 6-11, over the key tiles j in [lo, hi): S = Q_i K_j^T, online softmax, O += P V_j.

    k_base, v_base: K and V offset to this kv head (and, unpaged, to the sequence's first key row).
    m_i is the running row max of the *base-2* scaled scores; l_i the running sum of exp2(s - m_i).
    TREE: masked tiles also apply `tree_bits` (tree: the mask's row of the sequence's first query)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    pad_d: tl.constexpr = HEAD_DIM < BLOCK_D
    for start_n in range(lo, hi, BLOCK_N):  # line 6: for 1 <= j <= T_c
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv = kv_offsets(offs_n, bt_row, n, stride_kt, stride_kp, PAGED, PAGE_SIZE)
        # line 7: load K_j (transposed) and, below, V_j
        # (an FP8 cache's E4M3 codes widen to q's dtype: exact, every E4M3 value is an fp16 / bf16
        # value; tl.dot sums the products in fp32)
        k_t = load_tile(k_base + kv[None, :] + offs_d[:, None], offs_n[None, :] < n, d_ok[:, None],
                        MASKED, pad_d).to(q.dtype)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION)  # line 8: S_ij = Q_i K_j^T
        if MASKED:
            seen = visible(offs_m, offs_n, shift, lo_w, hi_w, n)
            if TREE:
                seen = seen & tree_bits(tree, offs_m, offs_n, shift, n, stride_tr)
            s = tl.where(seen, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no visible key yet keeps m = -inf; subtract 0 instead, so that
            # exp2(-inf - (-inf)) = NaN never happens and its p stays exactly 0
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
        else:
            # line 9: m_ij (qk_scale > 0 commutes with max), then P~_ij: one FMA + one exp2 per score
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)  # line 9: rescale what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)  # line 9: l_ij
        v = load_tile(v_base + kv[:, None] + offs_d[None, :], offs_n[:, None] < n, d_ok[None, :],
                      MASKED, pad_d).to(q.dtype)
        # line 10: O_ij = diag(alpha) O_i(j-1) + P~_ij V_j
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(first row, length) of sequence b's queries and keys in the packed (tokens, heads, dim) tensors."""
    if VARLEN:
        q_start = tl.load(cu_seqlens_q + b)
        k_start = tl.load(cu_seqlens_k + b)
        q_len = tl.load(cu_seqlens_q + b + 1) - q_start
        return q_start, q_len, k_start, tl.load(cu_seqlens_k + b + 1) - k_start
    else:
        return b * seqlen_q, seqlen_q, b * seqlen_k, seqlen_k


# Lengths, the block table's row stride (the widest block table of an engine step) and the LSE's head stride
# (= the step's token count) change from call to call; Triton would compile a variant per "multiple of 16" /
# "equals 1" pattern of each, mid-serving (a ~1 s stall: an H200 serving run built one inside a timed rate).
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group", "window_left", "window_right",
                               "stride_bt", "stride_lse_h", "stride_tr"])
def _fwd_kernel(Q, K, V, Out, LSE, cu_seqlens_q, cu_seqlens_k, block_table, K_scale, V_scale,
                seqlen_q, seqlen_k, group, qk_scale, window_left, window_right,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_kp, stride_bt, stride_lse_h,
                stride_ks, stride_vs, Tree, stride_tr,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, VARLEN: tl.constexpr, PAGED: tl.constexpr,
                PAGE_SIZE: tl.constexpr, REVERSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                FP8_KV: tl.constexpr, TREE: tl.constexpr):
    """Algorithm 1, lines 4-15, for one query tile Q_i of one head of one sequence (line 3's loop is the grid:
    (cdiv(max_seqlen_q, BLOCK_M), heads_q, batch)). FP8_KV: E4M3 K/V codes, scaled as in decode.py.
    TREE: tree attention (`tree_bits`) over the new rows, Tree a (total_q, stride_tr) byte mask."""
    pid_m = tl.program_id(0)
    # causal: the last query tiles see the most keys; start them first so the tail is short
    if REVERSE:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, k_start, k_len = seq_bounds(b, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k,
                                                VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    hk = h // group  # GQA/MQA: `group` query heads share one key/value head
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok, d_ok = offs_m < q_len, offs_d < HEAD_DIM
    pad_d: tl.constexpr = HEAD_DIM < BLOCK_D
    q_off = q_start.to(tl.int64) * stride_qt + h * stride_qh
    q_ptrs = Q + q_off + offs_m[:, None] * stride_qt + offs_d[None, :]
    q = load_tile(q_ptrs, row_ok[:, None], d_ok[None, :], True, pad_d)  # line 4: load Q_i
    if PAGED:
        k_off = hk * stride_kh
        bt_row = block_table + b.to(tl.int64) * stride_bt
    else:
        k_off = k_start.to(tl.int64) * stride_kt + hk * stride_kh
        bt_row = block_table  # unused
    k_base, v_base = K + k_off, V + k_off
    k_scale, v_scale = 1.0, 1.0  # FP8: K's scale joins the softmax scale, V's the normalisation
    if FP8_KV:
        k_scale = tl.load(K_scale + hk * stride_ks)
        v_scale = tl.load(V_scale + hk * stride_vs)
    qk_scale = qk_scale * k_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # line 5: O_i = 0, l_i = 0, m_i = -inf
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    diag = k_len - q_len  # bottom-right alignment: query i sits at key position i + diag
    r1 = tl.minimum(start_m + BLOCK_M, q_len)
    lo, full_lo, full_hi, hi = tile_range(start_m, r1, shift=diag, lo_w=window_left,
                                          hi_w=window_right, n=k_len, BLOCK=BLOCK_N)
    if TREE:  # every tile holding a new key is masked: the unmasked run stops before the first
        full_hi = tl.minimum(full_hi, tl.maximum(diag // BLOCK_N * BLOCK_N, full_lo))
        Tree += q_start.to(tl.int64) * stride_tr
    # lines 6-11 in three runs: the left window edge (masked), the fully visible middle (no mask
    # arithmetic), the causal diagonal / right window edge / sequence end (masked)
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, offs_m,
                              lo=lo, hi=full_lo, n=k_len, shift=diag,
                              lo_w=window_left, hi_w=window_right, qk_scale=qk_scale,
                              stride_kt=stride_kt, stride_kp=stride_kp,
                              HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                              PAGED=PAGED, PAGE_SIZE=PAGE_SIZE, MASKED=True, TREE=TREE,
                              DOT_PRECISION=DOT_PRECISION, tree=Tree, stride_tr=stride_tr)
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, offs_m,
                              lo=full_lo, hi=full_hi, n=k_len, shift=diag,
                              lo_w=window_left, hi_w=window_right, qk_scale=qk_scale,
                              stride_kt=stride_kt, stride_kp=stride_kp,
                              HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                              PAGED=PAGED, PAGE_SIZE=PAGE_SIZE, MASKED=False,
                              DOT_PRECISION=DOT_PRECISION)
    acc, l_i, m_i = fwd_tiles(acc, l_i, m_i, q, k_base, v_base, bt_row, offs_m,
                              lo=full_hi, hi=hi, n=k_len, shift=diag,
                              lo_w=window_left, hi_w=window_right, qk_scale=qk_scale,
                              stride_kt=stride_kt, stride_kp=stride_kp,
                              HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                              PAGED=PAGED, PAGE_SIZE=PAGE_SIZE, MASKED=True, TREE=TREE,
                              DOT_PRECISION=DOT_PRECISION, tree=Tree, stride_tr=stride_tr)

    # line 12: O_i = diag(l_i)^-1 acc; line 13: L_i = m_i + log(l_i).
    # A row that saw no key: O = 0, L = -inf.
    empty = l_i == 0.0
    l_i = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * LN2_C)
    o_ptrs = Out + q_off + offs_m[:, None] * stride_qt + offs_d[None, :]  # line 14: write O_i
    o_ok = row_ok[:, None] & d_ok[None, :]
    tl.store(o_ptrs, (acc * v_scale / l_i[:, None]).to(Out.dtype.element_ty), mask=o_ok)
    tl.store(LSE + h * stride_lse_h + q_start + offs_m, lse, mask=row_ok)  # line 15: write L_i


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision products (tl.dot defaults to TF32 on GPUs); others: native MMA
    return "ieee" if dtype == torch.float32 else "tf32"


def attention_forward(q, k, v, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, block_table,
                      scale, window_left, window_right, config=None, k_scale=None, v_scale=None,
                      tree_mask=None):
    """Launch Algorithm 1. q: (total_q, Hq, D); k, v: (total_k, Hk, D), or (pages, page_size, Hk, D)
    with block_table (float8_e4m3fn with flat fp32 k_scale, v_scale of 1 or Hk elements: an FP8 cache).
    Dense batches pass cu_seqlens None and seqlen_q/k per sequence; varlen batches pass the max
    lengths. tree_mask: bool (total_q, max_seqlen_q), tree attention over each sequence's new rows
    (checks.check_tree_mask; the window must be causal). Returns out (total_q, Hq, D), lse (Hq, total_q).

    config: (BLOCK_M, BLOCK_N, num_warps, num_stages), default `configs.fwd_config`."""
    head_dim = q.shape[2]
    config = config or fwd_config(head_dim, q.dtype, q.device)
    return launch_forward(_fwd_kernel, q, k, v, batch, seqlen_q, seqlen_k, cu_seqlens_q,
                          cu_seqlens_k, block_table, scale, window_left, window_right, config,
                          HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), K_scale=k_scale,
                          V_scale=v_scale, FP8_KV=k_scale is not None,
                          stride_ks=0 if k_scale is None else scale_stride(k_scale),
                          stride_vs=0 if v_scale is None else scale_stride(v_scale),
                          TREE=tree_mask is not None,
                          Tree=None if tree_mask is None else tree_mask.view(torch.uint8),
                          stride_tr=0 if tree_mask is None else tree_mask.stride(0))


def launch_forward(kernel, q, k, v, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k,
                   block_table, scale, window_left, window_right, config, **head_axis):
    """Algorithm 1's grid (line 3's loop: one program per query tile, query head and sequence) for `kernel`;
    `head_axis`: the kernel's head-dim constexprs (and forward.py's: the FP8 scales)."""
    total_q, heads_q = q.shape[:2]
    out = torch.empty_like(q)
    lse = torch.empty(heads_q, total_q, dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0:
        return out, lse
    block_m, block_n, num_warps, num_stages = config
    paged = block_table is not None
    kernel[(cdiv(seqlen_q, block_m), heads_q, batch)](
        Q=q, K=k, V=v, Out=out, LSE=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        block_table=block_table, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        group=heads_q // k.shape[-2], qk_scale=scale * LOG2E,
        window_left=window_left, window_right=window_right,
        stride_qt=q.stride(-3), stride_qh=q.stride(-2),
        stride_kt=k.stride(-3), stride_kh=k.stride(-2), stride_kp=k.stride(0) if paged else 0,
        stride_bt=block_table.stride(0) if paged else 0, stride_lse_h=lse.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, VARLEN=cu_seqlens_q is not None,
        PAGED=paged, PAGE_SIZE=k.shape[1] if paged else 1, REVERSE=window_right == 0,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
        **head_axis)
    return out, lse
