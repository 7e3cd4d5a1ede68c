"""Plain-torch attention: the specification the Triton kernels are tested against, and the CPU path.

It materialises the full score matrix S = softmax_scale * Q K^T (FlashAttention-2 section 2.2, the
"standard attention implementation"), so it is O(seqlen^2) in memory: fine for tests and CPUs.

Conventions shared with the kernels (and with flash-attn):
  * layout (batch, seqlen, heads, head_dim); packed varlen tensors are (total_tokens, heads, head_dim);
  * GQA/MQA: query head h reads key/value head h // (heads_q // heads_k);
  * masks are aligned to the bottom-right: query i may see key j iff
        i + diag - left <= j <= i + diag + right,   diag = seqlen_k - seqlen_q,
    causal is right = 0, and -1 means unbounded on that side;
  * tree attention (SpecInfer §4.2, `tree_mask` of the varlen function): each sequence's new rows are
    its last keys; every earlier key is visible, and new row i sees new key t iff tree_mask[row, t];
  * LSE is the natural-log log-sum-exp of the scaled scores, (batch, heads, seqlen_q) or
    (heads, total_q) for varlen. A query that sees no key gets output 0 and LSE -inf.
"""

from __future__ import annotations

import torch

from .checks import (
    check_dense,
    check_kv_scales,
    check_kvcache,
    check_store_fp8,
    check_tree_mask,
    check_varlen,
)


def attention_torch(q, k, v, scale: float, left: int, right: int, upcast: bool = True,
                    mask: torch.Tensor | None = None):
    """softmax(scale * q k^T + mask) v for dense (B, M, Hq, D) q and (B, N, Hk, D) k, v; `mask`, a bool
    (M, N), hides keys the window shows (tree attention).

    `upcast` computes in fp32 (fp64 stays fp64); `upcast=False` computes in the input dtype, which is
    the "reference in the same low precision" of FlashAttention's error rule. Returns (out, lse)."""
    dtype = q.dtype
    if upcast and dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    m, n = q.shape[1], k.shape[1]
    s = torch.einsum("bmhd,bnhd->bhmn", q, k) * scale
    i = torch.arange(m, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    diag = n - m
    visible = (j >= i + diag - left) & (j <= i + diag + right)
    if mask is not None:
        visible = visible & mask
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, dim=-1)
    # softmax by hand so fully-masked rows give p = 0 instead of NaN
    p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse).to(s.dtype)[..., None])
    out = torch.einsum("bhmn,bnhd->bmhd", p, v)
    return out.to(dtype), lse


def flash_attn_func_torch(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False):
    """Reference of `flash_attn_func` (same signature); differentiable through torch autograd."""
    scale, left, right = check_dense(q, k, v, causal, softmax_scale, window_size)
    out, lse = attention_torch(q, k, v, scale, left, right)
    return (out, lse) if return_lse else out


def _paged_rows(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` token rows of one sequence whose pages are listed in `table_row`."""
    page = cache.shape[1]
    pages = table_row[: (length + page - 1) // page].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def dequantize_kv(rows: torch.Tensor, scale: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """An FP8 cache's rows (..., heads_k, head_dim) as values, code * scale (flat, 1 or heads_k
    elements), in fp32 (fp64 for an fp64 q); a 16-bit cache's rows as they are."""
    if scale is None:
        return rows
    dtype = torch.promote_types(q.dtype, torch.float32)
    return rows.to(dtype) * scale.to(dtype)[:, None]


def flash_attn_varlen_func_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal=False, softmax_scale=None, block_table=None, window_size=(-1, -1),
                                 return_lse=False, k_scale=None, v_scale=None, tree_mask=None):
    """Reference of `flash_attn_varlen_func`: one dense attention per packed sequence (an FP8 paged
    cache dequantized first). With tree_mask (checks.check_tree_mask), sequence b's M new rows see its
    first N - M keys and, of its last M, those tree_mask[rows of b, :M] shows."""
    scale, left, right, max_q, _ = check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, block_table,
        window_size,
    )
    if tree_mask is not None:
        left, right = check_tree_mask(tree_mask, q, cu_seqlens_q, cu_seqlens_k, max_q, window_size)
    k_scale, v_scale = check_kv_scales(q, k, k_scale, v_scale, names=("k", "v"))
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    # rows outside every sequence (before cu_seqlens_q[0] or past cu_seqlens_q[-1]) stay 0, their LSE -inf
    out = q.new_zeros(q.shape)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        qb = q[cq[b] : cq[b + 1]]
        if block_table is None:
            kb, vb = k[ck[b] : ck[b + 1]], v[ck[b] : ck[b + 1]]
        else:
            n = ck[b + 1] - ck[b]
            kb = dequantize_kv(_paged_rows(k, block_table[b], n), k_scale, q)
            vb = dequantize_kv(_paged_rows(v, block_table[b], n), v_scale, q)
        mask = None
        if tree_mask is not None:
            m, n = qb.shape[0], kb.shape[0]
            mask = torch.ones(m, n, dtype=torch.bool, device=q.device)
            mask[:, n - m :] = tree_mask[cq[b] : cq[b + 1], :m]
        o, lse_b = attention_torch(qb[None], kb[None], vb[None], scale, left, right, mask=mask)
        out[cq[b] : cq[b + 1]] = o[0]
        lse[:, cq[b] : cq[b + 1]] = lse_b[0]
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache_torch(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None,
                                  num_splits=0, causal=False, return_lse=False, k_scale=None, v_scale=None):
    """Reference of `flash_attn_with_kvcache`: q (B, Sq, Hq, D) attends to the first cache_seqlens[b]
    rows of sequence b's cache (row b of a contiguous cache, or the pages block_table[b] lists; an FP8
    cache dequantized first). `num_splits` only changes how the kernel splits the work, so the
    reference ignores it."""
    scale, cache_seqlens = check_kvcache(
        q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, num_splits
    )
    k_scale, v_scale = check_kv_scales(q, k_cache, k_scale, v_scale)
    left, right = (1 << 30), (0 if causal else 1 << 30)
    outs, lses = [], []
    for b, n in enumerate(cache_seqlens.tolist()):
        if block_table is None:
            kb, vb = k_cache[b, :n], v_cache[b, :n]
        else:
            kb, vb = _paged_rows(k_cache, block_table[b], n), _paged_rows(v_cache, block_table[b], n)
        kb, vb = dequantize_kv(kb, k_scale, q), dequantize_kv(vb, v_scale, q)
        o, lse = attention_torch(q[b : b + 1], kb[None], vb[None], scale, left, right)
        outs.append(o)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if return_lse else out


def store_kv_fp8_torch(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """Reference of `store_kv_fp8`: E4M3(clamp(x / scale, ±448)) scattered into the cache slots (one
    index_copy_ each; a negative slot is skipped)."""
    k, v, k_scale, v_scale = check_store_fp8(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    for x, cache, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        codes = (x.float() / s[:, None]).clamp(-448.0, 448.0).to(cache.dtype).view(torch.uint8)
        rows = cache.view(torch.uint8).view(-1, *cache.shape[2:])  # index_copy_ takes no float8
        rows.index_copy_(0, slot_mapping[keep], codes[keep])
