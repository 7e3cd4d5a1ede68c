"""The FP8 KV cache in the kernels (vLLM's kv_cache_dtype="fp8"): `store_kv_fp8` against nano_quant.kv's
`quantize_fp8` bit for bit, and Flash-Decoding / the paged prefill reading E4M3 blocks against torch
attention in fp64 over nano_quant.kv's `dequantize_fp8` of the same cache. On a CPU the kernels run under
TRITON_INTERPRET=1 (16-wide tiles, fp16 and fp32 queries: the interpreter has no bf16); the `gpu` tests
add bf16 queries, every head_dim and 128k keys.

The tolerance (`fp8_tolerance`) is derived from the kernels' arithmetic, not fitted. The codes are exact
in q's dtype and the reference sees the same values (code * scale), so the error comes from:
  * P rounded to q's dtype before P V (unit roundoff u_q): each weight moves by a factor (1 ± u_q), the
    output (a convex combination of V rows) by at most u_q max|V|;
  * the output written in q's dtype: u_q max|O|;
  * scores summed over head_dim in fp32, then scaled and exponentiated: |ds| <= (D + 8) 2^-24 s_max with
    s_max = max over (query, key) of scale sum_d |q_d k_d|; a score error d moves a softmax weight by a
    factor exp(d - mean d), the output by at most 2 |ds| max|V|;
  * acc and l summed across T key tiles (and BLOCK_N rows inside a tile) in fp32, rescaled as the max
    grows: (T + 2 BLOCK_N + 8) 2^-24 relative, each, on max|V|.
A kernel that summed in fp16 / bf16 (vLLM's long-context bug) misses this by orders of magnitude at 64k
keys (`test_fp8_decode_long_contraction_matches_fp64`).
"""

from __future__ import annotations

import math

import pytest
import torch

import nano_flashattn as fa
from nano_flashattn.checks import HEAD_DIMS, cdiv
from nano_flashattn.configs import decode_config
from nano_flashattn.decode import decode_forward

# the reference quantizer is nano_quant's (a fork of nano_flashattn alone skips these tests)
kv = pytest.importorskip("nano_quant.kv", reason="the FP8 reference is nano_quant.kv")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
EPS32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: EPS32}


def _values(*shape, gen, per_head_spread=True):
    """K/V-like values: a few outlier channels (KIVI §3.2's keys), heads of different magnitudes."""
    x = torch.randn(*shape, generator=gen)
    x[..., ::16] *= 6.0
    if per_head_spread:
        x = x * 2.0 ** torch.arange(shape[-2]).view(-1, 1)
    return x


def _scales(x, per_head):
    return kv.fp8_scale(x.reshape(-1, *x.shape[-2:]), per_head=per_head)


def _fp8_cache(lens, page, hk, d, per_head, gen, device=DEVICE):
    """A paged FP8 cache written by nano_quant.kv.quantize_fp8 (pages in shuffled order, spare pages),
    its scales, block table, and its values dequantized in fp64 by nano_quant.kv."""
    max_pages = max(max(cdiv(n, page) for n in lens), 1)
    num_pages = len(lens) * max_pages + 3
    table = torch.randperm(num_pages, generator=gen)[: len(lens) * max_pages].view(len(lens), -1)
    kvals, vvals = (_values(num_pages, page, hk, d, gen=gen) for _ in range(2))
    ks, vs = _scales(kvals, per_head), _scales(vvals, per_head)
    kc, vc = kv.quantize_fp8(kvals, ks), kv.quantize_fp8(vvals, vs)
    kd, vd = kv.dequantize_fp8(kc, ks, torch.float64), kv.dequantize_fp8(vc, vs, torch.float64)
    to = dict(device=device)
    return (kc.to(**to), vc.to(**to), ks.to(**to), vs.to(**to), table.to(torch.int32).to(**to),
            kd.to(**to), vd.to(**to))


def fp8_tolerance(q, k, v, out, n_keys, block_n, scale):
    """The bound of the module docstring for out = attention(q, k, v) over n_keys keys in block_n tiles
    (k, v: the dequantized keys and values the sequences read, any layout (..., head_dim))."""
    u = UNIT_ROUNDOFF[q.dtype]
    qa, ka = q.double().abs().reshape(-1, q.shape[-1]), k.double().abs().reshape(-1, k.shape[-1])
    s_max = scale * (qa @ ka.T).max().item() if ka.numel() else 0.0
    v_max = v.double().abs().max().item() if v.numel() else 0.0
    tiles = cdiv(max(n_keys, 1), block_n)
    relative = u + 2 * (q.shape[-1] + 8) * EPS32 * s_max + 2 * (tiles + 2 * block_n + 8) * EPS32
    return v_max * relative + u * out.double().abs().max().item() + 1e-9


def _check(name, ours, ref, tol):
    assert not torch.isnan(ours).any(), f"{name}: NaN (an unwritten element?)"
    ours, ref = ours.double(), ref.double()
    same_inf = torch.isinf(ref) & (ours == ref)  # the LSE of a query that sees no key: -inf
    err = torch.where(same_inf, 0.0, ours - ref).abs().max().item() if ours.numel() else 0.0
    assert err <= tol, f"{name}: error {err:.3g} > derived tolerance {tol:.3g}"


def _compare_decode(lens, seqlen_q, hq, hk, d, dtype, page, num_splits, causal, per_head, seed=0,
                    device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, ks, vs, table, kd, vd = _fp8_cache(lens, page, hk, d, per_head, gen, device)
    q = torch.randn(len(lens), seqlen_q, hq, d, generator=gen).to(device=device, dtype=dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    kw = dict(block_table=table, num_splits=num_splits, causal=causal, return_lse=True)
    out, lse = fa.flash_attn_with_kvcache_triton(q, kc, vc, seqlens, k_scale=ks, v_scale=vs, **kw)
    ro, rl = fa.flash_attn_with_kvcache_torch(q.double(), kd, vd, seqlens, **kw)
    block_n = decode_config(d, dtype, q.device, True)[0]
    tol = fp8_tolerance(q, kd, vd, ro, max(lens), block_n, d**-0.5)
    _check("out", out, ro, tol)
    # the LSE is a log of sums of the same weights: its error is the scores' (no V, no output rounding)
    lse_tol = fp8_tolerance(q, kd, torch.ones(1), torch.zeros(1), max(lens), block_n, d**-0.5)
    _check("lse", lse, rl, lse_tol)
    return out


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_store_fp8_bit_for_bit(per_head, d):
    """Codes equal nano_quant.kv.quantize_fp8's: clamped past ±448 · scale, E4M3's subnormals, ties
    (round half to even), -0; untouched slots keep their bytes, a negative slot is skipped."""
    gen = torch.Generator().manual_seed(d)
    page, hk, blocks = 16, 2, 6
    tokens = 40
    k, v = (_values(tokens, hk, d, gen=gen) for _ in range(2))
    # powers of two (exact ties below; amax up to 1.4x past 448 * scale: clamped), V's too small
    ks, vs = (torch.exp2(torch.log2(_scales(x, per_head)).round()) for x in (k, v))
    vs = vs * 0.5
    k[0, 0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e-3, -7e-4, 1e9, -1e9])
    # a quotient halfway between two neighbouring E4M3 values (ties go to the even code)
    grid = torch.arange(1, 120, dtype=torch.uint8).view(FP8).float()
    k[1, 0, : d // 2] = ((grid[: d // 2] + grid[1 : d // 2 + 1]) / 2) * ks.reshape(-1)[0]
    slots = torch.randperm(blocks * page, generator=gen)[:tokens]
    slots[5] = -1
    for store in (fa.store_kv_fp8_triton, fa.store_kv_fp8_torch):
        kc = torch.full((blocks, page, hk, d), 0x11, dtype=torch.uint8).view(FP8)
        vc = kc.clone()
        store(k, v, kc, vc, slots, ks, vs)
        for cache, x, s in ((kc, k, ks), (vc, v, vs)):
            rows = cache.view(-1, hk, d).view(torch.uint8)
            keep = slots >= 0
            want = kv.quantize_fp8(x, s).view(torch.uint8)
            assert torch.equal(rows[slots[keep]], want[keep]), store.__name__
            untouched = torch.ones(blocks * page, dtype=torch.bool)
            untouched[slots[keep]] = False
            assert (rows[untouched] == 0x11).all(), store.__name__


def test_store_fp8_takes_engine_shapes():
    """nano_vllm's K/V come as (1, tokens, heads, dim) or (batch, 1, heads, dim), int64 slots, a view of
    the (2, layers, blocks, block_size, heads, dim) pool; per-tensor scales as 0-dim tensors."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.zeros(2, 2, 5, 16, 2, 32, dtype=FP8)
    k, v = (torch.randn(1, 9, 2, 32, generator=gen).half() for _ in range(2))
    ks, vs = torch.tensor(0.01), torch.tensor(0.02)
    slots = torch.arange(9, dtype=torch.int64) + 20
    fa.store_kv_fp8_triton(k, v, pool[0, 1], pool[1, 1], slots, ks, vs)
    assert torch.equal(pool[0, 1].view(-1, 2, 32)[slots].view(torch.uint8),
                       kv.quantize_fp8(k[0], ks).view(torch.uint8))
    assert torch.equal(pool[1, 1].view(-1, 2, 32)[slots].view(torch.uint8),
                       kv.quantize_fp8(v[0], vs).view(torch.uint8))
    assert not pool[:, 0].view(torch.uint8).any()  # the other layer untouched


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_fp8_decode(num_splits, d):
    # a length-0 cache, a partial last page (37, 70), a whole one (48), GQA 4, per-head scales
    _compare_decode([0, 37, 70, 48], 1, 8, 2, d, torch.float16, 16, num_splits, True, True)


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_decode_fp32_queries_and_per_tensor_scales(per_head):
    # fp32 queries: full-precision products, u_q = 2^-24; 8 slices over 200 keys (each slice whole tiles)
    _compare_decode([5, 200, 33], 1, 4, 2, 64, torch.float32, 32, 8, True, per_head, seed=1)


def test_fp8_decode_multi_token_causal_mqa():
    # 3 new tokens of 8 query heads on one kv head (24 tile rows), causal, page 16, 4 slices
    _compare_decode([3, 45, 100], 3, 8, 1, 128, torch.float16, 16, 4, True, True, seed=2)


def test_fp8_decode_contiguous_cache():
    gen = torch.Generator().manual_seed(4)
    kvals, vvals = (_values(2, 50, 2, 64, gen=gen) for _ in range(2))
    ks, vs = _scales(kvals, True), _scales(vvals, False)
    kc, vc = kv.quantize_fp8(kvals, ks), kv.quantize_fp8(vvals, vs)
    q = torch.randn(2, 1, 4, 64, generator=gen).half()
    lens = torch.tensor([50, 17], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache_triton(q, kc, vc, lens, k_scale=ks, v_scale=vs, num_splits=2)
    kd, vd = kv.dequantize_fp8(kc, ks, torch.float64), kv.dequantize_fp8(vc, vs, torch.float64)
    ref = fa.flash_attn_with_kvcache_torch(q.double(), kd, vd, lens)
    _check("out", out, ref, fp8_tolerance(q, kd, vd, ref, 50, 16, 64**-0.5))


@pytest.mark.parametrize("d", [64, 128])
def test_fp8_paged_prefill(d):
    """forward.py's kernel reading an FP8 paged cache: chunks of 1, 7, 0 and 12 new tokens over 5, 40, 16
    and 33 keys (causal, bottom-right aligned), against the fp64 reference."""
    gen = torch.Generator().manual_seed(d + 1)
    lens_q, lens_k = [1, 7, 0, 12], [5, 40, 16, 33]
    kc, vc, ks, vs, table, kd, vd = _fp8_cache(lens_k, 16, 2, d, True, gen)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, d, generator=gen).half()
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out, lse = fa.flash_attn_varlen_func_triton(q, kc, vc, *args, causal=True, block_table=table,
                                                return_lse=True, k_scale=ks, v_scale=vs)
    ro, rl = fa.flash_attn_varlen_func_torch(q.double(), kd, vd, *args, causal=True,
                                             block_table=table, return_lse=True)
    _check("out", out, ro, fp8_tolerance(q, kd, vd, ro, max(lens_k), 16, d**-0.5))
    _check("lse", lse, rl, fp8_tolerance(q, kd, torch.ones(1), torch.zeros(1), 40, 16, d**-0.5))


def test_fp8_torch_path_and_dispatch():
    """On CPU tensors the plain names run the torch references, which dequantize the cache first."""
    gen = torch.Generator().manual_seed(5)
    kc, vc, ks, vs, table, kd, vd = _fp8_cache([20, 7], 16, 2, 32, False, gen, device="cpu")
    q = torch.randn(2, 1, 4, 32, generator=gen)
    lens = torch.tensor([20, 7], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, kc, vc, lens, block_table=table, k_scale=ks, v_scale=vs)
    ref = fa.flash_attn_with_kvcache_torch(q.double(), kd, vd, lens, block_table=table)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_fp8_decode_long_contraction_matches_fp64():
    """vLLM's long-context FP8 bug: products summed in low precision over a 128k-token contraction took a
    needle-in-a-haystack score from 91% to 13%. 64k keys, near-uniform scores (l ~ 10^5: an fp16
    running sum stalls at 2048) plus a needle holding about half the weight, V's mean far from 0: the
    output must match fp64 within the derived bound. One sequence, one kv head, tiles of 256 keys so the
    interpreter runs 256 tiles (4 slices of 64)."""
    gen = torch.Generator().manual_seed(6)
    n, d, page = 65536, 64, 256
    q = torch.randn(1, 1, 2, d, generator=gen).half()
    kvals = torch.randn(n // page, page, 1, d, generator=gen) * 0.1
    vvals = 1.0 + 0.25 * torch.randn(n // page, page, 1, d, generator=gen)
    needle, q0 = 41_234, q[0, 0, 0].float()
    kvals.view(n, 1, d)[needle, 0] = q0 * (math.log(n) * d**0.5 / q0.dot(q0))  # its score: ln n
    vvals.view(n, 1, d)[needle, 0] = -4.0
    ks, vs = _scales(kvals, False), _scales(vvals, False)
    kc, vc = kv.quantize_fp8(kvals, ks), kv.quantize_fp8(vvals, vs)
    table = torch.randperm(n // page, generator=gen).view(1, -1).to(torch.int32)
    lens = torch.tensor([n], dtype=torch.int32)
    out, _ = decode_forward(q, kc, vc, lens, table, d**-0.5, True, 4, k_scale=ks.reshape(1),
                            v_scale=vs.reshape(1), config=(256, 4, 1))
    kd, vd = kv.dequantize_fp8(kc, ks, torch.float64), kv.dequantize_fp8(vc, vs, torch.float64)
    ref = fa.flash_attn_with_kvcache_torch(q.double(), kd, vd, lens, block_table=table)
    weights = torch.softmax((kd.view(n, d) @ q[0, 0, 0].double()) * d**-0.5, 0)
    assert 0.2 < weights[needle] < 0.9  # the needle matters, and so do the other 65535 keys
    _check("out", out, ref, fp8_tolerance(q, kd, vd, ref, n, 256, d**-0.5))


def test_fp8_bad_inputs_name_the_argument():
    q = torch.randn(1, 1, 4, 32).half()
    kc = torch.zeros(2, 16, 2, 32, dtype=FP8)
    table = torch.zeros(1, 2, dtype=torch.int32)
    one = torch.ones(1)
    call = fa.flash_attn_with_kvcache_triton
    with pytest.raises(ValueError, match="k_cache has dtype torch.float8_e5m2"):
        call(q, kc.to(torch.float8_e5m2), kc.to(torch.float8_e5m2), 3, block_table=table,
             k_scale=one, v_scale=one)
    with pytest.raises(ValueError, match="v_cache has dtype torch.float16 but k_cache is float8"):
        call(q, kc, kc.half(), 3, block_table=table, k_scale=one, v_scale=one)
    with pytest.raises(ValueError, match="k_scale is required"):
        call(q, kc, kc, 3, block_table=table)
    with pytest.raises(ValueError, match="v_scale must be a float32 tensor of 1 .* or 2"):
        call(q, kc, kc, 3, block_table=table, k_scale=one, v_scale=torch.ones(3))
    with pytest.raises(ValueError, match="k_scale must be a float32"):
        call(q, kc, kc, 3, block_table=table, k_scale=one.half(), v_scale=one)
    with pytest.raises(ValueError, match="k_scale must be positive and finite"):
        call(q, kc, kc, 3, block_table=table, k_scale=-one, v_scale=one)
    with pytest.raises(ValueError, match="k_scale / v_scale are for float8_e4m3fn caches"):
        call(q, kc.half(), kc.half(), 3, block_table=table, k_scale=one, v_scale=one)
    with pytest.raises(ValueError, match="k has dtype torch.float8_e4m3fn"):  # FP8 only as a cache
        cu = torch.tensor([0, 1], dtype=torch.int32)
        fa.flash_attn_varlen_func_triton(q[0], kc[0], kc[0], cu, cu, 1, 1, k_scale=one, v_scale=one)
    k = torch.randn(3, 2, 32)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="k_cache must be a float8_e4m3fn"):
        fa.store_kv_fp8_triton(k, k, kc.half(), kc.half(), slots, one, one)
    with pytest.raises(ValueError, match="slot_mapping must be an int32/int64 \\(3,\\)"):
        fa.store_kv_fp8_triton(k, k, kc, kc.clone(), slots[:2], one, one)
    with pytest.raises(ValueError, match="slot_mapping has slot 32"):
        fa.store_kv_fp8_triton(k, k, kc, kc.clone(), slots + 30, one, one)
    with pytest.raises(ValueError, match="k must be a fp16/bf16/fp32 \\(..., 2, 32\\)"):
        fa.store_kv_fp8_triton(k[:, :1], k, kc, kc.clone(), slots, one, one)
    with pytest.raises(ValueError, match="k_scale must be a float32 tensor of 1 .* or 2"):
        fa.store_kv_fp8_triton(k, k, kc, kc.clone(), slots, torch.ones(2, 2), one)


# ----------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gpu_fp8_every_head_dim(d):
    """bf16 queries on the GPU configs, every head_dim the 16-bit kernels take: the store bit for bit,
    Flash-Decoding split and not, one and two new tokens, and the paged prefill."""
    gen = torch.Generator().manual_seed(d)
    k, v = (_values(300, 8, d, gen=gen).cuda() for _ in range(2))
    ks, vs = _scales(k, True), _scales(v, False)
    kc = torch.zeros(40, 16, 8, d, dtype=FP8, device="cuda")
    vc = kc.clone()
    slots = torch.randperm(640, generator=gen)[:300].cuda()
    fa.store_kv_fp8(k.bfloat16(), v.bfloat16(), kc, vc, slots, ks, vs)
    want = kv.quantize_fp8(k.bfloat16(), ks).view(torch.uint8)
    assert torch.equal(kc.view(-1, 8, d)[slots].view(torch.uint8), want)
    lens = [2048, 1, 777]
    _compare_decode(lens, 1, 32, 8, d, torch.bfloat16, 16, 0, True, True, device="cuda")
    _compare_decode(lens, 2, 32, 8, d, torch.bfloat16, 16, 4, True, False, device="cuda")
    gen = torch.Generator().manual_seed(d + 1)
    lens_k = [40, 500]
    kc, vc, ks, vs, table, kd, vd = _fp8_cache(lens_k, 16, 2, d, True, gen, "cuda")
    cu_q = torch.tensor([0, 3, 103], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 40, 540], dtype=torch.int32, device="cuda")
    q = torch.randn(103, 8, d, generator=gen).bfloat16().cuda()
    out = fa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 100, 500, causal=True, block_table=table,
                                    k_scale=ks, v_scale=vs)
    ref = fa.flash_attn_varlen_func_torch(q.double(), kd, vd, cu_q, cu_k, 100, 500, causal=True,
                                          block_table=table)
    _check("prefill", out, ref, fp8_tolerance(q, kd, vd, ref, 500, 128, d**-0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [65536, 131072])
def test_gpu_fp8_decode_long_contraction(n):
    """The 64k / 128k-key contraction on the GPU configs (bf16 queries, paged 16, split by the SM count),
    with a needle holding about half the weight, against fp64."""
    gen = torch.Generator().manual_seed(7)
    d, page = 128, 16
    q = torch.randn(1, 1, 32, d, generator=gen).bfloat16()
    kvals = torch.randn(n // page, page, 8, d, generator=gen) * 0.1
    vvals = 1.0 + 0.25 * torch.randn(n // page, page, 8, d, generator=gen)
    needle, q0 = n - 12_345, q[0, 0, ::4].float()  # each kv head's first query head
    kvals.view(n, 8, d)[needle] = q0 * (math.log(n) * d**0.5 / (q0 * q0).sum(-1, keepdim=True))
    vvals.view(n, 8, d)[needle] = -4.0
    ks, vs = _scales(kvals, True), _scales(vvals, True)
    kc, vc = kv.quantize_fp8(kvals, ks).cuda(), kv.quantize_fp8(vvals, vs).cuda()
    table = torch.randperm(n // page, generator=gen).view(1, -1).to(torch.int32).cuda()
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    out = fa.flash_attn_with_kvcache(q.cuda(), kc, vc, lens, block_table=table, causal=True,
                                     k_scale=ks.cuda(), v_scale=vs.cuda())
    kd = kv.dequantize_fp8(kc, ks.cuda(), torch.float64)
    vd = kv.dequantize_fp8(vc, vs.cuda(), torch.float64)
    ref = fa.flash_attn_with_kvcache_torch(q.double().cuda(), kd, vd, lens, block_table=table)
    block_n = decode_config(d, torch.bfloat16, torch.device("cuda"), True, 8)[0]
    _check("out", out, ref, fp8_tolerance(q.cuda(), kd, vd, ref, n, block_n, d**-0.5))
    assert math.isfinite(out.float().sum().item())


@pytest.mark.gpu
def test_gpu_pdl_decode_reads_fp8_like_the_paper_kernels():
    """layers/pdl.py launches decode.py's kernels wrapped in a wait: the FP8 path's sums too."""
    from nano_flashattn.layers import pdl

    if not pdl.applies(torch.device("cuda")):
        pytest.skip("PDL needs sm_90+ and a Triton with grid dependency control")
    gen = torch.Generator().manual_seed(8)
    kc, vc, ks, vs, table, _, _ = _fp8_cache([3000, 17, 1200], 16, 4, 128, True, gen, "cuda")
    q = torch.randn(3, 1, 16, 128, generator=gen).bfloat16().cuda()
    args = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=torch.tensor([3000, 17, 1200]).int().cuda(),
                block_table=table, scale=128**-0.5, causal=True, num_splits=0,
                k_scale=ks.reshape(-1), v_scale=vs.reshape(-1))
    out, lse = decode_forward(**args)
    out_pdl, lse_pdl = pdl.pdl_decode(**args)
    assert torch.equal(out, out_pdl) and torch.equal(lse, lse_pdl)
