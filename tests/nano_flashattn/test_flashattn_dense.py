"""flash_attn_func: the Triton kernels (Algorithm 1 and 2) against the fp64 torch reference, and the
reference against torch's own scaled_dot_product_attention. On CPU the kernels run under
TRITON_INTERPRET=1 (tests/conftest.py), so the shapes are small and the tiles 16 wide. head_dims that are
not powers of two run with the tile's head axis padded to the next power of two."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nano_flashattn as fa
from nano_flashattn.checks import HEAD_DIMS
from nano_flashattn.reference import attention_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(b, m, n, hq, hk, d, dtype, device=DEVICE, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(b, m, hq, d), mk(b, n, hk, d), mk(b, n, hk, d), mk(b, m, hq, d)


def _run_and_compare(fa_check, b, m, n, hq, hk, d, dtype, causal, window, backward=True, device=DEVICE):
    q, k, v, do = _inputs(b, m, n, hq, hk, d, dtype, device)
    q, k, v = (t.requires_grad_(backward) for t in (q, k, v))
    out, lse = fa.flash_attn_func_triton(q, k, v, causal=causal, window_size=window, return_lse=True)
    scale = d**-0.5
    left, right = (
        (1 << 30 if window[0] < 0 else window[0]),
        (0 if causal else 1 << 30 if window[1] < 0 else window[1]),
    )
    results = {}
    for name, (qq, kk, vv), upcast in (
        ("ref", [t.detach().double().requires_grad_(backward) for t in (q, k, v)], True),
        ("low", [t.detach().clone().requires_grad_(backward) for t in (q, k, v)], False),
    ):
        o, lse_r = attention_torch(qq, kk, vv, scale, left, right, upcast=upcast)
        grads = torch.autograd.grad(o, (qq, kk, vv), do.to(o.dtype)) if backward else ()
        results[name] = (o, lse_r, *grads)
    fa_check("out", out, results["low"][0], results["ref"][0])
    fa_check("lse", lse, results["low"][1], results["ref"][1])
    if backward:
        grads = torch.autograd.grad(out, (q, k, v), do)
        for i, name in enumerate(("dq", "dk", "dv")):
            fa_check(name, grads[i], results["low"][2 + i], results["ref"][2 + i])
    return q, k, v, do


# (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window)
CASES = [
    (1, 1, 1, 2, 2, 32, True, (-1, -1)),  # seqlen 1
    (2, 37, 53, 4, 1, 32, False, (-1, -1)),  # odd lengths, seqlen_q < seqlen_k, GQA 4
    (1, 53, 37, 8, 1, 32, True, (-1, -1)),  # seqlen_q > seqlen_k: the first rows see no key; MQA 8
    (1, 21, 45, 2, 2, 64, True, (-1, -1)),  # causal, bottom-right aligned, head_dim 64
    (1, 40, 40, 2, 2, 32, False, (7, 3)),  # local window
    (1, 30, 45, 2, 2, 32, True, (10, -1)),  # sliding window + causal, seqlen_q != seqlen_k
    (1, 19, 19, 4, 4, 128, False, (-1, -1)),  # head_dim 128, GQA 1
]


@pytest.mark.parametrize("b,m,n,hq,hk,d,causal,window", CASES)
def test_fwd_bwd_fp16(fa_check, b, m, n, hq, hk, d, causal, window):
    _run_and_compare(fa_check, b, m, n, hq, hk, d, torch.float16, causal, window)


@pytest.mark.slow  # ~3-13 s; runs in the repository suite, not again in the package's fork
@pytest.mark.parametrize("expand_waves", [0, 1 << 20])
def test_gqa_backward_both_paths(fa_check, monkeypatch, expand_waves):
    """dK/dV of GQA two ways: the kv-head programs looping over their query heads (0: never expand) and
    K/V expanded per query head with the group's partials summed after (always expand)."""
    from nano_flashattn import configs

    monkeypatch.setattr(configs, "GQA_EXPAND_WAVES", expand_waves)
    _run_and_compare(fa_check, 2, 37, 53, 4, 1, 32, torch.float16, True, (-1, -1))
    _run_and_compare(fa_check, 1, 40, 40, 8, 2, 64, torch.float16, False, (-1, -1))


def test_fwd_bwd_fp32_and_wide_heads(fa_check):
    _run_and_compare(fa_check, 1, 20, 30, 2, 1, 32, torch.float32, True, (-1, -1))
    _run_and_compare(fa_check, 1, 16, 20, 1, 1, 256, torch.float16, False, (-1, -1))


# head_dims the interpreter covers beyond the powers of two: the smallest, odd multiples of 8 (rows not
# 16-element aligned), the common 80 and 96, and 200 (padded to 256)
PADDED_HEAD_DIMS = [16, 40, 72, 80, 96, 200]


@pytest.mark.parametrize("d", PADDED_HEAD_DIMS)
def test_fwd_bwd_padded_head_dims_fp16(fa_check, d):
    _run_and_compare(fa_check, 1, 19, 27, 2, 1, d, torch.float16, True, (-1, -1))


def test_fwd_bwd_padded_head_dims_fp32(fa_check):
    _run_and_compare(fa_check, 1, 19, 27, 2, 1, 40, torch.float32, True, (-1, -1))
    _run_and_compare(fa_check, 2, 17, 17, 2, 2, 200, torch.float32, False, (5, 3))


@pytest.mark.slow  # ~3-13 s; runs in the repository suite, not again in the package's fork
def test_backward_is_deterministic():
    q, k, v, do = _inputs(1, 40, 40, 4, 1, 32, torch.float16)
    runs = []
    for _ in range(2):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        runs.append(torch.autograd.grad(fa.flash_attn_func_triton(qq, kk, vv, causal=True), (qq, kk, vv), do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_dispatch_cpu_goes_to_reference():
    q, k, v, _ = _inputs(1, 5, 7, 2, 1, 32, torch.float32, device="cpu")
    out = fa.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, fa.flash_attn_func_torch(q, k, v, causal=True))


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (4, 2))])
@pytest.mark.parametrize("d", [32, 20])  # 20: the reference (the CPU path) takes head_dims the kernels do not
def test_reference_matches_torch_sdpa(causal, window, d):
    """The oracle itself against an implementation nobody here wrote (fp64, explicit mask)."""
    b, m, n, hq, hk = 2, 9, 13, 4, 2
    q, k, v, _ = _inputs(b, m, n, hq, hk, d, torch.float64, device="cpu")
    out = fa.flash_attn_func_torch(q, k, v, causal=causal, window_size=window)
    i, j = torch.arange(m)[:, None], torch.arange(n)[None, :]
    left, right = window
    allowed = torch.ones(m, n, dtype=torch.bool)
    if causal:
        allowed &= j <= i + n - m  # bottom-right aligned causal
    if left >= 0:
        allowed &= j >= i + n - m - left
    if right >= 0:
        allowed &= j <= i + n - m + right
    kr, vr = (t.repeat_interleave(hq // hk, dim=2) for t in (k, v))
    sdpa = F.scaled_dot_product_attention(
        q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), attn_mask=allowed
    )
    torch.testing.assert_close(out, sdpa.transpose(1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bf16_fwd_bwd(fa_check, d, causal):
    _run_and_compare(fa_check, 2, 300, 300, 8, 2, d, torch.bfloat16, causal, (-1, -1), device="cuda")
    _run_and_compare(fa_check, 1, 257, 1000, 4, 4, d, torch.bfloat16, causal, (-1, -1), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [32, 256])
def test_gpu_other_head_dims(fa_check, d):
    _run_and_compare(fa_check, 1, 200, 333, 4, 1, d, torch.bfloat16, True, (-1, -1), device="cuda")
    _run_and_compare(fa_check, 1, 200, 200, 4, 4, d, torch.float16, False, (64, 16), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_gpu_bf16_every_head_dim(fa_check, d):
    """Every head_dim the kernels take, on the GPU configs (padded when not a power of two): causal GQA with
    ragged lengths (masked tiles and unmasked ones), and a local window with seqlen_q > seqlen_k."""
    _run_and_compare(fa_check, 2, 300, 333, 4, 2, d, torch.bfloat16, True, (-1, -1), device="cuda")
    _run_and_compare(fa_check, 1, 200, 150, 2, 1, d, torch.bfloat16, False, (40, 8), device="cuda")


@pytest.mark.gpu
def test_gpu_fp32(fa_check):
    _run_and_compare(fa_check, 1, 130, 170, 4, 2, 64, torch.float32, True, (-1, -1), device="cuda")
