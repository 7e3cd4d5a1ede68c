"""nano_quant.layers.gemv under the Triton interpreter: the W4A16 GEMV equals AWQ's dequantize-
then-matmul reference (AutoAWQ GEMM layout) on random weights: odd M, N not a multiple of BLOCK_N, several
groups of K split unevenly over programs, bias on and off, fp16 / fp32 activations (the interpreter computes
bf16 wrongly; bf16 is tested on the GPU). Outputs are poisoned (NaN) before each kernel runs. Tolerance as in
test_quant_kernels: at most twice the error of the reference evaluated in the output dtype."""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import poisoned, within_fa_rule  # noqa: F401 (a fixture)

from nano_quant.layers import gemv
from nano_quant.linear import WQLinear_GEMM, awq_dequantize_torch, awq_gemm_torch

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(m: int, k: int, n: int, group_size: int, dtype: torch.dtype, bias: bool):
    torch.manual_seed(m * 7 + k + n)
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=True), group_size)
    x = torch.randn(m, k).to(dtype)
    b = layer.bias.to(dtype) if bias else None
    w = awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, group_size)
    exact = x.double() @ w.double() + (0 if b is None else b.double())
    low = awq_gemm_torch(x, layer.qweight, layer.qzeros, layer.scales, group_size, b)
    return (x, layer.qweight, layer.qzeros, layer.scales, group_size, b), exact, low


@pytest.mark.parametrize("dtype,m,k,n,group_size,block,split_k,bias", [
    (torch.float16, 1, 128, 40, 32, (1, 32, 32), 1, False),   # one program sums all of K: direct store
    (torch.float16, 1, 128, 40, 32, (1, 32, 16), 3, True),    # 4 groups over 3 programs, 2 steps a group
    (torch.float32, 3, 192, 72, 64, (2, 64, 32), 2, False),   # M not a multiple of BLOCK_M
    (torch.float16, 5, 256, 24, 128, (4, 16, 64), 1, True)])
def test_awq_gemv(poisoned, dtype, m, k, n, group_size, block, split_k, bias):  # noqa: F811
    args, exact, low = _case(m, k, n, group_size, dtype, bias)
    cfg = {"BLOCK_M": block[0], "BLOCK_N": block[1], "BLOCK_K": block[2], "SPLIT_K": split_k, "num_warps": 4,
           "num_stages": 1}
    ours = gemv.awq_gemv_triton(*args, config=cfg)
    assert ours.dtype == dtype and ours.shape == (m, n) and within_fa_rule(ours, exact, low)


def test_default_configs(poisoned):  # noqa: F811
    """The heuristic tiles (SPLIT_K from the SM count) on a layer whose N is below one BLOCK_N."""
    args, exact, low = _case(2, 256, 64, 128, torch.float16, True)
    assert within_fa_rule(gemv.awq_gemv_triton(*args), exact, low)
    cfg = gemv.awq_gemv_config(1, 4096, 4096, 128, 132)
    assert cfg["SPLIT_K"] * 4096 // cfg["BLOCK_N"] >= 2 * 132 and 128 % cfg["BLOCK_K"] == 0


def test_bad_arguments():
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(64, 16, bias=False), 32)
    w = (layer.qweight, layer.qzeros, layer.scales, 32)
    for fn, name in ((gemv.awq_gemv_triton, "awq_gemv"),):
        with pytest.raises(ValueError, match=f"{name}: x \\(2, 32\\) does not match qweight"):
            fn(torch.randn(2, 32), *w)
        with pytest.raises(ValueError, match=f"{name}: BLOCK_K 64 must divide group_size 32"):
            fn(torch.randn(2, 64), *w, config={"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 1})
        with pytest.raises(ValueError, match=f"{name}: SPLIT_K must be >= 1, got 0"):
            fn(torch.randn(2, 64), *w, config={"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 0})
