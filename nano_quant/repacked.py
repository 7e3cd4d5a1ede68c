"""AWQ W4A16 over a K-contiguous repacked copy of the weight (a performance layer beside `gemv.py` and
`kernels.py`, which read AutoAWQ's layout; the checkpoint keeps AutoAWQ's format).

AWQ's speedup is memory-bound decoding (Lin et al., MLSys 2024, §4: TinyChat): at a few rows of x the GEMM
reads the weight once, and 4-bit weights move ~4x fewer bytes than 16-bit ones, provided the
dequantization is cheap enough to hide under the loads. `repack_for_gemv` lays each output column's words
along K (TinyChat's and tinygemm's decode layouts are K-contiguous too), and every kernel here unpacks a
nibble without shifting it down to bit 0: a half-word of a packed int32 is ORed once with a float exponent
pattern, then one AND with a constant keeps one nibble and the exponent that makes its lowest bit worth 1,
so the fp32 reads M + q for a power of two M (subtracted, or in the GEMV taken off once per word). The zero
point is pre-multiplied: Σ_k x_k (q_k − z) s = s Σ_k x_k q_k + (−z s) Σ_k x_k.

* `awq_gemv_repacked_triton` — M = 1 on CUDA cores: one AND and one FMA per weight (a subtract for a quarter
  of them), x widened once per word for several columns.
* `awq_mma_repacked_triton` — M = 2..64 on tensor cores: the unpacked tile (exact small integers in x's
  dtype, in nibble-major order so that it lands in the MMA's A-operand registers; x's tile permuted to
  match) is the A operand against xᵀ, scale and zero applied once per tile of a group.
* `dequantize_repacked_triton` — more rows: the (N, K) weight once per call, for cuBLAS.
* `RepackedGemvWQLinear`, `use_repacked_gemv` — a WQLinear_GEMM that builds the copy and dispatches;
  `drop_autoawq` frees AutoAWQ's tensors when only serving needs the layer.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from shared.kernels import use_triton
from shared.kernels.launch import cdiv, next_pow2

from .gemv import num_sms, split_k_partials, split_k_reduce
from .kernels import AWQ_LARGE_M
from .linear import WQLinear_GEMM
from .quant import unpack_awq

# `repack_for_gemv` turns AutoAWQ's (K, N/8) words into (N, K/8) words holding eight consecutive k of one
# output column, in nibble order (TinyChat's and tinygemm's GEMV layouts are K-contiguous too): a program
# that owns a few output columns reads contiguous runs of each with 16-byte loads. Per group the zero point is
# pre-multiplied, Σ_k x_k (q_k − z) s = s Σ_k x_k q_k + (−z s) Σ_k x_k, so the kernels need no zero unpack.

# The best M = 1 config per weight shape (N, K) on an H200, from `python -m nano_quant.bench tune=true
# "tune_systems=['w4a16 gemv repacked']" 'ms=[1]'`, which prints the lines to paste here (2026-12-02; they were
# also the best of a wider sweep: BLOCK_N 8-64, GPS 1-4, 1-2 warps, 2-4 stages, SPLIT_K 1-8). Shapes not listed
# take `awq_gemv_repacked_config`'s rule. The kernel must specialize `groups_per_split` (Triton's divisibility
# hint on the loop bound): marking it do_not_specialize cost 7% per layer (85.1 against 79.3 µs, same call).
MEASURED_REPACKED: dict[tuple[int, int], dict] = {  # NVIDIA H200: µs at M = 1 (tinygemm in the same run)
    (6144, 4096): {"BLOCK_N": 16, "GPS": 4, "SPLIT_K": 1, "num_warps": 1, "num_stages": 4},  # qkv: 12.6 (13.2)
    (4096, 4096): {"BLOCK_N": 8, "GPS": 2, "SPLIT_K": 1, "num_warps": 1, "num_stages": 4},  # o: 11.9 (10.1)
    (28672, 4096): {"BLOCK_N": 32, "GPS": 2, "SPLIT_K": 1, "num_warps": 1,
                    "num_stages": 3},  # gate_up: 31.8 (38.4)
    (4096, 14336): {"BLOCK_N": 16, "GPS": 4, "SPLIT_K": 4, "num_warps": 1, "num_stages": 3},  # down: 24.3 (22.1)
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


def dequantize_repacked_torch(qweight_t: torch.Tensor, scales_t: torch.Tensor, zeros_t: torch.Tensor,
                              group_size: int) -> torch.Tensor:
    """The (N, K) fp32 weight of the repacked tensors: Ŵ_nk = s·q + (−z·s), which is (q − z)·s (AWQ §3's
    group-wise grid)."""
    n, kp = qweight_t.shape
    q = (qweight_t[..., None] >> (4 * torch.arange(8, device=qweight_t.device, dtype=torch.int32))) & 0xF
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
def _load_x8(X, word, ok, X_PAIRS: tl.constexpr, EVEN: tl.constexpr):
    """x[8·word + t] for t = 0..7 as fp32 tensors shaped like `word`. X_PAIRS: bf16 read as int32 pairs, whose
    halves are the top halves of the fp32 bit patterns (one shift or one AND, no conversion)."""
    if X_PAIRS:
        p0, p1 = _load(X + 4 * word, ok, EVEN), _load(X + 4 * word + 1, ok, EVEN)
        p2, p3 = _load(X + 4 * word + 2, ok, EVEN), _load(X + 4 * word + 3, ok, EVEN)
        return ((p0 << 16).to(tl.float32, bitcast=True), (p0 & -65536).to(tl.float32, bitcast=True),
                (p1 << 16).to(tl.float32, bitcast=True), (p1 & -65536).to(tl.float32, bitcast=True),
                (p2 << 16).to(tl.float32, bitcast=True), (p2 & -65536).to(tl.float32, bitcast=True),
                (p3 << 16).to(tl.float32, bitcast=True), (p3 & -65536).to(tl.float32, bitcast=True))
    ptr = X + 8 * word
    return (_load(ptr, ok, EVEN).to(tl.float32), _load(ptr + 1, ok, EVEN).to(tl.float32),
            _load(ptr + 2, ok, EVEN).to(tl.float32), _load(ptr + 3, ok, EVEN).to(tl.float32),
            _load(ptr + 4, ok, EVEN).to(tl.float32), _load(ptr + 5, ok, EVEN).to(tl.float32),
            _load(ptr + 6, ok, EVEN).to(tl.float32), _load(ptr + 7, ok, EVEN).to(tl.float32))


@triton.jit
def _awq_gemv_repacked_kernel(X, QW, S, ZS, OUT, N, KP, GROUPS, groups_per_split, GROUP_SIZE: tl.constexpr,
                              BLOCK_N: tl.constexpr, GPS: tl.constexpr, WPG: tl.constexpr,
                              NUM_STAGES: tl.constexpr, EVEN: tl.constexpr, X_PAIRS: tl.constexpr,
                              EXACT: tl.constexpr):
    """One row of x. Tile axes (output column n, group g of the step, word w of the group): a step reads GPS
    whole groups of BLOCK_N columns (WPG: the group's GROUP_SIZE / 8 words, padded to a power of two), and
    each thread holds several columns at the same word positions, so x's eight values per word are loaded
    and widened once for all of them.

    Per word: both half-words are moved to bits 7-22 (lo: w << 7, hi: w >> 9) under an all-ones exponent,
    so the nibbles sit at bits 7, 11, 15 and 19 and one AND each reads 2^(23 − b) + q (`_nibble_at`). With
    those magics (2^16, 2^12, 2^8, 2^4) small, (2^(23 − b) + q)·x accumulates in fp32 with FMAs and Σ 2^(23−b)·x
    comes off once per word; only the 2^16 nibbles take their magic off per weight, which keeps the running sum
    below 2^13·|x|: ~1e-5 relative error before the fp16 / bf16 output's rounding (EXACT, for fp32 x: every
    magic off per weight). Then acc += s·part + (−z·s)·Σx."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)[:, None, None]  # columns past N re-read N - 1, never stored
    rg = tl.arange(0, GPS)[None, :, None]
    rw = tl.arange(0, WPG)[None, None, :]
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
        x0, x1, x2, x3, x4, x5, x6, x7 = _load_x8(X, word, ok, X_PAIRS, EVEN)
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
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(OUT + pid_k.to(tl.int64) * N + rn, y.to(OUT.dtype.element_ty), mask=rn < N)


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
                             config: dict | None = None) -> torch.Tensor:
    """x (1, K) @ Ŵ (K, N) (+ bias) over `repack_for_gemv`'s layout (AWQ §4's memory-bound decoding): each
    program streams BLOCK_N columns' K-contiguous packed words, GPS groups a step, scale and zero once per word."""
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
    per = cdiv(cdiv(groups, split), gps) * gps  # groups a program sums: whole steps
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    partial = split_k_partials(out, cdiv(groups, per), bias)
    wpg = next_pow2(group_size // 8)
    pairs = x.dtype == torch.bfloat16
    x = x.clone() if pairs and x.storage_offset() % 2 else x  # an int32 view needs an even offset
    stages = cfg.setdefault("num_stages", 1)
    _awq_gemv_repacked_kernel[(cdiv(n, cfg["BLOCK_N"]), cdiv(groups, per))](
        x.view(torch.int32) if pairs else x, qweight_t, scales_t, zeros_t, partial, n, kp, groups, per,
        GROUP_SIZE=group_size, GPS=gps, WPG=wpg, NUM_STAGES=stages,
        EVEN=groups % per == 0 and wpg * 8 == group_size, X_PAIRS=pairs, EXACT=x.dtype == torch.float32,
        **cfg)
    return split_k_reduce(partial, out, bias)


# ------------------------------------------------------------------ tensor cores, M = 2..64

@triton.jit
def _nibble(half, t: tl.constexpr):
    """Nibble t % 4 of a half-word whose exponent field is all ones: the AND keeps the nibble and the exponent
    of 2^(23 − 4t'), so the fp32 is 2^(23 − 4t') + q (the nibble's lowest bit is worth 1); subtracting the
    power of two leaves q exactly."""
    tt: tl.constexpr = t % 4
    return ((half & ((0xF << (4 * tt)) | ((150 - 4 * tt) << 23))).to(tl.float32, bitcast=True)
            - (1 << (23 - 4 * tt)))


@triton.jit
def _unpack_words(w, ROWS: tl.constexpr, W: tl.constexpr, NIBBLE_MAJOR: tl.constexpr):
    """(rows, W) int32 words -> (rows, 8·W) fp32 integers q: value 8j + t is nibble t of word j (the natural
    order), or with NIBBLE_MAJOR value W·t + j. Each nibble stays at its word's place (joins along new
    in-thread axes; nibble-major moves the nibble axes ahead of the word axis), so the thread that loaded the
    words of the MMA's A fragment holds their nibbles there in nibble-major order: nothing is exchanged
    between threads or through shared memory (the natural order, fed to the MMA, went through it)."""
    lo = (w & 0xFFFF) | 0x7F800000  # nibbles 0-3 in place, under an all-ones exponent
    hi = ((w >> 16) & 0xFFFF) | 0x7F800000  # nibbles 4-7
    q = tl.join(tl.join(tl.join(_nibble(lo, 0), _nibble(hi, 4)), tl.join(_nibble(lo, 2), _nibble(hi, 6))),
                tl.join(tl.join(_nibble(lo, 1), _nibble(hi, 5)), tl.join(_nibble(lo, 3), _nibble(hi, 7))))
    # axes (row, j, a, b, c) with t = 4a + 2b + c: flattened, 8j + t; as (row, a, b, c, j), W·t + j
    if NIBBLE_MAJOR:
        q = tl.permute(q, (0, 2, 3, 4, 1))
    return tl.reshape(q, (ROWS, 8 * W))


@triton.jit(do_not_specialize=["M", "iters_per_split"])
def _awq_mma_repacked_kernel(X, QW, S, ZS, OUT, M, N, KP, GROUPS, stride_xm, iters_per_split,
                             GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """out (BLOCK_M rows, BLOCK_N columns) over a K slice: per step, BLOCK_N columns' words of BLOCK_K values of
    K (one group: BLOCK_K divides GROUP_SIZE) are unpacked to exact integers q in x's dtype and multiplied
    as the A operand with xᵀ (the weight tile fills the MMA's M = 64 rows; x's few rows are its N), then
    acc += s·(q xᵀ) + (−z·s)·Σ_k x. The dot's sum over k runs in nibble-major order (`_unpack_words`),
    so x's tile is permuted the same way: a few rows, on their way to shared memory for the MMA anyway."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)  # columns past N re-read N - 1, never stored
    rw = tl.arange(0, BLOCK_K // 8)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    it_lo = pid_k * iters_per_split
    it_hi = tl.minimum(it_lo + iters_per_split, KP // (BLOCK_K // 8))
    for it in tl.range(it_lo, it_hi, num_stages=NUM_STAGES):
        w = tl.load(QW + rows[:, None] * KP + (it * (BLOCK_K // 8) + rw)[None, :])
        grp = it * BLOCK_K // GROUP_SIZE
        s = tl.load(S + rows * GROUPS + grp).to(tl.float32)
        zs = tl.load(ZS + rows * GROUPS + grp)
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + (it * BLOCK_K + rk)[None, :], mask=m_ok[:, None],
                    other=0.0)
        q = _unpack_words(w, BLOCK_N, BLOCK_K // 8, True).to(X.dtype.element_ty)  # 0..15: exact in fp16 / bf16
        x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 8)), (0, 2, 1)), (BLOCK_M, BLOCK_K))
        acc += tl.dot(q, tl.trans(x)) * s[:, None] + zs[:, None] * tl.sum(x.to(tl.float32), axis=1)[None, :]
    out = OUT + pid_k.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, tl.trans(acc).to(OUT.dtype.element_ty), mask=m_ok[:, None] & (rn < N)[None, :])


# Per llama3-8b layer at M = 16 (H200, 2026-12-02): 114 µs with the nibble-major unpack above, 136 with the
# natural-order one (the same joins unpermuted, whose result reached the MMA's A fragment through shared
# memory, 16 KB stored and re-read per step). Not kept: a nibble-major weight layout (x then read in order),
# 103 µs here but 89.5 against 80.4 for the M = 1 GEMV, which reads x's eight values for a word at a stride
# (batch-1 serving 1.27x bf16 against 1.40x); the weight dequantized to (q − z)·s in x's dtype and
# accumulated by the MMA itself (its wgmma then asynchronous), 110 and one more rounding per weight; with the
# natural-order unpack, two nibbles per AND/OR as bf16 128 + q (132-136), each nibble position its own dot
# (191-194), two nibbles per byte (128, for a third copy of the weight).
# The best config per (N, K) and row tile on an H200 (2026-12-02): at M = 16 and 32 from a sweep of BLOCK_N
# 64 / 128, 4 or 8 warps, 2-4 stages and SPLIT_K 1-8; at M = 64 from `python -m nano_quant.bench tune=true
# "tune_systems=['w4a16 mma repacked']" 'ms=[64]'` (BLOCK_N 64-256, 4 or 8 warps, 3 or 4 stages, SPLIT_K 1-8),
# which prints the entries. At 64 rows the permuted x tile costs more than the unpack saves: 220 µs per layer
# against 208 for the natural-order unpack's best tiles (2026-12-01), and bf16 cuBLAS 157. Other shapes take
# `awq_mma_repacked_config`'s rule.
MEASURED_MMA_REPACKED: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    # (N, K, BLOCK_M): (BLOCK_N, num_warps, num_stages, SPLIT_K); µs at M = 16 / 32 / 64, bf16 cuBLAS after
    (6144, 4096, 16): (64, 4, 3, 4), (6144, 4096, 32): (64, 4, 3, 4),
    (6144, 4096, 64): (256, 8, 4, 4),  # qkv: 17.6 / 21.7 / 35.4 (22.4 / 22.5 / 23.0)
    (4096, 4096, 16): (64, 4, 3, 8), (4096, 4096, 32): (128, 8, 3, 8),
    (4096, 4096, 64): (128, 8, 4, 4),  # o: 15.0 / 17.3 / 23.0 (19.2 / 18.2 / 17.4)
    (28672, 4096, 16): (128, 4, 4, 1), (28672, 4096, 32): (128, 4, 3, 1),
    (28672, 4096, 64): (256, 8, 3, 1),  # gate_up: 50.0 / 59.7 / 104.6 (68.3 / 69.5 / 71.6)
    (4096, 14336, 16): (128, 8, 3, 8), (4096, 14336, 32): (128, 4, 3, 8),
    (4096, 14336, 64): (128, 8, 4, 4),  # down: 31.1 / 36.1 / 57.0 (42.3 / 42.2 / 44.5)
}


@functools.lru_cache(maxsize=1024)
def awq_mma_repacked_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> dict:
    """Tiles for `_awq_mma_repacked_kernel`: rows of x padded to 16 / 32 / 64, BLOCK_K the group's largest
    power-of-two divisor up to 128; a measured entry, else 64 columns (128 for 64 rows), 4 warps, 3 stages,
    and SPLIT_K 4 (8 when N gives fewer than 96 column tiles), at most the steps along K."""
    block_m = min(64, max(16, next_pow2(m)))
    block_k = min(128, group_size & -group_size)
    known = MEASURED_MMA_REPACKED.get((n, k, block_m)) if num_sms == 132 and block_k == 128 else None
    if known is None:
        block_n = 64 if block_m <= 32 else 128
        known = (block_n, 4, 3, 4 if cdiv(n, block_n) >= 96 else 8)
    block_n, warps, stages, split = known
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
            "SPLIT_K": max(1, min(split, k // block_k)), "num_warps": warps, "num_stages": stages}


def awq_mma_repacked_triton(x: torch.Tensor, qweight_t: torch.Tensor, scales_t: torch.Tensor,
                            zeros_t: torch.Tensor, group_size: int, bias: torch.Tensor | None = None,
                            config: dict | None = None) -> torch.Tensor:
    """x (M, K) @ Ŵ (K, N) (+ bias) over `repack_for_gemv`'s layout on tensor cores, for decode-sized M (AWQ
    §4: the weight read once per step dominates); scale and zero applied once per group tile."""
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
    block_k, split = cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K")
    if block_k < 16 or block_k & (block_k - 1) or group_size % block_k or split < 1:
        raise ValueError(f"awq_mma_repacked: BLOCK_K {block_k} must be a power of two >= 16 dividing group_size "
                         f"{group_size}, and SPLIT_K {split} >= 1")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    partial = split_k_partials(out, split, bias)
    grid = (cdiv(n, cfg["BLOCK_N"]), split, cdiv(m, cfg["BLOCK_M"]))
    stages = cfg.pop("num_stages", 1)
    _awq_mma_repacked_kernel[grid](x, qweight_t, scales_t, zeros_t, partial, m, n, kp, groups, x.stride(0),
                                   cdiv(k // block_k, split), GROUP_SIZE=group_size, BLOCK_K=block_k,
                                   NUM_STAGES=stages, num_stages=stages, **cfg)
    return split_k_reduce(partial, out, bias)


# ------------------------------------------------------------------ more rows: dequantize once, then cuBLAS

@triton.jit
def _dequantize_repacked_kernel(QW, S, ZS, W, N, KP, GROUPS, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr):
    """Ŵ (BLOCK_N, BLOCK_K) = q·s + (−z·s), unpacked as in the tensor-core kernel."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.program_id(1) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rn < N)[:, None] & (rk < 8 * KP)[None, :]
    w = tl.load(QW + rn[:, None].to(tl.int64) * KP + rw[None, :], mask=(rn < N)[:, None] & (rw < KP)[None, :],
                other=0)
    grp = rn[:, None].to(tl.int64) * GROUPS + (rk // GROUP_SIZE)[None, :]
    s = tl.load(S + grp, mask=ok, other=0.0).to(tl.float32)
    zs = tl.load(ZS + grp, mask=ok, other=0.0)
    w_hat = (_unpack_words(w, BLOCK_N, BLOCK_K // 8, False) * s + zs).to(W.dtype.element_ty)
    tl.store(W + rn[:, None].to(tl.int64) * (8 * KP) + rk[None, :], w_hat, mask=ok)


def dequantize_repacked_triton(qweight_t: torch.Tensor, scales_t: torch.Tensor, zeros_t: torch.Tensor,
                               group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The (N, K) weight of the repacked tensors in `dtype`, for the rows where cuBLAS on the dequantized
    weight beats reading 4 bits per weight (above AWQ_LARGE_M: prefill)."""
    n, kp = qweight_t.shape
    w = torch.empty(n, kp * 8, device=qweight_t.device, dtype=dtype)
    block_n, block_k = 32, 128
    _dequantize_repacked_kernel[(cdiv(n, block_n), cdiv(kp * 8, block_k))](
        qweight_t, scales_t, zeros_t, w, n, kp, scales_t.shape[1], GROUP_SIZE=group_size, BLOCK_N=block_n,
        BLOCK_K=block_k)
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
        # the tensor-core kernel's BLOCK_K, a power of two dividing the group, must be >= 16
        fits = rows == 1 or (1 < rows <= AWQ_LARGE_M and self.group_size % 16 == 0)
        on_gpu = x.dtype in (torch.float16, torch.bfloat16) and use_triton(x)
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


def use_repacked_gemv(model: torch.nn.Module, drop_autoawq: bool = False) -> torch.nn.Module:
    """A performance layer, off unless called: every WQLinear_GEMM of `model` becomes a RepackedGemvWQLinear
    in place with its repacked tensors built now (before any CUDA-graph capture); with `drop_autoawq`,
    AutoAWQ's tensors are freed (the layers can then not be saved). Returns the model."""
    for m in model.modules():
        if type(m) is WQLinear_GEMM:
            m.__class__ = RepackedGemvWQLinear
            m.build_repacked()
            if drop_autoawq:
                m.drop_autoawq()
    return model
