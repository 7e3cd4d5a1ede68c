"""AWQ W4A16 over a K-contiguous repacked copy of the weight (a performance layer beside `gemv.py` and
`kernels.py`, which read AutoAWQ's layout; the checkpoint keeps AutoAWQ's format). It registers at the
"module_swap" point: `linear.swap_modules(model)` makes a model's AWQ layers on CUDA RepackedGemvWQLinear.

AWQ's speedup is memory-bound decoding (Lin et al., MLSys 2024, §4: TinyChat): at a few rows of x the GEMM
reads the weight once, and 4-bit weights move ~4x fewer bytes than 16-bit ones, provided the
dequantization is cheap enough to hide under the loads. `repack_for_gemv` lays each output column's words
along K (TinyChat's and tinygemm's decode layouts are K-contiguous too), and within every 32 values of K in
the order of the tensor cores' operand fragment: word c of a 32-value chunk holds the pairs k = 2c + 8i,
2c + 8i + 1 (i = 0..3) at nibbles i and 4 + i, so one shift and one AND-OR turn a word into a pair of
16-bit floats 2^e + q that is already an MMA register, while the GEMV still reads x's values as pairs.
The zero point is pre-multiplied: Σ_k x_k (q_k − z) s = s Σ_k x_k q_k + (−z s) Σ_k x_k.

* `awq_gemv_repacked_triton` — M = 1 on CUDA cores: one AND and one FMA per weight (a subtract for a quarter
  of them), x widened once per word for several columns.
* `awq_mma_repacked_triton` — M = 2..64 on tensor cores: each word becomes four 16-bit pairs 2^e + q
  (exact; two values per shift and AND-OR) in the MMA's A-operand registers, multiplied with xᵀ as it lies,
  scale, zero and the 2^e offset applied once per tile of a group.
* `dequantize_repacked_triton` — more rows: the (N, K) weight once per call, for cuBLAS.
* `RepackedGemvWQLinear`, `use_repacked_gemv` — a WQLinear_GEMM that builds the copy and dispatches;
  `drop_autoawq` frees AutoAWQ's tensors when only serving needs the layer (`swap_modules(model,
  serving_only=True)`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nano_flashattn.registry import layers_enabled
from shared.kernels import pdl_args, pdl_prologue, pdl_release, silu_and_mul, use_triton
from shared.kernels.launch import cdiv, next_pow2

from ..linear import REGISTRY, WQLinear_GEMM
from ..quant import unpack_awq
from .split_k import TICKETS, num_sms, split_k_epilogue, split_k_tickets

# `repack_for_gemv` turns AutoAWQ's (K, N/8) words into (N, K/8) words, each holding eight values of K of one
# output column (TinyChat's and tinygemm's GEMV layouts are K-contiguous too): a program that owns a few
# output columns reads contiguous runs of each. Within a chunk of 32 values of K, word c (0..3) holds the pairs
# (2c + 8i, 2c + 8i + 1) at nibbles (i, 4 + i), i = 0..3: a thread of an MMA holds exactly the values
# 2c, 2c + 1, 2c + 8, 2c + 9 of each 16 of K (PTX ISA, the fragments of mma.m16n8k16 and wgmma), so a word
# is two of its K-slices, and nibbles i and 4 + i, 16 bits apart, are one 32-bit register of them. Per group
# the zero point is pre-multiplied, Σ_k x_k (q_k − z) s = s Σ_k x_k q_k + (−z s) Σ_k x_k, so the kernels
# need no zero unpack.
CHUNK = 32  # values of K per chunk of four words; a group must hold whole chunks
# Rows of x up to which the repacked kernels run; above it the copy is dequantized for cuBLAS (H200, llama3-8b
# layer at M = 64: 146.5 µs against bf16's 158.0, 2026-12-02).
AWQ_LARGE_M = 64
_OFFSET = {torch.bfloat16: 128.0, torch.float16: 1024.0}  # 2^e of `_pair`'s 16-bit values 2^e + q

# The best M = 1 config per weight shape (N, K) on an H200, from `python -m nano_quant.bench tune=true
# "tune_systems=['w4a16 gemv repacked']" 'ms=[1]'`, which prints the lines to paste here (2026-12-02; they were
# also the best of a wider sweep: BLOCK_N 8-64, GPS 1-4, 1-2 warps, 2-4 stages, SPLIT_K 1-8). Shapes not listed
# take `awq_gemv_repacked_config`'s rule. The kernel must specialize `groups_per_split` (Triton's divisibility
# hint on the loop bound): marking it do_not_specialize cost 7% per layer (85.1 against 79.3 µs, same call).
MEASURED_REPACKED: dict[tuple[int, int], dict] = {  # H200: µs at M = 1, 2026-12-02 (tinygemm in the same run)
    (6144, 4096): {"BLOCK_N": 16, "GPS": 4, "SPLIT_K": 1, "num_warps": 1, "num_stages": 4},  # qkv: 12.8 (13.1)
    (4096, 4096): {"BLOCK_N": 8, "GPS": 2, "SPLIT_K": 1, "num_warps": 1, "num_stages": 4},  # o: 12.0 (9.9)
    (28672, 4096): {"BLOCK_N": 32, "GPS": 2, "SPLIT_K": 1, "num_warps": 1,
                    "num_stages": 3},  # gate_up: 33.1 (38.3)
    (4096, 14336): {"BLOCK_N": 16, "GPS": 4, "SPLIT_K": 4, "num_warps": 1, "num_stages": 3},  # down: 22.4 (22.2)
}


def repack_for_gemv(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's GEMM layout -> (qweight_t int32 (N, K/8), scales_t (N, K/G) in scales' dtype, zeros_t fp32
    (N, K/G) = −z·s): word 4u + c of row n holds q[32u + 2c + 8i + e, n] in nibble 4e + i. One more copy of
    the 4-bit weight."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"repack_for_gemv: qweight and qzeros must be 2-D int32, got {qweight.dtype} "
                         f"{tuple(qweight.shape)} and {qzeros.dtype}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if group_size < CHUNK or group_size % CHUNK or k % group_size:
        raise ValueError(f"repack_for_gemv: group_size {group_size} must be a multiple of {CHUNK} dividing "
                         f"K = {k}")
    groups = k // group_size
    if qzeros.shape != (groups, n // 8) or scales.shape != (groups, n):
        raise ValueError(f"repack_for_gemv: qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not "
                         f"match qweight {tuple(qweight.shape)} with group_size {group_size}")
    q = unpack_awq(qweight)  # (K, N), natural column order
    q = q.t().reshape(n, k // CHUNK, 4, 4, 2).permute(0, 1, 3, 4, 2)  # k = 32u + 8i + 2c + e -> (u, c, e, i)
    nibbles = q.reshape(n, k // 8, 8).to(torch.int64) << (4 * torch.arange(8, device=q.device))
    packed = nibbles.sum(-1)  # disjoint nibbles: the sum is a bitwise or
    qweight_t = (packed - (packed >= 2**31) * 2**32).to(torch.int32).contiguous()
    z = unpack_awq(qzeros)
    zeros_t = (-(z.float() * scales.float())).t().contiguous()
    return qweight_t, scales.t().contiguous(), zeros_t


def dequantize_repacked_torch(qweight_t: torch.Tensor, scales_t: torch.Tensor, zeros_t: torch.Tensor,
                              group_size: int) -> torch.Tensor:
    """The (N, K) fp32 weight of the repacked tensors: Ŵ_nk = s·q + (−z·s), which is (q − z)·s (AWQ §3's
    group-wise grid)."""
    n, kp = qweight_t.shape
    q = (qweight_t[..., None] >> (4 * torch.arange(8, device=qweight_t.device, dtype=torch.int32))) & 0xF
    q = q.reshape(n, kp // 4, 4, 2, 4).permute(0, 1, 4, 2, 3)  # (u, c, e, i) -> k = 32u + 8i + 2c + e
    return (q.reshape(n, kp * 8).float() * scales_t.float().repeat_interleave(group_size, 1)
            + zeros_t.repeat_interleave(group_size, 1))


def awq_gemv_repacked_reference(x: torch.Tensor, qweight_t: torch.Tensor, scales_t: torch.Tensor,
                                zeros_t: torch.Tensor, group_size: int,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ Ŵ (K, N) (+ bias) from the repacked tensors, in fp32 torch, returned in x's dtype."""
    y = x.float() @ dequantize_repacked_torch(qweight_t, scales_t, zeros_t, group_size).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


@triton.jit
def _nibble_at(half, b: tl.constexpr, minus: tl.constexpr):
    """The nibble at bit b of `half`, whose exponent field is all ones, as the fp32 2^(23 − b) + q: the AND keeps
    the nibble and the exponent of 2^(23 − b), which makes the nibble's lowest bit worth 1; `minus`: q (exact)."""
    v = (half & ((0xF << b) | ((150 - b) << 23))).to(tl.float32, bitcast=True)
    if minus:
        v -= 1 << (23 - b)
    return v


@triton.jit
def _load(ptr, ok, EVEN: tl.constexpr):
    """tl.load, masked (0 where not `ok`) unless EVEN."""
    if EVEN:
        return tl.load(ptr)
    return tl.load(ptr, mask=ok, other=0)


@triton.jit
def _pair_halves(p):
    """The two bf16 values of an int32 pair as fp32 (bit operations only: a half is the top half
    of the fp32 bit pattern)."""
    return (p << 16).to(tl.float32, bitcast=True), (p & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _load_x8(X, p, ok, X_PAIRS: tl.constexpr, EVEN: tl.constexpr):
    """The x of the nibbles t = 0..7 of words 4u + c, as fp32 tensors shaped like `p` = 16u + c, their first
    pairs: nibbles i and 4 + i are the pair x[2p + 8i], x[2p + 8i + 1]. X_PAIRS: bf16 read as int32 pairs, whose
    halves are the top halves of the fp32 bit patterns (one shift or one AND, no conversion)."""
    if X_PAIRS:
        x0, x4 = _pair_halves(_load(X + p, ok, EVEN))
        x1, x5 = _pair_halves(_load(X + p + 4, ok, EVEN))
        x2, x6 = _pair_halves(_load(X + p + 8, ok, EVEN))
        x3, x7 = _pair_halves(_load(X + p + 12, ok, EVEN))
        return x0, x1, x2, x3, x4, x5, x6, x7
    ptr = X + 2 * p
    return (_load(ptr, ok, EVEN).to(tl.float32), _load(ptr + 8, ok, EVEN).to(tl.float32),
            _load(ptr + 16, ok, EVEN).to(tl.float32), _load(ptr + 24, ok, EVEN).to(tl.float32),
            _load(ptr + 1, ok, EVEN).to(tl.float32), _load(ptr + 9, ok, EVEN).to(tl.float32),
            _load(ptr + 17, ok, EVEN).to(tl.float32), _load(ptr + 25, ok, EVEN).to(tl.float32))


@triton.jit
def _tile_columns(pid_n, N, BLOCK_N: tl.constexpr, SILU: tl.constexpr):
    """The output columns (weight rows) a program reads: BLOCK_N in a row, or with SILU (a fused gate_up of
    N = 2·I columns) BLOCK_N / 2 gate columns and the up columns I later that pair with them."""
    c = tl.arange(0, BLOCK_N)
    if SILU:
        half: tl.constexpr = BLOCK_N // 2
        j = pid_n * half + c % half
        return tl.where(c < half, j, tl.where(j < N // 2, j + N // 2, N))  # past the gate half: never stored
    return pid_n * BLOCK_N + c


@triton.jit
def _store_silu_and_mul(acc, rows_out, cols_out, ok, OUT, HALF: tl.constexpr, N_OUT):
    """SwiGLU after a fused gate_up tile (`silu_and_mul=True`): acc's first HALF columns (its last axis) are gate
    columns, the next HALF the up columns of the same outputs. Each is rounded to OUT's dtype first, as the
    unfused layer's output would be, then silu(g)·u in fp32 as `shared.kernels.silu_and_mul` computes it, so
    the values are those of the two launches; OUT is (M, N_OUT), N_OUT the gate_up width / 2."""
    g, u = tl.split(tl.permute(tl.reshape(acc, (acc.shape[0], 2, HALF)), (0, 2, 1)))
    g = g.to(OUT.dtype.element_ty).to(tl.float32)
    u = u.to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + rows_out * N_OUT + cols_out, (g * tl.sigmoid(g) * u).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _rnd(v, DT: tl.constexpr):
    """v rounded to the activation dtype and widened back (how a stored tensor would read)."""
    return v.to(DT).to(tl.float32)


@triton.jit
def _row_rstd(X, R, K, eps, X_PAIRS: tl.constexpr, HAS_RES: tl.constexpr, DT: tl.constexpr):
    """1 / rms of the row x (+ r, rounded: the residual stream as shared.kernels' RMSNorm adds it), over its K
    values, in fp32 — each program computes it itself (the row is a few KiB, in L2): no norm launch."""
    BLOCK: tl.constexpr = 1024
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    if X_PAIRS:  # int32 pairs of bf16
        for j0 in range(0, K // 2, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            lo, hi = _pair_halves(tl.load(X + j, mask=j < K // 2, other=0))
            if HAS_RES:
                rlo, rhi = _pair_halves(tl.load(R + j, mask=j < K // 2, other=0))
                lo, hi = _rnd(lo + rlo, DT), _rnd(hi + rhi, DT)
            ss += lo * lo + hi * hi
    else:
        for j0 in range(0, K, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            v = tl.load(X + j, mask=j < K, other=0.0).to(tl.float32)
            if HAS_RES:
                v = _rnd(v + tl.load(R + j, mask=j < K, other=0.0).to(tl.float32), DT)
            ss += v * v
    return tl.rsqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _prologue_x(x, r, w, rstd, DT: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr):
    """One x value as the GEMV multiplies it: the stream x + r rounded (HAS_RES), then RMSNorm'd as
    shared.kernels rounds it — x·rstd to the activation dtype, × weight, rounded again (NORM)."""
    if HAS_RES:
        x = _rnd(x + r, DT)
    if NORM:
        x = _rnd(w * _rnd(x * rstd, DT), DT)
    return x


@triton.jit
def _awq_gemv_repacked_kernel(X, QW, S, ZS, OUT, PART, TICKETS, BIAS, N, KP, GROUPS, groups_per_split,
                              NW, R, ADD_H, ADD_R, eps,
                              GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, GPS: tl.constexpr,
                              WPG: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN: tl.constexpr,
                              X_PAIRS: tl.constexpr, EXACT: tl.constexpr, SPLIT: tl.constexpr,
                              HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr,
                              NORM: tl.constexpr = False, HAS_RES: tl.constexpr = False,
                              ADD: tl.constexpr = 0):
    """One row of x. Tile axes (output column n, group g of the step, word w of the group): a step reads GPS
    whole groups of BLOCK_N columns (WPG: the group's GROUP_SIZE / 8 words, padded to a power of two), and
    each thread holds several columns at the same word positions, so x's eight values per word are loaded
    and widened once for all of them.

    Per word: both half-words are moved to bits 7-22 (lo: w << 7, hi: w >> 9) under an all-ones exponent,
    so the nibbles sit at bits 7, 11, 15 and 19 and one AND each reads 2^(23 − b) + q (`_nibble_at`). With
    those magics (2^16, 2^12, 2^8, 2^4) small, (2^(23 − b) + q)·x accumulates in fp32 with FMAs and Σ 2^(23−b)·x
    comes off once per word; only the 2^16 nibbles take their magic off per weight, which keeps the running sum
    below 2^13·|x|: ~1e-5 relative error before the fp16 / bf16 output's rounding (EXACT, for fp32 x: every
    magic off per weight). Then acc += s·part + (−z·s)·Σx.

    Neighbours fused in (the fused decoder layer's W4A16 steps, nano_vllm/layers/fused_decode.py): NORM — x is
    RMSNorm(x (+ R, HAS_RES)) with weight NW, each program computing the row's 1/rms itself and normalising the
    x values it multiplies; ADD — the output rounded, plus ADD_H (ADD = 1) or the stream ADD_H + ADD_R rounded
    (ADD = 2), rounded: an o_proj that returns the new residual stream (one slice of K, no bias)."""
    pdl_prologue(PDL, RELEASE=False)  # launch overlap with the previous kernel (shared.kernels)
    DT: tl.constexpr = tl.bfloat16 if X_PAIRS else X.dtype.element_ty
    rstd = 0.0
    if NORM:
        rstd = _row_rstd(X, R, KP * 8, eps, X_PAIRS, HAS_RES, DT)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = _tile_columns(pid_n, N, BLOCK_N, SILU)
    rows = tl.minimum(rn, N - 1).to(tl.int64)[:, None, None]  # columns past N re-read N - 1, never stored
    rg = tl.arange(0, GPS)[None, :, None]
    rw = tl.arange(0, WPG)[None, None, :]
    pair = 4 * rw - 3 * (rw % 4)  # word 4u + c's first pair of x, 16u + c, in its group (whole chunks)
    acc = tl.zeros((BLOCK_N, GPS, WPG), dtype=tl.float32)
    g_lo = pid_k * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, GROUPS)
    for g0 in tl.range(g_lo, g_hi, GPS, num_stages=NUM_STAGES):
        grp = g0 + rg
        word = grp * (GROUP_SIZE // 8) + rw
        ok = (grp < g_hi) & (rw < GROUP_SIZE // 8)
        if EVEN:
            w = tl.load(QW + rows * KP + word, eviction_policy="evict_first")  # read once: keep x in L2
            s = tl.load(S + rows * GROUPS + grp).to(tl.float32)
            zs = tl.load(ZS + rows * GROUPS + grp)
        else:  # masked words read 0 against x = 0, and s = 0: they add nothing
            w = tl.load(QW + rows * KP + word, mask=ok, other=0, eviction_policy="evict_first")
            s = tl.load(S + rows * GROUPS + grp, mask=grp < g_hi, other=0.0).to(tl.float32)
            zs = tl.load(ZS + rows * GROUPS + grp, mask=grp < g_hi, other=0.0)
        x0, x1, x2, x3, x4, x5, x6, x7 = _load_x8(X, grp * (GROUP_SIZE // 2) + pair, ok, X_PAIRS, EVEN)
        if NORM:  # per word position, shared by the BLOCK_N columns
            r0, r1, r2, r3, r4, r5, r6, r7 = x0, x1, x2, x3, x4, x5, x6, x7
            if HAS_RES:
                r0, r1, r2, r3, r4, r5, r6, r7 = _load_x8(R, grp * (GROUP_SIZE // 2) + pair, ok, X_PAIRS, EVEN)
            w0, w1, w2, w3, w4, w5, w6, w7 = _load_x8(NW, grp * (GROUP_SIZE // 2) + pair, ok, X_PAIRS, EVEN)
            x0 = _prologue_x(x0, r0, w0, rstd, DT, HAS_RES, NORM)
            x1 = _prologue_x(x1, r1, w1, rstd, DT, HAS_RES, NORM)
            x2 = _prologue_x(x2, r2, w2, rstd, DT, HAS_RES, NORM)
            x3 = _prologue_x(x3, r3, w3, rstd, DT, HAS_RES, NORM)
            x4 = _prologue_x(x4, r4, w4, rstd, DT, HAS_RES, NORM)
            x5 = _prologue_x(x5, r5, w5, rstd, DT, HAS_RES, NORM)
            x6 = _prologue_x(x6, r6, w6, rstd, DT, HAS_RES, NORM)
            x7 = _prologue_x(x7, r7, w7, rstd, DT, HAS_RES, NORM)
        lo = (w << 7) | 0x7F800000  # nibbles 0-3 at bits 7, 11, 15, 19 (bits shifted into the exponent: ORed away)
        hi = (w.to(tl.uint32, bitcast=True) >> 9).to(tl.int32, bitcast=True) | 0x7F800000  # nibbles 4-7
        part = _nibble_at(lo, 19, EXACT) * x3  # smallest magics first: the running sum grows last
        part += _nibble_at(hi, 19, EXACT) * x7
        part += _nibble_at(lo, 15, EXACT) * x2
        part += _nibble_at(hi, 15, EXACT) * x6
        part += _nibble_at(lo, 11, EXACT) * x1
        part += _nibble_at(hi, 11, EXACT) * x5
        part += _nibble_at(lo, 7, True) * x0
        part += _nibble_at(hi, 7, True) * x4
        if not EXACT:  # per word position, not per column
            part -= 16.0 * (x3 + x7) + 256.0 * (x2 + x6) + 4096.0 * (x1 + x5)
        x_sum = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
        acc += s * part + zs * x_sum
    pdl_release(PDL)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if SILU:  # one slice, no bias (checked on the host)
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        _store_silu_and_mul(y[None, :], 0, cols[None, :], (cols < N // 2)[None, :], OUT, BLOCK_N // 2, N // 2)
    elif ADD:  # one slice, no bias (checked on the host): round(y) + the stream, rounded
        ok = rn < N
        h = tl.load(ADD_H + rn, mask=ok, other=0.0).to(tl.float32)
        if ADD == 2:
            h = _rnd(h + tl.load(ADD_R + rn, mask=ok, other=0.0).to(tl.float32), OUT.dtype.element_ty)
        y = _rnd(y, OUT.dtype.element_ty) + h
        tl.store(OUT + rn, y.to(OUT.dtype.element_ty), mask=ok)
    else:
        split_k_epilogue(y, rn, rn < N, OUT, PART, TICKETS, pid_n, pid_k, N, N, BIAS, SPLIT, HAS_BIAS)


def _split_k_buffers(out: torch.Tensor, slices: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`split_k_epilogue`'s fp32 partials (slices, M, N) (`out` itself when one slice sums all of K) and its
    ticket counters for `tiles` output tiles."""
    if tiles > TICKETS:
        raise ValueError(f"repacked: {tiles} output tiles exceed the {TICKETS} split-K tickets")
    partial = out if slices == 1 else torch.empty(slices, *out.shape, device=out.device, dtype=torch.float32)
    return partial, split_k_tickets(out.device)


@functools.lru_cache(maxsize=1024)
def awq_gemv_repacked_config(n: int, k: int, group_size: int, num_sms: int) -> dict:
    """Tiles for `_awq_gemv_repacked_kernel` at M = 1: the measured entry of MEASURED_REPACKED, else 16
    columns and up to 4 groups per step on one warp, 3 stages, and SPLIT_K doubled while the grid has fewer
    than 2 programs per SM and every slice keeps at least two steps."""
    if (n, k) in MEASURED_REPACKED and num_sms == 132:
        return dict(MEASURED_REPACKED[(n, k)])
    groups = k // group_size
    gps = min(4, 1 << (groups.bit_length() - 1))  # the largest power of two up to min(4, groups)
    split = 1
    while cdiv(n, 16) * split < 2 * num_sms and groups >= 4 * split * gps:
        split *= 2
    return {"BLOCK_N": 16, "GPS": gps, "SPLIT_K": split, "num_warps": 1, "num_stages": 3}


def awq_gemv_repacked_triton(x: torch.Tensor, qweight_t: torch.Tensor, scales_t: torch.Tensor,
                             zeros_t: torch.Tensor, group_size: int, bias: torch.Tensor | None = None,
                             config: dict | None = None, silu_and_mul: bool = False,
                             norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                             residual: torch.Tensor | None = None,
                             add: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """x (1, K) @ Ŵ (K, N) (+ bias) over `repack_for_gemv`'s layout (AWQ §4's memory-bound decoding): each
    program streams BLOCK_N columns' K-contiguous packed words, GPS groups a step, scale and zero once per word.
    silu_and_mul: Ŵ is a fused gate_up (gate the first N / 2 columns, up the rest); returns SwiGLU's
    silu(gate)·up, (1, N / 2), from the kernel's epilogue (`_store_silu_and_mul`; one slice of K, no bias).

    The fused decoder layer's neighbours (each as shared.kernels / the paper path rounds it): norm_weight —
    x is first RMSNorm'd (weight norm_weight, eps), and with `residual` (1, K) the row normalised is the stream
    x + residual; add = (h, r) — returns round(x Ŵ) + h, or + round(h + r) when r is given: an o_proj that
    adds the residual stream (h, r (1, N); one slice of K, no bias)."""
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
    gps, split = cfg.pop("GPS"), cfg.pop("SPLIT_K")
    if gps < 1 or gps & (gps - 1) or cfg["BLOCK_N"] < 1 or cfg["BLOCK_N"] & (cfg["BLOCK_N"] - 1):
        raise ValueError(f"awq_gemv_repacked: GPS {gps} and BLOCK_N {cfg['BLOCK_N']} must be powers of two")
    if split < 1:
        raise ValueError(f"awq_gemv_repacked: SPLIT_K must be >= 1, got {split}")
    split = _check_silu_and_mul("awq_gemv_repacked", silu_and_mul, n, cfg["BLOCK_N"], bias, split)
    _check_neighbours(x, n, norm_weight, residual, add, bias, silu_and_mul)
    split = 1 if add is not None else split  # only a program holding all of K has the sum to add to
    per = cdiv(cdiv(groups, split), gps) * gps  # groups a program sums: whole steps
    out = torch.empty(1, n // 2 if silu_and_mul else n, device=x.device, dtype=x.dtype)
    grid = (cdiv(out.shape[1], cfg["BLOCK_N"] // 2 if silu_and_mul else cfg["BLOCK_N"]), cdiv(groups, per))
    partial, tickets = _split_k_buffers(out, grid[1], grid[0])
    wpg = next_pow2(group_size // 8)
    pairs = x.dtype == torch.bfloat16

    def as_read(t: torch.Tensor) -> torch.Tensor:  # bf16 rows as int32 pairs: an even offset, contiguous
        t = t.reshape(1, -1)
        t = t.clone() if pairs and (t.storage_offset() % 2 or t.stride(-1) != 1) else t
        return t.view(torch.int32) if pairs else t

    xr = as_read(x)
    nw = as_read(norm_weight) if norm_weight is not None else xr
    res = as_read(residual) if residual is not None else xr
    add_h, add_r = (add[0], add[0] if add[1] is None else add[1]) if add is not None else (out, out)
    stages = cfg.setdefault("num_stages", 1)
    _awq_gemv_repacked_kernel[grid](
        xr, qweight_t, scales_t, zeros_t, out, partial, tickets,
        out if bias is None else bias, n, kp, groups, per, nw, res, add_h.contiguous(), add_r.contiguous(),
        float(eps),
        GROUP_SIZE=group_size, GPS=gps, WPG=wpg,
        NUM_STAGES=stages, EVEN=groups % per == 0 and wpg * 8 == group_size, X_PAIRS=pairs,
        EXACT=x.dtype == torch.float32, SPLIT=grid[1] > 1, HAS_BIAS=bias is not None, SILU=silu_and_mul,
        NORM=norm_weight is not None, HAS_RES=residual is not None,
        ADD=0 if add is None else 1 if add[1] is None else 2, **pdl_args(x.device), **cfg)
    return out


def _check_neighbours(x: torch.Tensor, n: int, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
                      add: tuple | None, bias: torch.Tensor | None, silu_and_mul: bool) -> None:
    """The fused neighbours' tensors checked against x (1, K) and N: each a row of x's dtype and device."""
    k = x.shape[1]

    def row(name: str, t: torch.Tensor, size: int) -> None:
        if not isinstance(t, torch.Tensor) or t.numel() != size or t.dtype != x.dtype or t.device != x.device:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"awq_gemv_repacked: {name} must be {size} values of x's dtype {x.dtype} on its "
                             f"device, got {got}")

    if norm_weight is not None:
        row("norm_weight", norm_weight, k)
    if residual is not None:
        if norm_weight is None:
            raise ValueError("awq_gemv_repacked: residual is the stream a norm_weight normalises: give both")
        row("residual", residual, k)
    if add is None:
        return
    if silu_and_mul or bias is not None or not isinstance(add, tuple) or len(add) != 2:
        raise ValueError("awq_gemv_repacked: add is an (h, r or None) pair, without bias or silu_and_mul")
    row("add's h", add[0], n)
    if add[1] is not None:
        row("add's r", add[1], n)


def _check_silu_and_mul(name: str, silu_and_mul: bool, n: int, block_n: int, bias: torch.Tensor | None,
                        split: int) -> int:
    """The SwiGLU epilogue's conditions (an even N and BLOCK_N, no bias); returns the split count it runs with:
    1, since only a program holding all of K has the final gate and up values."""
    if not silu_and_mul:
        return split
    if n % 2 or block_n % 2 or bias is not None:
        raise ValueError(f"{name}: silu_and_mul needs an even N ({n}) and BLOCK_N ({block_n}) and no bias")
    return 1


# ------------------------------------------------------------------ tensor cores, M = 2..64

@triton.jit
def _zero_point(s, zs, dtype: tl.constexpr, PTX: tl.constexpr):
    """The zero point z per row (exact: zs = −z·s in fp32) in the form `_pair` subtracts it: for fp16 / bf16 on
    a GPU the int32 pair of −(2^e + z) in dtype (2^e as in `_pair`), else 2^e + z in dtype, or z in fp32."""
    z = (tl.fdiv(-zs, tl.where(s != 0, s, 1.0)) + 0.5).to(tl.int32)  # s = 0: zs = 0, z = 0, weights 0
    z = tl.minimum(tl.maximum(z, 0), 15)
    if dtype == tl.float32:
        z = z.to(tl.float32)
    elif PTX:  # the sign bit and 2^e's exponent in both halves, z in the low mantissa bits
        z = (z | (z << 16)) | ((0xC300C300 if dtype == tl.bfloat16 else 0xE400E400) - (1 << 32))
    else:
        z = (z + (128 if dtype == tl.bfloat16 else 1024)).to(dtype)
    return z


@triton.jit
def _pair(w, z, i: tl.constexpr, dtype: tl.constexpr, PTX: tl.constexpr, SUB: tl.constexpr):
    """Nibbles i and 4 + i of the words `w` (the values k = 2c + 8i and 2c + 8i + 1 of their chunk) in dtype.
    16-bit dtype: one AND-OR keeps both nibbles, 16 bits apart, under the bit pattern of 2^e (bf16 128, fp16
    1024: the power of two whose lowest mantissa bit is worth 1), so each half reads 2^e + q exactly and the
    32-bit word is already the MMA's register of two neighbouring K; with SUB one packed FMA takes 2^e + z
    (`_zero_point`, broadcast like w) off both: q − z, exact. fp32: 2^23 + q, less 2^23 (+ z with SUB). PTX:
    `lop3` (ptxas keeps an OR with a second constant apart, one more instruction) and `fma.rn.{b}f16x2`."""
    v = w >> (4 * i)
    if dtype == tl.float32:
        v = v & 0x000F000F
        lo = ((v & 0xFFFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        hi = ((v >> 16) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        if SUB:
            lo, hi = lo - z, hi - z
    else:
        magic: tl.constexpr = 0x43004300 if dtype == tl.bfloat16 else 0x64006400
        if PTX and SUB:
            fma: tl.constexpr = "fma.rn.bf16x2" if dtype == tl.bfloat16 else "fma.rn.f16x2"
            one: tl.constexpr = 0x3F803F80 if dtype == tl.bfloat16 else 0x3C003C00  # 1.0 in both halves
            v = tl.inline_asm_elementwise(
                f"{{ .reg .b32 t, one; lop3.b32 t, $1, 0x000F000F, {magic}, 0xEA; mov.b32 one, {one}; "
                f"{fma} $0, t, one, $2; }}", "=r,r,r", [v, z], dtype=tl.int32, is_pure=True, pack=1)
        elif PTX:
            v = tl.inline_asm_elementwise(f"lop3.b32 $0, $1, 0x000F000F, {magic}, 0xEA;", "=r,r", [v],
                                          dtype=tl.int32, is_pure=True, pack=1)
        else:
            v = (v & 0x000F000F) | magic
        lo = (v & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
        hi = (v >> 16).to(tl.int16).to(dtype, bitcast=True)
        if SUB and not PTX:
            lo, hi = lo - z, hi - z
    return lo, hi


@triton.jit
def _unpack_words(w, z, ROWS: tl.constexpr, W: tl.constexpr, dtype: tl.constexpr, PTX: tl.constexpr,
                  SUB: tl.constexpr):
    """(rows, W) int32 words of `repack_for_gemv`'s layout (W a multiple of 4: whole chunks) -> (rows, 8·W)
    values in natural K order, in dtype: q − z with SUB (z: each row's `_zero_point`), else 2^e + q for
    fp16 / bf16 (the offset comes off through Σx) and q for fp32. The joins and the permute only rename
    registers: each thread keeps the nibbles of the words it loaded, and those are its fragment of the MMA's A
    operand."""
    if SUB:
        z = tl.broadcast_to(z[:, None], (ROWS, W))
    l0, h0 = _pair(w, z, 0, dtype, PTX, SUB)
    l1, h1 = _pair(w, z, 1, dtype, PTX, SUB)
    l2, h2 = _pair(w, z, 2, dtype, PTX, SUB)
    l3, h3 = _pair(w, z, 3, dtype, PTX, SUB)
    q = tl.join(tl.join(tl.join(l0, h0), tl.join(l1, h1)), tl.join(tl.join(l2, h2), tl.join(l3, h3)))
    # axes (row, word = 4u + c, e, b, a) for pair i = 2a + b; k = 32u + 16a + 8b + 2c + e
    q = tl.permute(tl.reshape(q, (ROWS, W // 4, 4, 2, 2, 2)), (0, 1, 5, 4, 2, 3))
    return tl.reshape(q, (ROWS, 8 * W))


@triton.jit(do_not_specialize=["M", "iters_per_split"])
def _awq_mma_repacked_kernel(X, QW, S, ZS, OUT, PART, TICKETS, BIAS, M, N, KP, GROUPS, stride_xm,
                             iters_per_split, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                             OFFSET: tl.constexpr, PTX: tl.constexpr, NUM_STAGES: tl.constexpr,
                             SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                             PDL: tl.constexpr):
    """out (BLOCK_M rows, BLOCK_N columns) over a K slice: per step, K_TILES tiles of BLOCK_N columns' words of
    BLOCK_K values of K (each in one group: BLOCK_K divides GROUP_SIZE) become OFFSET + q in x's dtype
    (`_unpack_words`, in registers) and are multiplied as the A operand with xᵀ (the weight tile fills the
    MMA's M = 64 rows; x's rows are its N), then acc += s·(q' xᵀ) + (−z·s − OFFSET·s)·Σ_k x: the offset and
    the zero point in one term. From 64 rows of x, where Σx costs as much as the tile's unpack (BLOCK_M·BLOCK_K
    adds), the tile is q − z instead, one packed FMA per register, and acc += s·((q − z) xᵀ). K_TILES > 1
    reads longer runs of each column a step (DRAM likes 128 bytes better than 64)."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = _tile_columns(pid_n, N, BLOCK_N, SILU)
    rows = tl.minimum(rn, N - 1).to(tl.int64)  # columns past N re-read N - 1, never stored
    rw = tl.arange(0, BLOCK_K // 8)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    it_lo = pid_k * iters_per_split
    it_hi = tl.minimum(it_lo + iters_per_split, KP // (K_TILES * BLOCK_K // 8))
    pdl_prologue(PDL, RELEASE=False)
    for it in tl.range(it_lo, it_hi, num_stages=NUM_STAGES):
        for t in tl.static_range(K_TILES):
            kt = it * K_TILES + t  # the tile's index along K
            w = tl.load(QW + rows[:, None] * KP + (kt * (BLOCK_K // 8) + rw)[None, :])
            grp = kt * BLOCK_K // GROUP_SIZE
            s = tl.load(S + rows * GROUPS + grp).to(tl.float32)
            zs = tl.load(ZS + rows * GROUPS + grp)
            x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + (kt * BLOCK_K + rk)[None, :],
                        mask=m_ok[:, None], other=0.0)
            if BLOCK_M >= 64:  # H200, llama3-8b layer at M = 64, each its best tiles: 146.0 against 159.3 µs
                q = _unpack_words(w, _zero_point(s, zs, X.dtype.element_ty, PTX), BLOCK_N, BLOCK_K // 8,
                                  X.dtype.element_ty, PTX, True)
                acc += tl.dot(q, tl.trans(x)) * s[:, None]
            else:  # with Σx (same run); at M = 16 Σx is the cheaper: 89.5 against 94.5 µs
                q = _unpack_words(w, 0, BLOCK_N, BLOCK_K // 8, X.dtype.element_ty, PTX, False)
                acc += (tl.dot(q, tl.trans(x)) * s[:, None]
                        + (zs - OFFSET * s)[:, None] * tl.sum(x.to(tl.float32), axis=1)[None, :])
    pdl_release(PDL)
    if SILU:  # one slice, no bias (checked on the host)
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        _store_silu_and_mul(tl.trans(acc), rm[:, None].to(tl.int64), cols[None, :],
                            m_ok[:, None] & (cols < N // 2)[None, :], OUT, BLOCK_N // 2, N // 2)
    else:
        split_k_epilogue(tl.trans(acc), rm[:, None].to(tl.int64) * N + rn[None, :],
                         m_ok[:, None] & (rn < N)[None, :], OUT, PART, TICKETS, pid_m * tl.num_programs(0) + pid_n,
                         pid_k, M * N, N, BIAS, SPLIT, HAS_BIAS)


# Per llama3-8b layer (H200, 2026-12-02, `python -m nano_quant.bench 'ms=[1,4,16,64]'`): 90.4 µs at M = 16 and
# 146.5 at 64 (bf16 cuBLAS 154.5 / 158.0) with the fragment-order layout and the two-values-per-instruction
# unpack above, against 116.5 / 226.2 for the natural-order layout's kernel (its tile through shared memory
# into the A fragment, or x's tile permuted to match a nibble-major unpack; four instructions per value). A
# step is 333 SASS instructions per thread at 128 x 16 tiles, against 593. Not kept: fp32 scales, whose loads
# the pipeline copies asynchronously (2-byte ones it does not): 0-10% slower, for 3% more bytes; TMA loads
# (tensor descriptors): 98.6 against 89.5 µs at M = 16, 155.5 against 146.0 at 64; earlier, a nibble-major
# weight layout with x read at a stride, which cost the M = 1 GEMV 11%.
# The best config per (N, K) and row tile on an H200 (2026-12-02), from a sweep of BLOCK_N 64 / 128 / 256,
# 4 or 8 warps, 3 or 4 stages, SPLIT_K 1-8 and K_TILES 1-2 (`python -m nano_quant.bench tune=true
# "tune_systems=['w4a16 mma repacked']" 'ms=[16,32,64]'` sweeps that grid and prints the entries). Other shapes
# take `awq_mma_repacked_config`'s rule.
MEASURED_MMA_REPACKED: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {
    # (N, K, BLOCK_M): (BLOCK_N, num_warps, num_stages, SPLIT_K, K_TILES); µs at M = 16 / 32 / 64, bf16 cuBLAS after
    (6144, 4096, 16): (64, 4, 3, 4, 1), (6144, 4096, 32): (64, 4, 3, 4, 1),
    (6144, 4096, 64): (64, 4, 3, 4, 1),  # qkv: 14.7 / 17.2 / 22.9 (22.6 / 22.8 / 23.2)
    (4096, 4096, 16): (64, 4, 4, 4, 1), (4096, 4096, 32): (64, 4, 4, 4, 1),
    (4096, 4096, 64): (64, 4, 3, 2, 2),  # o: 12.8 / 15.2 / 17.6 (19.5 / 18.4 / 18.4)
    (28672, 4096, 16): (64, 4, 3, 1, 2), (28672, 4096, 32): (128, 8, 3, 1, 1),
    (28672, 4096, 64): (128, 4, 3, 1, 1),  # gate_up: 37.9 / 45.1 / 66.5 (70.8 / 71.2 / 72.1)
    (4096, 14336, 16): (64, 4, 3, 8, 2), (4096, 14336, 32): (128, 8, 3, 8, 1),
    (4096, 14336, 64): (64, 4, 3, 4, 2),  # down: 25.0 / 28.4 / 39.4 (41.5 / 42.7 / 44.3)
}


@functools.lru_cache(maxsize=1024)
def awq_mma_repacked_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> dict:
    """Tiles for `_awq_mma_repacked_kernel`: rows of x padded to 16 / 32 / 64, BLOCK_K the group's largest
    power-of-two divisor up to 128; a measured entry, else 64 columns (128 for 64 rows), 4 warps, 3 stages, one
    tile a step, and SPLIT_K 4 (8 when N gives fewer than 96 column tiles), at most the steps along K."""
    block_m = min(64, max(16, next_pow2(m)))
    block_k = min(128, group_size & -group_size)
    known = MEASURED_MMA_REPACKED.get((n, k, block_m)) if num_sms == 132 and block_k == 128 else None
    if known is None or (k // block_k) % known[4]:
        block_n = 64 if block_m <= 32 else 128
        known = (block_n, 4, 3, 4 if cdiv(n, block_n) >= 96 else 8, 1)
    block_n, warps, stages, split, k_tiles = known
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "K_TILES": k_tiles,
            "SPLIT_K": max(1, min(split, k // block_k // k_tiles)), "num_warps": warps, "num_stages": stages}


def awq_mma_repacked_triton(x: torch.Tensor, qweight_t: torch.Tensor, scales_t: torch.Tensor,
                            zeros_t: torch.Tensor, group_size: int, bias: torch.Tensor | None = None,
                            config: dict | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """x (M, K) @ Ŵ (K, N) (+ bias) over `repack_for_gemv`'s layout on tensor cores, for decode-sized M (AWQ
    §4: the weight read once per step dominates); scale and zero applied once per group tile. silu_and_mul: as
    `awq_gemv_repacked_triton`'s, (M, N / 2)."""
    if x.dim() != 2:
        raise ValueError(f"awq_mma_repacked: x must be (M, K), got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n, kp = qweight_t.shape
    groups = scales_t.shape[-1]
    if (kp * 8 != k or qweight_t.stride(1) != 1 or groups * group_size != k or scales_t.shape != (n, groups)
            or zeros_t.shape != (n, groups) or zeros_t.dtype != torch.float32):
        raise ValueError(f"awq_mma_repacked: x {tuple(x.shape)} does not match qweight_t "
                         f"{tuple(qweight_t.shape)} / scales_t {tuple(scales_t.shape)} / zeros_t "
                         f"{tuple(zeros_t.shape)} {zeros_t.dtype} with group_size {group_size}")
    cfg = dict(config or awq_mma_repacked_config(m, n, k, group_size, num_sms(x.device)))
    block_k, split, k_tiles = cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K"), cfg.pop("K_TILES", 1)
    if block_k < CHUNK or block_k & (block_k - 1) or group_size % block_k or split < 1:
        raise ValueError(f"awq_mma_repacked: BLOCK_K {block_k} must be a power of two >= {CHUNK} dividing "
                         f"group_size {group_size}, and SPLIT_K {split} >= 1")
    if k_tiles < 1 or (k // block_k) % k_tiles:
        raise ValueError(f"awq_mma_repacked: K_TILES {k_tiles} must divide the {k // block_k} tiles of "
                         f"BLOCK_K {block_k} along K = {k}")
    split = _check_silu_and_mul("awq_mma_repacked", silu_and_mul, n, cfg["BLOCK_N"], bias, split)
    out = torch.empty(m, n // 2 if silu_and_mul else n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    per = cdiv(k // block_k // k_tiles, split)  # steps a program takes: no empty slice
    grid = (cdiv(out.shape[1], cfg["BLOCK_N"] // 2 if silu_and_mul else cfg["BLOCK_N"]),
            cdiv(k // block_k // k_tiles, per), cdiv(m, cfg["BLOCK_M"]))
    partial, tickets = _split_k_buffers(out, grid[1], grid[0] * grid[2])
    stages = cfg.pop("num_stages", 1)
    _awq_mma_repacked_kernel[grid](x, qweight_t, scales_t, zeros_t, out, partial, tickets,
                                   out if bias is None else bias, m, n, kp, groups, x.stride(0), per,
                                   GROUP_SIZE=group_size, BLOCK_K=block_k, K_TILES=k_tiles,
                                   OFFSET=_OFFSET.get(x.dtype, 0.0), PTX=x.is_cuda, NUM_STAGES=stages,
                                   SPLIT=grid[1] > 1, HAS_BIAS=bias is not None, SILU=silu_and_mul,
                                   num_stages=stages, **pdl_args(x.device), **cfg)
    return out


# ------------------------------------------------------------------ more rows: dequantize once, then cuBLAS

# Values per program and warps of the dequantizing copy (a program takes one group of BLOCK_N rows).
DEQUANT_TILE = {"values": 8192, "num_warps": 4}  # H200: best of 2,048-16,384 values, 4-16 warps


@triton.jit
def _dequantize_repacked_kernel(QW, S, ZS, W, N, KP, GROUPS, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr):
    """Ŵ (BLOCK_N, GROUP_SIZE) = q·s + (−z·s) of one group, unpacked as in the tensor-core kernel. One group
    per program: its scale and zero are one value per row, loaded once and broadcast along K (a gather of
    them per element made this copy ten times slower than its bytes). BLOCK_K: the group padded to a power
    of two (a group holds whole chunks of 32, so the padding is whole chunks too)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    cw, ck = tl.arange(0, BLOCK_K // 8), tl.arange(0, BLOCK_K)
    row_ok = rn < N
    w = tl.load(QW + rn[:, None].to(tl.int64) * KP + (g * (GROUP_SIZE // 8) + cw)[None, :],
                mask=row_ok[:, None] & (cw < GROUP_SIZE // 8)[None, :], other=0)
    s = tl.load(S + rn.to(tl.int64) * GROUPS + g, mask=row_ok, other=0.0).to(tl.float32)
    zs = tl.load(ZS + rn.to(tl.int64) * GROUPS + g, mask=row_ok, other=0.0)
    q = _unpack_words(w, 0, BLOCK_N, BLOCK_K // 8, tl.float32, False, False)
    w_hat = (q * s[:, None] + zs[:, None]).to(W.dtype.element_ty)
    tl.store(W + rn[:, None].to(tl.int64) * (8 * KP) + (g * GROUP_SIZE + ck)[None, :], w_hat,
             mask=row_ok[:, None] & (ck < GROUP_SIZE)[None, :])


def dequantize_repacked_triton(qweight_t: torch.Tensor, scales_t: torch.Tensor, zeros_t: torch.Tensor,
                               group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The (N, K) weight of the repacked tensors in `dtype`, for the rows where cuBLAS on the dequantized
    weight beats reading 4 bits per weight (above AWQ_LARGE_M: prefill)."""
    n, kp = qweight_t.shape
    groups = scales_t.shape[1]
    w = torch.empty(n, kp * 8, device=qweight_t.device, dtype=dtype)
    block_k = next_pow2(group_size)
    block_n = max(1, DEQUANT_TILE["values"] // block_k)  # rows per program
    _dequantize_repacked_kernel[(cdiv(n, block_n), groups)](
        qweight_t, scales_t, zeros_t, w, n, kp, groups, GROUP_SIZE=group_size, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=DEQUANT_TILE["num_warps"])
    return w


class RepackedGemvWQLinear(WQLinear_GEMM):
    """WQLinear_GEMM that runs the repacked kernels on CUDA (fp16 / bf16) for up to AWQ_LARGE_M rows of x —
    `awq_gemv_repacked_triton` for one row, `awq_mma_repacked_triton` for more — and its own path otherwise.
    The repacked tensors are non-persistent buffers: one more copy of the 4-bit weight, N·K/2 bytes, plus 6
    bytes per group and column (fp16 scales, fp32 zeros) — for llama3-8b's decoder layers 3.6 GiB more —
    unless `drop_autoawq` frees AutoAWQ's tensors (serving: the checkpoint on disk keeps them), after which
    every other call dequantizes the repacked copy."""

    def build_repacked(self) -> None:
        for name, t in zip(("qweight_t", "scales_t", "zeros_t"),
                           repack_for_gemv(self.qweight, self.qzeros, self.scales, self.group_size)):
            self.register_buffer(name, t, persistent=False)

    def drop_autoawq(self) -> None:
        """Free qweight / qzeros / scales: the layer keeps only the repacked copy (its state dict is empty of
        them, so it can no longer be saved)."""
        for name in ("qweight", "qzeros", "scales"):
            delattr(self, name)
        self.repacked_only = True

    def dequantize(self) -> torch.Tensor:
        if getattr(self, "repacked_only", False):
            return dequantize_repacked_torch(self.qweight_t, self.scales_t, self.zeros_t, self.group_size)
        return super().dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        fits = 1 <= rows <= AWQ_LARGE_M
        on_gpu = x.dtype in (torch.float16, torch.bfloat16) and use_triton(x) and layers_enabled()
        if (fits and on_gpu) or getattr(self, "repacked_only", False):
            if getattr(self, "qweight_t", None) is None:  # built once, on the first call that needs it
                self.build_repacked()
            bias = None if self.bias is None else self.bias.to(x.dtype)
            x2 = x.reshape(rows, -1)
            if fits and on_gpu:
                kernel = awq_gemv_repacked_triton if rows == 1 else awq_mma_repacked_triton
                y = kernel(x2, self.qweight_t, self.scales_t, self.zeros_t, self.group_size, bias)
            else:
                w = (dequantize_repacked_triton(self.qweight_t, self.scales_t, self.zeros_t, self.group_size,
                                                x.dtype) if on_gpu else
                     dequantize_repacked_torch(self.qweight_t, self.scales_t, self.zeros_t, self.group_size))
                y = torch.nn.functional.linear(x2, w.to(x.dtype), bias)
            return y.view(*x.shape[:-1], self.out_features)
        return super().forward(x)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU's silu(gate)·up of this layer's output, for a fused gate_up (gate the first half of its
        columns, up the second: nano_vllm's `FusedMLP`). On the repacked kernels' path (1..AWQ_LARGE_M rows
        on CUDA, no bias) it comes from the GEMM's epilogue: no (M, N) output and no second launch; otherwise
        `forward`, then `shared.kernels.silu_and_mul`."""
        rows = x.numel() // self.in_features
        if (1 <= rows <= AWQ_LARGE_M and x.dtype in (torch.float16, torch.bfloat16) and use_triton(x)
                and layers_enabled() and self.bias is None and self.out_features % 2 == 0):
            if getattr(self, "qweight_t", None) is None:
                self.build_repacked()
            kernel = awq_gemv_repacked_triton if rows == 1 else awq_mma_repacked_triton
            y = kernel(x.reshape(rows, -1), self.qweight_t, self.scales_t, self.zeros_t, self.group_size,
                       silu_and_mul=True)
            return y.view(*x.shape[:-1], self.out_features // 2)
        gate, up = self.forward(x).chunk(2, dim=-1)
        return silu_and_mul(gate, up)


def use_repacked_gemv(model: torch.nn.Module, drop_autoawq: bool = False) -> torch.nn.Module:
    """Every WQLinear_GEMM of `model` whose group holds whole chunks (a multiple of 32) becomes a
    RepackedGemvWQLinear in place with its repacked tensors built now (before any CUDA-graph capture); with
    `drop_autoawq`, AutoAWQ's tensors are freed (the layers can then not be saved). Other layers keep
    AutoAWQ's kernels. Returns the model. `linear.swap_modules` calls it for a model on CUDA."""
    for m in model.modules():
        if type(m) is WQLinear_GEMM and m.group_size % CHUNK == 0:
            m.__class__ = RepackedGemvWQLinear
            m.build_repacked()
            if drop_autoawq:
                m.drop_autoawq()
    return model


def _swap(model: torch.nn.Module, serving_only: bool = False) -> None:
    use_repacked_gemv(model, drop_autoawq=serving_only)


def _has_awq_on_cuda(model: torch.nn.Module, **kwargs) -> bool:
    return any(type(m) is WQLinear_GEMM and m.group_size % CHUNK == 0 and use_triton(m.qweight)
               for m in model.modules())


REGISTRY.register("module_swap", _swap, applies=_has_awq_on_cuda)
