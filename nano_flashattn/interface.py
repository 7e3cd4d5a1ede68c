"""flash-attn's three entry points on the Triton kernels (`*_triton`), with autograd, and the dispatch point
where performance layers plug in.

The kernels work on packed (tokens, heads, head_dim) tensors; a dense (batch, seqlen, heads, head_dim)
batch is the special case of equal lengths, viewed without a copy. These functions run anywhere Triton
runs: on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (how CI tests them).

Every kernel launch goes through `run_kernel(kind, **arguments)`: the first performance layer registered at
that point (dispatch.py's REGISTRY: "forward", "backward", "decode") whose predicate accepts the arguments,
else the paper path's launcher (`attention_forward`, `attention_backward`, `decode_forward`). A layer takes
the paper launcher's keyword arguments and returns what it returns. Nothing here imports a layer: the
registry finds them (`layers/`); deleting one runs the paper path in its place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .backward import attention_backward
from .checks import (
    check_dense,
    check_kernel_dtype,
    check_kernel_head_dim,
    check_kv_scales,
    check_kvcache,
    check_tree_mask,
    check_varlen,
)
from .decode import decode_forward
from .dispatch import REGISTRY
from .forward import attention_forward
from .registry import layers_enabled, performance_layers

PAPER_KERNELS: dict[str, Callable] = {
    "forward": attention_forward, "backward": attention_backward, "decode": decode_forward,
}


def run_kernel(kind: str, **arguments):
    """Launch `kind` with a registered layer that applies to these arguments, else with the paper path."""
    layer = REGISTRY.select(kind, **arguments)
    return (layer or PAPER_KERNELS[kind])(**arguments)


class FlashAttnFunction(torch.autograd.Function):
    """Algorithm 1 forward, Algorithm 2 backward; saves q, k, v, O and the LSE (never P)."""

    @staticmethod
    def forward(ctx, q, k, v, batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, scale, left, right):
        ctx.launch_args = dict(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, scale=scale,
                               window_left=left, window_right=right)
        # autograd runs the backward on a thread of its own, outside the forward's context: carry the
        # performance-layer switch across, so a paper-path forward gets a paper-path backward
        ctx.layers = layers_enabled()
        out, lse = run_kernel("forward", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              block_table=None, **ctx.launch_args)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        with performance_layers(ctx.layers):
            dq, dk, dv = run_kernel("backward", do=dout, q=q, k=k, v=v, out=out, lse=lse,
                                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **ctx.launch_args)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (B*S, H, D) packed rows; a copy only if t is not contiguous."""
    return t.contiguous().view(-1, *t.shape[-2:])


def _check_kernel_inputs(q: torch.Tensor) -> None:
    check_kernel_dtype(q)
    check_kernel_head_dim(q.shape[-1])


def flash_attn_func_triton(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), return_lse=False):
    """FlashAttention-2 on (batch, seqlen, heads, head_dim) tensors; see `nano_flashattn.flash_attn_func`."""
    scale, left, right = check_dense(q, k, v, causal, softmax_scale, window_size)
    _check_kernel_inputs(q)
    batch, seqlen_q, heads_q, head_dim = q.shape
    out, lse = FlashAttnFunction.apply(_rows(q), _rows(k), _rows(v), batch, seqlen_q, k.shape[1], None, None,
                                       scale, left, right)
    out = out.view(batch, seqlen_q, heads_q, head_dim)
    if not return_lse:
        return out
    return out, lse.view(heads_q, batch, seqlen_q).transpose(0, 1)


def flash_attn_varlen_func_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  causal=False, softmax_scale=None, block_table=None, window_size=(-1, -1),
                                  return_lse=False, k_scale=None, v_scale=None, tree_mask=None):
    """Packed variable-length FlashAttention-2; see `nano_flashattn.flash_attn_varlen_func`."""
    scale, left, right, max_q, max_k = check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, block_table,
        window_size,
    )
    k_scale, v_scale = check_kv_scales(q, k, k_scale, v_scale, names=("k", "v"))
    if tree_mask is not None:
        left, right = check_tree_mask(tree_mask, q, cu_seqlens_q, cu_seqlens_k, max_q, window_size)
        tree_mask = tree_mask.contiguous()
    _check_kernel_inputs(q)
    batch = cu_seqlens_q.numel() - 1
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if block_table is None and tree_mask is None:
        out, lse = FlashAttnFunction.apply(q, k, v, batch, max_q, max_k, cu_seqlens_q, cu_seqlens_k, scale,
                                           left, right)
    else:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            what = "block_table: no backward through a paged KV cache" if tree_mask is None else (
                "tree_mask: no backward through tree attention (inference only)")
            raise ValueError(f"{what}; call under torch.no_grad()")
        paged = dict(q=q, k=k, v=v, batch=batch, seqlen_q=max_q, seqlen_k=max_k,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     block_table=None if block_table is None else block_table.contiguous(),
                     scale=scale, window_left=left, window_right=right)
        if k_scale is None and tree_mask is None:
            out, lse = run_kernel("forward", **paged)
        else:  # an FP8 cache or a tree mask: forward.py's kernel (the layers read neither)
            out, lse = attention_forward(**paged, k_scale=k_scale, v_scale=v_scale, tree_mask=tree_mask)
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache_triton(q, k_cache, v_cache, cache_seqlens, block_table=None, softmax_scale=None,
                                   num_splits=0, causal=False, return_lse=False, k_scale=None, v_scale=None):
    """Flash-Decoding over a contiguous or paged KV cache; see `nano_flashattn.flash_attn_with_kvcache`."""
    scale, cache_seqlens = check_kvcache(
        q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, num_splits
    )
    k_scale, v_scale = check_kv_scales(q, k_cache, k_scale, v_scale)
    _check_kernel_inputs(q)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(
            f"k_cache / v_cache strides {k_cache.stride()} / {v_cache.stride()}: the caches must share "
            "strides, with a contiguous head_dim"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table is not None:
        block_table = block_table.contiguous()
    with torch.no_grad():  # inference only
        out, lse = run_kernel("decode", q=q, k_cache=k_cache, v_cache=v_cache,
                              cache_seqlens=cache_seqlens.contiguous(), block_table=block_table, scale=scale,
                              causal=causal, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    return (out, lse) if return_lse else out
