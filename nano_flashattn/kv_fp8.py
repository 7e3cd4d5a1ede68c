"""vLLM's FP8 KV cache (`kv_cache_dtype="fp8"`): K and V stored as E4M3 codes, one fp32 scale per tensor
or per KV head, quantized as they are written and read back by the attention kernels.

A value x is stored as the code E4M3(clamp(x / scale, -448, 448)) (448: E4M3's largest finite value; a
quotient past it would otherwise become NaN) and read back as code * scale. The scale is fixed before
the cache is written (calibration: amax / 448), so a write needs no reduction and no sync.

The kernels that read the cache (forward.py's paged prefill, decode.py's Flash-Decoding) widen the codes
in registers and fold the scales into the arithmetic they already do: K's scale into the softmax scale of
S = Q K^T, V's into the final normalisation of O = P V / l (see `_decode_split_kernel`). Both sums
accumulate in fp32, across each tile and across tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_store_fp8, scale_stride
from .configs import block_d

FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (t + it) - it rounds |t| < 2^22 half to even


@triton.jit
def to_e4m3(x, scale):
    """E4M3(clamp(x / scale, ±448)), rounded to nearest even like torch's cast, built in integers. The
    quotient y is rounded to E4M3's grid in fp32 (3 mantissa bits: step 2^(e - 3) at exponent e,
    subnormals below 2^-6 share step 2^-9): m = round(|y| / 2^(e - 3)) is an integer in [0, 16], and
    the code is (e + 6) · 8 + m (a normal's exponent field e + 7 and mantissa m - 8; m = 16 carries into
    the next exponent; at e = -6 it is the subnormal's code m). No float-to-fp8 conversion: on sm_90 the
    packed two-element cvt gave wrong codes for threads that hold several elements.
    `div_rn`: the correctly rounded quotient torch computes (`/` on fp32 is approximate on GPUs)."""
    y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX)
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    m = (tl.abs(y) * ((3 - e + 127) << 23).to(tl.float32, bitcast=True) + RNE_MAGIC) - RNE_MAGIC
    code = (e + 6) * 8 + m.to(tl.int32)
    # y's sign bit set by hand: a negative value that rounds to 0 is -0, as in torch
    return (code | ((bits >> 24) & 0x80)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _store_kv_fp8_kernel(K, V, K_cache, V_cache, slot_mapping, K_scale, V_scale,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                         stride_ks, stride_vs, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (token, kv head) row of K and of V, quantized into cache slot slot_mapping[token]:
    grid (tokens, kv_heads). A negative slot is skipped (vLLM's padding)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot >= 0:
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        row = slot * stride_cs + h * stride_ch + offs_d
        k = tl.load(K + t * stride_kt + h * stride_kh + offs_d, mask=d_ok)
        tl.store(K_cache + row, to_e4m3(k, tl.load(K_scale + h * stride_ks)), mask=d_ok)
        v = tl.load(V + t * stride_vt + h * stride_vh + offs_d, mask=d_ok)
        tl.store(V_cache + row, to_e4m3(v, tl.load(V_scale + h * stride_vs)), mask=d_ok)


def store_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Write new K/V rows (..., kv_heads, head_dim) into paged float8_e4m3fn caches (num_blocks,
    block_size, kv_heads, head_dim): row i goes to slot slot_mapping[i] = block * block_size + offset.
    k_scale, v_scale: fp32, 1 element (per tensor) or kv_heads (per head). CUDA-graph safe, no sync."""
    k, v, k_scale, v_scale = check_store_fp8(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    tokens, heads, head_dim = k.shape
    if tokens == 0:
        return
    _store_kv_fp8_kernel[(tokens, heads)](
        K=k, V=v, K_cache=k_cache, V_cache=v_cache, slot_mapping=slot_mapping,
        K_scale=k_scale, V_scale=v_scale,
        stride_kt=k.stride(0), stride_kh=k.stride(1), stride_vt=v.stride(0), stride_vh=v.stride(1),
        stride_cs=k_cache.stride(1), stride_ch=k_cache.stride(2),
        stride_ks=scale_stride(k_scale), stride_vs=scale_stride(v_scale),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        # one element a thread: with two, the E4M3 conversion of head_dims above 128 wrote every second code
        # wrong on an H100 (Triton 3.6, 2026-12-06: 0xFC where torch's cast gives the value's code)
        num_warps=max(1, block_d(head_dim) // 32))
