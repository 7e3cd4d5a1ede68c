"""Plain-torch references for the element-wise hot spots of a Llama/Qwen block.

These are the specification the Triton kernels are tested against, and what runs on CPU (and on any
device where Triton is missing). They import nothing but torch, so they work everywhere, and autograd
differentiates them for free.

Every reference computes in fp32 (or in fp64 when given fp64 inputs, so a test can call the same
function as its float64 ground truth) and casts back to the input dtype, exactly where Hugging Face's
Llama code does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _acc(dtype: torch.dtype) -> torch.dtype:
    # fp16/bf16/fp32 -> fp32, fp64 -> fp64: HF's `.float()` would silently demote a float64 check.
    return torch.promote_types(dtype, torch.float32)


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if weight.dim() != 1 or x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} must be (hidden,) for x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        got, want = (tuple(residual.shape), residual.dtype), (tuple(x.shape), x.dtype)
        raise ValueError(f"rms_norm: residual {got} must match x {want}")


def check_rope_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() not in (3, 4) or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: x {tuple(x.shape)} must be (B, S, H, D) or (T, H, D) with D even")
    want = (*x.shape[:-2], x.shape[-1] // 2)
    if cos.shape != sin.shape or cos.dim() != x.dim() - 1 or cos.shape[-1] != want[-1]:
        raise ValueError(f"apply_rope: cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must be {want}")
    try:
        ok = torch.broadcast_shapes(cos.shape, want) == want
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"apply_rope: cos/sin {tuple(cos.shape)} do not broadcast to {want}")


def check_silu_and_mul_args(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"silu_and_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ"
        )


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019, eq. 4): y = x / sqrt(mean(x^2) + eps) * g.

    Numerics of HF `LlamaRMSNorm`: normalise in fp32, round to the input dtype, then scale by the
    weight. With `residual`, first form the new residual stream `s = x + residual` (in x's dtype, like
    HF's `hidden_states = residual + hidden_states`) and return `(rmsnorm(s), s)`, the contract of
    vLLM's `fused_add_rms_norm`.
    """
    check_rms_norm_args(x, weight, residual)
    s = x if residual is None else x + residual
    h = s.to(_acc(s.dtype))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = (weight * h.to(s.dtype)).to(s.dtype)
    return y if residual is None else (y, s)


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, RoFormer eq. 34), HF's non-interleaved layout.

    The pair rotated by angle theta_i is (x[i], x[i + D/2]) ("rotate_half"), not (x[2i], x[2i+1]).
    x: (B, S, H, D) or (T, H, D); cos, sin: (B, S, D/2) or (T, D/2), broadcast over heads.
    """
    check_rope_args(x, cos, sin)
    acc = _acc(x.dtype)
    x1, x2 = x.to(acc).chunk(2, dim=-1)
    c, s = cos.to(acc).unsqueeze(-2), sin.to(acc).unsqueeze(-2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def silu_and_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer 2020, "GLU Variants Improve Transformer", FFN_SwiGLU): silu(gate) * up."""
    check_silu_and_mul_args(gate, up)
    acc = _acc(gate.dtype)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)
