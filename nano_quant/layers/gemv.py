"""The W4A16 GEMV for decode-sized M (a performance layer at the "awq_gemm" point: it registers for one
row of x on CUDA, before `kernels.py`, which takes the other rows).

AWQ's speedup is memory-bound decoding (Lin et al., MLSys 2024, §4: TinyChat): at batch 1 the GEMM is a
GEMV, HBM traffic is the weight, and 4-bit weights move ~4x fewer bytes than 16-bit ones — provided the
dequantization is cheap enough to hide under the loads. TinyChat's kernel unpacks nibbles into fp16 pairs
with a lop3 and a magic exponent; the same trick in fp32, which Triton can express portably:

* `awq_gemv_triton` — no tensor cores, for M ≤ a few rows. A program owns BLOCK_N output columns and a
  range of whole groups of K (split-K), reads the packed words as they lie in memory (BLOCK_K, BLOCK_N/8)
  with 16-byte loads and never reorders them: one AND-OR turns nibble t of a word into the fp32
  2^23 + q·16^t (the nibble dropped into an fp32 mantissa), one subtract makes it exact, one FMA
  accumulates x·q. AutoAWQ's nibble order [0, 2, 4, 6, 1, 3, 5, 7] puts the even columns of a word in its
  low 16 bits and the odd ones in the high 16 bits, so `w` and `w >> 16` give the two halves. The zero
  point and scale are applied once per group of G rows (AWQ §3's grid is per group):
  Σ_k x_k (q_kn − z_n) s_n = s_n (Σ_k x_k q_kn − z_n Σ_k x_k).

Split-K partial sums are reduced in a fixed order (`split_k.py`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shared.kernels import use_triton
from shared.kernels.launch import cdiv

from ..linear import REGISTRY
from .split_k import num_sms, split_k_partials, split_k_reduce

# fp32 with exponent 2^23 and an empty mantissa: OR-ing an integer q < 2^23 into it gives the float 2^23 + q.
_MAGIC_BITS = tl.constexpr(0x4B000000)
_MAGIC = tl.constexpr(8388608.0)
# Rows of x up to which the GEMV takes the W4A16 product (its work grows with M, a tensor-core kernel's
# does not). Set from `python -m nano_quant.bench ms=[1,4,8,16,32,64]` (rows `w4a16 gemv`, `w4a16 mma`).
AWQ_GEMV_MAX_M = 1


def _launch(kernel, picker, name: str, x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
            scales: torch.Tensor, group_size: int, bias: torch.Tensor | None, config: dict | None) -> torch.Tensor:
    """Check the shapes, pick tiles, run a (N tiles, SPLIT_K, M tiles) grid of `kernel`, reduce split-K."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = scales.shape[1]
    cfg = dict(config or picker(m, n, k, group_size, num_sms(x.device)))
    if qweight.shape != (k, n // 8) or k % group_size or qweight.stride(1) != 1:
        raise ValueError(f"{name}: x {tuple(x.shape)} does not match qweight {tuple(qweight.shape)} / "
                         f"scales {tuple(scales.shape)} with group_size {group_size}")
    if group_size % cfg["BLOCK_K"]:
        raise ValueError(f"{name}: BLOCK_K {cfg['BLOCK_K']} must divide group_size {group_size}")
    split = cfg.pop("SPLIT_K")
    if split < 1:
        raise ValueError(f"{name}: SPLIT_K must be >= 1, got {split}")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    partial = split_k_partials(out, split, bias)
    grid = (cdiv(n, cfg["BLOCK_N"]), split, cdiv(m, cfg["BLOCK_M"]))
    kernel[grid](x, qweight, qzeros, scales, partial, m, n, n // 8, k, x.stride(0), qweight.stride(0), split,
                 GROUP_SIZE=group_size, **cfg)
    return split_k_reduce(partial, out, bias)


def _split_k(tiles: int, groups: int, num_sms: int, waves: int) -> int:
    """Programs per output tile along K so the grid covers the SMs `waves` times (whole groups each)."""
    return max(1, min(groups, cdiv(waves * num_sms, tiles)))


# ------------------------------------------------------------------ GEMV: CUDA cores, M ≤ a few rows

@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _awq_gemv_kernel(X, QW, QZ, S, OUT, M, N, NP, K, stride_xm, stride_qw, SPLIT_K, GROUP_SIZE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BLOCK_P: tl.constexpr = BLOCK_N // 8  # packed int32 columns
    # Axes: (token m, row k, packed column p, nibble pair t). Column 8p + 2t is bits 4t of the word (even
    # half), column 8p + 2t + 1 is bits 16 + 4t (odd half).
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None, None, None]
    rk = tl.arange(0, BLOCK_K)[None, :, None, None]
    rp = pid_n * BLOCK_P + tl.arange(0, BLOCK_P)[None, None, :, None]
    t = tl.arange(0, 4)[None, None, None, :]
    nibble = 0xF << (4 * t)
    unit = 1.0 / (1 << (4 * t)).to(tl.float32)  # the nibble kept in place is q·16^t: scale back, exactly
    # NP = N / 8 as its own argument: Triton specializes it when divisible by 16, which keeps the masked
    # weight loads 16 bytes wide.
    p_ok, m_ok = rp < NP, rm < M
    # The per-group vectors, (m, p, t) after the sum over k.
    p3, t3 = tl.sum(rp, axis=1), tl.sum(t, axis=1)
    col = 8 * p3 + 2 * t3
    groups = K // GROUP_SIZE
    acc_even = tl.zeros((BLOCK_M, BLOCK_P, 4), dtype=tl.float32)
    acc_odd = tl.zeros((BLOCK_M, BLOCK_P, 4), dtype=tl.float32)
    for g in range(pid_k * groups // SPLIT_K, (pid_k + 1) * groups // SPLIT_K):
        # Elementwise FMAs over the group's rows; one reduction over k per group (a tree reduction per
        # BLOCK_K rows would cost shuffles and adds on every step).
        q_even = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_P, 4), dtype=tl.float32)
        q_odd = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_P, 4), dtype=tl.float32)
        x_acc = tl.zeros((BLOCK_M, BLOCK_K, 1, 1), dtype=tl.float32)
        for kk in tl.static_range(0, GROUP_SIZE, BLOCK_K):
            k = g * GROUP_SIZE + kk + rk
            x = tl.load(X + rm.to(tl.int64) * stride_xm + k, mask=m_ok, other=0.0).to(tl.float32)
            w = tl.load(QW + k.to(tl.int64) * stride_qw + rp, mask=p_ok, other=0)
            q_even += x * (((w & nibble) | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC)
            q_odd += x * ((((w >> 16) & nibble) | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC)
            x_acc += x
        x_sum = tl.sum(x_acc, axis=1)
        zw = tl.load(QZ + g * stride_qw + p3, mask=p3 < NP, other=0)
        s_even = tl.load(S + g * N + col, mask=p3 < NP, other=0.0).to(tl.float32)
        s_odd = tl.load(S + g * N + col + 1, mask=p3 < NP, other=0.0).to(tl.float32)
        z_even = ((zw >> (4 * t3)) & 0xF).to(tl.float32)
        z_odd = ((zw >> (16 + 4 * t3)) & 0xF).to(tl.float32)
        acc_even += s_even * (tl.sum(q_even, axis=1) * tl.sum(unit, axis=1) - z_even * x_sum)
        acc_odd += s_odd * (tl.sum(q_odd, axis=1) * tl.sum(unit, axis=1) - z_odd * x_sum)
    m3 = tl.sum(rm, axis=1)
    ptrs = OUT + pid_k.to(tl.int64) * M * N + m3.to(tl.int64) * N + col
    ok = (m3 < M) & (p3 < NP)
    tl.store(ptrs, acc_even.to(OUT.dtype.element_ty), mask=ok)
    tl.store(ptrs + 1, acc_odd.to(OUT.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=1024)
def awq_gemv_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> dict:
    """Tiles for `_awq_gemv_kernel`: 16-word (64-byte) rows of packed weight, 16 rows per step, and SPLIT_K
    so the grid covers the SMs about four times (several programs per SM keep enough loads in flight). The
    best of the `tune=true` sweep on an H200 (2026-12-01) for llama3-8b's four projections at M = 1."""
    block_m = 1 if m == 1 else 2 if m == 2 else 4
    block_n, block_k = 128, min(16, group_size)
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
            "SPLIT_K": _split_k(tiles, k // group_size, num_sms, 4), "num_warps": 4, "num_stages": 1}


def awq_gemv_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int, bias: torch.Tensor | None = None,
                    config: dict | None = None) -> torch.Tensor:
    """x (M, K) @ Ŵ (K, N) (+ bias) on CUDA cores for a few rows of x (AutoAWQ GEMM layout, AWQ §4's
    memory-bound decoding): weights read once as packed words, scale and zero applied once per group."""
    return _launch(_awq_gemv_kernel, awq_gemv_config, "awq_gemv", x, qweight, qzeros, scales, group_size, bias,
                   config)


def _applies(x: torch.Tensor, *args, **kwargs) -> bool:
    return use_triton(x) and x.shape[0] <= AWQ_GEMV_MAX_M


REGISTRY.register("awq_gemm", awq_gemv_triton, applies=_applies)
