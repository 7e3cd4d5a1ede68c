"""nano_quant.layers.kernels under the Triton interpreter: each kernel equals its torch reference.

fp16 / fp32 activations only (the interpreter computes bf16 wrongly, and rounds fp32 -> fp8 wrongly, so the
FP8 quantization kernel is tested on the GPU); ragged M and N, K not a multiple of the kernels' K tile,
K a non-power-of-two number of groups, uneven split-K. Outputs are poisoned before each kernel runs
(NaN / out-of-range integers), so an element a kernel fails to write fails the comparison. Tolerances
follow FlashAttention's rule: our error against a float64 reference is at most twice the error of the
same formula evaluated in the output precision, plus a small epsilon.
"""

from __future__ import annotations

import pytest
import torch

from nano_quant.layers import kernels
from nano_quant.linear import WQLinear_GEMM, awq_dequantize_torch, awq_gemm_torch, scaled_mm_torch
from nano_quant.quant import quantize_rowwise

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty returns NaN-filled floats and out-of-range integers while a test runs."""
    real = torch.empty

    def empty(*size, dtype=None, **kwargs):
        t = real(*size, dtype=dtype, **kwargs)
        if t.is_floating_point() and t.element_size() > 1:
            t.fill_(float("nan"))
        elif t.dtype == torch.int8:
            t.fill_(-128)  # never produced: quantized values are clamped to [-127, 127]
        elif not t.is_floating_point():
            t.fill_(-(2**30))
        return t

    monkeypatch.setattr(torch, "empty", empty)


def within_fa_rule(ours: torch.Tensor, exact: torch.Tensor, low: torch.Tensor, eps: float = 1e-6) -> bool:
    scale = float(exact.abs().max())
    err, ref_err = (ours.double() - exact).abs().max(), (low.double() - exact).abs().max()
    return bool(torch.isfinite(ours).all()) and float(err) <= 2 * float(ref_err) + eps * scale


@pytest.mark.parametrize("dtype,m,k", [(torch.float16, 1, 64), (torch.float32, 5, 200),
                                       (torch.float16, 3, 2500)])
def test_per_token_quant_int8(poisoned, dtype, m, k):
    torch.manual_seed(m * k)
    x = (torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    x[0, 7] = 0.5 * float(x[0].abs().max())  # ties and the row max itself are covered
    q, scale = kernels.quantize_per_token_triton(x, "int8")
    q_ref, scale_ref = quantize_rowwise(x, "int8")
    assert torch.equal(scale, scale_ref) and torch.equal(q, q_ref)


@pytest.mark.parametrize("fmt,out_dtype,m,n,k,bias", [
    ("int8", torch.float16, 1, 40, 200, False), ("int8", torch.float32, 37, 72, 96, True),
    ("fp8", torch.float16, 17, 40, 200, True), ("fp8", torch.float32, 5, 72, 128, False)])
def test_scaled_mm(poisoned, fmt, out_dtype, m, n, k, bias):
    torch.manual_seed(m + n + k)
    qa, sa = quantize_rowwise(torch.randn(m, k), fmt)
    qb, sb = quantize_rowwise(torch.randn(n, k) * 0.1, fmt)
    b = torch.randn(n) if bias else None
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
    ours = kernels.scaled_mm_triton(qa, qb, sa, sb, b, out_dtype, config=cfg)
    exact = scaled_mm_torch(qa, qb, sa, sb, b, torch.float64)
    low = scaled_mm_torch(qa, qb, sa, sb, b, out_dtype)
    assert ours.dtype == out_dtype and ours.shape == (m, n)
    if fmt == "int8" and out_dtype == torch.float32:
        assert torch.equal(ours, low)  # exact INT32 sums, the same fp32 epilogue
    assert within_fa_rule(ours, exact, low)


@pytest.mark.parametrize("dtype,group_size,block_k,split_k,m", [
    (torch.float16, 32, 32, 1, 1), (torch.float32, 64, 32, 4, 33), (torch.float16, 128, 64, 3, 7)])
def test_awq_gemm(poisoned, dtype, group_size, block_k, split_k, m):
    torch.manual_seed(group_size + m)
    k, n = 3 * group_size, 40  # three groups; N not a multiple of BLOCK_N
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=True), group_size)
    x = torch.randn(m, k).to(dtype)
    bias = layer.bias.to(dtype) if m != 7 else None
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4,
           "num_stages": 1}
    ours = kernels.awq_gemm_triton(x, layer.qweight, layer.qzeros, layer.scales, group_size, bias, config=cfg)
    w = awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, group_size)
    exact = x.double() @ w.double() + (0 if bias is None else bias.double())
    low = awq_gemm_torch(x, layer.qweight, layer.qzeros, layer.scales, group_size, bias)
    assert ours.dtype == dtype and within_fa_rule(ours, exact, low)


def test_awq_default_config_and_dequantize(poisoned):
    torch.manual_seed(0)
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(256, 64, bias=False), 128)
    x = torch.randn(3, 256, dtype=torch.float16)
    ours = kernels.awq_gemm_triton(x, layer.qweight, layer.qzeros, layer.scales, 128)  # heuristic tiles
    exact = x.double() @ awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, 128).double()
    low = awq_gemm_torch(x, layer.qweight, layer.qzeros, layer.scales, 128, None)
    assert within_fa_rule(ours, exact, low)
    w = kernels.awq_dequantize_triton(layer.qweight, layer.qzeros, layer.scales, 128, torch.float32)
    assert torch.equal(w, awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, 128))


def test_bad_arguments():
    qa, sa = quantize_rowwise(torch.randn(4, 32))
    qb, sb = quantize_rowwise(torch.randn(8, 32), "fp8")
    with pytest.raises(ValueError, match="must share dtype and K"):
        kernels.scaled_mm_triton(qa, qb, sa, sb, None, torch.float32)
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(64, 16, bias=False), 32)
    with pytest.raises(ValueError, match="does not match qweight"):
        kernels.awq_gemm_triton(torch.randn(2, 32), layer.qweight, layer.qzeros, layer.scales, 32)
    with pytest.raises(ValueError, match="BLOCK_K 64 must divide group_size 32"):
        kernels.awq_gemm_triton(torch.randn(2, 64), layer.qweight, layer.qzeros, layer.scales, 32,
                                config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 1})



@pytest.mark.slow
def test_kernels_compile_for_hopper():
    """The interpreter never compiles: build every kernel for sm_90 in a process without TRITON_INTERPRET
    (no GPU needed; Triton ships ptxas) and check the GEMMs use wgmma with pipelined loads."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("quant_hopper_compile.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled 9 kernels for sm_90" in proc.stdout
