"""KIVI's 2- and 4-bit KV cache (Liu et al., ICML 2024, arXiv 2402.02750, §3) in a paged pool: the layout,
the torch path (the CPU path and the specification of the kernels in kv_kivi.py) and the dispatch.

Quantization is KIVI §3's (nano_quant.kv is the reference the tests hold it to): asymmetric b-bit round to
nearest over a group of G elements, `scale = (max - min) / (2^b - 1)`, `zero = min` (fp16 both), `code =
clamp(round((x - zero) / scale), 0, 2^b - 1)`, read back as `code * scale + zero` in fp32. Keys are
quantized per channel (a group: G consecutive tokens of one channel), values per token (G consecutive
channels of one token). Codes are packed into int32 words, 32 / b a word, code i at bits [b·i, b·i + b).

The paged layout. A block holds `block_size` tokens (G divides it, so a block holds whole key groups); K
and V of a layer are each a uint8 pool (num_blocks, block_size, heads, width), width = head_dim · (b / 8 +
4 / G) bytes: a token's codes plus its share of the fp16 scales and zeros. Inside one block's bytes:

    K: words (block_size·b/32, heads, head_dim) int32 | scale, zero (block_size/G, heads, head_dim) fp16
    V: words (block_size, heads, head_dim·b/32) int32  | scale, zero (block_size, heads, head_dim/G) fp16

Byte-level block operations (copy-on-write, a KV transfer, a block's hash) see one uint8 block like any
other. Values are quantized as they are written. A key group can only be quantized once its G tokens are
all there, so until then the newest tokens' keys — the sequence's last, not yet full group — live in 16
bits: KIVI's residual window (§3.3), here at most G - 1 keys. They sit in `k_tail`, (entries, G, heads,
head_dim) of the model's dtype, entry `tail_of_block[block]` for the block that holds the partial group
(one per sequence; the engine assigns entries). Token j of a sequence of length L reads its key from the
codes if j < L // G · G, else from row j % G of that entry; every value comes from the codes.

The write (`store_kv_kivi`) runs in two passes over the new tokens: (1) each token whose slot ends a group
(slot % G == G - 1) gathers its group — the members written this step from k, the older ones from the
tail — and writes the group's packed codes, scale and zero; (2) each token's value is quantized into its
slot, and its key goes to the tail unless its group was completed in (1). Pass 1 runs first, so pass 2 may
overwrite tail rows pass 1 read (a sequence that completes a group and starts the next in one step).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .checks import DTYPES


class KIVILayout(NamedTuple):
    """The geometry of one layer's K or V pool (see the module docstring)."""

    bits: int
    group_size: int
    block_size: int
    heads: int
    head_dim: int

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    @property
    def width(self) -> int:
        """Bytes per (token, head) of the K pool and of the V pool."""
        return self.head_dim * self.bits // 8 + 4 * self.head_dim // self.group_size

    @property
    def code_bytes(self) -> int:
        """Bytes of one block's packed words (K's and V's are equal)."""
        return self.block_size * self.heads * self.head_dim * self.bits // 8

    def key_views(self, pool: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(words, scale, zero) of a K pool: (n, bs·b/32, H, D) int32, (n, bs/G, H, D) fp16 twice."""
        n, bs, h, d, g = pool.shape[0], self.block_size, self.heads, self.head_dim, self.group_size
        flat, a = pool.view(n, -1), self.code_bytes
        side = 2 * (bs // g) * h * d  # bytes of the scales (and of the zeros)
        words = flat[:, :a].view(torch.int32).view(n, bs // self.per_word, h, d)
        scale = flat[:, a:a + side].view(torch.float16).view(n, bs // g, h, d)
        zero = flat[:, a + side:a + 2 * side].view(torch.float16).view(n, bs // g, h, d)
        return words, scale, zero

    def value_views(self, pool: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(words, scale, zero) of a V pool: (n, bs, H, D·b/32) int32, (n, bs, H, D/G) fp16 twice."""
        n, bs, h, d, g = pool.shape[0], self.block_size, self.heads, self.head_dim, self.group_size
        flat, a = pool.view(n, -1), self.code_bytes
        side = 2 * bs * h * (d // g)
        words = flat[:, :a].view(torch.int32).view(n, bs, h, d // self.per_word)
        scale = flat[:, a:a + side].view(torch.float16).view(n, bs, h, d // g)
        zero = flat[:, a + side:a + 2 * side].view(torch.float16).view(n, bs, h, d // g)
        return words, scale, zero


def check_kivi_spec(bits: int, group_size: int, head_dim: int, block_size: int | None = None) -> None:
    """b in {2, 4}; G a power of two holding whole words (a multiple of 32 / b) that divides head_dim
    (value groups) and the block size (key groups)."""
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4 (kivi2 / kivi4), got {bits!r}")
    if (type(group_size) is not int or group_size < 32 // bits or group_size & (group_size - 1)):
        raise ValueError(f"group_size must be a power of two >= {32 // bits} (whole int32 words of "
                         f"{bits}-bit codes), got {group_size!r}")
    if head_dim % group_size:
        raise ValueError(f"head_dim ({head_dim}) must be a multiple of group_size ({group_size}): "
                         "values are quantized in groups of group_size channels")
    if block_size is not None and block_size % group_size:
        raise ValueError(f"group_size ({group_size}) must divide block_size ({block_size}): a block "
                         "holds whole key groups")


def layout_of(k_cache: Tensor, v_cache: Tensor, k_tail: Tensor, tail_of_block: Tensor, bits: int,
              group_size: int) -> KIVILayout:
    """Check a KIVI cache's tensors against each other; returns its layout."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor) or t.dtype != torch.uint8 or t.dim() != 4 or not t.is_contiguous():
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a contiguous uint8 (num_blocks, block_size, heads, width) "
                             f"tensor, got {got}")
    if v_cache.shape != k_cache.shape or v_cache.device != k_cache.device:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}")
    if (not isinstance(k_tail, Tensor) or k_tail.dim() != 4 or k_tail.dtype not in DTYPES
            or k_tail.device != k_cache.device or not k_tail.is_contiguous()):
        got = f"{k_tail.dtype} {tuple(k_tail.shape)}" if isinstance(k_tail, Tensor) else k_tail
        raise ValueError(f"k_tail must be a contiguous fp16/bf16/fp32 (entries, group_size, heads, "
                         f"head_dim) tensor on the cache's device, got {got}")
    _, block_size, heads, width = k_cache.shape
    check_kivi_spec(bits, group_size, k_tail.shape[-1], block_size)
    layout = KIVILayout(bits, group_size, block_size, heads, k_tail.shape[-1])
    if k_tail.shape[1:] != (group_size, heads, layout.head_dim) or width != layout.width:
        raise ValueError(f"k_tail {tuple(k_tail.shape)} / cache width {width}: expected (entries, "
                         f"{group_size}, {heads}, head_dim) and width head_dim·({bits}/8 + 4/"
                         f"{group_size}) = {layout.width} bytes")
    if (not isinstance(tail_of_block, Tensor) or tail_of_block.dtype != torch.int32
            or tail_of_block.shape != (k_cache.shape[0],) or tail_of_block.device != k_cache.device):
        got = (f"{tail_of_block.dtype} {tuple(tail_of_block.shape)}" if isinstance(tail_of_block, Tensor)
               else type(tail_of_block).__name__)
        raise ValueError(f"tail_of_block must be an int32 ({k_cache.shape[0]},) tensor (a tail entry per "
                         f"block) on the cache's device, got {got}")
    return layout


# ----------------------------------------------------------------------------------------- torch path
def quantize_groups(x: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """KIVI's round to nearest over the last axis (a group): (codes int32, scale, zero fp16)."""
    x = x.float()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale, zero = ((hi - lo) / (2**bits - 1)).clamp(min=1e-6).half(), lo.half()
    codes = ((x - zero) / scale).round().clamp(0, 2**bits - 1).to(torch.int32)
    return codes, scale[..., 0], zero[..., 0]


def pack_last(codes: Tensor, bits: int) -> Tensor:
    """int32 codes -> int32 words along the last axis (32 / b a word, code i at bits [b·i, b·i + b))."""
    fields = codes.unflatten(-1, (-1, 32 // bits)).to(torch.int64)
    shifts = torch.arange(32 // bits, device=codes.device) * bits
    words = (fields << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_last(words: Tensor, bits: int) -> Tensor:
    """The inverse of `pack_last`: int32 words -> int32 codes, 32 / b times longer along the last axis."""
    shifts = torch.arange(32 // bits, device=words.device, dtype=torch.int32) * bits
    return ((words[..., None] >> shifts) & (2**bits - 1)).flatten(-2)


def store_kv_kivi_torch(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, k_tail: Tensor,
                        slot_mapping: Tensor, tail_of_block: Tensor, bits: int, group_size: int) -> None:
    """`store_kv_kivi` in torch: the two passes of the module docstring, vectorised over tokens."""
    lay = layout_of(k_cache, v_cache, k_tail, tail_of_block, bits, group_size)
    k, v, slots = _check_rows(k, v, slot_mapping, lay, k_cache)
    G, bs, n = lay.group_size, lay.block_size, k.shape[0]
    slots = slots.long()
    kw, ks, kz = lay.key_views(k_cache)
    vw, vs, vz = lay.value_views(v_cache)
    # pass 1: the groups completed by this step's tokens
    ends = torch.nonzero((slots >= 0) & (slots % G == G - 1)).flatten()
    if ends.numel():
        o = torch.arange(G, device=k.device)
        rows = ends[:, None] - (G - 1) + o  # (groups, G): the members' rows, if written this step
        want = slots[ends, None] - (G - 1) + o  # ...and their slots
        new = (rows >= 0) & (slots[rows.clamp(min=0)] == want)
        entry = tail_of_block[slots[ends] // bs].long()
        old = k_tail[entry[:, None], o[None, :]]  # (groups, G, H, D)
        group = torch.where(new[..., None, None], k[rows.clamp(min=0)], old.to(k.dtype))
        codes, scale, zero = quantize_groups(group.movedim(1, -1), bits)  # (groups, H, D, G)
        words = pack_last(codes, bits).movedim(-1, 1)  # (groups, G·b/32, H, D)
        first = slots[ends] - (G - 1)
        blk, off = first // bs, first % bs
        word_rows = off[:, None] // lay.per_word + torch.arange(G // lay.per_word, device=k.device)
        kw[blk[:, None], word_rows] = words
        ks[blk, off // G], kz[blk, off // G] = scale, zero
    # pass 2: values into their slots; keys of groups still open into the tail
    ok = torch.nonzero(slots >= 0).flatten()
    s = slots[ok]
    codes, scale, zero = quantize_groups(v[ok].unflatten(-1, (-1, G)), bits)  # (t, H, D/G, G)
    vw[s // bs, s % bs] = pack_last(codes.flatten(-2), bits)
    vs[s // bs, s % bs], vz[s // bs, s % bs] = scale, zero
    last = ok + (G - 1 - s % G)  # the row that would complete this token's group in this step
    done = (last < n) & (slots[last.clamp(max=n - 1)] == s - s % G + G - 1)
    open_ = ok[~done]
    s = slots[open_]
    k_tail[tail_of_block[s // bs].long(), s % G] = k[open_].to(k_tail.dtype)


class KIVIWindow(NamedTuple):
    """KIVI's 16-bit residual window (§3.3, R = 128 in the paper), kept beside the packed blocks: each
    sequence's newest tokens in a ring of `rows` (>= R + G - 1) 16-bit K and V rows, entry
    `entry[b]` of `k` / `v` (entries, rows, heads_k, head_dim); position p sits in row p % rows. The
    blocks still hold every token's codes (a block's bytes depend on its tokens alone); a decode reads
    values at positions >= max(start[b], L - R) and keys at positions >= max(start[b], (L - R) // G · G)
    from the ring instead (L: the sequence's length): the cache `nano_quant.kv`'s KIVICache holds, where a
    key leaves the window with its whole group. `start[b]`: the first position the sequence wrote into
    its ring (tokens a prefix hit shared were never written there and are read from their codes)."""
    k: Tensor
    v: Tensor
    entry: Tensor  # int32 (batch,)
    start: Tensor  # int32 (batch,)
    residual: int  # R


def window_bounds(window: KIVIWindow, cache_seqlens: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """(first key position, first value position) each sequence reads from its window."""
    lens, start = cache_seqlens.long(), window.start.long()
    old = (lens - window.residual).clamp(min=0)
    return torch.maximum(start, old // group_size * group_size), torch.maximum(start, old)


def store_kv_window(k: Tensor, v: Tensor, window: KIVIWindow, window_slot: Tensor) -> None:
    """Write new rows k, v (..., heads_k, head_dim) into the window's rings: row i to flat ring row
    window_slot[i] = entry · rows + position % rows (every slot valid: padding goes to a scratch entry).
    One index_copy_ each, no host sync: CUDA-graph safe."""
    heads, dim = window.k.shape[-2:]
    for ring, x in ((window.k, k), (window.v, v)):
        ring.view(-1, heads, dim).index_copy_(0, window_slot, x.reshape(-1, heads, dim).to(ring.dtype))


def overlay_window(k: Tensor, v: Tensor, table: Tensor, window: KIVIWindow, cache_seqlens: Tensor,
                   group_size: int) -> None:
    """Put the window's rows over the dequantized pages of `dequantize_kivi_pages` (in place)."""
    bs, rows = k.shape[1], window.k.shape[1]
    key_lo, value_lo = window_bounds(window, cache_seqlens, group_size)
    lens = cache_seqlens.long()
    pos = (lens[:, None] - 1 - torch.arange(rows, device=k.device)[None, :])  # the newest `rows`
    entry = window.entry.long()[:, None]
    for x, ring, lo in ((k, window.k, key_lo), (v, window.v, value_lo)):
        live = (pos >= lo[:, None]) & (pos >= 0)
        at = pos.clamp(min=0)
        page = torch.where(live, table.long().gather(1, at // bs), x.shape[0] - 1)
        x[page, torch.where(live, at % bs, 0)] = torch.where(
            live[..., None, None], ring[entry, at % rows].to(x.dtype), x[page, at % bs])


def dequantize_kivi_pages(k_cache: Tensor, v_cache: Tensor, k_tail: Tensor, block_table: Tensor,
                          cache_seqlens: Tensor, tail_of_block: Tensor, bits: int, group_size: int,
                          dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The K/V that sequences b (block_table (B, W), cache_seqlens (B,)) read, as 16-bit pages: codes ·
    scale + zero in fp32, cast to `dtype`, and each sequence's last partial key group from the tail.
    Returns (k, v, table): (B·W + 1, block_size, heads, head_dim) caches and the (B, W) table into them
    (page B·W is scratch). Fixed shapes, no host sync: usable inside a CUDA graph."""
    lay = layout_of(k_cache, v_cache, k_tail, tail_of_block, bits, group_size)
    B, W = block_table.shape
    G, bs = lay.group_size, lay.block_size
    blocks = torch.cat([block_table.reshape(-1).long(), block_table.new_zeros(1).long()])
    kw, ks, kz = (t[blocks] for t in lay.key_views(k_cache))
    codes = unpack_last(kw.movedim(1, -1), bits).movedim(-1, 1)  # (n, bs, H, D)
    scale, zero = (t.float().repeat_interleave(G, 1) for t in (ks, kz))
    k = (codes.float() * scale + zero).to(dtype)
    vw, vs, vz = (t[blocks] for t in lay.value_views(v_cache))
    scale, zero = (t.float().repeat_interleave(G, -1) for t in (vs, vz))
    v = (unpack_last(vw, bits).float() * scale + zero).to(dtype)
    # the residual: keys [L // G · G, L) of each sequence, rows 0.. of its tail entry
    lens = cache_seqlens.long()
    nk = lens // G * G
    o = torch.arange(G, device=k.device)
    pos = nk[:, None] + o  # (B, G)
    live = pos < lens[:, None]
    col = (nk // bs).clamp(max=W - 1)
    entry = tail_of_block[block_table.gather(1, col[:, None].to(block_table.dtype))[:, 0].long()]
    page = torch.where(live, torch.arange(B, device=k.device)[:, None] * W + pos // bs, B * W)
    row = torch.where(live, pos % bs, 0)
    k[page, row] = k_tail[entry.long()[:, None], o[None, :]].to(dtype)
    table = torch.arange(B * W, device=k.device, dtype=torch.int32).view(B, W)
    return k, v, table


def _check_rows(k: Tensor, v: Tensor, slot_mapping: Tensor, lay: KIVILayout, cache: Tensor):
    """New rows k, v (..., heads, head_dim) -> (tokens, heads, head_dim); slot_mapping one per row."""
    want = (lay.heads, lay.head_dim)
    for name, t in (("k", k), ("v", v)):
        if (not isinstance(t, Tensor) or t.dtype not in DTYPES or tuple(t.shape[-2:]) != want
                or t.device != cache.device):
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else t
            raise ValueError(f"{name} must be a fp16/bf16/fp32 (..., {want[0]}, {want[1]}) tensor on "
                             f"{cache.device} like the cache, got {got}")
    k, v = k.reshape(-1, *want), v.reshape(-1, *want)
    if (not isinstance(slot_mapping, Tensor) or slot_mapping.shape != (k.shape[0],)
            or slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.device != cache.device
            or v.shape != k.shape):
        got = (f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
               if isinstance(slot_mapping, Tensor) else type(slot_mapping).__name__)
        raise ValueError(f"slot_mapping must be an int32/int64 ({k.shape[0]},) tensor on the cache's "
                         f"device, one slot per row of k (and v, shaped like k); got {got}")
    return k, v, slot_mapping


def kivi_attention_torch(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_tail: Tensor,
                         cache_seqlens: Tensor, block_table: Tensor, tail_of_block: Tensor, bits: int,
                         group_size: int, softmax_scale: float | None = None, causal: bool = False,
                         return_lse: bool = False, window: KIVIWindow | None = None):
    """`flash_attn_with_kivi_cache` in torch: the pages dequantized (the window's rows over them), then
    the 16-bit reference."""
    from .reference import flash_attn_with_kvcache_torch

    k, v, table = dequantize_kivi_pages(k_cache, v_cache, k_tail, block_table, cache_seqlens,
                                        tail_of_block, bits, group_size, q.dtype)
    if window is not None:
        overlay_window(k, v, table, window, cache_seqlens, group_size)
    return flash_attn_with_kvcache_torch(q, k, v, cache_seqlens, block_table=table,
                                         softmax_scale=softmax_scale, causal=causal,
                                         return_lse=return_lse)


# ----------------------------------------------------------------------------------------- dispatch
def _on_triton(t: Tensor) -> bool:
    from . import use_triton

    return use_triton(t)


def store_kv_kivi(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, k_tail: Tensor,
                  slot_mapping: Tensor, tail_of_block: Tensor, bits: int, group_size: int) -> None:
    """Write new K/V rows (..., heads, head_dim) into a KIVI paged cache (module docstring): row i is
    token slot_mapping[i] = block · block_size + offset (negative: skipped). Values are quantized per
    token now; a key waits in k_tail (entry tail_of_block[block], row offset % G) until the row that
    ends its group is written, which quantizes the group. Triton on CUDA tensors (no host sync: CUDA-graph
    safe), torch elsewhere."""
    if _on_triton(k):
        from .kv_kivi import store_kv_kivi_triton as impl
    else:
        impl = store_kv_kivi_torch
    impl(k, v, k_cache, v_cache, k_tail, slot_mapping, tail_of_block, bits, group_size)


def flash_attn_with_kivi_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_tail: Tensor,
                               cache_seqlens: Tensor, block_table: Tensor, tail_of_block: Tensor,
                               bits: int, group_size: int, softmax_scale: float | None = None,
                               num_splits: int = 0, causal: bool = False, return_lse: bool = False,
                               window: KIVIWindow | None = None):
    """Decode attention (Flash-Decoding) of q (batch, seqlen_q, heads_q, head_dim) over a KIVI paged cache
    (block_table (batch, pages) int32, cache_seqlens (batch,) int32): the arguments and returns of
    `flash_attn_with_kvcache`, the cache as `store_kv_kivi` writes it, and with `window` the newest
    tokens from its 16-bit rings (`KIVIWindow`). Triton on CUDA tensors (packed codes dequantized in
    registers, fp32 sums), torch elsewhere."""
    if window is not None:
        check_window(window, q, k_tail)
    if _on_triton(q):
        from .kv_kivi import flash_attn_with_kivi_cache_triton

        return flash_attn_with_kivi_cache_triton(q, k_cache, v_cache, k_tail, cache_seqlens, block_table,
                                                 tail_of_block, bits, group_size, softmax_scale,
                                                 num_splits, causal, return_lse, window=window)
    return kivi_attention_torch(q, k_cache, v_cache, k_tail, cache_seqlens, block_table, tail_of_block,
                                bits, group_size, softmax_scale, causal, return_lse, window)


def check_window(window: KIVIWindow, q: Tensor, k_tail: Tensor) -> None:
    """A KIVIWindow that fits q (batch) and the cache (heads_k, head_dim, the tail's group size)."""
    batch, G = q.shape[0], k_tail.shape[1]
    heads, dim = k_tail.shape[-2:]
    ok = (isinstance(window, KIVIWindow) and isinstance(window.residual, int) and window.residual >= 0
          and window.k.shape == window.v.shape and window.k.dim() == 4
          and tuple(window.k.shape[2:]) == (heads, dim) and window.k.shape[1] >= window.residual + G - 1
          and window.k.device == q.device and all(
              t.dtype == torch.int32 and t.shape == (batch,) and t.device == q.device
              for t in (window.entry, window.start)))
    if not ok:
        raise ValueError(f"window must be a KIVIWindow: k, v (entries, rows >= residual + "
                         f"{G - 1}, {heads}, {dim}) on q's device, entry and start int32 ({batch},), "
                         f"residual an int >= 0; got {window!r:.300}")
