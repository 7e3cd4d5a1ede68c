"""The W4A16 GEMV for decode-sized M (a performance layer beside `kernels.py`, which dispatches to it).

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

Split-K partial sums go to a (SPLIT_K, M, N) fp32 buffer that `_split_k_sum_kernel` reduces (+ bias) in a
fixed order: the result is the same on every run, which a captured CUDA graph's replay is compared against,
and every buffer's size depends only on shapes, so it is capture-safe. fp32 atomics into a zeroed buffer
would save the second launch but not the memset, and would sum in a different order on every run.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shared.kernels import use_triton
from shared.kernels.launch import cdiv

from .linear import WQLinear_GEMM
from .quant import unpack_awq

# fp32 with exponent 2^23 and an empty mantissa: OR-ing an integer q < 2^23 into it gives the float 2^23 + q.
_MAGIC_BITS = tl.constexpr(0x4B000000)
_MAGIC = tl.constexpr(8388608.0)


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere: the interpreter's stand-in)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@triton.jit
def _split_k_sum_kernel(P, BIAS, OUT, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(P + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=ok)


def split_k_partials(out: torch.Tensor, split_k: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Where a split-K kernel writes: `out` itself when one program sums all of K and there is no bias,
    else a (split_k, M, N) fp32 buffer for `split_k_reduce`."""
    if split_k == 1 and bias is None:
        return out
    return torch.empty(split_k, *out.shape, device=out.device, dtype=torch.float32)


def split_k_reduce(partial: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """out = Σ_s partial[s] (+ bias), in a fixed order; nothing to do if the kernel wrote `out` directly."""
    if partial is not out:
        mn, block = out.numel(), 1024
        _split_k_sum_kernel[(cdiv(mn, block),)](partial, bias if bias is not None else partial, out, mn,
                                                out.shape[1], SPLIT_K=partial.shape[0],
                                                HAS_BIAS=bias is not None, BLOCK=block)
    return out


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


# ------------------------------------------------------------------ GEMV over a K-contiguous repacked layout
# `repack_for_gemv` turns AutoAWQ's (K, N/8) words into (N, K/8) words holding eight consecutive k of one
# output column, in nibble order (TinyChat's and tinygemm's GEMV layouts are K-contiguous too): a program
# that owns a few output columns then reads long contiguous runs of each (BLOCK_K / 2 bytes per row per
# step) with 16-byte loads, and x's matching 8 elements are four int32 pairs. Per group the zero point is
# pre-multiplied, Σ_k x_k (q_k − z) s = s Σ_k x_k q_k + (−z s) Σ_k x_k, so the kernel needs no zero unpack.
# The kernel is bound by its instruction count, not by HBM: per weight one AND, one subtract and one FMA.

# The best M = 1 config per weight shape (N, K) on an H200, from `python -m nano_quant.bench tune=true
# "tune_systems=['w4a16 gemv repacked']" 'ms=[1]'`, which prints the lines to paste here (2026-12-01).
# Shapes not listed take `awq_gemv_repacked_config`'s rule.
MEASURED_REPACKED: dict[tuple[int, int], dict] = {  # NVIDIA H200: µs at M = 1 (tinygemm in the same run)
    (6144, 4096): {"BLOCK_N": 8, "BLOCK_K": 2048, "SPLIT_K": 1, "num_warps": 2,
                   "num_stages": 1},  # qkv: 13.6 (13.2)
    (4096, 4096): {"BLOCK_N": 4, "BLOCK_K": 2048, "SPLIT_K": 1, "num_warps": 1,
                   "num_stages": 1},  # o: 11.1 (10.2)
    (28672, 4096): {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1, "num_warps": 1,
                    "num_stages": 1},  # gate_up: 39.1 (38.6)
    (4096, 14336): {"BLOCK_N": 8, "BLOCK_K": 2048, "SPLIT_K": 1, "num_warps": 2,
                    "num_stages": 1},  # down: 24.6 (22.3)
}


def repack_for_gemv(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's GEMM layout -> (qweight_t int32 (N, K/8), scales_t (N, K/G) in scales' dtype, zeros_t fp32
    (N, K/G) = −z·s): word j of row n holds q[8j + i, n] in nibble i. One more copy of the 4-bit weight."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"repack_for_gemv: qweight and qzeros must be 2-D int32, got {qweight.dtype} "
                         f"{tuple(qweight.shape)} and {qzeros.dtype}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if group_size < 8 or group_size % 8 or k % group_size:
        raise ValueError(f"repack_for_gemv: group_size {group_size} must be a multiple of 8 dividing K = {k}")
    groups = k // group_size
    if qzeros.shape != (groups, n // 8) or scales.shape != (groups, n):
        raise ValueError(f"repack_for_gemv: qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not "
                         f"match qweight {tuple(qweight.shape)} with group_size {group_size}")
    q = unpack_awq(qweight)  # (K, N), natural column order
    nibbles = q.t().reshape(n, k // 8, 8).to(torch.int64) << (4 * torch.arange(8, device=q.device))
    packed = nibbles.sum(-1)  # disjoint nibbles: the sum is a bitwise or
    qweight_t = (packed - (packed >= 2**31) * 2**32).to(torch.int32).contiguous()
    z = unpack_awq(qzeros)
    zeros_t = (-(z.float() * scales.float())).t().contiguous()
    return qweight_t, scales.t().contiguous(), zeros_t


def awq_gemv_repacked_reference(x: torch.Tensor, qweight_t: torch.Tensor, scales_t: torch.Tensor,
                                zeros_t: torch.Tensor, group_size: int,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ Ŵ (K, N) (+ bias) from the repacked tensors, in fp32 torch, returned in x's dtype: Ŵ_kn =
    s·q + (−z·s), which is (q − z)·s (AWQ §3's group-wise grid)."""
    n, kp = qweight_t.shape
    q = (qweight_t[..., None] >> (4 * torch.arange(8, device=x.device, dtype=torch.int32))) & 0xF
    w = (q.reshape(n, kp * 8).float() * scales_t.float().repeat_interleave(group_size, 1)
         + zeros_t.repeat_interleave(group_size, 1))
    y = x.float() @ w.t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


@triton.jit(do_not_specialize=["iters_per_split"])
def _awq_gemv_repacked_kernel(X, QW, S, ZS, OUT, N, KP, GROUPS, iters_per_split, GROUP_SIZE: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NG: tl.constexpr,
                              WPG: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                              X_PAIRS: tl.constexpr):
    """One row of x. Tile axes (output column n, group g of the step, word w of the group, pair j): a step
    reads BLOCK_K = NG·WPG·8 values of K for BLOCK_N columns. Nibbles 2j and 2j + 1 of a word meet x's
    pair j. No nibble is shifted down: nibbles 0-3 stay in place in the low half-word, 4-7 in the high one
    (one shift a word), each half ORed with the magic exponent once, so one AND with a constant makes the
    fp32 2^23 + q·16^(t%4); x is pre-multiplied by 16^-(t%4) (exact: a power of two). X_PAIRS: x is bf16
    read as int32 pairs, whose halves are already the fp32 bit patterns' top halves (no conversion)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1)[:, None, None].to(tl.int64)  # columns past N re-read N - 1, never stored
    gi = tl.arange(0, NG)[None, :, None]
    wrd = gi * WPG + tl.arange(0, WPG)[None, None, :]
    j = tl.arange(0, 4)[None, None, None, :]
    mask_a = (0xF << (8 * (j % 2))) | _MAGIC_BITS  # nibble 2j % 4 of a half-word, and the magic exponent
    mask_b = (0xF0 << (8 * (j % 2))) | _MAGIC_BITS  # nibble (2j + 1) % 4
    unit_a = tl.where(j % 2 == 0, 1.0, 1.0 / 256)
    unit_b = tl.where(j % 2 == 0, 1.0 / 16, 1.0 / 4096)
    acc = tl.zeros((BLOCK_N, NG, WPG), dtype=tl.float32)
    it_lo = pid_k * iters_per_split
    it_hi = tl.minimum(it_lo + iters_per_split, tl.cdiv(KP, BLOCK_K // 8))
    for it in tl.range(it_lo, it_hi, num_stages=NUM_STAGES):
        kw = it * (BLOCK_K // 8) + wrd  # word index along K, a multiple of BLOCK_K / 8 plus the tile offset
        grp = (it * BLOCK_K + gi * (WPG * 8)) // GROUP_SIZE
        kw4 = kw[:, :, :, None]
        if EVEN_K:
            w = tl.load(QW + rows * KP + kw)
            s = tl.load(S + rows * GROUPS + grp)
            zs = tl.load(ZS + rows * GROUPS + grp)
            if X_PAIRS:
                x2 = tl.load(X + 4 * kw4 + j)
            else:
                xa = tl.load(X + 8 * kw4 + 2 * j)
                xb = tl.load(X + 8 * kw4 + 2 * j + 1)
        else:
            w = tl.load(QW + rows * KP + kw, mask=kw < KP, other=0)
            s = tl.load(S + rows * GROUPS + grp, mask=grp < GROUPS, other=0.0)
            zs = tl.load(ZS + rows * GROUPS + grp, mask=grp < GROUPS, other=0.0)
            if X_PAIRS:
                x2 = tl.load(X + 4 * kw4 + j, mask=kw4 < KP, other=0)
            else:
                xa = tl.load(X + 8 * kw4 + 2 * j, mask=kw4 < KP, other=0.0)
                xb = tl.load(X + 8 * kw4 + 2 * j + 1, mask=kw4 < KP, other=0.0)
        if X_PAIRS:  # bf16 is the top half of fp32: shift the low element up, mask the high one
            xa = (x2 << 16).to(tl.float32, bitcast=True)
            xb = (x2 & -65536).to(tl.float32, bitcast=True)
        else:
            xa, xb = xa.to(tl.float32), xb.to(tl.float32)
        lo = (w & 0xFFFF) | _MAGIC_BITS
        hi = ((w >> 16) & 0xFFFF) | _MAGIC_BITS
        half = tl.where(j < 2, lo[:, :, :, None], hi[:, :, :, None])
        qa = (half & mask_a).to(tl.float32, bitcast=True) - _MAGIC
        qb = (half & mask_b).to(tl.float32, bitcast=True) - _MAGIC
        p = tl.sum((xa * unit_a) * qa + (xb * unit_b) * qb, axis=3)
        acc += s.to(tl.float32) * p + zs * tl.sum(xa + xb, axis=3)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(OUT + pid_k.to(tl.int64) * N + rn, y.to(OUT.dtype.element_ty), mask=rn < N)


@functools.lru_cache(maxsize=1024)
def awq_gemv_repacked_config(n: int, k: int, group_size: int, num_sms: int) -> dict:
    """Tiles for `_awq_gemv_repacked_kernel` at M = 1: the measured entry of MEASURED_REPACKED, else 8
    columns per program, up to 2048 values of K (1 KiB contiguous per column) per step, 2 warps, no software
    pipeline (the measured tiles' choice), and SPLIT_K only where N leaves fewer than 2 programs per SM."""
    if (n, k) in MEASURED_REPACKED and num_sms == 132:
        return dict(MEASURED_REPACKED[(n, k)])
    pow2_group = group_size & (group_size - 1) == 0
    block_n = 8
    block_k = min(2048, max(group_size, next_pow2_at_most(k))) if pow2_group else group_size & -group_size
    split = 1
    while cdiv(n, block_n) * split < 2 * num_sms and k >= 4 * split * block_k:
        split *= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 2, "num_stages": 1}


def next_pow2_at_most(v: int) -> int:
    """The largest power of two <= v (v >= 1)."""
    return 1 << (v.bit_length() - 1)


def awq_gemv_repacked_triton(x: torch.Tensor, qweight_t: torch.Tensor, scales_t: torch.Tensor,
                             zeros_t: torch.Tensor, group_size: int, bias: torch.Tensor | None = None,
                             config: dict | None = None) -> torch.Tensor:
    """x (1, K) @ Ŵ (K, N) (+ bias) over `repack_for_gemv`'s layout (AWQ §4's memory-bound decoding): each
    program streams BLOCK_N columns' K-contiguous packed words, applies scale and zero once per word's group."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"awq_gemv_repacked: x must be (1, K), got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    k = x.shape[1]
    n, kp = qweight_t.shape
    groups = scales_t.shape[-1]
    if (kp * 8 != k or qweight_t.stride(1) != 1 or group_size % 8 or groups * group_size != k
            or scales_t.shape != (n, groups) or zeros_t.shape != (n, groups) or zeros_t.dtype != torch.float32):
        raise ValueError(f"awq_gemv_repacked: x {tuple(x.shape)} does not match qweight_t "
                         f"{tuple(qweight_t.shape)} / scales_t {tuple(scales_t.shape)} / zeros_t "
                         f"{tuple(zeros_t.shape)} {zeros_t.dtype} with group_size {group_size}")
    cfg = dict(config or awq_gemv_repacked_config(n, k, group_size, num_sms(x.device)))
    block_k, split = cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K")
    if block_k < 8 or block_k & (block_k - 1) or (block_k % group_size and group_size % block_k):
        raise ValueError(f"awq_gemv_repacked: BLOCK_K {block_k} must be a power of two >= 8 that divides "
                         f"or is a multiple of group_size {group_size}")
    if split < 1 or cfg["BLOCK_N"] < 1 or cfg["BLOCK_N"] & (cfg["BLOCK_N"] - 1):
        raise ValueError(f"awq_gemv_repacked: SPLIT_K must be >= 1 and BLOCK_N a power of two, got {split}, "
                         f"{cfg['BLOCK_N']}")
    ng = max(block_k // group_size, 1)
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    partial = split_k_partials(out, split, bias)
    iters = cdiv(cdiv(k, block_k), split)
    stages = cfg.setdefault("num_stages", 1)
    pairs = x.dtype == torch.bfloat16
    x = x.clone() if pairs and x.storage_offset() % 2 else x  # an int32 view needs an even offset
    _awq_gemv_repacked_kernel[(cdiv(n, cfg["BLOCK_N"]), split)](
        x.view(torch.int32) if pairs else x, qweight_t, scales_t, zeros_t, partial, n, kp, groups, iters,
        GROUP_SIZE=group_size, BLOCK_K=block_k, NG=ng, WPG=block_k // 8 // ng, NUM_STAGES=stages,
        EVEN_K=k % block_k == 0, X_PAIRS=pairs, **cfg)
    return split_k_reduce(partial, out, bias)


class RepackedGemvWQLinear(WQLinear_GEMM):
    """WQLinear_GEMM that runs `awq_gemv_repacked_triton` for one row of x on CUDA (fp16 / bf16) and its own
    path otherwise. The repacked tensors are non-persistent buffers (the checkpoint keeps AutoAWQ's format):
    one more copy of the 4-bit weight, N·K/2 bytes, plus 6 bytes per group and column (fp16 scales, fp32
    zeros) — for llama3-8b's decoder layers 3.6 GiB more."""

    def build_repacked(self) -> None:
        for name, t in zip(("qweight_t", "scales_t", "zeros_t"),
                           repack_for_gemv(self.qweight, self.qzeros, self.scales, self.group_size)):
            self.register_buffer(name, t, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features and x.dtype in (torch.float16, torch.bfloat16) and use_triton(x):
            if getattr(self, "qweight_t", None) is None:  # built once, on the first one-row call
                self.build_repacked()
            bias = None if self.bias is None else self.bias.to(x.dtype)
            y = awq_gemv_repacked_triton(x.reshape(1, -1), self.qweight_t, self.scales_t, self.zeros_t,
                                         self.group_size, bias)
            return y.view(*x.shape[:-1], self.out_features)
        return super().forward(x)


def use_repacked_gemv(model: torch.nn.Module) -> torch.nn.Module:
    """A performance layer, off unless called: every WQLinear_GEMM of `model` becomes a RepackedGemvWQLinear
    in place with its repacked tensors built now (before any CUDA-graph capture); returns the model."""
    for m in model.modules():
        if type(m) is WQLinear_GEMM:
            m.__class__ = RepackedGemvWQLinear
            m.build_repacked()
    return model

