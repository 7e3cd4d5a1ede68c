"""nano_flashattn: FlashAttention-2 (arXiv 2307.08691) forward and backward, Flash-Decoding and paged-KV
attention in Triton, behind flash-attn's API. Depends on torch and Triton only.

    flash_attn_func(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False)
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           softmax_scale=None, block_table=None, window_size=(-1, -1), return_lse=False)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None,
                            num_splits=0, causal=False, return_lse=False)

Each exists three times: `*_torch` (reference.py, the specification and the CPU path), `*_triton`
(interface.py, the kernels; on CPU tensors they run under TRITON_INTERPRET=1) and the plain name,
which dispatches: CUDA tensors go to Triton, everything else to the reference. The kernels take every
head_dim that is a multiple of 8 from 16 to 256 (`HEAD_DIMS`); the references take any. Arguments are
checked (ValueError naming the argument); `with trusted_metadata():` skips the few checks that read tensor
values (a device sync each), for engines that validated that metadata on the host.

Performance layers (`layers/`: Hopper kernels, the split head axis, programmatic dependent launch) run by
default wherever they apply; `with performance_layers(False):` runs the paper path alone, `load_layers()`
loads them now and returns those missing, and `REGISTRY` (dispatch.py) is where they register.
"""

from __future__ import annotations

import torch

from .checks import HEAD_DIMS, trusted_metadata
from .dispatch import REGISTRY, load_layers, performance_layers
from .reference import (
    flash_attn_func_torch,
    flash_attn_varlen_func_torch,
    flash_attn_with_kvcache_torch,
    store_kv_fp8_torch,
)

try:
    import triton  # noqa: F401
except ImportError:  # no Triton for this platform: references only
    HAS_TRITON = False
else:
    HAS_TRITON = True

if HAS_TRITON:  # outside the try: a bug in a kernel module must be an error, not a silent fallback
    from .interface import (
        flash_attn_func_triton,
        flash_attn_varlen_func_triton,
        flash_attn_with_kvcache_triton,
    )
    from .kv_fp8 import store_kv_fp8 as store_kv_fp8_triton
else:

    def _no_triton(*args, **kwargs):
        raise RuntimeError("Triton is not installed; use the *_torch references")

    flash_attn_func_triton = flash_attn_varlen_func_triton = flash_attn_with_kvcache_triton = _no_triton
    store_kv_fp8_triton = _no_triton

__all__ = [
    "HEAD_DIMS",
    "REGISTRY",
    "flash_attn_func",
    "flash_attn_func_torch",
    "flash_attn_func_triton",
    "flash_attn_varlen_func",
    "flash_attn_varlen_func_torch",
    "flash_attn_varlen_func_triton",
    "flash_attn_with_kvcache",
    "flash_attn_with_kvcache_torch",
    "flash_attn_with_kvcache_triton",
    "load_layers",
    "performance_layers",
    "store_kv_fp8",
    "store_kv_fp8_torch",
    "store_kv_fp8_triton",
    "trusted_metadata",
    "use_triton",
]


def use_triton(q) -> bool:
    """The dispatch rule: Triton for plain CUDA tensors (when Triton is importable), the torch reference
    else; tensor subclasses (DTensor, AsyncCollectiveTensor, ...) own no data pointer a kernel could read."""
    return HAS_TRITON and type(q) in (torch.Tensor, torch.nn.Parameter) and q.is_cuda


def flash_attn_func(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False):
    """Attention softmax(softmax_scale * q k^T + mask) v, FlashAttention-2 style, with autograd.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_k, head_dim) with heads_q a
    multiple of heads_k (GQA/MQA); head_dim a multiple of 8 from 16 to 256 on the kernels (any on the
    reference); fp16, bf16 or fp32.
    causal and window_size=(left, right) mask query i from key j unless
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (bottom-right aligned,
    -1 = unbounded; causal sets right = 0). softmax_scale defaults to 1/sqrt(head_dim).
    Returns out (like q), and with return_lse the natural-log log-sum-exp (batch, heads_q, seqlen_q),
    fp32, -inf for a query that sees no key (whose output is 0).
    """
    impl = flash_attn_func_triton if use_triton(q) else flash_attn_func_torch
    return impl(q, k, v, causal, softmax_scale, window_size, return_lse)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           softmax_scale=None, block_table=None, window_size=(-1, -1), return_lse=False,
                           k_scale=None, v_scale=None, tree_mask=None):
    """flash_attn_func over a packed batch of variable-length sequences.

    q: (total_q, heads_q, head_dim), sequence b its rows cu_seqlens_q[b]:cu_seqlens_q[b+1]; k, v likewise
    with cu_seqlens_k (int32, (batch + 1,)); max_seqlen_* bound the lengths (they size the grid, so no
    device sync is needed). With block_table (int32, (batch, max_pages)) k and v are a paged cache
    (num_pages, page_size, heads_k, head_dim) and sequence b's key j lives in page
    block_table[b, j // page_size] (inference only); a paged cache may be float8_e4m3fn codes, read as
    code * k_scale / v_scale (fp32, 1 or heads_k elements; `store_kv_fp8` writes it). Autograd without
    block_table.
    tree_mask (tree attention, SpecInfer §4.2: verifying a draft tree in one forward): bool
    (total_q, max_seqlen_q); sequence b's query rows are its new tokens, the last of its keys; row r
    sees every earlier key and new token t of its sequence iff tree_mask[r, t] (its ancestors and
    itself; nodes in topological order, so the bits lie at or left of the row's own, which is set).
    Causal is implied, window_size must be (-1, -1); inference only. None: no cost, as before.
    Returns out (total_q, heads_q, head_dim) and with return_lse the LSE (heads_q, total_q).
    Rows past cu_seqlens_q[-1] belong to no sequence: the kernels leave them unwritten.
    """
    impl = flash_attn_varlen_func_triton if use_triton(q) else flash_attn_varlen_func_torch
    return impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                softmax_scale=softmax_scale, block_table=block_table, window_size=window_size,
                return_lse=return_lse, k_scale=k_scale, v_scale=v_scale, tree_mask=tree_mask)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None,
                            num_splits=0, causal=False, return_lse=False, k_scale=None, v_scale=None):
    """Decode attention (Flash-Decoding) of a few new query tokens against a KV cache.

    q: (batch, seqlen_q, heads_q, head_dim); cache_seqlens: int32 (batch,) or an int, the number of
    valid cache rows of each sequence; k_cache, v_cache: contiguous (batch, max_seqlen, heads_k,
    head_dim), or paged (num_pages, page_size, heads_k, head_dim) with block_table (batch, max_pages)
    and page_size a power of two >= 16. num_splits: how many slices the keys are split into (0: chosen
    from the SM count and the cache size). causal aligns the new tokens to the end of the cache.
    An FP8 cache (vLLM's kv_cache_dtype="fp8"): float8_e4m3fn k_cache / v_cache with fp32 k_scale /
    v_scale of 1 (per tensor) or heads_k (per kv head) elements, values code * scale.
    Returns out like q, and with return_lse the LSE (batch, heads_q, seqlen_q).
    """
    impl = flash_attn_with_kvcache_triton if use_triton(q) else flash_attn_with_kvcache_torch
    return impl(q, k_cache, v_cache, cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
                num_splits=num_splits, causal=causal, return_lse=return_lse, k_scale=k_scale,
                v_scale=v_scale)


def store_kv_fp8(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """Write new K/V rows (..., heads_k, head_dim) into an FP8 paged cache (vLLM's kv_cache_dtype="fp8"):
    float8_e4m3fn k_cache / v_cache (num_blocks, block_size, heads_k, head_dim), row i to slot
    slot_mapping[i] = block * block_size + offset (negative: skipped), as E4M3(clamp(x / scale, ±448))
    with fp32 k_scale / v_scale of 1 (per tensor) or heads_k (per kv head) elements."""
    impl = store_kv_fp8_triton if use_triton(k) else store_kv_fp8_torch
    impl(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
