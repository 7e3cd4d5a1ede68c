"""The split-head layer (nano_flashattn.layers.split_head): head_dims 48, 80, 96, 144, 160, 192 as two power-of-two
parts of the head axis, against the fp64 reference with FlashAttention's error rule, forward and backward,
dense and varlen, GQA, windows, paged K/V. On CPU the kernels run under TRITON_INTERPRET=1 (16-row tiles).

Each test registers the layer; conftest's `paper_path` drops the registration after it, so the other test
files keep testing the paper path's padded tiles at these head_dims."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_flashattn_dense import _run_and_compare
from test_flashattn_varlen_decode import _compare_varlen

import nano_flashattn as fa
from nano_flashattn import REGISTRY, configs
from nano_flashattn.interface import PAPER_KERNELS, run_kernel

# A performance layer's interpreter tests: run from the repository, left out of a fork of the package.
pytestmark = pytest.mark.slow


@pytest.fixture
def layer():
    """The layer, registered for this test (the `paper_path` fixture drops the registration after it)."""
    mod = importlib.import_module("nano_flashattn.layers.split_head")
    mod.enable()
    return mod


@pytest.fixture
def launches(layer, monkeypatch):
    """Counts launches of the layer's forward and dQ kernels (so a test knows the layer ran)."""
    counts = {"fwd": 0, "dq": 0}

    class Counted:
        def __init__(self, kernel, key):
            self.kernel, self.key = kernel, key

        def __getitem__(self, grid):
            counts[self.key] += 1
            return self.kernel[grid]

    monkeypatch.setattr(layer, "_split_fwd_kernel", Counted(layer._split_fwd_kernel, "fwd"))
    monkeypatch.setattr(layer, "_split_dq_kernel", Counted(layer._split_dq_kernel, "dq"))
    return counts


def test_split_head_dims(layer):
    assert layer.SPLIT_HEAD_DIMS == (48, 80, 96, 144, 160, 192)
    assert [layer.split(d) for d in (48, 80, 96, 144, 160, 192)] == [
        (32, 16), (64, 16), (64, 32), (128, 16), (128, 32), (128, 64)]
    assert all(layer.split(d) is None for d in (16, 40, 64, 72, 128, 200, 224, 256))


def test_registered_and_applies_only_to_split_head_dims(layer, launches):
    q = torch.zeros(5, 2, 96)
    assert REGISTRY.select("forward", q=q) is layer.split_forward
    assert not any(layer.applies(q=torch.zeros(5, 2, d)) for d in (64, 72, 128, 256))
    q, k, v = (torch.randn(1, 9, 2, d, dtype=torch.float16) for d in (80, 80, 80))
    qq = q.clone().requires_grad_()
    fa.flash_attn_func_triton(qq, k, v, causal=True).sum().backward()
    assert launches == {"fwd": 1, "dq": 1}
    fa.flash_attn_func_triton(*(t[..., :64].contiguous() for t in (q, k, v)))  # 64: the paper path
    assert launches["fwd"] == 1


def test_disable_hands_calls_back_to_the_paper_path(layer, launches):
    q, k, v = (torch.randn(1, 9, 2, 96, dtype=torch.float16) for _ in range(3))
    layer.disable()
    try:
        assert not layer.enabled()
        fa.flash_attn_func_triton(q, k, v)
        assert launches["fwd"] == 0
    finally:
        layer.enable()
    layer.enable()  # idempotent: one registration per kind
    assert [entry.impl for entry in REGISTRY.layers("forward")] == [layer.split_forward]
    fa.flash_attn_func_triton(q, k, v)
    assert launches["fwd"] == 1


def test_launcher_rejects_a_head_dim_without_a_split(layer):
    q = torch.zeros(4, 2, 72, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^head_dim 72 \(q.shape\[-1\]\) has no two-part split; the split "
                                         r"kernels take \(48, 80, 96, 144, 160, 192\)"):
        layer.split_forward(q, q, q, 1, 4, 4, None, None, None, 1.0, -1, -1)
    with pytest.raises(ValueError, match=r"^head_dim 72 \(q.shape\[-1\]\) has no two-part split"):
        layer.split_backward(q, q, q, q, q, torch.zeros(2, 4), 1, 4, 4, None, None, 1.0, -1, -1)


# (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, window)
CASES = [
    (1, 19, 27, 4, 2, 96, True, (-1, -1)),  # GQA 2, seqlen_q < seqlen_k, ragged tiles
    (2, 17, 17, 2, 2, 96, False, (-1, -1)),
    (1, 27, 19, 2, 1, 80, True, (-1, -1)),  # seqlen_q > seqlen_k: the first rows see no key; MQA
    (1, 20, 20, 2, 2, 80, False, (5, 3)),  # local window
    (1, 17, 21, 2, 1, 160, True, (-1, -1)),
    (1, 16, 18, 2, 2, 48, False, (-1, -1)),
]


@pytest.mark.parametrize("b,m,n,hq,hk,d,causal,window", CASES)
def test_fwd_bwd_fp16(fa_check, launches, b, m, n, hq, hk, d, causal, window):
    _run_and_compare(fa_check, b, m, n, hq, hk, d, torch.float16, causal, window)
    assert launches["fwd"] >= 1 and launches["dq"] >= 1


def test_fwd_bwd_fp32(fa_check, launches):
    _run_and_compare(fa_check, 1, 19, 23, 2, 1, 96, torch.float32, True, (-1, -1))
    _run_and_compare(fa_check, 1, 17, 17, 2, 2, 192, torch.float32, False, (6, -1))
    assert launches["fwd"] == 2


@pytest.mark.parametrize("expand_waves", [0, 1 << 20])
def test_gqa_backward_both_paths(fa_check, layer, monkeypatch, expand_waves):
    """dK/dV of GQA with the kv-head programs looping over their query heads, and with K/V expanded."""
    monkeypatch.setattr(configs, "GQA_EXPAND_WAVES", expand_waves)
    _run_and_compare(fa_check, 1, 21, 30, 4, 1, 96, torch.float16, True, (-1, -1))


@pytest.mark.parametrize("d,causal", [(96, True), (80, False), (144, True)])
def test_varlen_fwd_bwd(fa_check, launches, d, causal):
    _compare_varlen(fa_check, [0, 1, 17, 5], [3, 1, 20, 9], 4, 2, d, torch.float16, causal)
    assert launches["fwd"] == 1 and launches["dq"] == 1


def test_varlen_paged_kv(fa_check, launches):
    _compare_varlen(fa_check, [1, 7, 12], [5, 40, 33], 4, 2, 96, torch.float16, True, page=16)
    assert launches["fwd"] == 1


def test_bench_turns_the_layer_on_and_off(layer, monkeypatch):
    from nano_flashattn import bench, launch

    cuda = torch.device("cuda", 0)  # the layer runs on any CUDA device: an A100, say
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(launch, "_capability", launch._capability.__wrapped__)  # uncached
    assert bench.set_layers(bench.parse_args(["--no-split-head"]), cuda)["split_head"] is False
    assert not layer.enabled()
    assert bench.set_layers(bench.parse_args([]), cuda)["split_head"] is True and layer.enabled()
    assert bench.set_layers(bench.parse_args(["--paper-path"]), cuda)["split_head"] is False


def test_empty_batch(layer):
    q = torch.zeros(0, 2, 96, dtype=torch.float16)
    out, lse = run_kernel("forward", q=q, k=q, v=q, batch=0, seqlen_q=0, seqlen_k=0, cu_seqlens_q=None,
                          cu_seqlens_k=None, block_table=None, scale=1.0, window_left=-1, window_right=-1)
    assert out.shape == (0, 2, 96) and lse.shape == (2, 0)
    assert PAPER_KERNELS["forward"] is not layer.split_forward


@pytest.mark.gpu
@pytest.mark.parametrize("d", [48, 80, 96, 144, 160, 192])
def test_gpu_bf16_split_head_dims(fa_check, launches, d):
    """Every split head_dim on the GPU configs: causal GQA with ragged lengths, a local window with
    seqlen_q > seqlen_k, varlen, paged prefill."""
    _run_and_compare(fa_check, 2, 300, 333, 4, 2, d, torch.bfloat16, True, (-1, -1), device="cuda")
    _run_and_compare(fa_check, 1, 200, 150, 2, 1, d, torch.bfloat16, False, (40, 8), device="cuda")
    _compare_varlen(fa_check, [0, 1, 200, 129], [5, 1, 300, 129], 8, 2, d, torch.bfloat16, True,
                    device="cuda")
    _compare_varlen(fa_check, [3, 100], [40, 500], 8, 2, d, torch.bfloat16, True, page=16, device="cuda")
    assert launches["fwd"] == 4 and launches["dq"] == 3


@pytest.mark.gpu
@pytest.mark.parametrize("d", [80, 96])
def test_gpu_fp16_fp32_and_long(fa_check, launches, d):
    _run_and_compare(fa_check, 1, 200, 200, 4, 4, d, torch.float16, False, (64, 16), device="cuda")
    _run_and_compare(fa_check, 1, 130, 170, 4, 2, d, torch.float32, True, (-1, -1), device="cuda")
    _run_and_compare(fa_check, 1, 2048, 2048, 8, 2, d, torch.bfloat16, True, (-1, -1), device="cuda")
    assert launches["fwd"] == 3
