"""flash_attn_varlen_func (packed batches, paged K/V) and flash_attn_with_kvcache (Flash-Decoding),
Triton against the fp64 reference with FlashAttention's error rule."""

from __future__ import annotations

import pytest
import torch

import nano_flashattn as fa
from nano_flashattn.checks import HEAD_DIMS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cu(lens, device=DEVICE):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _rand(*shape, dtype, device=DEVICE, gen=None):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _paged_cache(lens, page, hk, d, dtype, device, gen):
    """A paged cache whose pages are handed out in shuffled order, plus spare pages of junk."""
    max_pages = max(max(-(-n // page) for n in lens), 1)
    num_pages = len(lens) * max_pages + 3
    table = torch.randperm(num_pages, generator=gen)[: len(lens) * max_pages].view(len(lens), max_pages)
    k = _rand(num_pages, page, hk, d, dtype=dtype, device=device, gen=gen)
    v = _rand(num_pages, page, hk, d, dtype=dtype, device=device, gen=gen)
    return k, v, table.to(device=device, dtype=torch.int32)


def _compare_varlen(
    fa_check, lens_q, lens_k, hq, hk, d, dtype, causal, page=None, backward=True, device=DEVICE
):
    gen = torch.Generator().manual_seed(1)
    cu_q, cu_k = _cu(lens_q, device), _cu(lens_k, device)
    q = _rand(sum(lens_q), hq, d, dtype=dtype, device=device, gen=gen)
    table = None
    if page is None:
        k = _rand(sum(lens_k), hk, d, dtype=dtype, device=device, gen=gen)
        v = _rand(sum(lens_k), hk, d, dtype=dtype, device=device, gen=gen)
    else:
        k, v, table = _paged_cache(lens_k, page, hk, d, dtype, device, gen)
        backward = False
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    kw = dict(causal=causal, block_table=table, return_lse=True)
    qq, kk, vv = (t.clone().requires_grad_(backward) for t in (q, k, v))
    out, lse = fa.flash_attn_varlen_func_triton(qq, kk, vv, *args, **kw)
    ref = [t.double().requires_grad_(backward) for t in (q, k, v)]
    low = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    ro, rl = fa.flash_attn_varlen_func_torch(*ref, *args, **kw)
    lo, ll = fa.flash_attn_varlen_func_torch(*low, *args, **kw)
    fa_check("out", out, lo, ro)
    fa_check("lse", lse, ll, rl)
    if backward:
        do = _rand(*q.shape, dtype=dtype, device=device, gen=gen)
        ours = torch.autograd.grad(out, (qq, kk, vv), do)
        r = torch.autograd.grad(ro, ref, do.double())
        lw = torch.autograd.grad(lo, low, do)
        for name, a, b, c in zip(("dq", "dk", "dv"), ours, lw, r):
            fa_check(name, a, b, c)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_fwd_bwd(fa_check, causal):
    # empty and length-1 sequences on both sides, q longer and shorter than k
    _compare_varlen(fa_check, [0, 1, 17, 5, 3], [3, 1, 20, 9, 0], 4, 2, 32, torch.float16, causal)


@pytest.mark.parametrize("page", [16, 32])
def test_varlen_paged_kv(fa_check, page):
    _compare_varlen(fa_check, [1, 7, 0, 12], [5, 40, 16, 33], 8, 2, 32, torch.float16, True, page=page)


@pytest.mark.parametrize("d,dtype", [(40, torch.float16), (96, torch.float16), (72, torch.float32)])
def test_varlen_padded_head_dims(fa_check, d, dtype):
    # head_dim padded to the next power of two: forward and backward of a packed batch, then paged prefill
    _compare_varlen(fa_check, [0, 1, 17, 5], [3, 1, 20, 9], 4, 2, d, dtype, True)
    _compare_varlen(fa_check, [1, 7, 12], [5, 40, 33], 4, 2, d, dtype, True, page=16)


def _compare_decode(
    fa_check, batch, seqlen_q, hq, hk, d, lens, dtype, page, num_splits, causal, device=DEVICE
):
    gen = torch.Generator().manual_seed(2)
    q = _rand(batch, seqlen_q, hq, d, dtype=dtype, device=device, gen=gen)
    if page is None:
        cap = max(lens) + 5
        kc = _rand(batch, cap, hk, d, dtype=dtype, device=device, gen=gen)
        vc = _rand(batch, cap, hk, d, dtype=dtype, device=device, gen=gen)
        table = None
    else:
        kc, vc, table = _paged_cache(lens, page, hk, d, dtype, device, gen)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    kw = dict(block_table=table, num_splits=num_splits, causal=causal, return_lse=True)
    out, lse = fa.flash_attn_with_kvcache_triton(q, kc, vc, seqlens, **kw)
    ro, rl = fa.flash_attn_with_kvcache_torch(q.double(), kc.double(), vc.double(), seqlens, **kw)
    lo, ll = fa.flash_attn_with_kvcache_torch(q, kc, vc, seqlens, **kw)
    fa_check("out", out, lo, ro)
    fa_check("lse", lse, ll, rl)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("page", [None, 16])
def test_decode_splits(fa_check, num_splits, page):
    # a length-0 cache (output 0, LSE -inf), lengths not multiple of the tile, GQA 4
    _compare_decode(fa_check, 3, 1, 8, 2, 32, [0, 37, 70], torch.float16, page, num_splits, False)


@pytest.mark.parametrize("page", [None, 16])
def test_decode_slices_follow_each_length(fa_check, page):
    # each sequence's own keys cut into 8 slices of whole tiles: 5 keys leave 7 slices empty, 200 fill them all
    _compare_decode(fa_check, 4, 1, 8, 2, 32, [0, 5, 37, 200], torch.float16, page, 8, True)


def test_decode_paged_causal_multi_token(fa_check):
    # 2 new tokens per sequence, causal (bottom-right aligned to the cache end), page 32, shuffled
    _compare_decode(fa_check, 2, 2, 4, 1, 64, [2, 45], torch.float16, 32, 2, True)


def test_decode_mqa_many_rows(fa_check):
    # 16 query heads x 5 tokens on one kv head = 80 tile rows: more than one row block per program
    _compare_decode(fa_check, 1, 5, 16, 1, 32, [23], torch.float16, None, 2, True)


@pytest.mark.parametrize("d,page,num_splits,dtype", [(16, None, 2, torch.float16), (40, 16, 3, torch.float16),
                                                   (96, 32, 0, torch.float16), (200, 16, 2, torch.float32)])
def test_decode_padded_head_dims(fa_check, d, page, num_splits, dtype):
    # Flash-Decoding with head_dim padded in the split kernel and in the combine (num_splits > 1)
    _compare_decode(fa_check, 3, 2, 8, 2, d, [0, 37, 70], dtype, page, num_splits, True)


def test_decode_int_seqlens_and_dispatch():
    q = torch.randn(2, 1, 4, 32)
    kc, vc = torch.randn(2, 10, 2, 32), torch.randn(2, 10, 2, 32)
    out = fa.flash_attn_with_kvcache(q, kc, vc, 10)
    torch.testing.assert_close(out, fa.flash_attn_func_torch(q, kc, vc))


@pytest.mark.gpu
@pytest.mark.parametrize("page", [None, 16, 256])
def test_gpu_bf16_decode(fa_check, page):
    lens = [4096, 1, 777, 3000]
    _compare_decode(fa_check, 4, 1, 32, 8, 128, lens, torch.bfloat16, page, 0, False, device="cuda")
    _compare_decode(fa_check, 4, 3, 32, 8, 128, lens, torch.bfloat16, page, 5, True, device="cuda")


@pytest.mark.gpu
def test_gpu_bf16_varlen(fa_check):
    _compare_varlen(
        fa_check, [0, 1, 300, 129], [5, 1, 300, 700], 8, 2, 128, torch.bfloat16, True, device="cuda"
    )
    _compare_varlen(
        fa_check, [3, 100, 0], [40, 500, 64], 8, 2, 128, torch.bfloat16, True, page=16, device="cuda"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gpu_bf16_every_head_dim_varlen_paged_decode(fa_check, d):
    """Every head_dim the kernels take, on the GPU configs: varlen forward and backward, paged prefill, and
    Flash-Decoding over contiguous and paged caches, split and not."""
    _compare_varlen(fa_check, [0, 1, 200, 129], [5, 1, 300, 129], 8, 2, d, torch.bfloat16, True,
                    device="cuda")
    _compare_varlen(fa_check, [3, 100], [40, 500], 8, 2, d, torch.bfloat16, True, page=16, device="cuda")
    lens = [2048, 1, 777]
    _compare_decode(fa_check, 3, 1, 32, 8, d, lens, torch.bfloat16, None, 0, False, device="cuda")
    _compare_decode(fa_check, 3, 2, 32, 8, d, lens, torch.bfloat16, 16, 4, True, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_pdl_decode_equals_the_paper_kernels_bit_for_bit(paged):
    """layers/pdl.py wraps Flash-Decoding's kernels in a wait and launches them with PDL: the same sums."""
    from nano_flashattn.decode import decode_forward
    from nano_flashattn.layers import pdl

    if not pdl.applies(torch.device("cuda")):
        pytest.skip("PDL needs sm_90+ and a Triton with grid dependency control")
    torch.manual_seed(0)
    batch, heads_q, heads_k, d, ctx = 3, 16, 4, 128, 3000
    q = torch.randn(batch, 1, heads_q, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([ctx, 17, 1200], device="cuda", dtype=torch.int32)
    if paged:
        pages = torch.randperm(batch * ctx // 16 + 8, device="cuda", dtype=torch.int32)
        block_table = pages[: batch * cdiv_pages(ctx)].view(batch, -1)
        kc, vc = (torch.randn(int(pages.numel()), 16, heads_k, d, device="cuda", dtype=torch.bfloat16)
                  for _ in range(2))
    else:
        block_table = None
        kc, vc = (torch.randn(batch, ctx, heads_k, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    args = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens, block_table=block_table,
                scale=d**-0.5, causal=True, num_splits=0)
    out, lse = decode_forward(**args)
    out_pdl, lse_pdl = pdl.pdl_decode(**args)
    assert torch.equal(out, out_pdl) and torch.equal(lse, lse_pdl)


def cdiv_pages(n: int) -> int:
    return -(-n // 16)
