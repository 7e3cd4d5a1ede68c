"""nano_quant on a CUDA GPU (run by hand: `python -m pytest -m gpu tests/nano_quant`): the Triton kernels in
bf16 and FP8 against torch's own INT8 / FP8 / INT4 GEMMs and float64 references on llama3-8b-sized and
ragged shapes, a quantized model against its CPU reference, and CUDA-graph capture of a quantized forward."""

from __future__ import annotations

import pytest
import torch

from nano_quant import load_quantized_model, quantize_model, save_quantized
from nano_quant.layers import kernels
from nano_quant.linear import WQLinear_GEMM, awq_dequantize_torch, awq_gemm, awq_gemm_torch, scaled_mm_torch
from nano_quant.quant import quantize_rowwise
from shared.config import ModelConfig
from shared.model import build_model

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 4096), (7, 100), (300, 14336)])
def test_per_token_quant(dtype, m, k):
    x = (torch.randn(m, k, device=DEV) * 3).to(dtype)
    q, s = kernels.quantize_per_token_triton(x, "int8")
    q_ref, s_ref = quantize_rowwise(x, "int8")
    # The GPU's amax / 127 may round the scale one fp32 ulp away from torch's: then a value sitting on a
    # rounding boundary can land one integer step away. Such values are rare (a count, not a fraction: a
    # 7 x 100 input has 700 values, and one of them on a boundary is already 0.14%).
    torch.testing.assert_close(s, s_ref, rtol=2**-22, atol=0)
    assert (q.int() - q_ref.int()).abs().max() <= 1
    assert int((q != q_ref).sum()) <= max(4, 1e-3 * q.numel())
    q8, s8 = kernels.quantize_per_token_triton(x, "fp8")
    q8_ref, s8_ref = quantize_rowwise(x, "fp8")
    torch.testing.assert_close(s8, s8_ref, rtol=2**-22, atol=0)
    differ = (q8.float() != q8_ref.float())
    assert int(differ.sum()) <= max(8, 5e-3 * differ.numel())  # a one-ulp scale moves boundary values
    assert torch.all((q8.float() - q8_ref.float()).abs() <= q8_ref.float().abs() * 2**-3 + 2**-9)


SHAPES = [(1, 6144, 4096), (33, 4096, 14336), (300, 1000, 3000), (2048, 28672, 4096)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_gemm_vs_torch_int_mm(m, n, k):
    qa, sa = quantize_rowwise(torch.randn(m, k, device=DEV), "int8")
    qw, sw = quantize_rowwise(torch.randn(n, k, device=DEV) * 0.02, "int8")
    bias = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    ours = kernels.scaled_mm_triton(qa, qw, sa, sw, bias, torch.bfloat16)
    exact = scaled_mm_torch(qa, qw, sa, sw, bias, torch.float64)
    low = scaled_mm_torch(qa, qw, sa, sw, bias, torch.bfloat16)
    assert rel(ours, exact) <= 2 * rel(low, exact) + 1e-6
    if m > 16:  # cuBLAS INT8: the same int32 sums
        acc = torch._int_mm(qa, qw.t())
        peer = (acc.float() * sa[:, None] * sw[None, :] + bias.float()).to(torch.bfloat16)
        assert rel(ours, exact) <= 2 * rel(peer, exact) + 1e-6


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_gemm_vs_torch_scaled_mm(m, n, k):
    qa, sa = quantize_rowwise(torch.randn(m, k, device=DEV), "fp8")
    qw, sw = quantize_rowwise(torch.randn(n, k, device=DEV) * 0.02, "fp8")
    ours = kernels.scaled_mm_triton(qa, qw, sa, sw, None, torch.bfloat16)
    exact = scaled_mm_torch(qa, qw, sa, sw, None, torch.float64)
    # cuBLASLt's FP8 GEMM wants M, N and K multiples of 16: zero padding, which adds nothing, sliced off after
    rows, outs, cols = m + (-m % 16), n + (-n % 16), k + (-k % 16)
    qa_p, sa_p = qa.new_zeros(rows, cols), sa.new_ones(rows)
    qw_p, sw_p = qw.new_zeros(outs, cols), sw.new_ones(outs)
    qa_p[:m, :k], sa_p[:m], qw_p[:n, :k], sw_p[:n] = qa, sa, qw, sw
    peer = torch._scaled_mm(qa_p, qw_p.t(), scale_a=sa_p[:, None], scale_b=sw_p[None, :],
                            out_dtype=torch.bfloat16)[:m, :n]
    # Hopper's FP8 tensor cores may accumulate with fewer than 32 bits: 4x the peer's error, plus bf16's step
    assert rel(ours, exact) <= 4 * rel(peer, exact) + 2**-8


@pytest.mark.parametrize("m", [1, 5, 16, 17, 64, 65, 300])
@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096), (384, 1000)])
def test_awq_gemm_vs_reference_and_tinygemm(m, k, n):
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=False, device=DEV), 128)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    ours = awq_gemm(x, layer.qweight, layer.qzeros, layer.scales, 128, None)
    w = awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, 128)
    exact = x.double() @ w.double()
    low = awq_gemm_torch(x, layer.qweight, layer.qzeros, layer.scales, 128, None)
    assert ours.dtype == torch.bfloat16 and rel(ours, exact) <= 2 * rel(low, exact) + 1e-6
    if k % 1024 == 0:
        from nano_quant.bench import weights

        ops = weights(k, n, torch.device(DEV))
        peer = torch.ops.aten._weight_int4pack_mm(x, ops["int4pack"], 128, ops["scales_and_zeros"])
        mine = awq_gemm(x, ops["qweight"], ops["qzeros"], ops["scales"], 128, None)
        ref = x.double() @ ops["w4_dense"].double().t()
        assert rel(mine, ref) <= 2 * rel(peer, ref) + 1e-3


def _tiny(tmp_path, method):
    cfg = ModelConfig.from_name("tiny").replace(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = build_model(cfg, seed=0)
    quantize_model(model, method, torch.randint(0, 4096, (4, 64)), progress=False)
    return save_quantized(model, tmp_path / method, dtype=None), build_model(cfg, seed=0)


@pytest.mark.parametrize("method", ["awq", "smoothquant", "smoothquant-fp8"])
def test_quantized_model_on_gpu_matches_cpu(tmp_path, method):
    """The CUDA path (bf16, Triton kernels) differs from the CPU reference path (fp32, torch references) by
    less than twice the quantization error itself, plus bf16's rounding."""
    path, float_model = _tiny(tmp_path, method)
    x = torch.randint(0, 4096, (3, 40))
    with torch.no_grad():
        ref = float_model(x)
        cpu = load_quantized_model(path)(x)
        gpu = load_quantized_model(path, DEV, torch.bfloat16)(x.to(DEV)).float().cpu()
    assert rel(gpu, cpu) <= 2 * rel(cpu, ref) + 2e-2


@pytest.mark.parametrize("method", ["rtn-w4", "naive-w8a8"])
def test_cuda_graph_capture(tmp_path, method):
    model = load_quantized_model(_tiny(tmp_path, method)[0], DEV, torch.bfloat16)
    x = torch.randint(0, 4096, (4, 1), device=DEV)
    with torch.no_grad():
        eager = model(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(x)  # warm-up outside capture: kernels compiled, configs cached
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)
