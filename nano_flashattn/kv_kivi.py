"""KIVI's 2- and 4-bit KV cache (arXiv 2402.02750) in Triton: the write that quantizes, and Flash-Decoding
over packed blocks. The layout, the torch path and the dispatch are kivi.py's.

* The write (`store_kv_kivi_triton`), two kernels over (token, kv head) in stream order: `_key_groups`
  quantizes each key group that a new token completes (per channel over the group's G tokens, KIVI
  §3.2), reading the group's older members from the 16-bit tail; `_store_values` quantizes each new
  token's value (per token, groups of G channels) and puts its key into the tail unless `_key_groups`
  just quantized its group. No host sync: CUDA-graph safe.
* The read (`flash_attn_with_kivi_cache_triton`): decode.py's split-K over the keys, with tiles that
  dequantize in registers — a word holds 32 / b codes, code = (word >> b·i) & (2^b - 1), value = code ·
  scale + zero, one FMA in fp16 (the stored scales' dtype; bf16 queries go to fp16) or in fp32 for fp32
  queries, each thread splitting the words it loaded (`fields`); `tl.dot` sums in fp32, as do the
  running softmax sums across tiles. Keys past the last full group come from the tail instead; the tiles that may hold
  them (and the sequence end, the causal edge) are the masked ones. The slices merge in decode.py's
  `_combine_kernel`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import (
    DTYPES,
    NO_WINDOW,
    _values_checkable,
    cdiv,
    check_block_table,
    check_lengths_fit,
    check_scale,
    next_pow2,
)
from .configs import block_d, num_sms
from .decode import _combine_kernel, pick_num_splits
from .forward import LN2_C, LOG2E, dot_precision, visible
from .kivi import _check_rows, layout_of

RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (t + it) - it rounds |t| < 2^22 half to even
NO_WINDOW_C = tl.constexpr(NO_WINDOW)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def group_scale(lo, hi, BITS: tl.constexpr):
    """KIVI's fp16 scale and zero of groups with minimum lo and maximum hi (fp32):
    scale = max((hi - lo) / (2^b - 1), 1e-6), zero = lo, each rounded to fp16 as torch's `.half()`.
    `div_rn`: the correctly rounded quotient torch computes."""
    levels = tl.zeros_like(lo) + (2**BITS - 1)
    scale = tl.maximum(tl.math.div_rn(hi - lo, levels), 1e-6)
    return scale.to(tl.float16), lo.to(tl.float16)


@triton.jit
def group_codes(x, scale, zero, BITS: tl.constexpr):
    """clamp(round((x - zero) / scale), 0, 2^b - 1), rounded half to even like torch.round, int32."""
    t = tl.math.div_rn(x - zero.to(tl.float32), scale.to(tl.float32))
    t = (t + RNE_MAGIC) - RNE_MAGIC
    return tl.minimum(tl.maximum(t, 0.0), 2**BITS - 1.0).to(tl.int32)


@triton.jit
def pack_fields(codes, BITS: tl.constexpr):
    """(rows, n) int32 codes -> (rows, n·b/32) words along the last axis, code i of a word at bits
    b·(i // 2) + 16·(i % 2) (kivi.field_shifts)."""
    PW: tl.constexpr = 32 // BITS
    i = tl.arange(0, PW)
    codes = tl.reshape(codes, (codes.shape[0], codes.shape[1] // PW, PW))
    return tl.reduce(codes << (BITS * (i // 2) + 16 * (i % 2))[None, None, :], 2, _or)


@triton.jit
def _key_groups(K, KW, KS, KZ, Tail, slot_mapping, tail_of_block,
                stride_kt, stride_kh, stride_wb, stride_wr, stride_wh, stride_sb, stride_sg, stride_sh,
                stride_te, stride_tr, stride_th,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
                BITS: tl.constexpr):
    """Pass 1: if token i's slot ends a key group, quantize the group per channel; each of its tokens'
    codes packed along the channels. grid (tokens, heads)."""
    PW: tl.constexpr = 32 // BITS
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.load(slot_mapping + i).to(tl.int64)
    if (s >= 0) & (s % G == G - 1):
        o = tl.arange(0, G)
        rows = i - (G - 1) + o
        # a member was written this step iff the row G - 1 - o before i holds its slot
        new = tl.load(slot_mapping + rows, mask=rows >= 0, other=-1).to(tl.int64) == s - (G - 1) + o
        entry = tl.load(tail_of_block + s // BS).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d[None, :] < HEAD_DIM
        fresh = tl.load(K + rows[:, None] * stride_kt + h * stride_kh + d[None, :],
                        mask=new[:, None] & d_ok, other=0.0)
        older = tl.load(Tail + entry * stride_te + o[:, None] * stride_tr + h * stride_th + d[None, :],
                        mask=(~new)[:, None] & d_ok, other=0.0)
        x = tl.where(new[:, None], fresh.to(tl.float32), older.to(tl.float32))  # (G, BLOCK_D)
        scale, zero = group_scale(tl.min(x, 0), tl.max(x, 0), BITS)
        words = pack_fields(group_codes(x, scale[None, :], zero[None, :], BITS), BITS)  # (G, BLOCK_D/PW)
        first = s % BS - (G - 1)  # the group's first offset in block s // BS
        blk = s // BS
        w = tl.arange(0, BLOCK_D // PW)
        tl.store(KW + blk * stride_wb + (first + o)[:, None] * stride_wr + h * stride_wh + w[None, :],
                 words, mask=w[None, :] < HEAD_DIM // PW)
        at = blk * stride_sb + (first // G) * stride_sg + h * stride_sh + d
        tl.store(KS + at, scale, mask=d < HEAD_DIM)
        tl.store(KZ + at, zero, mask=d < HEAD_DIM)


@triton.jit
def _value_codes(x, BLOCK_D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr):
    """Rows x (rows, BLOCK_D) fp32 quantized per row in groups of G channels: codes (rows, BLOCK_D),
    scale and zero (rows, BLOCK_D / G)."""
    xg = tl.reshape(x, (x.shape[0], BLOCK_D // G, G))
    scale, zero = group_scale(tl.min(xg, 2), tl.max(xg, 2), BITS)
    codes = group_codes(xg, scale[:, :, None], zero[:, :, None], BITS)
    return tl.reshape(codes, (x.shape[0], BLOCK_D)), scale, zero


@triton.jit(do_not_specialize=["num_tokens"])
def _store_values(K, V, VW, VS, VZ, Tail, slot_mapping, tail_of_block, num_tokens,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_wb, stride_wr, stride_wh,
                  stride_sb, stride_st, stride_sh, stride_te, stride_tr, stride_th,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
                  BITS: tl.constexpr):
    """Pass 2: token i's value quantized per token (groups of G channels): its scale and zero into its
    slot; if i is this step's last row in its run of 32 / b slots, the run's words (one per channel)
    set anew — this step's rows' fields from their codes, the others kept. Its key into the tail unless
    its group is complete in this step. grid (tokens, heads)."""
    PW: tl.constexpr = 32 // BITS
    NG: tl.constexpr = BLOCK_D // G
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.load(slot_mapping + i).to(tl.int64)
    if s >= 0:
        blk, off = s // BS, s % BS
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        g = tl.arange(0, NG)
        x = tl.load(V + i * stride_vt + h * stride_vh + d, mask=d_ok, other=0.0).to(tl.float32)
        codes1, scale, zero = _value_codes(x[None, :], BLOCK_D, G, BITS)
        row = blk * stride_sb + off * stride_st + h * stride_sh
        tl.store(VS + row + g, tl.reshape(scale, (NG,)), mask=g < HEAD_DIM // G)
        tl.store(VZ + row + g, tl.reshape(zero, (NG,)), mask=g < HEAD_DIM // G)
        nxt = tl.load(slot_mapping + i + 1, mask=i + 1 < num_tokens, other=-1).to(tl.int64)
        if (s % PW == PW - 1) | (nxt != s + 1):  # the run's last row this step: its words
            o = tl.arange(0, PW)
            rows = i - s % PW + o
            new = (rows <= i) & (tl.load(slot_mapping + rows, mask=(rows >= 0) & (rows <= i),
                                         other=-1).to(tl.int64) == s - s % PW + o)
            xs = tl.load(V + rows[:, None] * stride_vt + h * stride_vh + d[None, :],
                         mask=new[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            codes, run_scale, run_zero = _value_codes(xs, BLOCK_D, G, BITS)  # (PW, BLOCK_D)
            shift = BITS * (o // 2) + 16 * (o % 2)  # kivi.field_shifts
            fresh = tl.reduce(tl.where(new[:, None], codes << shift[:, None], 0), 0, _or)  # (BLOCK_D,)
            keep = tl.reduce(tl.where(new, 0, (2**BITS - 1) << shift), 0, _or)  # the older fields
            at = VW + blk * stride_wb + (off // PW) * stride_wr + h * stride_wh + d
            old = tl.load(at, mask=d_ok, other=0)
            tl.store(at, (old & keep) | fresh, mask=d_ok)
        last = i + (G - 1 - s % G)  # the row that completes the group, if this step writes it
        end = tl.load(slot_mapping + last, mask=last < num_tokens, other=-1).to(tl.int64)
        if end != s - s % G + G - 1:
            entry = tl.load(tail_of_block + blk).to(tl.int64)
            dd = tl.arange(0, BLOCK_D)
            k = tl.load(K + i * stride_kt + h * stride_kh + dd, mask=dd < HEAD_DIM)
            tl.store(Tail + entry * stride_te + (s % G) * stride_tr + h * stride_th + dd,
                     k.to(Tail.dtype.element_ty), mask=dd < HEAD_DIM)


def store_kv_kivi_triton(k, v, k_cache, v_cache, k_tail, slot_mapping, tail_of_block, bits,
                         group_size) -> None:
    """`kivi.store_kv_kivi` on the kernels (the two passes, in this order)."""
    lay = layout_of(k_cache, v_cache, k_tail, tail_of_block, bits, group_size)
    k, v, slot_mapping = _check_rows(k, v, slot_mapping, lay, k_cache)
    if slot_mapping.numel() and _values_checkable(slot_mapping):
        hi = slot_mapping.max().item()
        if hi >= k_cache.shape[0] * lay.block_size:
            raise ValueError(f"slot_mapping has slot {hi}, the cache has "
                             f"{k_cache.shape[0] * lay.block_size} slots")
    tokens = k.shape[0]
    if tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    kw, ks, kz = lay.key_views(k_cache)
    vw, vs, vz = lay.value_views(v_cache)
    meta = dict(HEAD_DIM=lay.head_dim, BLOCK_D=block_d(lay.head_dim), G=lay.group_size,
                BS=lay.block_size, BITS=bits)
    tail = dict(stride_te=k_tail.stride(0), stride_tr=k_tail.stride(1), stride_th=k_tail.stride(2))
    _key_groups[(tokens, lay.heads)](
        K=k, KW=kw, KS=ks, KZ=kz, Tail=k_tail, slot_mapping=slot_mapping, tail_of_block=tail_of_block,
        stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_wb=kw.stride(0), stride_wr=kw.stride(1), stride_wh=kw.stride(2),
        stride_sb=ks.stride(0), stride_sg=ks.stride(1), stride_sh=ks.stride(2), **tail, **meta)
    _store_values[(tokens, lay.heads)](
        K=k, V=v, VW=vw, VS=vs, VZ=vz, Tail=k_tail, slot_mapping=slot_mapping,
        tail_of_block=tail_of_block, num_tokens=tokens,
        stride_kt=k.stride(0), stride_kh=k.stride(1), stride_vt=v.stride(0), stride_vh=v.stride(1),
        stride_wb=vw.stride(0), stride_wr=vw.stride(1), stride_wh=vw.stride(2),
        stride_sb=vs.stride(0), stride_st=vs.stride(1), stride_sh=vs.stride(2), **tail, **meta)


# ----------------------------------------------------------------------------------------- the read
@triton.jit
def _code_pair(w, rot, BITS: tl.constexpr, PTX: tl.constexpr):
    """Codes 2j, 2j + 1 of words w (bits b·j and 16 + b·j, kivi.field_shifts) as two fp16 c / 2^b: the
    word rotated left by `rot` puts both at the top of their half's mantissa, one AND-OR sets the
    exponent of 1.0 under them (1 + c / 2^b, exact), and a packed subtract takes the 1 off. PTX: `shf`
    (a rotate), `lop3` (ptxas keeps an OR with a second constant apart) and `sub.f16x2`."""
    MASK: tl.constexpr = ((2**BITS - 1) << (10 - BITS)) * 65537
    if PTX:
        v = tl.inline_asm_elementwise(
            f"{{ .reg .b32 t, one; shf.l.wrap.b32 t, $1, $1, $2; lop3.b32 t, t, {MASK}, 0x3C003C00, 0xEA; "
            f"mov.b32 one, 0x3C003C00; sub.f16x2 $0, t, one; }}",
            "=r,r,r", [w, rot], dtype=tl.int32, is_pure=True, pack=1)
        lo = (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        u = w.to(tl.uint32, bitcast=True)
        r = rot.to(tl.uint32)
        v = (((u << r) | (u >> ((32 - r) & 31))) & MASK) | 0x3C003C00
        lo = (v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True) - 1.0
        hi = (v >> 16).to(tl.uint16).to(tl.float16, bitcast=True) - 1.0
    return lo, hi


@triton.jit
def code_tile(words, ROWS: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr, PTX: tl.constexpr):
    """Words (ROWS, W) -> their codes / 2^b (ROWS, W·32/b) fp16 in order. Each word is split by four
    lane parts c, each taking the pairs the MMA's operand fragment gives lane c of a quad: k = 2c, 2c + 1
    and 8 + 2c, 9 + 2c of each 16 (PTX ISA, mma.m16n8k16 / wgmma): a 2-bit word's pairs c and c + 4, a
    4-bit word's pair c. The joins, the permute and the reshape only rename registers, so the tile
    is the MMA's register operand as it comes out (wgmma's A: the tokens or channels are its rows)."""
    c = tl.arange(0, 4)[None, None, :]
    wb = tl.broadcast_to(words[:, :, None], (ROWS, W, 4))
    TOP: tl.constexpr = 10 - BITS  # where a code's lowest bit goes: the top of a half's mantissa
    l0, h0 = _code_pair(wb, (TOP - BITS * c) & 31, BITS, PTX)
    if BITS == 2:
        l1, h1 = _code_pair(wb, (TOP - BITS * (c + 4)) & 31, BITS, PTX)
        t = tl.join(tl.join(l0, h0), tl.join(l1, h1))  # (ROWS, W, 4 c, 2 e, 2 sel)
        return tl.reshape(tl.permute(t, (0, 1, 4, 2, 3)), (ROWS, 16 * W))  # k = 16w + 8sel + 2c + e
    else:
        return tl.reshape(tl.join(l0, h0), (ROWS, 8 * W))  # k = 8w + 2c + e


@triton.jit
def _kivi_tiles(acc, vb, acc16, l_i, m_i, q, qh, bt_row, t, lo, hi, n, nk, shift, hi_w, qk_scale, hk,
                entry, KW, KS, KZ, VW, VS, VZ, Tail,
                stride_kwb, stride_kwr, stride_kwh, stride_ksb, stride_ksg, stride_ksh,
                stride_vwb, stride_vwr, stride_vwh, stride_vsb, stride_vst, stride_vsh,
                stride_te, stride_tr, stride_th, WK, WV, key_lo, value_lo, rows, stride_wr, stride_wh,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                MASKED: tl.constexpr, DT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                WINDOW: tl.constexpr, PTX: tl.constexpr):
    """FA2's Algorithm 1 loop over key tiles [lo, hi) of a KIVI cache, transposed: S^T = K q^T and
    O^T = V^T P, the code tiles the MMA's A operand, the scales and zeros folded into the other side.
    A key is s·c + z per channel of its group j, so S^T = C_K (q ∘ s_j)^T + q·z_j: q is scaled once per
    group in the tile (the groups side by side in N, each token taking its group's column block) and
    q·z_j is one more small product. A value is s·c + z per token of its channel group g, so
    O^T = C_V^T (P ∘ s_g) + (P^T z)_g: P scaled per channel group (side by side in N, channel d keeping
    block g(d) at the end) and P^T z one small product. MASKED: keys past the sequence end or the causal
    edge masked; keys from nk (the open group) from tail entry `entry` in 16 bits; with a WINDOW, keys
    from key_lo and values from value_lo from the rings WK, WV (row position % rows), their values'
    sums in acc16."""
    PW: tl.constexpr = 32 // BITS
    NGT: tl.constexpr = BLOCK_N // G if BLOCK_N > G else 1  # key groups a tile spans
    NGV: tl.constexpr = BLOCK_D // G  # channel groups of the values
    LEV: tl.constexpr = 2.0**BITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    wk = tl.arange(0, BLOCK_D // PW)
    wv = tl.arange(0, BLOCK_N // PW)
    jg = tl.arange(0, NGT)
    gv = tl.arange(0, NGV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=offs_n < n, other=0).to(tl.int64)
        # ---- S^T (BLOCK_N, BLOCK_M), in log2 units
        kw = tl.load(KW + page[:, None] * stride_kwb + (offs_n % PAGE_SIZE)[:, None] * stride_kwr
                     + hk * stride_kwh + wk[None, :],
                     mask=((offs_n < nk) & (offs_n < n))[:, None] & (wk < HEAD_DIM // PW)[None, :], other=0)
        ck = code_tile(kw, BLOCK_N, BLOCK_D // PW, BITS, PTX).to(DT)
        gtok = start_n + jg * G  # each key group's first token (one group if G >= BLOCK_N)
        gpage = tl.load(bt_row + gtok // PAGE_SIZE, mask=gtok < n, other=0).to(tl.int64)
        at = (gpage * stride_ksb + ((gtok % PAGE_SIZE) // G) * stride_ksg + hk * stride_ksh)[:, None] + d[None, :]
        g_ok = (gtok < nk)[:, None] & d_ok[None, :]
        ks = tl.load(KS + at, mask=g_ok, other=0.0).to(tl.float32)  # (NGT, BLOCK_D)
        kz = tl.load(KZ + at, mask=g_ok, other=0.0)
        qs = (q[:, None, :] * (LEV * ks)[None, :, :]).to(DT)  # (BLOCK_M, NGT, BLOCK_D), rounded once
        s = tl.dot(ck, tl.trans(tl.reshape(qs, (BLOCK_M * NGT, BLOCK_D))), input_precision=DOT_PRECISION)
        s = s + tl.reshape(tl.dot(qh, tl.trans(kz.to(DT)), input_precision=DOT_PRECISION),
                           (BLOCK_M * NGT,))[None, :]
        s = tl.reshape(s, (BLOCK_N, BLOCK_M, NGT))
        if NGT == 1:
            s = tl.reshape(s, (BLOCK_N, BLOCK_M))
        else:  # each token its group's block
            s = tl.sum(tl.where(((offs_n - start_n) // G)[:, None, None] == jg[None, None, :], s, 0.0), 2)
        if MASKED:  # keys nk.. from the tail (16 bits), keys from key_lo from the window
            t_ok = ((offs_n >= nk) & (offs_n < n))[:, None] & d_ok[None, :]
            k16 = tl.load(Tail + entry * stride_te + (offs_n - nk)[:, None] * stride_tr + hk * stride_th
                          + d[None, :], mask=t_ok, other=0.0)
            if WINDOW:
                w_ok = ((offs_n >= key_lo) & (offs_n < n))[:, None] & d_ok[None, :]
                kr = tl.load(WK + (offs_n % rows)[:, None] * stride_wr + hk * stride_wh + d[None, :],
                             mask=w_ok, other=0.0)
                k16 = tl.where((offs_n >= key_lo)[:, None], kr.to(k16.dtype), k16)
                raw = (offs_n >= nk) | (offs_n >= key_lo)
            else:
                raw = offs_n >= nk
            s16 = tl.dot(k16.to(DT), tl.trans(qh), input_precision=DOT_PRECISION)
            s = tl.where(raw[:, None], s16, s)
            seen = (offs_n[:, None] < n) & (offs_n[:, None] <= t[None, :] + shift + hi_w)
            s = tl.where(seen, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[None, :])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 0) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(s * qk_scale - m_use[None, :])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 0)
        # ---- O^T (BLOCK_D, BLOCK_M · NGV): the value codes of the tile's tokens, channel by channel
        chunk = start_n + wv * PW
        cpage = tl.load(bt_row + chunk // PAGE_SIZE, mask=chunk < n, other=0).to(tl.int64)
        vw = tl.load(VW + (cpage * stride_vwb + ((chunk % PAGE_SIZE) // PW) * stride_vwr
                           + hk * stride_vwh)[None, :] + d[:, None],
                     mask=d_ok[:, None] & (chunk < n)[None, :], other=0)
        cv = code_tile(vw, BLOCK_D, BLOCK_N // PW, BITS, PTX).to(DT)  # (BLOCK_D, BLOCK_N)
        v_at = (page * stride_vsb + (offs_n % PAGE_SIZE) * stride_vst + hk * stride_vsh)[:, None] + gv[None, :]
        v_ok = (offs_n < n)[:, None] & (gv < HEAD_DIM // G)[None, :]
        vs = tl.load(VS + v_at, mask=v_ok, other=0.0).to(tl.float32)  # (BLOCK_N, NGV)
        vz = tl.load(VZ + v_at, mask=v_ok, other=0.0)
        pq = p
        if MASKED and WINDOW:  # the window's values in 16 bits: their weights leave the codes' sums
            live = (offs_n >= value_lo) & (offs_n < n)
            vr = tl.load(WV + (offs_n % rows)[None, :] * stride_wr + hk * stride_wh + d[:, None],
                         mask=d_ok[:, None] & live[None, :], other=0.0)
            acc16 = tl.dot(vr.to(DT), tl.where(live[:, None], p, 0.0).to(DT), acc16 * alpha[None, :],
                           input_precision=DOT_PRECISION)
            pq = tl.where(live[:, None], 0.0, p)
        elif WINDOW:
            acc16 = acc16 * alpha[None, :]
        ps = tl.reshape((pq[:, :, None] * (LEV * vs)[:, None, :]).to(DT), (BLOCK_N, BLOCK_M * NGV))
        al = tl.reshape(tl.broadcast_to(alpha[:, None], (BLOCK_M, NGV)), (BLOCK_M * NGV,))
        acc = tl.dot(cv, ps, acc * al[None, :], input_precision=DOT_PRECISION)
        vb = vb * al + tl.reshape(tl.dot(tl.trans(pq.to(DT)), vz.to(DT), input_precision=DOT_PRECISION),
                                  (BLOCK_M * NGV,))
        m_i = m_new
    return acc, vb, acc16, l_i, m_i


@triton.jit(do_not_specialize=["seqlen_q", "group", "stride_bt"])
def _kivi_decode_split_kernel(Q, KW, KS, KZ, VW, VS, VZ, Tail, Out, LSE, cache_seqlens, block_table,
                              tail_of_block, WinK, WinV, win_entry, win_start, residual, ring_rows,
                              stride_we, stride_wr, stride_wh, seqlen_q, group, qk_scale, window_right,
                              stride_qb, stride_qt, stride_qh,
                              stride_kwb, stride_kwr, stride_kwh, stride_ksb, stride_ksg, stride_ksh,
                              stride_vwb, stride_vwr, stride_vwh, stride_vsb, stride_vst, stride_vsh,
                              stride_te, stride_tr, stride_th, stride_bt,
                              stride_ob, stride_ot, stride_oh, stride_os,
                              stride_lb, stride_lt, stride_lh, stride_ls,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, G: tl.constexpr,
                              BITS: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
                              PTX: tl.constexpr):
    """decode._decode_split_kernel over a KIVI cache: grid (num_splits, heads_k * row_blocks, batch);
    `_kivi_tiles` does the work, transposed. WINDOW: the newest keys and values from the sequence's
    16-bit rings (kivi.KIVIWindow)."""
    NGV: tl.constexpr = BLOCK_D // G
    # the masked tiles (the last few: the open group, the window, the causal edge) hold 16-bit rows
    # beside the codes: half as many keys keep them in registers
    MASKED_N: tl.constexpr = BLOCK_N // 2 if BLOCK_N >= 64 else BLOCK_N
    split = tl.program_id(0)
    row_blocks = tl.cdiv(group * seqlen_q, BLOCK_M)
    hk = tl.program_id(1) // row_blocks
    b64 = tl.program_id(2).to(tl.int64)
    rows = (tl.program_id(1) % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * seqlen_q
    h = hk * group + rows // seqlen_q
    t = rows % seqlen_q
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + b64 * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    if Q.dtype.element_ty == tl.float32:
        DT: tl.constexpr = tl.float32
    else:  # products in fp16, the stored scales' dtype, which holds K, V, q (|q| <= 65504) and P more
        # finely than bf16
        DT: tl.constexpr = tl.float16
        q = tl.clamp(q, -65504.0, 65504.0)
    qh = q.to(DT)
    k_len = tl.load(cache_seqlens + b64)
    bt_row = block_table + b64 * stride_bt
    nk = k_len // G * G  # keys [0, nk) are codes, [nk, k_len) the tail of the block holding nk
    entry = tl.load(tail_of_block + tl.load(bt_row + tl.minimum(nk, tl.maximum(k_len - 1, 0))
                                            // PAGE_SIZE)).to(tl.int64)
    split_len = tl.cdiv(tl.cdiv(k_len, tl.num_programs(0)), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, k_len)
    diag = k_len - seqlen_q
    full_hi = tl.minimum(tl.minimum(hi, diag + window_right + 1), nk)
    key_lo, value_lo = k_len, k_len
    WK, WV = WinK, WinV
    if WINDOW:  # kivi.window_bounds; the tiles from key_lo on are the masked ones
        w_start = tl.load(win_start + b64)
        old = tl.maximum(k_len - residual, 0)
        key_lo = tl.maximum(w_start, old // G * G)
        value_lo = tl.maximum(w_start, old)
        full_hi = tl.minimum(full_hi, tl.minimum(key_lo, value_lo))
        ring = tl.load(win_entry + b64).to(tl.int64) * stride_we
        WK, WV = WinK + ring, WinV + ring
    full_hi = tl.maximum(lo + (full_hi - lo) // BLOCK_N * BLOCK_N, lo)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_D, BLOCK_M * NGV], tl.float32)
    vb = tl.zeros([BLOCK_M * NGV], tl.float32)
    acc16 = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)
    acc, vb, acc16, l_i, m_i = _kivi_tiles(
        acc, vb, acc16, l_i, m_i, q, qh, bt_row, t, lo, full_hi, hi, nk, diag, window_right, qk_scale,
        hk, entry, KW, KS, KZ, VW, VS, VZ, Tail,
        stride_kwb, stride_kwr, stride_kwh, stride_ksb, stride_ksg, stride_ksh,
        stride_vwb, stride_vwr, stride_vwh, stride_vsb, stride_vst, stride_vsh,
        stride_te, stride_tr, stride_th, WK, WV, key_lo, value_lo, ring_rows, stride_wr, stride_wh,
        HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, G=G,
        BITS=BITS, MASKED=False, DT=DT, DOT_PRECISION=DOT_PRECISION, WINDOW=WINDOW, PTX=PTX)
    acc, vb, acc16, l_i, m_i = _kivi_tiles(
        acc, vb, acc16, l_i, m_i, q, qh, bt_row, t, full_hi, hi, hi, nk, diag, window_right, qk_scale,
        hk, entry, KW, KS, KZ, VW, VS, VZ, Tail,
        stride_kwb, stride_kwr, stride_kwh, stride_ksb, stride_ksg, stride_ksh,
        stride_vwb, stride_vwr, stride_vwh, stride_vsb, stride_vst, stride_vsh,
        stride_te, stride_tr, stride_th, WK, WV, key_lo, value_lo, ring_rows, stride_wr, stride_wh,
        HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=MASKED_N, PAGE_SIZE=PAGE_SIZE, G=G,
        BITS=BITS, MASKED=True, DT=DT, DOT_PRECISION=DOT_PRECISION, WINDOW=WINDOW, PTX=PTX)
    # channel d keeps its group's column block; then the zero points' sums and the window's values
    o = tl.reshape(acc + vb[None, :], (BLOCK_D, BLOCK_M, NGV))
    o = tl.sum(tl.where((d // G)[:, None, None] == tl.arange(0, NGV)[None, None, :], o, 0.0), 2) + acc16
    empty = l_i == 0.0
    l_i = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * LN2_C)
    o_ptrs = (Out + b64 * stride_ob + t[None, :] * stride_ot + h[None, :] * stride_oh
              + split * stride_os + d[:, None])
    tl.store(o_ptrs, (o / l_i[None, :]).to(Out.dtype.element_ty), mask=d_ok[:, None] & row_ok[None, :])
    lse_ptrs = LSE + b64 * stride_lb + t * stride_lt + h * stride_lh + split * stride_ls
    tl.store(lse_ptrs, lse, mask=row_ok)


# Programs an SM that Flash-Decoding's split count aims for (decode.py's DECODE_TUNING["waves"] times
# this): a tile's words, scales and zeros are loaded, split and scaled before its dot, so an SM needs
# more programs in flight than the 16-bit kernel does. Not yet tuned on a GPU.
KIVI_WAVES = 2


def kivi_decode_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                       bits: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of `_kivi_decode_split_kernel`: four warps (one warpgroup, so the
    code tiles are wgmma's register operand) and tiles of 128 keys at head_dim <= 128: 34 SASS
    instructions per key and warp in the 2-bit hd128 loop as Triton 3.6 compiles it for sm_90a, no spill
    (the kernel before this layout: 69). 64-key tiles above (hd 256 spills: the accumulator holds a
    column block per channel group, 8 at G = 32; fp32 queries spill too). Not yet timed on a GPU. Under the interpreter, 32-key
    tiles (two key groups of 16)."""
    if device.type != "cuda":
        return 32, 4, 1
    if dtype == torch.float32:
        return 32, 4, 2
    if head_dim > 128:
        return 64, 4, 2
    return 128, 4, 2


def check_kivi_decode(q, lay, cache_seqlens, block_table, num_blocks):
    """flash_attn_with_kivi_cache's q, lengths and block table. Returns cache_seqlens as a tensor."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in DTYPES:
        got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be a fp16/bf16/fp32 (batch, seqlen_q, heads_q, head_dim) tensor, got {got}")
    if q.shape[-1] != lay.head_dim or q.shape[2] % lay.heads:
        raise ValueError(f"q {tuple(q.shape)}: head_dim must be the cache's ({lay.head_dim}) and heads_q a "
                         f"multiple of its {lay.heads} kv heads")
    batch = q.shape[0]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if (not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.shape != (batch,)
            or cache_seqlens.dtype != torch.int32 or cache_seqlens.device != q.device):
        got = (f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}" if isinstance(cache_seqlens, torch.Tensor)
               else repr(cache_seqlens))
        raise ValueError(f"cache_seqlens must be an int or an int32 ({batch},) tensor on q's device, got {got}")
    check_block_table(block_table, batch, num_blocks, lay.block_size, q)
    check_lengths_fit(cache_seqlens, "cache_seqlens", block_table.shape[1] * lay.block_size, False)
    return cache_seqlens


def flash_attn_with_kivi_cache_triton(q, k_cache, v_cache, k_tail, cache_seqlens, block_table,
                                      tail_of_block, bits, group_size, softmax_scale=None, num_splits=0,
                                      causal=False, return_lse=False, config=None, window=None):
    """`kivi.flash_attn_with_kivi_cache` on the kernels: Flash-Decoding's split and combine. config:
    (BLOCK_N, num_warps, num_stages) of the split kernel, default `kivi_decode_config`."""
    lay = layout_of(k_cache, v_cache, k_tail, tail_of_block, bits, group_size)
    cache_seqlens = check_kivi_decode(q, lay, cache_seqlens, block_table, k_cache.shape[0])
    scale = check_scale(softmax_scale, lay.head_dim)
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_table = block_table.contiguous()
    batch, seqlen_q, heads_q, head_dim = q.shape
    group = heads_q // lay.heads
    capacity = block_table.shape[1] * lay.block_size
    block_m = max(4, min(64, next_pow2(group * seqlen_q)))  # the products' N: the rows, padded
    row_blocks = cdiv(group * seqlen_q, block_m)
    programs = batch * lay.heads * row_blocks
    block_n, num_warps, num_stages = config or kivi_decode_config(head_dim, q.dtype, q.device, lay.bits)
    if num_splits == 0:  # KIVI_WAVES programs an SM: one a SM leaves a dequantizing tile's latency bare
        num_splits = pick_num_splits(programs, capacity, block_n, KIVI_WAVES * num_sms(q.device))
    split_len = cdiv(cdiv(max(capacity, 1), num_splits), block_n) * block_n
    num_splits = cdiv(max(capacity, 1), split_len)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, seqlen_q, heads_q, dtype=torch.float32, device=q.device)
    if num_splits == 1:
        o_part, lse_part, s_strides = out, lse, (0, 0)
    else:
        o_part = torch.empty(batch, seqlen_q, heads_q, num_splits, head_dim, dtype=torch.float32,
                             device=q.device)
        lse_part = torch.empty(batch, seqlen_q, heads_q, num_splits, dtype=torch.float32, device=q.device)
        s_strides = (o_part.stride(3), lse_part.stride(3))
    if batch == 0:
        return (out, lse.transpose(1, 2)) if return_lse else out
    kw, ks, kz = lay.key_views(k_cache)
    vw, vs, vz = lay.value_views(v_cache)
    win = window if window is not None else (k_tail, k_tail, cache_seqlens, cache_seqlens, 0)
    with torch.no_grad():
        _kivi_decode_split_kernel[(num_splits, lay.heads * row_blocks, batch)](
            Q=q, KW=kw, KS=ks, KZ=kz, VW=vw, VS=vs, VZ=vz, Tail=k_tail, Out=o_part, LSE=lse_part,
            cache_seqlens=cache_seqlens, block_table=block_table, tail_of_block=tail_of_block,
            WinK=win[0], WinV=win[1], win_entry=win[2], win_start=win[3], residual=win[4],
            ring_rows=win[0].shape[1], stride_we=win[0].stride(0), stride_wr=win[0].stride(1),
            stride_wh=win[0].stride(2),
            seqlen_q=seqlen_q, group=group, qk_scale=scale * LOG2E,
            window_right=0 if causal else NO_WINDOW,
            stride_qb=q.stride(0), stride_qt=q.stride(1), stride_qh=q.stride(2),
            stride_kwb=kw.stride(0), stride_kwr=kw.stride(1), stride_kwh=kw.stride(2),
            stride_ksb=ks.stride(0), stride_ksg=ks.stride(1), stride_ksh=ks.stride(2),
            stride_vwb=vw.stride(0), stride_vwr=vw.stride(1), stride_vwh=vw.stride(2),
            stride_vsb=vs.stride(0), stride_vst=vs.stride(1), stride_vsh=vs.stride(2),
            stride_te=k_tail.stride(0), stride_tr=k_tail.stride(1), stride_th=k_tail.stride(2),
            stride_bt=block_table.stride(0),
            stride_ob=o_part.stride(0), stride_ot=o_part.stride(1), stride_oh=o_part.stride(2),
            stride_os=s_strides[0],
            stride_lb=lse_part.stride(0), stride_lt=lse_part.stride(1), stride_lh=lse_part.stride(2),
            stride_ls=s_strides[1],
            HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
            PAGE_SIZE=lay.block_size, G=lay.group_size, BITS=bits, DOT_PRECISION=dot_precision(q.dtype),
            WINDOW=window is not None, PTX=q.is_cuda, num_warps=num_warps, num_stages=num_stages)
        if num_splits > 1:
            _combine_kernel[(batch * seqlen_q * heads_q,)](
                O_part=o_part, LSE_part=lse_part, Out=out, LSE=lse, num_splits=num_splits,
                HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_S=next_pow2(num_splits))
    return (out, lse.transpose(1, 2)) if return_lse else out
