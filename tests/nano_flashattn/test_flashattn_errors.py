"""Every bad input of the issue raises ValueError naming the argument, on the Triton path and on the
reference path alike (both share nano_flashattn.checks), before any kernel runs."""

from __future__ import annotations

import pytest
import torch

import nano_flashattn as fa

DENSE = [fa.flash_attn_func_triton, fa.flash_attn_func_torch]
VARLEN = [fa.flash_attn_varlen_func_triton, fa.flash_attn_varlen_func_torch]
KVCACHE = [fa.flash_attn_with_kvcache_triton, fa.flash_attn_with_kvcache_torch]


def _qkv(hq=4, hk=2, d=32, n=8, dtype=torch.float16):
    return (
        torch.randn(1, 5, hq, d, dtype=dtype),
        torch.randn(1, n, hk, d, dtype=dtype),
        torch.randn(1, n, hk, d, dtype=dtype),
    )


@pytest.mark.parametrize("fn", DENSE)
def test_dense_bad_inputs(fn):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"v shape .* must equal k shape"):  # mismatched head counts
        fn(q, k, torch.randn(1, 8, 1, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"q heads \(4\) must be divisible by k heads \(3\)"):
        fn(*_qkv(hq=4, hk=3))
    with pytest.raises(ValueError, match=r"head_dim 0 \(q.shape\[-1\]\) must be positive"):
        fn(*_qkv(d=0))
    with pytest.raises(ValueError, match=r"head_dim mismatch"):
        fn(q, torch.randn(1, 8, 2, 64, dtype=torch.float16), torch.randn(1, 8, 2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^k has dtype torch.float32 but q has torch.float16"):
        fn(q, k.float(), v)
    with pytest.raises(ValueError, match=r"^v is on meta but q is on cpu"):
        fn(q, k, v.to("meta"))
    with pytest.raises(ValueError, match=r"^q must have 4 dims"):
        fn(q[0], k, v)
    with pytest.raises(ValueError, match=r"k batch \(2\) must equal q batch \(1\)"):
        fn(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match=r"^softmax_scale"):
        fn(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match=r"^window_size"):
        fn(q, k, v, window_size=(3,))
    with pytest.raises(ValueError, match=r"^q has dtype torch.int64"):
        fn(q.long(), k.long(), v.long())


@pytest.mark.parametrize("d", [20, 12, 8, 264])
def test_kernels_refuse_head_dims_they_cannot_tile(d):
    """Not a multiple of 8, below 16 or above 256: the kernels refuse, naming head_dim and the supported set
    (every entry point, before any launch); the torch references take any head_dim."""
    q, k, v = _qkv(d=d)
    msg = (rf"^head_dim {d} \(q.shape\[-1\]\) is unsupported by the kernels; "
           r"supported: multiples of 8 from 16 to 256")
    with pytest.raises(ValueError, match=msg):
        fa.flash_attn_func_triton(q, k, v)
    q2, k2, v2, cu_q, cu_k, mq, mk, _ = _varlen(d=d)
    with pytest.raises(ValueError, match=msg):
        fa.flash_attn_varlen_func_triton(q2, k2, v2, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match=msg):
        fa.flash_attn_with_kvcache_triton(q, k, v, 8)
    fa.flash_attn_func_torch(q, k, v)


def test_kernels_refuse_fp64():
    q, k, v = (t.double() for t in _qkv())
    with pytest.raises(ValueError, match=r"^q has dtype torch.float64"):
        fa.flash_attn_func_triton(q, k, v)
    fa.flash_attn_func_torch(q, k, v)  # the reference runs in fp64: it is the tests' oracle


def _varlen(paged=False, d=32):
    q = torch.randn(6, 4, d, dtype=torch.float16)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 9], dtype=torch.int32)
    if paged:
        k = torch.randn(4, 16, 2, d, dtype=torch.float16)
        table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        return q, k, k.clone(), cu_q, cu_k, 4, 6, table
    k = torch.randn(9, 2, d, dtype=torch.float16)
    return q, k, k.clone(), cu_q, cu_k, 4, 6, None


@pytest.mark.parametrize("fn", VARLEN)
def test_varlen_bad_inputs(fn):
    q, k, v, cu_q, cu_k, mq, mk, _ = _varlen()
    with pytest.raises(ValueError, match=r"^cu_seqlens_q must have shape \(batch \+ 1,\)"):
        fn(q, k, v, cu_q[None], cu_k, mq, mk)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k has shape \(4,\), expected \(3,\)"):
        fn(q, k, v, cu_q, torch.tensor([0, 3, 6, 9], dtype=torch.int32), mq, mk)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k must be int32"):
        fn(q, k, v, cu_q, cu_k.long(), mq, mk)
    with pytest.raises(
        ValueError, match=r"^cu_seqlens_q must be non-decreasing, with lengths <= max_seqlen_q"
    ):
        fn(q, k, v, cu_q, cu_k, 3, mk)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k must be non-decreasing"):
        fn(q, k, v, cu_q, torch.tensor([0, 3, 10], dtype=torch.int32), mq, 7)
    with pytest.raises(ValueError, match=r"^max_seqlen_q must be an int"):
        fn(q, k, v, cu_q, cu_k, -1, mk)
    q, k, v, cu_q, cu_k, mq, mk, table = _varlen(paged=True)
    with pytest.raises(
        ValueError, match=r"^block_table points outside the cache: entries in \[0, 4\], cache has 4"
    ):
        fn(q, k, v, cu_q, cu_k, mq, mk, block_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^block_table must have shape \(batch=2, max_pages\)"):
        fn(q, k, v, cu_q, cu_k, mq, mk, block_table=table[:1])
    with pytest.raises(ValueError, match=r"^page size"):
        fn(q, k[:, :12], v[:, :12], cu_q, cu_k, mq, mk, block_table=table)


def test_varlen_paged_has_no_backward():
    q, k, v, cu_q, cu_k, mq, mk, table = _varlen(paged=True)
    with pytest.raises(ValueError, match=r"^block_table: no backward"):
        fa.flash_attn_varlen_func_triton(q.requires_grad_(), k, v, cu_q, cu_k, mq, mk, block_table=table)


@pytest.mark.parametrize("fn", KVCACHE)
def test_kvcache_bad_inputs(fn):
    q = torch.randn(2, 1, 8, 32, dtype=torch.float16)
    kc = torch.randn(2, 20, 2, 32, dtype=torch.float16)
    lens = torch.tensor([5, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q heads \(8\) must be divisible by k_cache heads \(3\)"):
        fn(
            q,
            torch.randn(2, 20, 3, 32, dtype=torch.float16),
            torch.randn(2, 20, 3, 32, dtype=torch.float16),
            lens,
        )
    with pytest.raises(ValueError, match=r"^v_cache has dtype torch.bfloat16"):
        fn(q, kc, kc.bfloat16(), lens)
    with pytest.raises(ValueError, match=r"^cache_seqlens must be an int or a \(2,\) int32 tensor"):
        fn(q, kc, kc, lens[:1])
    with pytest.raises(ValueError, match=r"^cache_seqlens has lengths in \[5, 21\], the cache holds 20"):
        fn(q, kc, kc, torch.tensor([5, 21], dtype=torch.int32))
    pages = torch.randn(5, 16, 2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^block_table points outside the cache: entries in \[0, 7\]"):
        fn(q, pages, pages, lens, block_table=torch.tensor([[0, 1], [2, 7]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^block_table must be int32"):
        fn(q, pages, pages, lens, block_table=torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match=r"^num_splits must be an int >= 0"):
        fn(q, kc, kc, lens, num_splits=-2)


def test_trusted_metadata_skips_only_the_value_checks():
    """Inside `trusted_metadata()` the syncing value checks are off (an engine vouches for its block
    tables); shape / dtype checks still run, and the switch is restored on exit."""
    q, k, v, cu_q, cu_k, mq, mk, _table = _varlen(paged=True)
    bad = torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)
    with fa.trusted_metadata():
        with pytest.raises(ValueError, match=r"^block_table must be int32"):
            fa.flash_attn_varlen_func_torch(q, k, v, cu_q, cu_k, mq, mk, block_table=bad.long())
        assert not fa.checks._values_checkable(bad)
    with pytest.raises(ValueError, match=r"^block_table points outside the cache"):
        fa.flash_attn_varlen_func_torch(q, k, v, cu_q, cu_k, mq, mk, block_table=bad)
