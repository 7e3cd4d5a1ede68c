"""KIVI's 2- and 4-bit KV cache (arXiv 2402.02750) in Triton: the write that quantizes, and Flash-Decoding
over packed blocks. The layout, the torch path and the dispatch are kivi.py's.

* The write (`store_kv_kivi_triton`), two kernels over (token, kv head) in stream order: `_key_groups`
  quantizes each key group that a new token completes (per channel over the group's G tokens, KIVI
  §3.2), reading the group's older members from the 16-bit tail; `_store_values` quantizes each new
  token's value (per token, groups of G channels) and puts its key into the tail unless `_key_groups`
  just quantized its group. No host sync: CUDA-graph safe.
* The read (`flash_attn_with_kivi_cache_triton`): decode.py's split-K over the keys, with tiles that
  dequantize in registers — a word holds 32 / b codes, code = (word >> b·i) & (2^b - 1), value = code ·
  scale + zero, in fp16 (the stored scales' dtype; bf16 queries go to fp16) or in fp32 for fp32 queries,
  each thread splitting the words it loaded itself; `tl.dot` sums in fp32, as do the running softmax
  sums across tiles. In fp16 two codes share a 32-bit register (`_pairs_asm`: codes j and j + 16 / b
  of a word, one shift, one AND-OR, one packed subtract and one packed FMA a pair), so a tile's columns
  come in `field_order`: a K tile's tokens j, j + 16 / b side by side (the softmax and P·V do not care
  in which order the keys come, as long as V's rows follow the same order), a V tile's channels likewise
  (the output's columns then come in that order: the store puts each where it belongs). Keys past the
  last full group come from the tail instead; the tiles that may hold them (and the sequence end, the
  causal edge) are the masked ones. The slices merge in decode.py's
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
def code_value(codes, scale, zero, out_dtype: tl.constexpr):
    """code · scale + zero for integer codes, in `out_dtype` (fp16 or fp32); scale and zero are the stored
    fp16. The code goes into a float's mantissa and the float's exponent is subtracted, exactly: in fp16,
    bits 0x6400 | code are 1024 + code; in fp32, 0x4B000000 | code are 2^23 + code. An OR and an add
    run at full rate where the integer-to-float conversion (I2F) runs at an eighth on sm_90. In fp16 the
    stored scale and zero need no conversion and the product and sum are one FMA, rounded once."""
    if out_dtype == tl.float16:
        x = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
        return x * scale + zero
    else:
        x = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return x * scale.to(tl.float32) + zero.to(tl.float32)


@triton.jit
def fields(words, scale, zero, START: tl.constexpr, STEP: tl.constexpr, COUNT: tl.constexpr,
           BITS: tl.constexpr, out_dtype: tl.constexpr):
    """Fields START, START + STEP, ... (COUNT of them) of every word, dequantized (`code_value`), as
    words.shape + (2,) * log2(COUNT), flattening in field order. Built by tl.join, whose new axis stays
    in the thread: each thread splits whole words it loaded itself, and the reshape to the tile moves
    nothing (splitting by broadcast over a field axis spreads the fields of one word over 16 threads,
    each loading the word again and its scale and zero)."""
    if COUNT == 1:
        return code_value((words >> (START * BITS)) & (2**BITS - 1), scale, zero, out_dtype)
    else:
        even = fields(words, scale, zero, START, 2 * STEP, COUNT // 2, BITS, out_dtype)
        odd = fields(words, scale, zero, START + STEP, 2 * STEP, COUNT // 2, BITS, out_dtype)
        return tl.join(even, odd)


def _pairs_asm(bits: int) -> str:
    """PTX that splits one int32 word of 32 / b codes into fp16 `code · scale + zero`, two codes a
    32-bit register: shifted right by b·j, the word's halves hold codes j and j + 16 / b at bit 0 of each
    half, and one AND-OR (mask (2^b - 1) in both halves, 0x6400 above) makes the pair of fp16 numbers
    1024 + code; one packed subtract and one packed FMA finish both (`code_value` two at a time)."""
    half, mask = 16 // bits, (2**bits - 1) * 0x00010001
    w, sc, zr = 2 * half + 0, 2 * half + 1, 2 * half + 2  # operands after the 2·half outputs
    lines = ["{", ".reg .b32 s2, z2, m, t;", f"mov.b32 s2, {{${sc}, ${sc}}};", f"mov.b32 z2, {{${zr}, ${zr}}};",
             "mov.b32 m, 0x64006400;"]
    for j in range(half):
        src = f"${w}" if j == 0 else "t"
        if j:
            lines.append(f"shr.u32 t, ${w}, {bits * j};")
        lines += [f"lop3.b32 t, {src}, {mask}, 0x64006400, 0xea;", "sub.f16x2 t, t, m;",
                  "fma.rn.f16x2 t, t, s2, z2;", f"mov.b32 {{${2 * j}, ${2 * j + 1}}}, t;"]
    return "\n".join([*lines, "}"])


# The interpreter (CPU tensors: the tests) runs no PTX: it splits the words in plain Triton, in the same order.
INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))
PAIRS_ASM_2, PAIRS_ASM_4 = tl.constexpr(_pairs_asm(2)), tl.constexpr(_pairs_asm(4))
PAIRS_ARGS_2, PAIRS_ARGS_4 = (tl.constexpr(",".join(["=h"] * (32 // b) + ["r", "h", "h"])) for b in (2, 4))


@triton.jit
def _order(x, COUNT: tl.constexpr, START: tl.constexpr, STEP: tl.constexpr):
    """Elements START, START + STEP, ... (COUNT) of the tuple x joined so they flatten in that order."""
    if COUNT == 1:
        return x[START]
    else:
        return tl.join(_order(x, COUNT // 2, START, 2 * STEP), _order(x, COUNT // 2, START + STEP, 2 * STEP))


@triton.jit
def paired_fields(words, scale, zero, BITS: tl.constexpr):
    """Every field of every word dequantized in fp16 two at a time (`_pairs_asm`), as words.shape +
    (2,) * log2(32 / b), flattening in `field_order`: fields 0, H, 1, H + 1, ... (H = 16 / b), so the
    two fp16 halves of one register stay neighbours in the tile and reach shared memory unpermuted."""
    PW: tl.constexpr = 32 // BITS
    if INTERPRETED:
        return tl.join(fields(words, scale, zero, 0, 1, PW // 2, BITS, tl.float16),
                       fields(words, scale, zero, PW // 2, 1, PW // 2, BITS, tl.float16))
    if BITS == 2:
        outs = tl.inline_asm_elementwise(PAIRS_ASM_2, PAIRS_ARGS_2, [words, scale, zero],
                                         dtype=(tl.float16,) * PW, is_pure=True, pack=1)
    else:
        outs = tl.inline_asm_elementwise(PAIRS_ASM_4, PAIRS_ARGS_4, [words, scale, zero],
                                         dtype=(tl.float16,) * PW, is_pure=True, pack=1)
    return _order(outs, PW, 0, 1)


@triton.jit
def field_order(p, PW: tl.constexpr, PAIRED: tl.constexpr):
    """The field (token of a key word, channel of a value word) at position p of a tile dequantized by
    `paired_fields` (PAIRED) or `fields` (in order)."""
    if PAIRED:
        return p // PW * PW + (p % PW) // 2 + (p % 2) * (PW // 2)
    else:
        return p


@triton.jit
def spread(x, TIMES: tl.constexpr):
    """x (R, C) -> (R, C·TIMES), each column repeated TIMES times in place (tl.join: in the thread)."""
    if TIMES == 1:
        return x
    else:
        y = spread(x, TIMES // 2)
        return tl.reshape(tl.join(y, y), (y.shape[0], 2 * y.shape[1]))


@triton.jit
def _key_groups(K, KW, KS, KZ, Tail, slot_mapping, tail_of_block,
                stride_kt, stride_kh, stride_wb, stride_wr, stride_wh, stride_sb, stride_sg, stride_sh,
                stride_te, stride_tr, stride_th,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
                BITS: tl.constexpr):
    """Pass 1: if token i's slot ends a key group, quantize the group per channel. grid (tokens, heads)."""
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
        codes = group_codes(x, scale[None, :], zero[None, :], BITS)
        # token o of the group is field o % PW of word o // PW (words run along the tokens)
        codes = codes << ((o % PW) * BITS)[:, None]
        words = tl.reduce(tl.reshape(codes, (G // PW, PW, BLOCK_D)), 1, _or)
        first = s % BS - (G - 1)  # the group's first offset in block s // BS
        blk = s // BS
        w = first // PW + tl.arange(0, G // PW)
        tl.store(KW + blk * stride_wb + w[:, None] * stride_wr + h * stride_wh + d[None, :], words,
                 mask=d_ok)
        at = blk * stride_sb + (first // G) * stride_sg + h * stride_sh + d
        tl.store(KS + at, scale, mask=d < HEAD_DIM)
        tl.store(KZ + at, zero, mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_tokens"])
def _store_values(K, V, VW, VS, VZ, Tail, slot_mapping, tail_of_block, num_tokens,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_wb, stride_wt, stride_wh,
                  stride_sb, stride_st, stride_sh, stride_te, stride_tr, stride_th,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
                  BITS: tl.constexpr):
    """Pass 2: token i's value quantized per token (groups of G channels) into its slot; its key into
    the tail unless its group is complete in this step. grid (tokens, heads)."""
    PW: tl.constexpr = 32 // BITS
    NG: tl.constexpr = BLOCK_D // G
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.load(slot_mapping + i).to(tl.int64)
    if s >= 0:
        blk, off = s // BS, s % BS
        c = tl.arange(0, G)
        g = tl.arange(0, NG)
        d = g[:, None] * G + c[None, :]  # (groups, G): channel d is group d // G, member d % G
        x = tl.load(V + i * stride_vt + h * stride_vh + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        scale, zero = group_scale(tl.min(x, 1), tl.max(x, 1), BITS)
        codes = group_codes(x, scale[:, None], zero[:, None], BITS) << ((c % PW) * BITS)[None, :]
        words = tl.reduce(tl.reshape(codes, (BLOCK_D // PW, PW)), 1, _or)  # channels d // PW
        row = blk * stride_wb + off * stride_wt + h * stride_wh
        w = tl.arange(0, BLOCK_D // PW)
        tl.store(VW + row + w, words, mask=w < HEAD_DIM // PW)
        row = blk * stride_sb + off * stride_st + h * stride_sh
        tl.store(VS + row + g, scale, mask=g < HEAD_DIM // G)
        tl.store(VZ + row + g, zero, mask=g < HEAD_DIM // G)
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
        stride_wb=vw.stride(0), stride_wt=vw.stride(1), stride_wh=vw.stride(2),
        stride_sb=vs.stride(0), stride_st=vs.stride(1), stride_sh=vs.stride(2), **tail, **meta)


# ----------------------------------------------------------------------------------------- the read
@triton.jit
def _key_tile(KW, KS, KZ, bt_row, start_n, n, nk, hk, stride_kwb, stride_kwr, stride_kwh,
              stride_ksb, stride_ksg, stride_ksh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
              out_dtype: tl.constexpr):
    """K^T (BLOCK_D, BLOCK_N) of keys [start_n, start_n + BLOCK_N) from their codes, in `out_dtype`: each int32
    word read once (32 / b consecutive tokens of one channel, within one page), its fields shifted out,
    times the channel's scale plus its zero (group w·PW // G of the page). Keys at or past min(n, nk):
    whatever the words hold (the caller masks them)."""
    PW: tl.constexpr = 32 // BITS
    d = tl.arange(0, BLOCK_D)
    tok = start_n + tl.arange(0, BLOCK_N // PW) * PW  # each word's first token
    ok = (d < HEAD_DIM)[:, None] & ((tok < n) & (tok < nk))[None, :]
    page = tl.load(bt_row + tok // PAGE_SIZE, mask=tok < n, other=0).to(tl.int64)
    r = tok % PAGE_SIZE
    words = tl.load(KW + page[None, :] * stride_kwb + (r // PW)[None, :] * stride_kwr + hk * stride_kwh
                    + d[:, None], mask=ok, other=0)  # (BLOCK_D, BLOCK_N / PW)
    at = page[None, :] * stride_ksb + (r // G)[None, :] * stride_ksg + hk * stride_ksh + d[:, None]
    scale = tl.load(KS + at, mask=ok, other=0.0)
    zero = tl.load(KZ + at, mask=ok, other=0.0)
    if out_dtype == tl.float16:
        return tl.reshape(paired_fields(words, scale, zero, BITS), (BLOCK_D, BLOCK_N))
    return tl.reshape(fields(words, scale, zero, 0, 1, PW, BITS, out_dtype), (BLOCK_D, BLOCK_N))


@triton.jit
def _value_tile(VW, VS, VZ, bt_row, offs_n, n, hk, stride_vwb, stride_vwt, stride_vsb, stride_vst,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                out_dtype: tl.constexpr):
    """V (BLOCK_N, BLOCK_D) of tokens offs_n in `out_dtype`: each word (32 / b channels of one token) read
    once, times the token's scale plus zero of group (word · PW) // G; with fp16 tiles the columns in
    `field_order`. Past n: 0. A head's words and its scales are HEAD_DIM // PW and HEAD_DIM // G
    apart in a block (`KIVILayout.value_views`): as constants, the compiler sees a token's 32-byte words
    and its group scales contiguous and aligned, and copies them a vector at a time (cp.async), ahead of
    the tile, like every other operand."""
    PW: tl.constexpr = 32 // BITS
    w = tl.arange(0, BLOCK_D // PW)
    ok = (offs_n < n)[:, None] & (w < HEAD_DIM // PW)[None, :]
    page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=offs_n < n, other=0).to(tl.int64)
    r = offs_n % PAGE_SIZE
    row = page[:, None] * stride_vwb + r[:, None] * stride_vwt + hk * (HEAD_DIM // PW)
    words = tl.load(VW + row + w[None, :], mask=ok, other=0)  # (BLOCK_N, BLOCK_D / PW)
    g = tl.arange(0, BLOCK_D // G)
    g_ok = (offs_n < n)[:, None] & (g < HEAD_DIM // G)[None, :]
    at = page[:, None] * stride_vsb + r[:, None] * stride_vst + hk * (HEAD_DIM // G) + g[None, :]
    scale = tl.load(VS + at, mask=g_ok, other=0.0)
    zero = tl.load(VZ + at, mask=g_ok, other=0.0)
    scale, zero = spread(scale, G // PW), spread(zero, G // PW)  # a scale a word
    if out_dtype == tl.float16:
        return tl.reshape(paired_fields(words, scale, zero, BITS), (BLOCK_N, BLOCK_D))
    return tl.reshape(fields(words, scale, zero, 0, 1, PW, BITS, out_dtype), (BLOCK_N, BLOCK_D))


@triton.jit
def _kivi_tiles(acc, l_i, m_i, q, bt_row, t, lo, hi, n, nk, shift, hi_w, qk_scale, hk, entry,
                KW, KS, KZ, VW, VS, VZ, Tail,
                stride_kwb, stride_kwr, stride_kwh, stride_ksb, stride_ksg, stride_ksh,
                stride_vwb, stride_vwt, stride_vsb, stride_vst,
                stride_te, stride_tr, stride_th, WK, WV, key_lo, value_lo, rows, stride_wr, stride_wh,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                PAGE_SIZE: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, MASKED: tl.constexpr,
                DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr):
    """FA2's Algorithm 1 loop (forward.fwd_tiles) over key tiles [lo, hi) of a KIVI cache, each K and V
    tile dequantized in registers. lo is a multiple of BLOCK_N. MASKED: keys past the sequence end or
    the causal edge are masked, and keys from nk on (the sequence's open group) come from tail entry
    `entry`, in 16 bits; with a WINDOW, keys from key_lo and values from value_lo come from the
    sequence's 16-bit rings WK, WV (row position % rows)."""
    PW: tl.constexpr = 32 // BITS
    PAIRED: tl.constexpr = q.dtype == tl.float16
    d = tl.arange(0, BLOCK_D)
    dv = field_order(d, PW, PAIRED)  # the channel of each column of a V tile
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + field_order(tl.arange(0, BLOCK_N), PW, PAIRED)  # the token of each key column
        k = _key_tile(KW, KS, KZ, bt_row, start_n, n, nk, hk, stride_kwb, stride_kwr, stride_kwh,
                      stride_ksb, stride_ksg, stride_ksh, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, G, BITS,
                      q.dtype)
        if MASKED:  # keys nk.. live in the tail, row j - nk; keys past n read 0
            t_ok = (d < HEAD_DIM)[:, None] & ((offs_n >= nk) & (offs_n < n))[None, :]
            kt = tl.load(Tail + entry * stride_te + (offs_n - nk)[None, :] * stride_tr
                         + hk * stride_th + d[:, None], mask=t_ok, other=0.0)
            k = tl.where(((offs_n < nk) & (offs_n < n))[None, :], k, kt.to(k.dtype))
            if WINDOW:
                w_ok = (d < HEAD_DIM)[:, None] & ((offs_n >= key_lo) & (offs_n < n))[None, :]
                kw = tl.load(WK + (offs_n % rows)[None, :] * stride_wr + hk * stride_wh + d[:, None],
                             mask=w_ok, other=0.0)
                k = tl.where((offs_n >= key_lo)[None, :], kw.to(k.dtype), k)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)  # S = Q K^T, fp32 sums
        if MASKED:
            seen = visible(t, offs_n, shift, NO_WINDOW_C, hi_w, n)
            s = tl.where(seen, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _value_tile(VW, VS, VZ, bt_row, offs_n, n, hk, stride_vwb, stride_vwt, stride_vsb, stride_vst,
                        HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, G,
                        BITS, q.dtype)
        if MASKED and WINDOW:
            w_ok = ((offs_n >= value_lo) & (offs_n < n))[:, None] & (dv < HEAD_DIM)[None, :]
            vw = tl.load(WV + (offs_n % rows)[:, None] * stride_wr + hk * stride_wh + dv[None, :],
                         mask=w_ok, other=0.0)
            v = tl.where((offs_n >= value_lo)[:, None], vw.to(v.dtype), v)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seqlen_q", "group", "stride_bt"])
def _kivi_decode_split_kernel(Q, KW, KS, KZ, VW, VS, VZ, Tail, Out, LSE, cache_seqlens, block_table,
                              tail_of_block, WinK, WinV, win_entry, win_start, residual, ring_rows,
                              stride_we, stride_wr, stride_wh, seqlen_q, group, qk_scale, window_right,
                              stride_qb, stride_qt, stride_qh,
                              stride_kwb, stride_kwr, stride_kwh, stride_ksb, stride_ksg, stride_ksh,
                              stride_vwb, stride_vwt, stride_vsb, stride_vst,
                              stride_te, stride_tr, stride_th, stride_bt,
                              stride_ob, stride_ot, stride_oh, stride_os,
                              stride_lb, stride_lt, stride_lh, stride_ls,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, G: tl.constexpr,
                              BITS: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr):
    """decode._decode_split_kernel over a KIVI cache: grid (num_splits, heads_k * row_blocks, batch).
    WINDOW: the newest keys and values from the sequence's 16-bit rings (kivi.KIVIWindow)."""
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
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if q.dtype == tl.bfloat16:  # tiles and products in fp16, the dtype of the stored scales and zeros:
        # a code dequantizes in one FMA without conversions, and fp16 holds K, V, q (|q| <= 65504) and P
        # more finely than bf16
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
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
        full_hi = tl.minimum(full_hi, key_lo)
        ring = tl.load(win_entry + b64).to(tl.int64) * stride_we
        WK, WV = WinK + ring, WinV + ring
    full_hi = tl.maximum(lo + (full_hi - lo) // BLOCK_N * BLOCK_N, lo)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _kivi_tiles(acc, l_i, m_i, q, bt_row, t, lo, full_hi, hi, nk, diag, window_right,
                                qk_scale, hk, entry, KW, KS, KZ, VW, VS, VZ, Tail,
                                stride_kwb, stride_kwr, stride_kwh, stride_ksb, stride_ksg, stride_ksh,
                                stride_vwb, stride_vwt, stride_vsb, stride_vst,
                                stride_te, stride_tr, stride_th, WK, WV, key_lo, value_lo, ring_rows,
                                stride_wr, stride_wh, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                                BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, G=G, BITS=BITS, MASKED=False,
                                DOT_PRECISION=DOT_PRECISION, WINDOW=WINDOW)
    acc, l_i, m_i = _kivi_tiles(acc, l_i, m_i, q, bt_row, t, full_hi, hi, hi, nk, diag, window_right,
                                qk_scale, hk, entry, KW, KS, KZ, VW, VS, VZ, Tail,
                                stride_kwb, stride_kwr, stride_kwh, stride_ksb, stride_ksg, stride_ksh,
                                stride_vwb, stride_vwt, stride_vsb, stride_vst,
                                stride_te, stride_tr, stride_th, WK, WV, key_lo, value_lo, ring_rows,
                                stride_wr, stride_wh, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                                BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, G=G, BITS=BITS, MASKED=True,
                                DOT_PRECISION=DOT_PRECISION, WINDOW=WINDOW)
    empty = l_i == 0.0
    l_i = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_i)) * LN2_C)
    dv = field_order(d, 32 // BITS, q.dtype == tl.float16)  # acc's columns: the V tiles' channels
    o_ptrs = (Out + b64 * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh
              + split * stride_os + dv[None, :])
    tl.store(o_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=row_ok[:, None] & (dv < HEAD_DIM)[None, :])
    lse_ptrs = LSE + b64 * stride_lb + t * stride_lt + h * stride_lh + split * stride_ls
    tl.store(lse_ptrs, lse, mask=row_ok)


# Programs an SM that Flash-Decoding's split count aims for (decode.py's DECODE_TUNING["waves"] times
# this): a tile's words, scales and zeros are loaded,
# split and scaled before its dot, so an SM needs more programs in flight than the 16-bit kernel does.
# Not tuned: only 2-3 programs fit on an SM at once (registers, shared memory), so a batch that leaves
# one slice per (sequence, kv head) can end on a part-empty round (64 × 16k: 512 programs, 1.29 rounds
# of 396 on an H100).
KIVI_WAVES = 2


def kivi_decode_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                       bits: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of `_kivi_decode_split_kernel`. hd ≤ 128 with 16-bit queries: 64-key
    tiles at 4 warps, the fastest of ten configs timed on one H100 (2026-12-07, llama3-8b heads, page 32,
    CUDA-graph replays) for 2-bit codes: 64 × 16k 1,522 µs against 1,540 for 128-key tiles at 4 warps,
    1,544 at 3 stages, 2,283 for 32-key tiles, 2,697 at 8 warps; 1 × 64k 112 µs. 4-bit codes keep 32-key
    tiles at 4 warps (1,622 against 1,927 µs at 64 × 16k for 64-key tiles, which are faster at 1 × 64k:
    138 against 165 µs). Other head_dims: chosen from ptxas's report at sm_90 (no spill), not timed."""
    if device.type != "cuda":
        return 16, 4, 1
    if dtype == torch.float32:
        return 16, 8, 2
    if head_dim <= 64:
        return 64, 4, 3
    if head_dim <= 128:
        return (64, 4, 2) if bits == 2 else (32, 4, 2)
    return 32, 8, 2


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
    block_m = max(16, min(64, next_pow2(group * seqlen_q)))
    row_blocks = cdiv(group * seqlen_q, block_m)
    programs = batch * lay.heads * row_blocks
    block_n, num_warps, num_stages = config or kivi_decode_config(head_dim, q.dtype, q.device, lay.bits)
    if num_splits == 0:
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
            stride_vwb=vw.stride(0), stride_vwt=vw.stride(1),
            stride_vsb=vs.stride(0), stride_vst=vs.stride(1),
            stride_te=k_tail.stride(0), stride_tr=k_tail.stride(1), stride_th=k_tail.stride(2),
            stride_bt=block_table.stride(0),
            stride_ob=o_part.stride(0), stride_ot=o_part.stride(1), stride_oh=o_part.stride(2),
            stride_os=s_strides[0],
            stride_lb=lse_part.stride(0), stride_lt=lse_part.stride(1), stride_lh=lse_part.stride(2),
            stride_ls=s_strides[1],
            HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
            PAGE_SIZE=lay.block_size, G=lay.group_size, BITS=bits, DOT_PRECISION=dot_precision(q.dtype),
            WINDOW=window is not None, num_warps=num_warps, num_stages=num_stages)
        if num_splits > 1:
            _combine_kernel[(batch * seqlen_q * heads_q,)](
                O_part=o_part, LSE_part=lse_part, Out=out, LSE=lse, num_splits=num_splits,
                HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_S=next_pow2(num_splits))
    return (out, lse.transpose(1, 2)) if return_lse else out
