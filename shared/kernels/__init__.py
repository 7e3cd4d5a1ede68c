"""Element-wise hot spots of a Llama/Qwen block: RMSNorm (+ fused residual add), RoPE, SwiGLU's gate.

Each op exists twice: a plain-torch reference (`*_torch`, `reference.py`) that is the specification
and runs anywhere, and a Triton kernel (`*_triton`) with forward and backward. The public functions
dispatch on the input: CUDA tensors (with Triton installed) go to Triton, everything else to the
reference. Tests call both halves directly; on a CPU the Triton halves run under `TRITON_INTERPRET=1`.

    rms_norm(x, weight, eps, residual=None)   -> y | (y, x + residual)
    apply_rope(x, cos, sin)                   -> rotated copy of x
    silu_and_mul(gate, up)                    -> silu(gate) * up
"""

from __future__ import annotations

import torch

from .reference import apply_rope_torch, rms_norm_torch, silu_and_mul_torch

try:
    import triton  # noqa: F401
except ImportError:  # no Triton wheel for this platform (macOS, Windows): torch references only
    HAS_TRITON = False
else:
    HAS_TRITON = True

if HAS_TRITON:  # imported outside the try, so a bug in a kernel module is an error, not a fallback
    from nano_flashattn.launch import pdl_args as pdl_args  # re-exported for the packages' kernels
    from nano_flashattn.launch import pdl_prologue as pdl_prologue
    from nano_flashattn.launch import pdl_release as pdl_release

    from .activation import silu_and_mul_triton
    from .rmsnorm import rms_norm_triton
    from .rope import apply_rope_triton
else:

    def _no_triton(*args, **kwargs):
        raise RuntimeError("Triton is not installed; use the *_torch references")

    rms_norm_triton = apply_rope_triton = silu_and_mul_triton = _no_triton

__all__ = [
    "HAS_TRITON",
    "apply_rope",
    "apply_rope_torch",
    "apply_rope_triton",
    "rms_norm",
    "rms_norm_torch",
    "rms_norm_triton",
    "silu_and_mul",
    "silu_and_mul_torch",
    "silu_and_mul_triton",
    "use_triton",
]


def use_triton(x: torch.Tensor) -> bool:
    """The dispatch rule: Triton for plain CUDA tensors when Triton is importable, the torch reference
    else. Tensor subclasses (DTensor, the AsyncCollectiveTensor of an in-flight collective, fake tensors)
    take the reference path: a Triton kernel reads raw data pointers, which such wrappers do not own."""
    return HAS_TRITON and x.is_cuda and type(x) in (torch.Tensor, torch.nn.Parameter)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019) over the last dim, HF LlamaRMSNorm numerics, with autograd.

    x: (..., hidden), weight: (hidden,). Returns y; with `residual` (same shape and dtype as x)
    returns `(y, s)` where `s = x + residual` is the new residual stream and `y = rmsnorm(s)`: the
    fused add + norm of vLLM's `fused_add_rms_norm` (out of place).
    """
    impl = rms_norm_triton if use_triton(x) else rms_norm_torch
    return impl(x, weight, eps, residual)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, RoFormer eq. 34), HF "rotate_half" layout.

    x: (B, S, H, D) or (T, H, D); cos, sin: (B, S, D/2) or (T, D/2) fp32, broadcast over heads.
    Returns a new tensor (x's dtype), computed in fp32; differentiable in x.
    """
    impl = apply_rope_triton if use_triton(x) else apply_rope_torch
    return impl(x, cos, sin)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer 2020): silu(gate) * up, computed in fp32, returned in gate's dtype."""
    impl = silu_and_mul_triton if use_triton(gate) else silu_and_mul_torch
    return impl(gate, up)
