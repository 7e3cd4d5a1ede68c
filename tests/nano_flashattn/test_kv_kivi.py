"""KIVI's 2- and 4-bit KV cache in the kernels (nano_flashattn.kivi, kv_kivi.py): the write against
nano_quant.kv's `quantize` bit for bit (codes, fp16 scales and zeros, the 16-bit open group), and
Flash-Decoding over packed blocks against fp64 attention over nano_quant.kv's `KIVICache` of the same K/V.
On a CPU the kernels run under TRITON_INTERPRET=1 (fp16 and fp32 queries); the `gpu` tests add bf16,
every head_dim the 16-bit decode kernel takes that the group size divides, 128k keys and CUDA graphs.

The decode tolerance (`kivi_tolerance`) is FP8's (test_kv_fp8.py, derived from the kernels' arithmetic:
P rounded to q's dtype, the output's rounding, fp32 sums over head_dim and across tiles) plus the
rounding of each dequantized value into q's dtype: the reference reads code · scale + zero computed in
fp32 and rounded to q's dtype, as the kernel does, but a GPU may fuse the multiply-add and round a value
one unit differently — a relative u_q on K (scores: u_q s_max, twice on the weights) and on V.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nano_flashattn as fa
from nano_flashattn.checks import HEAD_DIMS, cdiv
from nano_flashattn.kivi import (
    KIVILayout,
    KIVIWindow,
    dequantize_kivi_pages,
    flash_attn_with_kivi_cache,
    store_kv_kivi,
    store_kv_kivi_torch,
    store_kv_window,
)
from nano_flashattn.kv_kivi import flash_attn_with_kivi_cache_triton, store_kv_kivi_triton

kv = pytest.importorskip("nano_quant.kv", reason="the KIVI reference is nano_quant.kv")

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: EPS32}


def _values(n, heads, d, gen):
    """K/V-like rows: outlier channels (KIVI §3.2's keys), heads of different magnitudes."""
    x = torch.randn(n, heads, d, generator=gen)
    x[..., ::8] *= 5.0
    return x * 2.0 ** torch.arange(heads).view(-1, 1)


class Cache:
    """A paged KIVI cache: pools, tail, map and block table for sequences of `lens` tokens."""

    def __init__(self, lens, bits, G, bs, heads, d, gen, dtype=torch.float32, device=DEVICE):
        self.lay = KIVILayout(bits, G, bs, heads, d)
        self.bits, self.G, self.bs, self.lens = bits, G, bs, lens
        width = max(max(cdiv(n, bs) for n in lens), 1)
        num_blocks = len(lens) * width + 2
        shape = (num_blocks, bs, heads, self.lay.width)
        self.k_cache = torch.zeros(shape, dtype=torch.uint8, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.k_tail = torch.zeros(len(lens) + 1, G, heads, d, dtype=dtype, device=device)
        self.tail_of_block = torch.full((num_blocks,), len(lens), dtype=torch.int32, device=device)
        perm = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * width]
        self.table = perm.view(len(lens), width).to(torch.int32).to(device)
        self.k = [_values(n, heads, d, gen).to(device, dtype) for n in lens]
        self.v = [_values(n, heads, d, gen).to(device, dtype) for n in lens]
        for b, n in enumerate(lens):  # each sequence's open group: tail entry b
            if n % G:
                self.tail_of_block[self.table[b, (n - n % G) // bs]] = b
        self.seqlens = torch.tensor(lens, dtype=torch.int32, device=device)

    def twin(self):
        """The same sequences, K/V and block table over empty pools."""
        other = copy.copy(self)
        other.k_cache, other.v_cache = torch.zeros_like(self.k_cache), torch.zeros_like(self.v_cache)
        other.k_tail, other.tail_of_block = torch.zeros_like(self.k_tail), self.tail_of_block.clone()
        return other

    def slots(self, b, lo, hi):
        pos = torch.arange(lo, hi, device=self.table.device)
        return self.table[b, pos // self.bs].long() * self.bs + pos % self.bs

    def write(self, store=store_kv_kivi_torch, chunks=None):
        """Every sequence's K/V through `store`, in `chunks` (token counts) or at once."""
        for b, n in enumerate(self.lens):
            lo = 0
            for c in chunks or [n]:
                hi = min(lo + c, n)
                if hi > lo:
                    store(self.k[b][lo:hi], self.v[b][lo:hi], self.k_cache, self.v_cache, self.k_tail,
                          self.slots(b, lo, hi), self.tail_of_block, self.bits, self.G)
                lo = hi
        return self

    def args(self):
        return (self.k_cache, self.v_cache, self.k_tail, self.seqlens, self.table, self.tail_of_block,
                self.bits, self.G)

    def reference(self, dtype):
        """nano_quant.kv's KIVICache (residual 0) of each sequence, dequantized to `dtype` (what the
        kernel reads), as fp64 pages in this cache's block table layout."""
        spec = kv.KVCacheSpec(f"kivi{self.bits}", self.bits, self.G, 0)
        pages = [torch.zeros(self.k_cache.shape[0], self.bs, *self.k[0].shape[1:], dtype=torch.float64,
                             device=self.table.device) for _ in range(2)]
        for b, n in enumerate(self.lens):
            if n == 0:
                continue
            cache = kv.KIVICache(spec)
            cache.append(self.k[b].float(), self.v[b].float())
            pos = torch.arange(n, device=self.table.device)
            for page, x in zip(pages, cache.dequantize()):
                page[self.table[b, pos // self.bs].long(), pos % self.bs] = x.to(dtype).double()
        return pages


def kivi_tolerance(q, k, v, out, n_keys, block_n, scale):
    """FP8's bound (module docstring) plus one unit of q's dtype on every dequantized K and V value."""
    u = UNIT_ROUNDOFF[q.dtype]
    qa, ka = q.double().abs().reshape(-1, q.shape[-1]), k.double().abs().reshape(-1, k.shape[-1])
    s_max = scale * (qa @ ka.T).max().item() if ka.numel() else 0.0
    v_max = v.double().abs().max().item() if v.numel() else 0.0
    tiles = cdiv(max(n_keys, 1), block_n)  # block_n: the smallest tile the kernel may use, 128 the largest
    relative = 2 * u + 2 * (q.shape[-1] + 8) * EPS32 * s_max + 2 * u * s_max
    relative += 2 * (tiles + 2 * 128 + 8) * EPS32
    return v_max * relative + u * out.double().abs().max().item() + 1e-9


def _check(name, ours, ref, tol):
    assert not torch.isnan(ours).any(), f"{name}: NaN (an unwritten element?)"
    ours, ref = ours.double(), ref.double()
    same_inf = torch.isinf(ref) & (ours == ref)
    err = torch.where(same_inf, 0.0, ours - ref).abs().max().item() if ours.numel() else 0.0
    assert err <= tol, f"{name}: error {err:.3g} > derived tolerance {tol:.3g}"


def _compare_decode(cache, q, num_splits, causal, config=None):
    out, lse = flash_attn_with_kivi_cache_triton(q, *cache.args(), num_splits=num_splits, causal=causal,
                                                 return_lse=True, config=config)
    kd, vd = cache.reference(q.dtype)
    ro, rl = fa.flash_attn_with_kvcache_torch(q.double(), kd, vd, cache.seqlens, block_table=cache.table,
                                              causal=causal, return_lse=True)
    block_n = config[0] if config else 16
    d = q.shape[-1]
    keys = torch.cat([kd[cache.table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(cache.lens)])
    vals = torch.cat([vd[cache.table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(cache.lens)])
    _check("out", out, ro, kivi_tolerance(q, keys, vals, ro, max(cache.lens), block_n, d**-0.5))
    lse_tol = kivi_tolerance(q, keys, torch.ones(1), torch.zeros(1), max(cache.lens), block_n, d**-0.5)
    _check("lse", lse, rl, lse_tol)
    return out


# ----------------------------------------------------------------------------------------- the write
@pytest.mark.parametrize("bits, G, d, heads", [(2, 16, 32, 2), (4, 16, 96, 1), (2, 32, 128, 1)])
def test_store_matches_nano_quant_bit_for_bit(bits, G, d, heads):
    """Two sequences written chunk by chunk — chunks that stay inside a group, close one, close one and
    open the next in one step, fill a block exactly — then every closed key group's words, scale and
    zero equal nano_quant.kv.quantize of its G keys (per channel), every value's its per-token codes,
    each open group's keys sit exact in the tail; the torch path writes the same bytes, and so do calls
    that mix both sequences' rows with padding."""
    gen = torch.Generator().manual_seed(bits * 100 + d)
    bs, chunks = 2 * G, [3, G - 3, 1, G + 5, 2 * G - 5, 7]
    lens = [sum(chunks) - 4, G + 1]
    triton_cache = Cache(lens, bits, G, bs, heads, d, gen)
    torch_cache = triton_cache.twin().write(store_kv_kivi_torch, chunks)
    triton_cache.write(store_kv_kivi_triton, chunks)
    assert torch.equal(triton_cache.k_cache, torch_cache.k_cache)
    assert torch.equal(triton_cache.v_cache, torch_cache.v_cache)
    c = triton_cache
    kw, ks, kz = c.lay.key_views(c.k_cache)
    vw, vs, vz = c.lay.value_views(c.v_cache)
    for b, n in enumerate(lens):
        slots = c.slots(b, 0, n)
        blk, off = slots // bs, slots % bs
        words, scale, zero = kv.quantize(c.v[b], bits, G, kv.VALUE_AXIS)
        assert torch.equal(vw[blk, off], words)
        assert torch.equal(vs[blk, off], scale) and torch.equal(vz[blk, off], zero)
        for g in range(n // G):  # closed key groups
            words, scale, zero = kv.quantize(c.k[b][g * G:(g + 1) * G], bits, G, kv.KEY_AXIS)
            s = slots[g * G]
            rows = torch.arange(G // (32 // bits)) + (s % bs) // (32 // bits)
            assert torch.equal(kw[s // bs, rows], words)
            assert torch.equal(ks[s // bs, (s % bs) // G], scale[0])
            assert torch.equal(kz[s // bs, (s % bs) // G], zero[0])
        if n % G:  # the open group, exact in tail entry b
            assert torch.equal(c.k_tail[b, : n % G], c.k[b][n - n % G:])
    if (bits, G) != (2, 16):
        return
    # two sequences in one call, with padding rows (slot -1) between them
    fresh = c.twin()
    rows = [(b, lo, min(lo + 9, n)) for b, n in enumerate(lens) for lo in range(0, n, 9)]
    for i in range(0, len(rows), 3):
        part = rows[i:i + 3]
        k = torch.cat([c.k[b][lo:hi] for b, lo, hi in part] + [c.k[0][:2]])
        v = torch.cat([c.v[b][lo:hi] for b, lo, hi in part] + [c.v[0][:2]])
        slots = torch.cat([c.slots(b, lo, hi) for b, lo, hi in part] + [torch.full((2,), -1)])
        store_kv_kivi_triton(k, v, fresh.k_cache, fresh.v_cache, fresh.k_tail, slots, fresh.tail_of_block,
                             bits, G)
    assert torch.equal(fresh.k_cache, c.k_cache) and torch.equal(fresh.v_cache, c.v_cache)


def test_store_fp16_rows_and_engine_shapes():
    """K/V rows (1, tokens, heads, dim) of fp16, an fp16 tail: the write takes the engine's shapes."""
    gen = torch.Generator().manual_seed(3)
    c = Cache([20], 2, 16, 16, 2, 32, gen, dtype=torch.float16)
    store_kv_kivi(c.k[0][None], c.v[0][None], c.k_cache, c.v_cache, c.k_tail, c.slots(0, 0, 20),
                  c.tail_of_block, 2, 16)
    ref = c.twin().write(store_kv_kivi_triton)
    assert torch.equal(c.k_cache, ref.k_cache) and torch.equal(c.k_tail, ref.k_tail)


# ----------------------------------------------------------------------------------------- the read
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("bits, G, d", [(2, 16, 64), (4, 32, 128)])
def test_kivi_decode(bits, G, d, num_splits):
    """Batches of ragged sequences (one with no closed group, one that ends on a group boundary), GQA."""
    gen = torch.Generator().manual_seed(num_splits + d)
    cache = Cache([75, 16, 5, 2 * G], bits, G, 32, 2, d, gen).write()
    q = torch.randn(4, 1, 4, d, generator=gen).half()
    _compare_decode(cache, q, num_splits, causal=True)


def window_of(cache, residual, starts, rows):
    """A KIVIWindow over `cache`'s sequences: sequence b in entry b, holding its exact K/V from position
    starts[b] on, written by `store_kv_window` one step at a time (a step never wraps its ring)."""
    heads, d = cache.k[0].shape[1:]
    dev, dtype = cache.table.device, cache.k[0].dtype
    n = len(cache.lens)
    rings = [torch.zeros(n + 1, rows, heads, d, dtype=dtype, device=dev) for _ in range(2)]
    win = KIVIWindow(*rings, torch.arange(n, dtype=torch.int32, device=dev),
                     torch.tensor(starts, dtype=torch.int32, device=dev), residual)
    for b, length in enumerate(cache.lens):
        for lo in range(starts[b], length, rows):
            pos = torch.arange(lo, min(lo + rows, length), device=dev)
            store_kv_window(cache.k[b][pos], cache.v[b][pos], win, b * rows + pos % rows)
    return win


@pytest.mark.parametrize("residual, starts", [(40, [0, 0, 0, 0]), (8, [70, 0, 3, 100])])
def test_kivi_decode_reads_the_newest_tokens_from_the_window(residual, starts):
    """KIVI §3.3's residual window beside the blocks: values at positions >= max(start, L - R) and keys
    from max(start, (L - R) // G · G) on (a key leaves the window with its whole group, as in
    nano_quant.kv's KIVICache) are the exact 16-bit rows; older ones their codes. The kernel and the
    torch path against fp64 attention over pages built here from nano_quant.kv's codes and the exact K/V."""
    gen = torch.Generator().manual_seed(residual)
    G = 16
    cache = Cache([75, 16, 5, 2 * G + 3], 2, G, 32, 2, 64, gen).write()
    win = window_of(cache, residual, starts, residual + G)
    q = torch.randn(4, 1, 4, 64, generator=gen).half()
    kd, vd = cache.reference(q.dtype)
    for b, n in enumerate(cache.lens):  # the reference's pages with the window's rows over them
        old = max(n - residual, 0)
        for x, exact, lo in ((kd, cache.k[b], max(starts[b], old // G * G)),
                             (vd, cache.v[b], max(starts[b], old))):
            pos = torch.arange(min(lo, n), n)
            x[cache.table[b, pos // cache.bs].long(), pos % cache.bs] = exact[pos].to(q.dtype).double()
    ref = fa.flash_attn_with_kvcache_torch(q.double(), kd, vd, cache.seqlens, block_table=cache.table,
                                           causal=True)
    tol = kivi_tolerance(q, kd, vd, ref, max(cache.lens), 16, 64**-0.5)
    for out in (flash_attn_with_kivi_cache_triton(q, *cache.args(), num_splits=2, causal=True, window=win),
                flash_attn_with_kivi_cache(q, *cache.args(), causal=True, window=win)):
        _check("out", out, ref, tol)
    plain = flash_attn_with_kivi_cache(q, *cache.args(), causal=True)
    assert (plain.double() - ref).abs().max() > 3 * tol  # the window changed what was read
    with pytest.raises(ValueError, match="window must be a KIVIWindow"):
        flash_attn_with_kivi_cache(q, *cache.args(), window=win._replace(k=win.k[:, :G]))


def test_kivi_decode_fp32_multi_token_causal_mqa():
    """fp32 queries (ieee products), 3 new tokens per sequence (causal, bottom-right), one kv head."""
    gen = torch.Generator().manual_seed(7)
    cache = Cache([70, 33], 2, 32, 32, 1, 32, gen).write()
    q = torch.randn(2, 3, 4, 32, generator=gen)
    _compare_decode(cache, q, 2, causal=True)


def test_kivi_torch_path_and_dispatch():
    """On CPU tensors the plain names run the torch path: pages dequantized, then the 16-bit reference;
    it reads what nano_quant.kv's KIVICache holds."""
    gen = torch.Generator().manual_seed(5)
    cache = Cache([40, 9], 4, 16, 16, 2, 32, gen).write(store_kv_kivi)
    q = torch.randn(2, 1, 4, 32, generator=gen)
    out = flash_attn_with_kivi_cache(q.cpu(), *(a.cpu() if torch.is_tensor(a) else a for a in cache.args()))
    kd, vd = (x.cpu() for x in cache.reference(torch.float32))
    ref = fa.flash_attn_with_kvcache_torch(q.double(), kd, vd, cache.seqlens.cpu(),
                                           block_table=cache.table.cpu())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    k, _, pages = dequantize_kivi_pages(*cache.args()[:3], cache.table, cache.seqlens,
                                        cache.tail_of_block, 4, 16, torch.float32)
    assert pages.shape == cache.table.shape and k.shape[0] == cache.table.numel() + 1


@pytest.mark.slow
def test_kivi_decode_long_contraction_matches_fp64():
    """vLLM's long-context FP8 bug (products summed in low precision over a 128k-token contraction) must
    not happen here: 64k keys, near-uniform scores plus a needle holding about half the weight, V's mean
    far from 0, fp16 queries: the output matches fp64 within the derived bound. Tiles of 256 keys, 4
    slices; the open group of the tail at the end."""
    gen = torch.Generator().manual_seed(6)
    n, d, bs, G = 65536 - 5, 64, 256, 32
    cache = Cache([n], 4, G, bs, 1, d, gen)
    cache.k[0] = torch.randn(n, 1, d, generator=gen) * 0.1
    cache.v[0] = 1.0 + 0.25 * torch.randn(n, 1, d, generator=gen)
    q = torch.randn(1, 1, 2, d, generator=gen).half()
    needle, q0 = 41_234, q[0, 0, 0].float()
    cache.k[0][needle, 0] = q0 * (math.log(n) * d**0.5 / q0.dot(q0))  # its score: ln n
    cache.v[0][needle, 0] = -4.0
    cache.write()
    out = _compare_decode(cache, q, 4, causal=True, config=(256, 4, 1))
    kd = cache.reference(torch.float16)[0][cache.table[0].long()].flatten(0, 1)[:n, 0]
    weights = torch.softmax((kd @ q0.double()) * d**-0.5, 0)
    assert 0.2 < weights[needle] < 0.9 and not torch.isnan(out).any()


def test_kivi_bad_inputs_name_the_argument():
    gen = torch.Generator().manual_seed(8)
    c = Cache([20], 2, 16, 16, 2, 32, gen).write()
    q = torch.randn(1, 1, 4, 32).half()
    args = list(c.args())
    call = flash_attn_with_kivi_cache_triton
    with pytest.raises(ValueError, match="k_cache must be a contiguous uint8"):
        call(q, c.k_cache.half(), *args[1:])
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        call(q, *args[:6], 3, 16)
    with pytest.raises(ValueError, match=r"group_size \(32\) must divide block_size \(16\)"):
        call(q, *args[:7], 32)
    with pytest.raises(ValueError, match="group_size must be a power of two >= 16"):
        call(q, *args[:7], 8)
    with pytest.raises(ValueError, match=r"expected \(entries, 16, 2, head_dim\)"):
        call(q, args[0], args[1], c.k_tail[:, :8].contiguous(), *args[3:])
    with pytest.raises(ValueError, match=r"tail_of_block must be an int32 \(4,\)"):
        call(q, *args[:5], c.tail_of_block.long(), 2, 16)
    with pytest.raises(ValueError, match="head_dim must be the cache's"):
        call(torch.randn(1, 1, 4, 64).half(), *args)
    with pytest.raises(ValueError, match="cache_seqlens must be an int or an int32"):
        call(q, *args[:3], c.seqlens.long(), *args[4:])
    with pytest.raises(ValueError, match="block_table points outside the cache"):
        call(q, *args[:4], c.table + 5, *args[5:])
    with pytest.raises(ValueError, match="cache_seqlens has lengths"):
        call(q, *args[:3], c.seqlens + 20, *args[4:])
    k = torch.randn(3, 2, 32)
    with pytest.raises(ValueError, match="slot_mapping must be an int32/int64 \\(3,\\)"):
        store_kv_kivi_triton(k, k, *args[:3], torch.arange(2), c.tail_of_block, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping has slot 64, the cache has 64 slots"):
        store_kv_kivi_triton(k, k, *args[:3], torch.arange(3) + 62, c.tail_of_block, 2, 16)
    with pytest.raises(ValueError, match=r"k must be a fp16/bf16/fp32 \(..., 2, 32\)"):
        store_kv_kivi_triton(k[:, :1], k, *args[:3], torch.arange(3), c.tail_of_block, 2, 16)
    with pytest.raises(ValueError, match=r"head_dim \(24\) must be a multiple of group_size \(16\)"):
        KIVILayout(2, 16, 16, 1, 24) and fa.kivi.check_kivi_spec(2, 16, 24)


_COMPILE = """
import sys
import torch
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nano_flashattn import kv_kivi

def build(kernel, pointers, ints, consts, **options):
    sig = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(consts, "constexpr")}
    if "qk_scale" in sig:
        sig["qk_scale"] = "fp32"
    triton_compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options=options)


strides = lambda *names: [f"stride_{n}" for n in names]
for config in sys.argv[1:]:  # "bits,head_dim,dtype", each compiled in turn, its ptxas log after its name
  bits, d, dtype = int(config.split(",")[0]), int(config.split(",")[1]), config.split(",")[2]
  print("config", config, flush=True)
  G, BS, BD = 32, 32, max(16, 1 << (d - 1).bit_length())
  block_n, warps, stages = kv_kivi.kivi_decode_config(d, getattr(torch, dtype), torch.device("cuda"), bits)
  ty = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
  store = dict(HEAD_DIM=d, BLOCK_D=BD, G=G, BS=BS, BITS=bits)
  codes = {"KW": "*i32", "KS": "*fp16", "KZ": "*fp16"}
  build(kv_kivi._key_groups, {"K": f"*{ty}", **codes, "Tail": f"*{ty}", "slot_mapping": "*i64",
        "tail_of_block": "*i32"}, strides("kt", "kh", "wb", "wr", "wh", "sb", "sg", "sh", "te", "tr", "th"),
        store, num_warps=4)
  build(kv_kivi._store_values, {"K": f"*{ty}", "V": f"*{ty}", "VW": "*i32", "VS": "*fp16", "VZ": "*fp16",
        "Tail": f"*{ty}", "slot_mapping": "*i64", "tail_of_block": "*i32"},
        ["num_tokens", *strides("kt", "kh", "vt", "vh", "wb", "wt", "wh", "sb", "st", "sh", "te", "tr", "th")],
        store, num_warps=4)
  build(kv_kivi._kivi_decode_split_kernel,
        {"Q": f"*{ty}", **codes, "VW": "*i32", "VS": "*fp16", "VZ": "*fp16", "Tail": f"*{ty}", "Out": "*fp32",
         "LSE": "*fp32", "cache_seqlens": "*i32", "block_table": "*i32", "tail_of_block": "*i32",
         "WinK": f"*{ty}", "WinV": f"*{ty}", "win_entry": "*i32", "win_start": "*i32"},
        ["residual", "ring_rows", "stride_we", "stride_wr", "stride_wh", "seqlen_q", "group", "qk_scale",
         "window_right",
         *strides("qb", "qt", "qh", "kwb", "kwr", "kwh", "ksb", "ksg", "ksh", "vwb", "vwt", "vsb", "vst",
                  "te", "tr", "th", "bt", "ob", "ot", "oh", "os", "lb", "lt", "lh", "ls")],
        dict(HEAD_DIM=d, BLOCK_D=BD, BLOCK_M=16, BLOCK_N=block_n, PAGE_SIZE=BS, G=G, BITS=bits,
             DOT_PRECISION="ieee" if dtype == "float32" else "tf32", WINDOW=True), num_warps=warps,
        num_stages=stages)
print("compiled")
"""


SM90_CONFIGS = [(2, 128, "bfloat16"), (4, 128, "bfloat16"), (4, 64, "float16"), (2, 256, "bfloat16"),
                (4, 128, "float32")]


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    """The three kernels compiled for sm_90 with the installed Triton, no GPU needed, at
    `kivi_decode_config`'s tiles: a Triton construct the interpreter takes and the compiler does not
    fails here, and ptxas must not spill (a dequantized fp32 tile is register-hungry) — except the decode
    kernel's 2-bit hd 128 tile, which spills and was measured faster than the tiles that do not
    (`kivi_decode_config`). Every config in one process of its own: this one imported Triton under
    TRITON_INTERPRET=1."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DUMP_PTXAS_LOG="1", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _COMPILE, *(",".join(map(str, c)) for c in SM90_CONFIGS)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
    logs = done.stdout.split("config ")[1:]  # one per config, in order
    assert [log.split()[0] for log in logs] == [",".join(map(str, c)) for c in SM90_CONFIGS]
    for config, log in zip(SM90_CONFIGS, logs):
        reports = [line for line in log.splitlines() if "spill" in line]
        assert len(reports) == 3, (config, log[-3000:])  # ptxas's line for each of the three kernels
        spills = [line for line in reports if " 0 bytes spill" not in line]
        assert len(spills) == (config == (2, 128, "bfloat16")), (config, log[-3000:])


# ----------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("d", [x for x in HEAD_DIMS if x % 32 == 0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kivi_every_head_dim(d, dtype):
    """The compiled kernels: the write bit for bit against the torch path (fp32 quotients by div_rn,
    half-to-even rounding), then decode in bf16 / fp16 for every head_dim a group of 32 divides."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(d)
    ours = Cache([300, 77, 32, 1], 2, 32, 64, 2, d, gen, dtype=dtype, device="cuda")
    ref = ours.twin()
    ours.write(store_kv_kivi_triton, [5, 59, 1, 100, 200]), ref.write(store_kv_kivi_torch, [64, 300])
    assert torch.equal(ours.k_cache, ref.k_cache) and torch.equal(ours.v_cache, ref.v_cache)
    q = torch.randn(4, 1, 8, d, generator=gen).to("cuda", dtype)
    _compare_decode(ours, q, 0, causal=True, config=None)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [65536, 131072])
def test_gpu_kivi_decode_long_contraction(n):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(n)
    cache = Cache([n - 7], 2, 32, 32, 8, 128, gen, dtype=torch.bfloat16, device="cuda").write()
    q = torch.randn(1, 1, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    _compare_decode(cache, q, 0, causal=True)


@pytest.mark.gpu
def test_gpu_kivi_write_and_decode_in_a_cuda_graph():
    """The engine's decode step: the write and the read captured in one CUDA graph (no host sync), then
    replayed on new rows, equals the eager calls."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(9)
    c = Cache([60, 31], 2, 32, 32, 2, 128, gen, dtype=torch.bfloat16, device="cuda").write()
    eager = c.twin()
    for name in ("k_cache", "v_cache", "k_tail"):
        getattr(eager, name).copy_(getattr(c, name))
    k, v = (torch.randn(2, 2, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    q = torch.randn(2, 1, 4, 128, generator=gen).to("cuda", torch.bfloat16)
    slots = torch.stack([c.slots(0, 60, 61), c.slots(1, 31, 32)]).flatten()
    lens = c.seqlens + 1

    def step(x):
        store_kv_kivi_triton(k, v, x.k_cache, x.v_cache, x.k_tail, slots, x.tail_of_block, 2, 32)
        return flash_attn_with_kivi_cache_triton(q, x.k_cache, x.v_cache, x.k_tail, lens, x.table,
                                                 x.tail_of_block, 2, 32, causal=True)

    step(c)  # compile outside the capture
    c.k_tail.copy_(eager.k_tail), c.k_cache.copy_(eager.k_cache), c.v_cache.copy_(eager.v_cache)
    graph = torch.cuda.CUDAGraph()
    with fa.trusted_metadata(), torch.cuda.graph(graph):
        out = step(c)
    graph.replay()
    want = step(eager)
    assert torch.equal(out, want) and torch.equal(c.k_cache, eager.k_cache)
