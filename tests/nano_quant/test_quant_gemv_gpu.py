"""nano_quant.layers.gemv on a CUDA GPU (run by hand: `python -m pytest -m gpu tests/nano_quant`): the W4A16 GEMV
in bf16 on llama3-8b layer shapes and ragged ones, against a float64 evaluation of the same
INT4 weights and against torch's tinygemm (`_weight_int4pack_mm`), default and swept configs; and the
dispatch inside a captured CUDA graph replays bit for bit."""

from __future__ import annotations

import pytest
import torch

from nano_quant.bench import tune_configs, weights
from nano_quant.layers import gemv, repacked
from nano_quant.linear import WQLinear_GEMM, awq_dequantize_torch, awq_gemm, awq_gemm_torch

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096), (384, 1000)])
def test_vs_reference_and_tinygemm(k, n):
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=True, device=DEV), 128)
    bias = layer.bias.to(torch.bfloat16)
    w = awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, 128).double()
    ops = weights(k, n, torch.device(DEV)) if k % 1024 == 0 else None
    for m in (1, 2, 3, 4, 5, 8):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ours = gemv.awq_gemv_triton(x, layer.qweight, layer.qzeros, layer.scales, 128, bias)
        low = awq_gemm_torch(x, layer.qweight, layer.qzeros, layer.scales, 128, bias)
        exact = x.double() @ w + bias.double()
        assert ours.dtype == torch.bfloat16 and rel(ours, exact) <= 2 * rel(low, exact) + 1e-6, m
        if ops is not None:
            peer = torch.ops.aten._weight_int4pack_mm(x, ops["int4pack"], 128, ops["scales_and_zeros"])
            mine = gemv.awq_gemv_triton(x, ops["qweight"], ops["qzeros"], ops["scales"], 128, None)
            ref = x.double() @ ops["w4_dense"].double().t()
            assert rel(mine, ref) <= 2 * rel(peer, ref) + 1e-3, m


@pytest.mark.parametrize("m", [1, 4])
def test_every_swept_config_is_right(m):
    """Each config the bench's sweep tries computes the same product (a fast wrong config cannot win)."""
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(4096, 4096, bias=False, device=DEV), 128)
    x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
    exact = x.double() @ awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, 128).double()
    low = awq_gemm_torch(x, layer.qweight, layer.qzeros, layer.scales, 128, None)
    for cfg in tune_configs("awq_gemv", m):
        try:
            ours = gemv.awq_gemv_triton(x, layer.qweight, layer.qzeros, layer.scales, 128, None, config=cfg)
        except triton_resource_errors():
            continue
        assert rel(ours, exact) <= 2 * rel(low, exact) + 1e-6, cfg


def triton_resource_errors() -> tuple[type[BaseException], ...]:
    from triton.runtime.errors import OutOfResources

    return (OutOfResources,)


@pytest.mark.parametrize("m", [1, 4, 16])
def test_dispatch_under_cuda_graph(m):
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(4096, 6144, bias=True, device=DEV), 128)
    bias = layer.bias.to(torch.bfloat16)
    x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
    eager = awq_gemm(x, layer.qweight, layer.qzeros, layer.scales, 128, bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = awq_gemm(x, layer.qweight, layer.qzeros, layer.scales, 128, bias)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)  # split-K sums in a fixed order


@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096), (384, 1000)])
def test_repacked_vs_reference(k, n):
    """The repacked M = 1 GEMV in bf16, default and every swept config, against float64."""
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=True, device=DEV), 128)
    bias = layer.bias.to(torch.bfloat16)
    packed = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 128)
    w = awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, 128).double()
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    low = awq_gemm_torch(x, layer.qweight, layer.qzeros, layer.scales, 128, bias)
    exact = x.double() @ w + bias.double()
    for cfg in [None, *tune_configs("awq_gemv_repacked", 1, n, k)]:
        ours = repacked.awq_gemv_repacked_triton(x, *packed, 128, bias, config=cfg)
        assert ours.dtype == torch.bfloat16 and rel(ours, exact) <= 2 * rel(low, exact) + 1e-6, cfg


@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096), (384, 1000)])
@pytest.mark.parametrize("m", [2, 16, 33, 64])
def test_repacked_mma_vs_reference(k, n, m):
    """The repacked tensor-core kernel in bf16 at decode-sized M, default config, against float64; and the
    layer dispatches to it, also inside a captured CUDA graph."""
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=True, device=DEV), 128)
    bias = layer.bias.to(torch.bfloat16)
    packed = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 128)
    w = awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, 128).double()
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    low = awq_gemm_torch(x, layer.qweight, layer.qzeros, layer.scales, 128, bias)
    exact = x.double() @ w + bias.double()
    ours = repacked.awq_mma_repacked_triton(x, *packed, 128, bias)
    assert ours.dtype == torch.bfloat16 and rel(ours, exact) <= 2 * rel(low, exact) + 1e-6
    repacked.use_repacked_gemv(torch.nn.Sequential(layer))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, layer(x)) and rel(out, exact) <= 2 * rel(low, exact) + 1e-6


def test_repacked_only_layer():
    """AutoAWQ's tensors dropped: 1 / 16 / 200 rows (GEMV, tensor cores, dequantize + cuBLAS) against float64."""
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(4096, 1024, bias=True, device=DEV), 128)
    w = layer.dequantize().double()
    bias = layer.bias.double()
    repacked.use_repacked_gemv(torch.nn.Sequential(layer), drop_autoawq=True)
    for m in (1, 16, 200):
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
        exact = x.double() @ w.t() + bias
        low = (x.float() @ w.t().float() + bias.float()).to(torch.bfloat16)
        out = layer(x)
        assert out.dtype == torch.bfloat16 and rel(out, exact) <= 2 * rel(low, exact) + 1e-6, m


@pytest.mark.parametrize("k,n,group_size", [(4096, 28672, 128), (14336, 4096, 128), (384, 1000, 96)])
def test_dequantize_repacked_exact(k, n, group_size):
    """The prefill path's dequantizing copy writes the torch dequantization rounded once to bf16, bit for bit,
    on llama3-8b's widest shapes and on a padded group with a ragged last row block."""
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=False, device=DEV), group_size)
    packed = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, group_size)
    got = repacked.dequantize_repacked_triton(*packed, group_size, torch.bfloat16)
    assert torch.equal(got, repacked.dequantize_repacked_torch(*packed, group_size).to(torch.bfloat16))


@pytest.mark.parametrize("m", [1, 2, 16, 33, 64])
def test_silu_and_mul_epilogue_bf16(m):
    """A fused gate_up of llama3-8b's shape in bf16: the kernels' SwiGLU epilogue writes exactly what the plain
    kernel and the SwiGLU kernel write (default configs), and the layer's `forward_silu_and_mul` replays in a
    CUDA graph."""
    from shared.kernels import silu_and_mul

    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(4096, 28672, bias=False, device=DEV), 128)
    packed = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 128)
    x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
    kernel = repacked.awq_gemv_repacked_triton if m == 1 else repacked.awq_mma_repacked_triton
    want = silu_and_mul(*kernel(x, *packed, 128).chunk(2, dim=-1))
    assert torch.equal(kernel(x, *packed, 128, silu_and_mul=True), want)
    repacked.use_repacked_gemv(torch.nn.Sequential(layer))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.forward_silu_and_mul(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
