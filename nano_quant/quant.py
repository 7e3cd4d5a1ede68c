"""The number formats, as plain torch: what "W8A8" and "W4A16 g128" mean, and the specification every
kernel is tested against.

* **Symmetric absmax, one scale per row** (SmoothQuant §2, Eq. 1: X̄ = round(X / Δ), Δ = max|X| / 127).
  A weight W (out, in) quantized per row is SmoothQuant's *per-channel* weight quantization; an activation
  X (tokens, in) quantized per row at run time is its *per-token dynamic* activation quantization. `fmt`
  "int8" rounds to integers in [-127, 127]; "fp8" casts to float8 e4m3 (max 448), the Hopper variant.
* **Group-wise asymmetric INT4 with zero points** (AWQ §3; what AutoAWQ stores): each run of
  `group_size` consecutive input channels of a weight row has a scale Δ and an integer zero point z,
  q = clamp(round(w / Δ) + z, 0, 15), w ≈ (q − z)·Δ, with Δ = (max − min) / 15 over the group.
* **AutoAWQ's "GEMM" packing**: eight 4-bit values per int32 along the output dimension, in the nibble
  order [0, 2, 4, 6, 1, 3, 5, 7] (`AWQ_ORDER`), weights stored transposed (in, out / 8).
"""

from __future__ import annotations

import torch

INT8_MAX = 127
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FORMATS = ("int8", "fp8")
# Packed nibble i (bits 4i..4i+3) holds column AWQ_ORDER[i] of 8; column j of 8 sits at bit AWQ_SHIFTS[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_SHIFTS = tuple(4 * AWQ_ORDER.index(j) for j in range(8))


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def check_bits(bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")


def check_group_size(in_features: int, group_size: int) -> None:
    if not isinstance(group_size, int) or group_size <= 0 or in_features % group_size:
        raise ValueError(f"group_size ({group_size!r}) must be a positive int dividing the input "
                         f"dimension K = {in_features}")


def quantize_rowwise(t: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization with one fp32 scale per row (SmoothQuant Eq. 1): (q, Δ), t ≈ q·Δ.

    Per-channel for a weight (out, in), per-token (dynamic) for an activation (tokens, in). int8:
    q = round(t / Δ), Δ = max|t_row| / 127; fp8: q = e4m3(t / Δ), Δ = max|t_row| / 448."""
    check_format(fmt)
    qmax = INT8_MAX if fmt == "int8" else FP8_MAX
    scale = (t.detach().abs().amax(dim=-1).float() / qmax).clamp(min=1e-8)  # an all-zero row: Δ > 0
    x = t.float() / scale[..., None]
    if fmt == "int8":
        q = x.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:  # clamped first: a quotient a rounding step above 448 must not become NaN
        q = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_rowwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q·Δ in fp32 (the inverse of `quantize_rowwise` up to its rounding)."""
    return q.float() * scale[..., None]


def quantize_groupwise(w: torch.Tensor, group_size: int = 128, bits: int = 4,
                       zero_point: bool = True, scale_dtype: torch.dtype = torch.float16
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Group-wise round-to-nearest of a weight (out, in) along its input dimension (AWQ §3's Q(·)).

    Returns q (out, in) int32 in [0, 2^bits − 1] (asymmetric) or [−2^(bits−1), 2^(bits−1) − 1]
    (`zero_point=False`), scales (out, in / group_size) and zero points of the same shape (None when
    symmetric). The range of each group is widened to include 0, so every weight is within Δ/2 of its
    grid and the zero point is an integer in range. Scales are rounded to `scale_dtype` (AutoAWQ stores
    fp16) *before* the weights are rounded, so the stored scales reproduce the grid."""
    check_bits(bits)
    check_group_size(w.shape[-1], group_size)
    g = w.detach().float().reshape(w.shape[0], -1, group_size)
    if zero_point:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        qmax = 2**bits - 1
        scales = ((hi - lo) / qmax).clamp(min=1e-5).to(scale_dtype).float()
        zeros = (-lo / scales).round().clamp(0, qmax)
        q = ((g / scales[..., None]).round() + zeros[..., None]).clamp(0, qmax)
    else:
        qmax = 2 ** (bits - 1) - 1
        scales = (g.abs().amax(-1) / qmax).clamp(min=1e-5).to(scale_dtype).float()
        zeros = None
        q = (g / scales[..., None]).round().clamp(-qmax - 1, qmax)
    q = q.reshape(w.shape).to(torch.int32)
    return q, scales.to(scale_dtype), None if zeros is None else zeros.to(torch.int32)


def dequantize_groupwise(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                         group_size: int) -> torch.Tensor:
    """(q − z)·Δ in fp32, each group's scale and zero point broadcast over its `group_size` columns."""
    g = q.reshape(q.shape[0], -1, group_size).float()
    if zeros is not None:
        g = g - zeros.float()[..., None]
    return (g * scales.float()[..., None]).reshape(q.shape)


def fake_quantize_groupwise(w: torch.Tensor, group_size: int = 128, bits: int = 4,
                            zero_point: bool = True) -> torch.Tensor:
    """Q(w): quantize then dequantize, in w's dtype (the error AWQ's search minimizes)."""
    q, scales, zeros = quantize_groupwise(w, group_size, bits, zero_point)
    return dequantize_groupwise(q, scales, zeros, group_size).to(w.dtype)


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """int4 values (rows, cols), cols a multiple of 8 -> int32 (rows, cols / 8) in AutoAWQ's nibble order."""
    if q.shape[-1] % 8:
        raise ValueError(f"the packed dimension must be a multiple of 8, got {q.shape[-1]}")
    q = q.to(torch.int64).reshape(q.shape[0], -1, 8)
    shifts = torch.tensor(AWQ_SHIFTS, device=q.device)
    packed = (q << shifts).sum(-1)  # disjoint nibbles: the sum is a bitwise or
    return (packed - (packed >= 2**31) * 2**32).to(torch.int32)  # two's complement into int32


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_awq`: int32 (rows, n) -> int32 values in [0, 15], shape (rows, 8n)."""
    shifts = torch.tensor(AWQ_SHIFTS, device=packed.device, dtype=torch.int32)
    return ((packed[..., None] >> shifts) & 0xF).reshape(packed.shape[0], -1)
