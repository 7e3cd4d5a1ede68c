"""The fused decoder layer — a performance layer: a one-row decode step in five kernels a layer.

At batch 1 a decode step should cost the bytes it reads (every weight once), but a Llama/Qwen layer of the
paper path is a dozen kernels — RMSNorm, the QKV GEMV, q/k norms, RoPE and the KV write, Flash-Decoding,
o_proj, the residual add and the next RMSNorm, gate/up, SwiGLU, down — and on small models each moves a
few KiB to a few MiB, so the step is launches, ramp-ups and drains. Here one row of x goes through

    (a) h + residual → RMSNorm → QKV GEMV
    (b) (Qwen3's q/k RMSNorm) → RoPE → k and v into the cache → decode attention: split-K over the keys
        (Flash-Decoding), the slices combined in the same kernel
    (c) o_proj GEMV → + (h + residual)                  (the new residual stream)
    (d) RMSNorm → gate/up GEMV → SiLU(gate)·up
    (e) down GEMV                                       (the next layer's (a) adds the stream)

(a), (c), (d), (e) are GEMV kernels (a few weight rows per program, products in fp32 registers, one
reduction after the loop: nano_vllm/layers/gemv.py's M = 1 scheme) with their neighbours as prologue and
epilogue:

* the RMSNorm prologue: every program forms the residual stream h + residual (rounded, as shared.kernels'
  RMSNorm adds), computes the row's 1/rms itself (x is a few KiB, in L2) and normalises the slice it
  multiplies, rounded as that RMSNorm rounds (x·rstd to the activation dtype, then × weight, rounded
  again), so the products are those of the paper path's input;
* the epilogues: the residual add (output rounded, then added in fp32 and rounded, as the paper path
  adds two bf16 tensors); SiLU(gate)·up, where a program reads gate's rows and up's rows of the same
  columns; QKV's output is rounded (plus its bias) and stored whole.

(b)'s prologue is the rest of the attention block's small ops: each attention program reads its kv head's
query rows and the new key of (a)'s output (a few hundred bytes, in L2), applies the head RMSNorm and RoPE
(RoFormer eq. 34, rotate_half) itself, and attends; the program whose slice of keys ends at the newest one
writes k and v into the cache row of this step's slot, and every tile takes the newest key's k and v from
registers, not from the cache. So no kernel waits on another program's sums within a kernel for (a): an
earlier version finished q/k per head in (a)'s last program of each head (an arrival counter, a store and
a load through L2 in the chain of every layer).

**Programmatic dependent launch.** Under the "pdl" layer of nano_flashattn (Hopper and later) each
kernel loads its first weight tile — for most shapes all the weights it will read — *before*
`griddepcontrol.wait`: weights do not depend on the previous kernel, so a kernel placed early (PDL) has its
HBM reads in flight while the kernel before drains, and the weight stream does not stop at the boundary.
Only x, the residual and the caches are touched after the wait; the attention kernel also loads its
slice's first tile of older keys before it waits (only q and the newest key depend on (a)). Each kernel also
lets the next one be placed before it waits (`pdl_prologue`'s EARLY), so the kernels ahead are placed as
far as the SMs hold their programs and their weights stream while this one waits and runs.

A fused layer returns (h, residual) as shared.model's layers do — the down projection's output and the
stream it will be added to — so the next layer, fused or not, and the final norm take it unchanged.

Applies on CUDA (`EngineConfig.fused_decode`, None: on where it applies) to one-row decode steps of a
16-bit model whose projections the "fused" layer stacked (`qkv_proj`, `gate_up_proj`), a 16-bit KV cache,
one device; every other step runs the paper path's layer (the GEMV layer, cuBLAS). Under
TRITON_INTERPRET=1 the same kernels run on a CPU (tests compare each fused op with its torch
definition, `reference_*`, and a fused step with the paper path's, layer by layer).

**No L2 prefetch.** The attention is latency-bound and HBM idles while it runs, so each kernel was made to
ask L2 for the weights after it (Hopper's `cp.async.bulk.prefetch.L2` before its grid-dependency wait, the
weights laid out in read order). On an H100 (2026-12-07) it was slower at every distance: 22.3 µs a
qwen3-0.6b layer with 8 MiB asked for by the attention alone against 20.9 without, llama3-8b 151.6 µs at
16 MiB against 150.5, and the batch-1 engine 1,136.8 tok/s at 24 MiB from every kernel against 1,308.2
(docs/results/nano_vllm_fused_decode_l2_prefetch_h100.json) — likely, not profiled, because the prefetch's
HBM traffic lengthens the attention and its lines are gone before the GEMVs read them. The code was removed;
commit 4cfe8cd holds it.

**W4A16.** With `fused_decode=True` (asked for: slower than the unfused W4 step, 241.3 against 333.1 tok/s
at batch 1 on llama3-8b's shape, H100, 2026-12-07; nano_vllm/README.md says what was measured), a
layer whose stacked projections are nano_quant's repacked W4A16 layers takes six kernels a one-row step:
nano_quant's W4 GEMV with the add + RMSNorm prologue (QKV), layers/fused.py's `rope_and_store`, (b), the W4
GEMV with the residual-stream epilogue (o_proj), with the RMSNorm prologue and its SwiGLU epilogue (gate/up),
and the plain W4 GEMV (down) — against nine in the unfused W4 step (no Qwen3 q/k norm: `rope_and_store`
rotates without it).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nano_flashattn.configs import num_sms
from nano_vllm.attention import PagedAttention
from nano_vllm.config import REGISTRY
from shared.kernels import HAS_TRITON
from shared.kernels.launch import cdiv, next_pow2
from shared.model import DecoderLayer


@dataclass(frozen=True)
class TileConfig:
    """BLOCK_N weight rows per program (for SwiGLU: of gate, and as many of up), BLOCK_K of K per loop
    iteration (the first tile is the one loaded before the wait), num_warps."""

    block_n: int
    block_k: int
    num_warps: int = 8


# The best config per kernel and weight shape (N, K) on a GPU with MEASURED_SMS SMs, from `python -m
# nano_vllm.bench fused_decode_sweep=true model=...`, which prints these lines; other shapes and GPUs take
# `tile_config`'s rule.
MEASURED_SMS = 132
MEASURED: dict[tuple[str, int, int], TileConfig] = {  # NVIDIA H100 80GB HBM3, qwen3-0.6b 2026-12-07
    ("qkv", 4096, 1024): TileConfig(32, 1024, 8),  # qwen3-0.6b: 4.17 µs alone, 2.02 TB/s
    ("o_proj", 1024, 2048): TileConfig(2, 1024, 4),  # 2.75 µs, 1.53 TB/s
    ("gate_up", 3072, 1024): TileConfig(4, 512, 4),  # 5.06 µs, 2.49 TB/s
    ("down", 1024, 3072): TileConfig(1, 2048, 4),  # 3.09 µs, 2.04 TB/s
    ("qkv", 6144, 4096): TileConfig(8, 2048, 8),  # llama3-8b (2026-12-06): 19.7 µs, 2.56 TB/s
    ("o_proj", 4096, 4096): TileConfig(8, 2048, 8),  # 12.9 µs, 2.61 TB/s
    ("gate_up", 14336, 4096): TileConfig(2, 4096, 8),  # 74.9 µs, 3.14 TB/s
    ("down", 4096, 14336): TileConfig(1, 16384, 8),  # 38.6 µs, 3.05 TB/s
}


@functools.lru_cache(maxsize=256)
def tile_config(kind: str, n: int, k: int, sms: int = 0) -> TileConfig:
    """The config of kernel `kind` ("qkv", "o_proj", "gate_up", "down") for a weight (N, K) — for gate_up
    N is the intermediate size — on a GPU of `sms` SMs (0: the interpreter): the measured one, else a
    rule: 8 weight rows a program, the whole row in one tile up to 2048 elements, so a program's whole
    read is issued before it waits. Under the interpreter (a CPU), 16 rows: it runs programs one by one."""
    if sms == MEASURED_SMS and (kind, n, k) in MEASURED:
        return MEASURED[kind, n, k]
    block_k = min(next_pow2(k), 2048)
    return TileConfig(16 if sms == 0 else 8, block_k, 8 if block_k >= 2048 else 4)



# ----------------------------------------------------------------------------------------------- reference


def reference_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """shared.kernels' RMSNorm rounding: x·rstd rounded to x's dtype, × weight, rounded again."""
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * (h * rstd).to(x.dtype).float()).to(x.dtype)


def reference_norm_qkv(x, residual, norm_w, eps, w, b):
    """(a) as torch ops: the projection of the normalised stream, q, k and v side by side."""
    return nn.functional.linear(reference_rms(reference_stream(x, residual), norm_w, eps), w, b)


def reference_rope(qkv, cos, sin, heads_q, heads_kv, q_norm_w, k_norm_w, qk_eps):
    """(b)'s prologue as torch ops: q (Hq, D) and k head-normed and rotated, v, from (a)'s output."""
    d = cos.shape[-1] * 2
    q, k, v = qkv.view(-1, d).split([heads_q, heads_kv, heads_kv])
    if q_norm_w is not None:
        q, k = reference_rms(q, q_norm_w, qk_eps), reference_rms(k, k_norm_w, qk_eps)

    def rope(t):
        t1, t2 = t.float().chunk(2, dim=-1)
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1).to(t.dtype)

    return rope(q), rope(k), v


def reference_stream(h, residual):
    """The residual stream: h, or h + residual rounded (shared.kernels' RMSNorm's add)."""
    return h if residual is None else (h.float() + residual.float()).to(h.dtype)


def reference_o_proj_residual(x, w, h, residual):
    """(c): the GEMV's output rounded, plus the stream, rounded."""
    return (nn.functional.linear(x, w).float() + reference_stream(h, residual).float()).to(x.dtype)


def reference_swiglu(x, norm_w, eps, w):
    """(d): RMSNorm, gate/up, silu(gate)·up in fp32 of the rounded halves, rounded."""
    gate, up = nn.functional.linear(reference_rms(x, norm_w, eps), w).float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


# ----------------------------------------------------------------------------------------------- kernels

if HAS_TRITON:
    import triton
    import triton.language as tl

    from shared.kernels import pdl_args, pdl_prologue

    @triton.jit
    def _tile(rows, offs_k, K, EVEN_K: tl.constexpr):
        if EVEN_K:
            return tl.load(rows + offs_k[None, :])
        else:
            return tl.load(rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)

    @triton.jit
    def _stream(X, R, offs, ok, HAS_RES: tl.constexpr):
        """x, or the residual stream x + r rounded to x's dtype (as shared.kernels' RMSNorm adds them)."""
        x = tl.load(X + offs, mask=ok, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(R + offs, mask=ok, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        return x

    @triton.jit
    def _x_tile(X, R, NW, offs_k, K, rstd, NORM: tl.constexpr, HAS_RES: tl.constexpr):
        """x's slice as the GEMV multiplies it: RMSNorm'd (rounded as shared.kernels rounds) when NORM."""
        x = _stream(X, R, offs_k, offs_k < K, HAS_RES)
        if NORM:
            w = tl.load(NW + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            n = (x.to(tl.float32) * rstd).to(X.dtype.element_ty).to(tl.float32)
            x = (w * n).to(X.dtype.element_ty)
        return x.to(tl.float32)

    @triton.jit
    def _gemv_row_slice(X, R, NW, W, N, K, eps, stride_w, PDL: tl.constexpr, NORM: tl.constexpr,
                        HAS_RES: tl.constexpr, TWO: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """Σ_k W[n, k]·x[k] for this program's BLOCK_N rows n (and, TWO, rows N + n: up beside gate), in
        fp32. The first weight tile is loaded before the wait for the previous kernel; x after it."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = W + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_w  # past N: row N-1, not stored
        offs_k = tl.arange(0, BLOCK_K)
        w0 = _tile(rows, offs_k, K, EVEN_K)  # before the wait: the weights never depend on it
        if TWO:
            u0 = _tile(rows + N * stride_w, offs_k, K, EVEN_K)
        pdl_prologue(PDL, EARLY=True)  # let the next kernel be placed, then wait for the one before
        rstd = 0.0
        if NORM:
            ss = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xs = _stream(X, R, k0 + offs_k, k0 + offs_k < K, HAS_RES).to(tl.float32)
                ss += xs * xs
            rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        x = _x_tile(X, R, NW, offs_k, K, rstd, NORM, HAS_RES)
        acc = w0.to(tl.float32) * x[None, :]
        if TWO:  # noqa: SIM108 -- u0 exists only when TWO
            acc_u = u0.to(tl.float32) * x[None, :]
        else:
            acc_u = acc
        for k0 in range(BLOCK_K, K, BLOCK_K):
            x = _x_tile(X, R, NW, k0 + offs_k, K, rstd, NORM, HAS_RES)
            acc += _tile(rows, k0 + offs_k, K, EVEN_K).to(tl.float32) * x[None, :]
            if TWO:
                acc_u += _tile(rows + N * stride_w, k0 + offs_k, K, EVEN_K).to(tl.float32) * x[None, :]
        return offs_n, tl.sum(acc, axis=1), tl.sum(acc_u, axis=1)

    @triton.jit
    def _o_proj_residual_kernel(X, W, H, R, OUT, N, K, stride_w, PDL: tl.constexpr, HAS_RES: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """(c): OUT = round(W·x) + the stream (H, or H + R rounded), rounded: the new residual stream."""
        offs_n, y, _ = _gemv_row_slice(X, X, X, W, N, K, 0.0, stride_w, PDL, False, False, False, BLOCK_N,
                                       BLOCK_K, EVEN_K)
        ok = offs_n < N
        r = _stream(H, R, offs_n, ok, HAS_RES).to(tl.float32)
        y = y.to(OUT.dtype.element_ty).to(tl.float32) + r
        tl.store(OUT + offs_n, y.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _down_kernel(X, W, OUT, N, K, stride_w, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """(e): OUT = W·x, rounded (the next RMSNorm adds the stream, as in the paper path)."""
        offs_n, y, _ = _gemv_row_slice(X, X, X, W, N, K, 0.0, stride_w, PDL, False, False, False, BLOCK_N,
                                       BLOCK_K, EVEN_K)
        tl.store(OUT + offs_n, y.to(OUT.dtype.element_ty), mask=offs_n < N)

    @triton.jit(do_not_specialize=["eps"])
    def _norm_gate_up_swiglu_kernel(X, NW, W, OUT, N, K, eps, stride_w, PDL: tl.constexpr,
                                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """(d): OUT[n] = silu(g)·u of g = round(W[n]·x̂), u = round(W[N + n]·x̂), x̂ = RMSNorm(x)."""
        offs_n, g, u = _gemv_row_slice(X, X, NW, W, N, K, eps, stride_w, PDL, True, False, True, BLOCK_N,
                                       BLOCK_K, EVEN_K)
        g = g.to(OUT.dtype.element_ty).to(tl.float32)
        u = u.to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + offs_n, (g * tl.sigmoid(g) * u).to(OUT.dtype.element_ty), mask=offs_n < N)

    @triton.jit(do_not_specialize=["eps"])
    def _norm_qkv_kernel(X, R, NW, W, BIAS, OUT, N, K, eps, stride_w, PDL: tl.constexpr,
                         HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """(a): OUT = W·RMSNorm(x (+ R)) (+ bias), rounded: q, k and v of this step as the projection
        returns them (the head norms, RoPE and the cache write are (b)'s prologue)."""
        offs_n, y, _ = _gemv_row_slice(X, R, NW, W, N, K, eps, stride_w, PDL, True, HAS_RES, False, BLOCK_N,
                                       BLOCK_K, EVEN_K)
        ok = offs_n < N
        if HAS_BIAS:
            y += tl.load(BIAS + offs_n, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + offs_n, y.to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _rms_rows(x1, x2, W, h, eps, HEAD_DIM: tl.constexpr, DT: tl.constexpr):
        """shared.kernels' RMSNorm of each row (both halves (rows, HALF)), rounded the same way."""
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(W + h).to(tl.float32)[None, :]
        w2 = tl.load(W + HEAD_DIM // 2 + h).to(tl.float32)[None, :]
        return (w1 * (x1 * rstd).to(DT).to(tl.float32)).to(DT).to(tl.float32), \
            (w2 * (x2 * rstd).to(DT).to(tl.float32)).to(DT).to(tl.float32)

    @triton.jit
    def _rope_rows(QKV, rows, ok, COS, SIN, NORM_W, eps, QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr,
                   DT: tl.constexpr):
        """Rows `rows` of (a)'s output (heads of HEAD_DIM): head-normed (QK_NORM) and rotated (RoFormer
        eq. 34, rotate_half), rounded as the paper path rounds: the two halves, (rows, HEAD_DIM / 2) each."""
        HALF: tl.constexpr = HEAD_DIM // 2
        h = tl.arange(0, HALF)
        at = QKV + rows[:, None] * HEAD_DIM + h[None, :]
        x1 = tl.load(at, mask=ok[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(at + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
        if QK_NORM:
            x1, x2 = _rms_rows(x1, x2, NORM_W, h, eps, HEAD_DIM, DT)
        c = tl.load(COS + h).to(tl.float32)[None, :]
        s = tl.load(SIN + h).to(tl.float32)[None, :]
        return (x1 * c - x2 * s).to(DT), (x2 * c + x1 * s).to(DT)


    @triton.jit
    def _kv_tile(K_CACHE, V_CACHE, TABLE, keys, ok, hk, HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                 PAGE: tl.constexpr):
        """K's two halves (BLOCK_KEYS, HEAD_DIM / 2) and V (BLOCK_KEYS, HEAD_DIM) of `keys` (one kv head)
        through the block table. K comes in halves so that q · k is two products of RoPE's halves, which
        (b) computes apart (no join of the halves into one row)."""
        HALF: tl.constexpr = HEAD_DIM // 2
        page = tl.load(TABLE + keys // PAGE, mask=ok, other=0).to(tl.int64)
        rows = ((page * PAGE + keys % PAGE) * HEADS_KV + hk) * HEAD_DIM
        h = tl.arange(0, HALF)
        d = tl.arange(0, HEAD_DIM)
        k1 = tl.load(K_CACHE + rows[:, None] + h[None, :], mask=ok[:, None], other=0.0)
        k2 = tl.load(K_CACHE + rows[:, None] + HALF + h[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V_CACHE + rows[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        return k1, k2, v

    @triton.jit
    def _decode_attention_kernel(Q, K_CACHE, V_CACHE, TABLE, SEQLEN, OUT, O_PART, ML_PART, COUNTERS,
                                 qk_scale, COS, SIN, QNW, KNW, SLOT, qk_eps, PDL: tl.constexpr,
                                 ROPE: tl.constexpr, QK_NORM: tl.constexpr,
                                 HEADS_KV: tl.constexpr, GROUP: tl.constexpr,
                                 HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr,
                                 BLOCK_KEYS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GC: tl.constexpr,
                                 IEEE: tl.constexpr):
        """(b) for one row: Flash-Decoding (split-K softmax, Dao et al. 2023) with the combine in the same
        kernel. Program (split, kv head) attends the GROUP query heads of its kv head to one slice of the
        keys and writes (m, l, acc); the head's last slice to arrive combines them
        (O = Σ e^(m_s - M) acc_s / Σ e^(m_s - M) l_s). Slices are whole tiles, as few as cover the keys
        (at most SPLITS); programs past them return at once. The slice's first tile of keys older than this
        step is loaded before the wait for (a): only q and the newest key depend on it.

        ROPE: Q is (a)'s output (q, k, v of this step, unrotated): each program head-norms and rotates its
        GROUP query rows and the new key itself, the slice holding the newest key writes k and v to cache
        row SLOT, and every tile takes the new k, v from registers where it holds the newest key. Else Q
        is q, rotated, and the caches already hold this step's k, v."""
        split, hk = tl.program_id(0), tl.program_id(1)
        HALF: tl.constexpr = HEAD_DIM // 2
        k_len = tl.load(SEQLEN)
        split_len = tl.cdiv(tl.cdiv(k_len, SPLITS), BLOCK_KEYS) * BLOCK_KEYS
        slices = tl.cdiv(k_len, split_len)
        if split < slices:
            lo = split * split_len
            hi = tl.minimum(lo + split_len, k_len)
            keys = lo + tl.arange(0, BLOCK_KEYS)
            k1, k2, v = _kv_tile(K_CACHE, V_CACHE, TABLE, keys, keys < hi, hk, HEADS_KV, HEAD_DIM, PAGE)
            pdl_prologue(PDL, EARLY=True)
            g = tl.arange(0, BLOCK_G)
            d = tl.arange(0, HEAD_DIM)
            if ROPE:
                DT: tl.constexpr = K_CACHE.dtype.element_ty
                heads_q: tl.constexpr = HEADS_KV * GROUP
                q1, q2 = _rope_rows(Q, hk * GROUP + g, g < GROUP, COS, SIN, QNW, qk_eps, QK_NORM, HEAD_DIM, DT)
                one = tl.arange(0, 1)
                k1_new, k2_new = _rope_rows(Q, heads_q + hk + one, one < 1, COS, SIN, KNW, qk_eps, QK_NORM,
                                            HEAD_DIM, DT)
                v_new = tl.load(Q + (heads_q + HEADS_KV + hk) * HEAD_DIM + d[None, :] + one[:, None]).to(DT)
                if hi == k_len:  # the slice that holds the newest key stores it
                    row = (tl.load(SLOT).to(tl.int64) * HEADS_KV + hk) * HEAD_DIM + one[:, None]
                    h = tl.arange(0, HALF)[None, :]
                    tl.store(K_CACHE + row + h, k1_new)
                    tl.store(K_CACHE + row + HALF + h, k2_new)
                    tl.store(V_CACHE + row + d[None, :], v_new)
                newest = (keys == k_len - 1)[:, None]
                k1, k2, v = tl.where(newest, k1_new, k1), tl.where(newest, k2_new, k2), tl.where(newest, v_new, v)
            else:
                if hi == k_len:  # this slice holds the newest key, which the caller has just written
                    k1, k2, v = _kv_tile(K_CACHE, V_CACHE, TABLE, keys, keys < hi, hk, HEADS_KV, HEAD_DIM, PAGE)
                q_rows = Q + (hk * GROUP + g)[:, None] * HEAD_DIM + tl.arange(0, HALF)[None, :]
                q1 = tl.load(q_rows, mask=(g < GROUP)[:, None], other=0.0)
                q2 = tl.load(q_rows + HALF, mask=(g < GROUP)[:, None], other=0.0)
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
            for start in range(lo, hi, BLOCK_KEYS):
                if start > lo:
                    keys = start + tl.arange(0, BLOCK_KEYS)
                    k1, k2, v = _kv_tile(K_CACHE, V_CACHE, TABLE, keys, keys < hi, hk, HEADS_KV, HEAD_DIM, PAGE)
                    if ROPE:
                        newest = (keys == k_len - 1)[:, None]
                        k1, k2 = tl.where(newest, k1_new, k1), tl.where(newest, k2_new, k2)
                        v = tl.where(newest, v_new, v)
                if IEEE:  # fp32 caches: full-precision products, not TF32
                    s = tl.dot(q1, tl.trans(k1), input_precision="ieee")
                    s = tl.dot(q2, tl.trans(k2), s, input_precision="ieee") * qk_scale
                else:  # log2 units: qk_scale holds log2(e)/sqrt(D)
                    s = tl.dot(q2, tl.trans(k2), tl.dot(q1, tl.trans(k1))) * qk_scale
                s = tl.where((keys < hi)[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
            # the GROUP real rows of this slice's (m, l, acc) to the workspace, row (kv head, query, split)
            real = g < GROUP
            part = (hk * GROUP + g) * SPLITS + split
            tl.store(O_PART + part[:, None] * HEAD_DIM + d[None, :], acc, mask=real[:, None])
            tl.store(ML_PART + 2 * part, m, mask=real)
            tl.store(ML_PART + 2 * part + 1, l_i, mask=real)
            tl.debug_barrier()
            if tl.atomic_add(COUNTERS + hk, 1) == slices - 1:  # acq_rel: the other slices' partials are visible
                tl.atomic_xchg(COUNTERS + hk, 0)
                # every query head of the kv head at once, slice by slice with a running max (unrolled, no
                # store in between: every load can be in flight at once; slice 0 always holds keys). A tree
                # over 8 slices at a time, visiting only the slices with keys, ran the qwen3-0.6b batch-1
                # engine at 1,308.2 tok/s against this chain's 1,319.1 (H100, 2026-12-07; commit 11d8400)
                gc = tl.arange(0, BLOCK_GC)
                heads = hk * GROUP + gc
                mx = tl.full([BLOCK_GC], float("-inf"), tl.float32)
                den = tl.zeros([BLOCK_GC], tl.float32)
                num = tl.zeros([BLOCK_GC, HEAD_DIM], tl.float32)
                for sl in tl.static_range(SPLITS):
                    ok = (gc < GROUP) & (gc * 0 + sl < slices)
                    at = heads * SPLITS + sl
                    m_s = tl.load(ML_PART + 2 * at, mask=ok, other=float("-inf"), cache_modifier=".cg")
                    l_s = tl.load(ML_PART + 2 * at + 1, mask=ok, other=0.0, cache_modifier=".cg")
                    a_s = tl.load(O_PART + at[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0,
                                  cache_modifier=".cg")
                    m_new = tl.maximum(mx, m_s)
                    alpha = tl.exp2(mx - m_new)
                    beta = tl.where(ok, tl.exp2(m_s - m_new), 0.0)
                    den = den * alpha + beta * l_s
                    num = num * alpha[:, None] + beta[:, None] * a_s
                    mx = m_new
                tl.store(OUT + heads[:, None] * HEAD_DIM + d[None, :], (num / den[:, None]).to(OUT.dtype.element_ty),
                         mask=(gc < GROUP)[:, None])

def _config(kind: str, x: torch.Tensor, n: int, k: int, config: TileConfig | None) -> TileConfig:
    return config or tile_config(kind, n, k, num_sms(x.device) if x.is_cuda else 0)


def _launch_args(kind: str, x: torch.Tensor, n: int, k: int,
                 config: TileConfig | None) -> tuple[tuple, dict]:
    config = _config(kind, x, n, k, config)
    grid = (cdiv(n, config.block_n),)
    return grid, {"BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "EVEN_K": k % config.block_k == 0,
                  "num_warps": config.num_warps, **pdl_args(x.device)}


def _check(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    if x.dim() != 1 or w.dim() != 2 or w.shape[1] != x.shape[0] or w.stride(1) != 1 or x.stride(0) != 1:
        raise ValueError(f"{what}: x must be one contiguous row of K and w (N, K) with a unit-stride K, got x "
                         f"{tuple(x.shape)} and w {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise ValueError(f"{what}: x and w must share a dtype, got {x.dtype} and {w.dtype}")


def o_proj_residual(x: torch.Tensor, w: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                    config: TileConfig | None = None) -> torch.Tensor:
    """(c): round(x Wᵀ) + the stream (h, or h + residual rounded), rounded; x (K,), w (N, K), h (N,)."""
    _check(x, w, "o_proj_residual")
    n, k = w.shape
    for name, t in (("h", h), ("residual", residual)):
        if t is not None and (t.shape != (n,) or t.dtype != x.dtype or t.stride(0) != 1):
            raise ValueError(f"o_proj_residual: {name} must be a contiguous ({n},) {x.dtype}, got "
                             f"{tuple(t.shape)} {t.dtype}")
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    grid, meta = _launch_args("o_proj", x, n, k, config)
    _o_proj_residual_kernel[grid](x, w, h, residual if residual is not None else h, out, n, k, w.stride(0),
                                  HAS_RES=residual is not None, **meta)
    return out


def down(x: torch.Tensor, w: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
    """(e): x Wᵀ, rounded; x (K,), w (N, K)."""
    _check(x, w, "down")
    n, k = w.shape
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    grid, meta = _launch_args("down", x, n, k, config)
    _down_kernel[grid](x, w, out, n, k, w.stride(0), **meta)
    return out


def norm_gate_up_swiglu(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
                        config: TileConfig | None = None) -> torch.Tensor:
    """(d): silu(gate)·up of [gate; up] = w · RMSNorm(x); x (K,), w (2I, K) → (I,)."""
    _check(x, w, "norm_gate_up_swiglu")
    n2, k = w.shape
    if n2 % 2 or norm_w.shape != (k,):
        raise ValueError(f"norm_gate_up_swiglu: w must be [gate; up] (2I, K) and norm_w (K,), got "
                         f"{tuple(w.shape)} and {tuple(norm_w.shape)}")
    n = n2 // 2
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    grid, meta = _launch_args("gate_up", x, n, k, config)
    _norm_gate_up_swiglu_kernel[grid](x, norm_w, w, out, n, k, eps, w.stride(0), **meta)
    return out


# Key slices per kv head (at most) and keys a tile: the best of `fused_decode_sweep` in the qwen3-0.6b layer
# chain (H100, 2026-12-07, 384 keys: 20.2 µs a layer against 21.1 with 32 slices; 5.5 µs alone,
# nano_flashattn's Flash-Decoding 6.9 µs). A slice is whole tiles and only the slices that hold keys run,
# so more slices cost only their empty programs and the combine's longer unrolled loop; `attention_splits`
# gives an engine whose sequences may be longer than 4096 tokens more of them.
ATTENTION_SPLITS, BLOCK_KEYS = 8, 64
ATTENTION_WARPS = 4  # `python -m nano_vllm.bench fused_decode_sweep=true` also tries 2 and 8


def attention_splits(max_model_len: int) -> int:
    """Slices enough that a slice of the longest sequence is at most 8 tiles: ATTENTION_SPLITS up to 4096
    tokens (what was measured), up to 32 for longer ones (an 8-slice kernel at 32k keys would run 64
    programs of 64 tiles each, a quarter of the SMs streaming)."""
    return min(32, max(ATTENTION_SPLITS, next_pow2(cdiv(max_model_len, 8 * BLOCK_KEYS))))


class Workspace:
    """The attention kernel's per-slice partials and per-kv-head arrival counters (zero between calls);
    every fused layer of a model shares one: its kernels run one after another on one stream."""

    def __init__(self, heads_kv: int, group: int, head_dim: int, device: torch.device, splits: int | None = None):
        splits = splits or ATTENTION_SPLITS
        rows = heads_kv * splits * group
        self.o_part = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        self.ml_part = torch.empty(2 * rows, dtype=torch.float32, device=device)
        self.attn_counters = torch.zeros(heads_kv, dtype=torch.int32, device=device)
        self.splits = splits


def norm_qkv(x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
             b: torch.Tensor | None, config: TileConfig | None = None) -> torch.Tensor:
    """(a): RMSNorm(x (+ residual: the stream, rounded)) · Wᵀ (+ b), rounded; x (K,), w (N, K) → (N,)."""
    _check(x, w, "norm_qkv")
    n, k = w.shape
    for name, t, size in (("residual", residual, k), ("norm_w", norm_w, k), ("b", b, n)):
        if t is not None and (t.shape != (size,) or t.dtype != x.dtype or t.stride(0) != 1):
            raise ValueError(f"norm_qkv: {name} must be a contiguous ({size},) {x.dtype}, got "
                             f"{tuple(t.shape)} {t.dtype}")
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    grid, meta = _launch_args("qkv", x, n, k, config)
    _norm_qkv_kernel[grid](x, residual if residual is not None else x, norm_w, w, b if b is not None else w, out,
                           n, k, eps, w.stride(0), HAS_RES=residual is not None, HAS_BIAS=b is not None, **meta)
    return out


def _check_attention(what: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, seqlen: torch.Tensor, heads_q: int, d: int) -> None:
    _, _, heads_kv, d_k = k_cache.shape
    if (d_k != d or heads_q % heads_kv or v_cache.shape != k_cache.shape or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or k_cache.dtype != q.dtype or d & (d - 1) or d < 16
            or block_table.dim() != 1 or seqlen.numel() != 1):
        raise ValueError(f"{what}: q {tuple(q.shape)} {q.dtype}, caches {tuple(k_cache.shape)} "
                         f"{k_cache.dtype}, block_table {tuple(block_table.shape)}, seqlen "
                         f"{tuple(seqlen.shape)} do not fit (head_dim a power of two >= 16, one sequence)")


def _attend(q, k_cache, v_cache, block_table, seqlen, workspace, block_keys, heads_q, rope=None,
            num_warps=None) -> torch.Tensor:
    d, page, heads_kv = k_cache.shape[-1], k_cache.shape[1], k_cache.shape[2]
    group = heads_q // heads_kv
    if workspace is None:
        workspace = Workspace(heads_kv, group, d, q.device)
    out = torch.empty(heads_q, d, dtype=q.dtype, device=q.device)
    cos, sin, q_norm_w, k_norm_w, qk_eps, slot = rope or (q, q, q, q, 0.0, seqlen)
    _decode_attention_kernel[(workspace.splits, heads_kv)](
        q, k_cache, v_cache, block_table, seqlen, out, workspace.o_part, workspace.ml_part,
        workspace.attn_counters, d**-0.5 * 1.4426950408889634, cos, sin,
        q_norm_w if q_norm_w is not None else cos, k_norm_w if k_norm_w is not None else cos, slot, qk_eps,
        ROPE=rope is not None, QK_NORM=rope is not None and q_norm_w is not None, HEADS_KV=heads_kv,
        GROUP=group, HEAD_DIM=d, PAGE=page, SPLITS=workspace.splits, BLOCK_KEYS=block_keys or BLOCK_KEYS,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_GC=next_pow2(group), IEEE=q.dtype == torch.float32,
        num_warps=num_warps or ATTENTION_WARPS, **pdl_args(q.device))
    return out


def rope_store_attention(qkv: torch.Tensor, heads_q: int, cos: torch.Tensor, sin: torch.Tensor,
                         q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None, qk_eps: float,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor, block_table: torch.Tensor,
                         seqlen: torch.Tensor, workspace: Workspace | None = None,
                         block_keys: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """(b) on (a)'s output qkv ((Hq + 2 Hkv) D,): q and the new k head-normed (q_norm_w / k_norm_w, or
    None) and rotated (cos / sin: (D/2,) fp32), k and v written to cache row `slot` (a (1,) int tensor) of
    k_cache / v_cache (pages, page_size, Hkv, D), and q attended to the `seqlen` keys (a (1,) int tensor,
    the new one included) through `block_table` (the sequence's row of page indices); returns (Hq, D)."""
    d = 2 * cos.shape[-1]
    heads_kv = k_cache.shape[2] if k_cache.dim() == 4 else 0
    if qkv.dim() != 1 or not heads_kv or qkv.shape[0] != (heads_q + 2 * heads_kv) * d or qkv.stride(0) != 1:
        raise ValueError(f"rope_store_attention: qkv {tuple(qkv.shape)} is not ({heads_q} + 2 x kv heads) x "
                         f"{d} of caches {tuple(k_cache.shape)}")
    _check_attention("rope_store_attention", qkv, k_cache, v_cache, block_table, seqlen, heads_q, d)
    if slot.numel() != 1:
        raise ValueError(f"rope_store_attention: slot must hold one cache row, got {tuple(slot.shape)}")
    return _attend(qkv, k_cache, v_cache, block_table, seqlen, workspace, block_keys, heads_q,
                   (cos, sin, q_norm_w, k_norm_w, qk_eps, slot), num_warps)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seqlen: torch.Tensor, workspace: Workspace | None = None,
                     block_keys: int | None = None) -> torch.Tensor:
    """(b) with q already rotated and this step's k, v already in the caches: causal attention of one
    query row q (Hq, D) to the `seqlen` (a (1,) int tensor) keys of one sequence in a paged cache (pages,
    page_size, Hkv, D) through `block_table` (its row of page indices); returns (Hq, D). Split-K over the
    keys, combined in the same kernel."""
    heads_q, d = q.shape if q.dim() == 2 else (0, 0)
    _check_attention("decode_attention", q, k_cache, v_cache, block_table, seqlen, max(heads_q, 1), d)
    return _attend(q, k_cache, v_cache, block_table, seqlen, workspace, block_keys, heads_q)


def reference_rope_store_attention(qkv, cos, sin, heads_q, heads_kv, q_norm_w, k_norm_w, qk_eps, k_old, v_old):
    """(b) as torch: the attention output (Hq, D) of (a)'s output against the older keys k_old, v_old
    (S - 1, Hkv, D) and the new one, and the new k, v rows (Hkv, D) the cache gets."""
    q, k, v = reference_rope(qkv, cos, sin, heads_q, heads_kv, q_norm_w, k_norm_w, qk_eps)
    return reference_attention(q, torch.cat([k_old, k[None]]), torch.cat([v_old, v[None]])), k, v


def reference_attention(q, k, v):
    """(b) as torch: q (Hq, D) against this sequence's keys k, v (S, Hkv, D), every key visible."""
    group = q.shape[0] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for an exact reference
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1).to(acc) for t in (k, v))  # (Hq, S, D)
    p = torch.softmax((q.to(acc)[:, None] @ k.transpose(1, 2))[:, 0] * q.shape[-1] ** -0.5, dim=-1)
    return (p[:, None] @ v)[:, 0].to(q.dtype)


# ------------------------------------------------------------------------------------------------- layer


def runs_kernels(x: torch.Tensor) -> bool:
    """CUDA, or a CPU under the Triton interpreter (the tests)."""
    return HAS_TRITON and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


class FusedDecoderLayer(DecoderLayer):
    """shared.model's DecoderLayer (its projections stacked by layers/fused.py) whose one-row decode steps
    take the five kernels above; any other step is DecoderLayer.forward."""

    workspace: Workspace

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn = self.self_attn
        paged = attn.attn_fn
        if (h.shape[0] * h.shape[1] != 1 or not getattr(ctx, "is_decode", False)
                or not isinstance(paged, PagedAttention) or paged.kv_cache.dtype != h.dtype
                or not runs_kernels(h)):
            return super().forward(h, residual, cos, sin, ctx)
        if getattr(self, "w4", False):
            return self._forward_w4(h, residual, cos, sin, ctx)
        x = h.reshape(-1)
        r = residual.reshape(-1) if residual is not None else None
        i = attn.layer_idx
        norm = self.input_layernorm
        q_norm, k_norm = attn.q_norm, attn.k_norm
        qkv = norm_qkv(x, r, norm.weight, norm.eps, attn.qkv_proj.weight, attn.qkv_proj.bias)
        o = rope_store_attention(
            qkv, attn.qkv_sizes[0] // attn.head_dim, cos.reshape(-1), sin.reshape(-1),
            q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0, paged.kv_cache[0, i], paged.kv_cache[1, i],
            ctx.slot_mapping, ctx.block_tables[0], ctx.context_lens, self.workspace)
        stream = o_proj_residual(o.reshape(-1), attn.o_proj.weight, x, r)
        post = self.post_attention_layernorm
        act = norm_gate_up_swiglu(stream, post.weight, post.eps, self.mlp.gate_up_proj.weight)
        # (h, residual) as the paper path's layers return them: the next RMSNorm adds the two
        return down(act, self.mlp.down_proj.weight).view(h.shape), stream.view(h.shape)

    def _forward_w4(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                    ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The same step over nano_quant's repacked W4A16 projections, six kernels: the W4 GEMV with the
        add + RMSNorm prologue (QKV), `rope_and_store` (layers/fused.py), (b), the W4 GEMV with the residual
        epilogue (o_proj), with the RMSNorm prologue and SwiGLU epilogue (gate/up), and the plain one (down)."""
        from nano_quant.layers.repacked import awq_gemv_repacked_triton  # a W4A16 model: nano_quant is there
        from nano_vllm.layers.fused import rope_and_store  # stacked the projections: it is there

        def w4(layer: nn.Module, x: torch.Tensor, **neighbours: Any) -> torch.Tensor:
            return awq_gemv_repacked_triton(x, layer.qweight_t, layer.scales_t, layer.zeros_t, layer.group_size,
                                            **neighbours)

        attn, paged = self.self_attn, self.self_attn.attn_fn
        x = h.reshape(1, -1)
        r = residual.reshape(1, -1) if residual is not None else None
        norm, post, d, i = self.input_layernorm, self.post_attention_layernorm, attn.head_dim, attn.layer_idx
        qkv = w4(attn.qkv_proj, x, norm_weight=norm.weight, eps=norm.eps, residual=r)
        q, k, v = (t.view(1, 1, -1, d) for t in qkv.split(attn.qkv_sizes, dim=-1))
        caches = paged.kv_cache[0, i], paged.kv_cache[1, i]
        q, _ = rope_and_store(q, k, v, cos.reshape(1, 1, -1), sin.reshape(1, 1, -1), *caches, ctx.slot_mapping)
        o = decode_attention(q.view(-1, d), *caches, ctx.block_tables[0], ctx.context_lens, self.workspace)
        stream = w4(attn.o_proj, o.reshape(1, -1), add=(x, r))
        act = w4(self.mlp.gate_up_proj, stream, norm_weight=post.weight, eps=post.eps, silu_and_mul=True)
        return w4(self.mlp.down_proj, act).view(h.shape), stream.view(h.shape)


def fusable(layer: nn.Module) -> bool:
    """A decoder layer whose projections the "fused" layer stacked, unquantized (16-bit; fp32 for the CPU
    tests), with no bias but QKV's (what the kernels read)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [getattr(attn, "qkv_proj", None), attn.o_proj, getattr(mlp, "gate_up_proj", None), mlp.down_proj]
    d = attn.head_dim
    return (isinstance(layer, DecoderLayer) and all(isinstance(m, nn.Linear) for m in linears)
            and d >= 16 and not d & (d - 1)
            and all(m.weight.dtype in (torch.float16, torch.bfloat16, torch.float32) for m in linears)
            and all(m.bias is None for m in linears[1:]))


def fusable_w4(layer: nn.Module) -> bool:
    """A decoder layer whose stacked projections are nano_quant's repacked W4A16 layers (`qweight_t`: the
    K-contiguous copy), no bias, no q/k norm (`rope_and_store` rotates without one)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = [getattr(attn, "qkv_proj", None), attn.o_proj, getattr(mlp, "gate_up_proj", None), mlp.down_proj]
    d = attn.head_dim
    return (isinstance(layer, DecoderLayer) and all(getattr(m, "qweight_t", None) is not None for m in linears)
            and all(getattr(m, "bias", None) is None for m in linears) and attn.q_norm is None
            and d >= 16 and not d & (d - 1))


def kernel_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes one launch of each fused kernel reads: its weight, its input row (twice with a norm: the
    norm's weight) and the residual row it adds, for the bench's profile."""
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp

    def nbytes(w: torch.Tensor, vectors: int) -> int:  # the weight and `vectors` rows of its K or N
        return (w.numel() + vectors * max(w.shape)) * w.element_size()

    return {"_norm_qkv_kernel": nbytes(attn.qkv_proj.weight, 2),
            "_o_proj_residual_kernel": nbytes(attn.o_proj.weight, 3),
            "_norm_gate_up_swiglu_kernel": nbytes(mlp.gate_up_proj.weight, 2),
            "_down_kernel": nbytes(mlp.down_proj.weight, 1)}


def apply_fused_decode(runner: Any) -> None:
    """The "runner" hook: every fusable decoder layer becomes a FusedDecoderLayer sharing one workspace. W4A16
    layers (`fusable_w4`) only where `fused_decode=True` asks: that step is slower than the unfused W4 one
    (module docstring)."""
    w4 = runner.config.fused_decode is True
    layers = [m for m in runner.model.model.layers if fusable(m) or (w4 and fusable_w4(m))]
    if not layers:
        return
    attn = layers[0].self_attn
    heads_q, heads_kv = (size // attn.head_dim for size in attn.qkv_sizes[:2])
    workspace = Workspace(heads_kv, heads_q // heads_kv, attn.head_dim, runner.device,
                          attention_splits(runner.max_model_len))
    for m in layers:
        m.w4 = not fusable(m)
        m.__class__ = FusedDecoderLayer
        m.workspace = workspace
    if not any(m.w4 for m in layers):  # the bench's per-kernel bytes: the 16-bit kernels' names
        runner.model.kernel_bytes = kernel_bytes(runner.model)


def _applies(runner: Any) -> bool:
    return (HAS_TRITON and runner.config.wants("fused_decode", runner.device)
            and runner.config.tensor_parallel_size == 1)


REGISTRY.register("runner", apply_fused_decode, applies=_applies)
