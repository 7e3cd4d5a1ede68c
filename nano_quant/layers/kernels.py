"""Triton kernels for the quantized linears (a performance layer: the math is `linear.py`'s torch references).

Importing this module (`linear.REGISTRY` does, on its first lookup) registers them at the points
"quantize_per_token", "scaled_mm" and "awq_gemm" for CUDA tensors (CPU tensors keep the references); a
forker may delete it and everything still runs, slower.

* `quantize_per_token_triton` — one program per token: absmax, scale, round, in one pass over HBM
  (the row is re-read from L1/L2 for the second sweep).
* `scaled_mm_triton` — SmoothQuant's GEMM: INT8 × INT8 → INT32 tensor-core accumulation (or FP8 e4m3 →
  fp32), and the per-token × per-channel scales (+ bias) applied in the epilogue, in registers, before
  the one store in the output dtype: no INT32 matrix ever reaches memory.
* `awq_gemm_triton` — AWQ's W4A16 GEMM for decode-sized M: each program loads packed int32 weights,
  unpacks the eight nibbles in AutoAWQ's order, applies zero points and scales in registers and feeds the
  16-bit tile to the tensor cores: HBM traffic is the 4-bit weight (plus 1/G of scales). K is split over
  several programs (partial sums reduced by a second small kernel) so that a few output tiles still fill
  every SM. For large M the GEMM is compute-bound and `awq_dequantize_triton` + cuBLAS is faster: `awq_gemm`
  picks by M (AWQ_LARGE_M). For one row the CUDA-core GEMV of `gemv.py` is faster; it registers first.

Under `TRITON_INTERPRET=1` these run on CPU tensors (the tests); the interpreter computes bf16 wrongly, so
CPU tests use fp16 / fp32 activations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from shared.kernels import use_triton
from shared.kernels.launch import cdiv, next_pow2

from ..linear import REGISTRY
from ..quant import FP8_MAX, INT8_MAX, check_format
from .split_k import num_sms, split_k_partials, split_k_reduce

# Adding then subtracting 1.5·2^23 rounds an fp32 |x| < 2^22 to the nearest integer, ties to even (as
# torch.round), with plain IEEE adds: portable to every Triton version and to its interpreter.
_ROUND_MAGIC = tl.constexpr(12582912.0)  # a jitted kernel may read only constexpr globals
# W4A16 dispatch by M (rows of x): up to AWQ_LARGE_M `awq_gemm_triton`; above it dequantize once, then a
# cuBLAS GEMM. Set from `python -m nano_quant.bench ms=[1,4,8,16,32,64]` (rows `w4a16 mma`, `bf16`).
AWQ_LARGE_M = 64


@triton.jit
def _per_token_quant_kernel(X, Q, S, K, stride_x, stride_q, QMAX: tl.constexpr, IS_FP8: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), 1e-8)  # IEEE division, as torch
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.math.div_rn(tl.load(X + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32), scale)
        if IS_FP8:
            q = tl.minimum(tl.maximum(x, -QMAX), QMAX)
        else:
            q = tl.minimum(tl.maximum((x + _ROUND_MAGIC) - _ROUND_MAGIC, -QMAX), QMAX)
        tl.store(Q + row * stride_q + offs, q.to(Q.dtype.element_ty), mask=offs < K)
    tl.store(S + row, scale)


def quantize_per_token_triton(x: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """`quant.quantize_rowwise` of a (M, K) activation, one program per row."""
    check_format(fmt)
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
    scale = torch.empty(m, device=x.device, dtype=torch.float32)
    if m:
        qmax = float(INT8_MAX) if fmt == "int8" else FP8_MAX
        _per_token_quant_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), QMAX=qmax,
                                      IS_FP8=fmt == "fp8", BLOCK=min(next_pow2(k), 2048))
    return q, scale


@triton.jit(do_not_specialize=["M"])
def _scaled_mm_kernel(A, B, SA, SB, BIAS, C, M, N, K, stride_am, stride_bn, stride_cm,
                      IS_INT8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped launch order: GROUP_M row tiles sweep the column tiles together, so B tiles are reused
    # from L2 while they are hot.
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_ptrs = B + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]  # the (K, N) view of W (N, K)
    if IS_INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(rn[None, :] < N) & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32) if IS_INT8 else tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    # Epilogue: Y = acc ⊙ (Δ_X Δ_Wᵀ) (+ bias), still in registers.
    sa = tl.load(SA + rm, mask=rm < M, other=0.0)
    sb = tl.load(SB + rn, mask=rn < N, other=0.0)
    out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        out += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, out.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@functools.lru_cache(maxsize=1024)
def scaled_mm_config(m: int, n: int, k: int, fp8: bool) -> dict:
    """Tile sizes for `_scaled_mm_kernel`: small tiles while M is decode-sized, Hopper-sized ones after."""
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    if m <= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def scaled_mm_triton(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype,
                     config: dict | None = None) -> torch.Tensor:
    """`linear.scaled_mm_torch` in one kernel: a (M, K), b (N, K), both int8 or both float8_e4m3fn."""
    m, k = a.shape
    n = b.shape[0]
    if b.dtype != a.dtype or b.shape[1] != k or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"scaled_mm: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} must "
                         "share dtype and K, with K contiguous")
    c = torch.empty(m, n, device=a.device, dtype=out_dtype)
    if m == 0:
        return c
    cfg = config or CONFIGS["scaled_mm"](m, n, k, a.dtype != torch.int8)
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
    _scaled_mm_kernel[grid](a, b, scale_a, scale_b, bias if bias is not None else scale_b, c, m, n, k,
                            a.stride(0), b.stride(0), c.stride(0), IS_INT8=a.dtype == torch.int8,
                            HAS_BIAS=bias is not None, **cfg)
    return c


@triton.jit
def _expand8(t):
    """Repeat each element of the last dim 8 times: column c of the result holds packed word c // 8."""
    t = tl.interleave(t, t)
    t = tl.interleave(t, t)
    return tl.interleave(t, t)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _awq_gemm_kernel(X, QW, QZ, S, OUT, M, N, K, stride_xm, SPLIT_K, GROUP_SIZE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rp = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # packed columns: eight outputs per int32
    rk = tl.arange(0, BLOCK_K)
    # AutoAWQ's nibble order [0, 2, 4, 6, 1, 3, 5, 7]: output column j of 8 sits at bit 4·(j//2 + 4·(j%2)).
    shifts = ((rn % 8) // 2 + (rn % 2) * 4) * 4
    n_ok, p_ok = rn < N, rp < N // 8
    k_blocks = K // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(pid_k * k_blocks // SPLIT_K, (pid_k + 1) * k_blocks // SPLIT_K):
        k0 = kb * BLOCK_K
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :], mask=rm[:, None] < M,
                    other=0.0)
        packed = _expand8(tl.load(QW + (k0 + rk)[:, None].to(tl.int64) * (N // 8) + rp[None, :],
                                  mask=p_ok[None, :], other=0))
        g = k0 // GROUP_SIZE  # BLOCK_K divides GROUP_SIZE: one scale row per tile
        zeros = _expand8(tl.load(QZ + g * (N // 8) + rp, mask=p_ok, other=0))
        scale = tl.load(S + g * N + rn, mask=n_ok, other=0.0).to(tl.float32)
        bias = -((zeros >> shifts) & 0xF).to(tl.float32) * scale  # w = q·Δ − z·Δ: one FMA per weight
        w = ((packed >> shifts[None, :]) & 0xF).to(tl.float32) * scale[None, :] + bias[None, :]
        acc += tl.dot(x, w.to(X.dtype.element_ty))
    out_ptrs = OUT + pid_k.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=(rm[:, None] < M) & n_ok[None, :])


@functools.lru_cache(maxsize=1024)
def awq_gemm_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> dict:
    """Tiles for `_awq_gemm_kernel`, and SPLIT_K chosen so the grid covers the SMs about twice."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 128 if n >= 128 * num_sms else 64
    block_k = min(128, group_size)
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    split_k = max(1, min(k // block_k, 16, cdiv(2 * num_sms, tiles)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k,
            "num_warps": 4, "num_stages": 4}


def awq_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int, bias: torch.Tensor | None = None,
                    config: dict | None = None) -> torch.Tensor:
    """x (M, K) @ Ŵ (K, N) with Ŵ dequantized tile by tile in registers (AutoAWQ GEMM layout)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = scales.shape[1]
    if qweight.shape != (k, n // 8) or k % group_size:
        raise ValueError(f"awq_gemm: x {tuple(x.shape)} does not match qweight {tuple(qweight.shape)} / "
                         f"scales {tuple(scales.shape)} with group_size {group_size}")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    cfg = dict(config or CONFIGS["awq_gemm"](m, n, k, group_size, num_sms(x.device)))
    if group_size % cfg["BLOCK_K"]:
        raise ValueError(f"awq_gemm: BLOCK_K {cfg['BLOCK_K']} must divide group_size {group_size}")
    split = cfg["SPLIT_K"]
    partial = split_k_partials(out, split, bias)
    grid = (cdiv(m, cfg["BLOCK_M"]), cdiv(n, cfg["BLOCK_N"]), split)
    tiles = {key: v for key, v in cfg.items() if key != "SPLIT_K"}
    _awq_gemm_kernel[grid](x, qweight, qzeros, scales, partial, m, n, k, x.stride(0), split,
                           GROUP_SIZE=group_size, **tiles)
    return split_k_reduce(partial, out, bias)


@triton.jit
def _awq_dequantize_kernel(QW, QZ, S, W, N, GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    rk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rp = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    shifts = ((rn % 8) // 2 + (rn % 2) * 4) * 4
    p_ok, n_ok = rp < N // 8, rn < N
    packed = _expand8(tl.load(QW + rk[:, None].to(tl.int64) * (N // 8) + rp[None, :], mask=p_ok[None, :],
                              other=0))
    g = rk // GROUP_SIZE
    zeros = _expand8(tl.load(QZ + g[:, None] * (N // 8) + rp[None, :], mask=p_ok[None, :], other=0))
    scale = tl.load(S + g[:, None] * N + rn[None, :], mask=n_ok[None, :], other=0.0).to(tl.float32)
    q = ((packed >> shifts[None, :]) & 0xF) - ((zeros >> shifts[None, :]) & 0xF)
    w = (q.to(tl.float32) * scale).to(W.dtype.element_ty)
    tl.store(W + rk[:, None].to(tl.int64) * N + rn[None, :], w, mask=n_ok[None, :])


def awq_dequantize_triton(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """Ŵ (K, N) in `dtype` (the large-M path: one pass over the 4-bit weight, then a dense GEMM)."""
    k, n = qweight.shape[0], scales.shape[1]
    w = torch.empty(k, n, device=qweight.device, dtype=dtype)
    block_k, block_n = 32, 128
    _awq_dequantize_kernel[(cdiv(k, block_k), cdiv(n, block_n))](qweight, qzeros, scales, w, n,
                                                                 GROUP_SIZE=group_size, BLOCK_K=block_k,
                                                                 BLOCK_N=block_n)
    return w


# ------------------------------------------------------------------ registration: CUDA tensors

def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The W4A16 product by M: dequantizing in registers up to AWQ_LARGE_M rows, else once, then cuBLAS."""
    if x.shape[0] <= AWQ_LARGE_M:
        return awq_gemm_triton(x, qweight, qzeros, scales, group_size, bias)
    out = x @ awq_dequantize_triton(qweight, qzeros, scales, group_size, x.dtype)
    return out if bias is None else out + bias


def _on_cuda(x: torch.Tensor, *args, **kwargs) -> bool:
    return use_triton(x)


# Tile-size pickers (a call may pass `config=` instead, as the bench's sweep does).
CONFIGS: dict[str, Callable[..., dict]] = {"scaled_mm": scaled_mm_config, "awq_gemm": awq_gemm_config}
REGISTRY.register("quantize_per_token", quantize_per_token_triton, applies=_on_cuda)
REGISTRY.register("scaled_mm", scaled_mm_triton, applies=_on_cuda)
REGISTRY.register("awq_gemm", awq_gemm, applies=_on_cuda)
