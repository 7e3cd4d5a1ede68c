"""Rotary position embedding (Su et al. 2021, RoFormer eq. 34) in Triton, HF's "rotate_half" layout.

    out[..., :D/2] = x1 * cos - x2 * sin          x1 = x[..., :D/2], x2 = x[..., D/2:]
    out[..., D/2:] = x2 * cos + x1 * sin

The rotation is orthogonal, so its backward is the rotation by -theta: the same kernel with sin
negated. cos/sin are (tokens, D/2), shared by all heads of a token, so HBM traffic is x in, out out.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import cdiv, needs_grad, next_pow2
from .reference import check_rope_args


@triton.jit(do_not_specialize=["n_rows"])  # the token count varies per call: one compiled variant
def _rope_kernel(
    X, COS, SIN, OUT,
    stride_xt, stride_xh, stride_ct, stride_st, stride_ot, stride_oh,
    n_rows, n_heads, half,
    NEG_SIN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # A row is one (token, head) pair. Blocks of rows rather than one token per program keep
    # programs large when a token has few heads (8 GQA key heads); cos/sin are re-read per head, but
    # from L1/L2, since the rows of one token are adjacent.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows = rows.to(tl.int64)
    t, h = rows // n_heads, rows % n_heads
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < half)[None, :]
    c = tl.load(COS + t[:, None] * stride_ct + d[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + t[:, None] * stride_st + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if NEG_SIN:
        s = -s
    x1_ptr = X + t[:, None] * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(x1_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptr + half, mask=mask, other=0.0).to(tl.float32)
    o1_ptr = OUT + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(o1_ptr, (x1 * c - x2 * s).to(OUT.dtype.element_ty), mask=mask)
    tl.store(o1_ptr + half, (x2 * c + x1 * s).to(OUT.dtype.element_ty), mask=mask)


def _tokens(t: torch.Tensor, lead: tuple[int, ...], last: tuple[int, ...]) -> torch.Tensor:
    """Flatten the (B, S) or (T,) token dims into one, keeping the last dim unit-stride."""
    t = t.expand(*lead, *last).reshape(-1, *last)
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=64)
def _launch_config(half: int) -> tuple[int, int, int]:
    """(BLOCK_R rows, BLOCK_D, num_warps): ~2K rotated pairs per program (32 heads of 128)."""
    block_d = next_pow2(half)
    return max(1, 2048 // block_d), block_d, 4


def _rope(x3d: torch.Tensor, cos2d: torch.Tensor, sin2d: torch.Tensor, neg_sin: bool) -> torch.Tensor:
    n_tok, n_heads, dim = x3d.shape
    out = torch.empty((n_tok, n_heads, dim), dtype=x3d.dtype, device=x3d.device)
    block_r, block_d, num_warps = _launch_config(dim // 2)
    n_rows = n_tok * n_heads
    if n_rows:
        _rope_kernel[(cdiv(n_rows, block_r),)](
            x3d, cos2d, sin2d, out,
            x3d.stride(0), x3d.stride(1), cos2d.stride(0), sin2d.stride(0), out.stride(0), out.stride(1),
            n_rows, n_heads, dim // 2,
            NEG_SIN=neg_sin, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps,
        )  # fmt: skip
    return out


def _forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rotated x, cos2d, sin2d): the token dims flattened, cos/sin expanded to them (backward reuses both)."""
    lead, (n_heads, dim) = tuple(x.shape[:-2]), x.shape[-2:]
    cos2d, sin2d = _tokens(cos, lead, (dim // 2,)), _tokens(sin, lead, (dim // 2,))
    return _rope(_tokens(x, lead, (n_heads, dim)), cos2d, sin2d, neg_sin=False).view(x.shape), cos2d, sin2d


class _RoPEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        out, cos2d, sin2d = _forward(x, cos, sin)
        ctx.save_for_backward(cos2d, sin2d)
        ctx.shape = x.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        cos2d, sin2d = ctx.saved_tensors
        n_heads, dim = ctx.shape[-2:]
        dx = _rope(_tokens(dout, tuple(ctx.shape[:-2]), (n_heads, dim)), cos2d, sin2d, neg_sin=True)
        return dx.view(ctx.shape), None, None


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (RoFormer eq. 34) in Triton, with autograd (d/dcos, d/dsin are not computed).

    x: (B, S, H, D) or (T, H, D), any strides with a unit-stride last dim (e.g. a slice of a fused
    qkv tensor); cos, sin: (B, S, D/2) or (T, D/2), broadcastable over the token dims. Returns a new
    contiguous tensor of x's shape and dtype; the rotation is computed in fp32.
    """
    check_rope_args(x, cos, sin)
    if not needs_grad(x):  # inference: no autograd node, no saved tensors
        return _forward(x, cos, sin)[0]
    return _RoPEFn.apply(x, cos, sin)
