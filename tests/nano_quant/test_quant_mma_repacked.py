"""nano_quant.gemv's tensor-core kernel over the repacked layout (2..16 rows) under the Triton interpreter:
`repack_for_gemv` of random AutoAWQ-packed weights, then the kernel equals AWQ's dequantize-then-matmul
reference (`awq_gemm_torch`) for M in {2, 5, 16}: N not a multiple of BLOCK_N, K not always a multiple of
BLOCK_K (ragged last step), group sizes 32 / 64 / 128, BLOCK_K below and above the group size, split-K 1 to
3, bias on and off, fp16 / fp32 activations (the interpreter computes bf16 wrongly; bf16 runs in the GPU
test). Tolerance as in test_quant_kernels: at most twice the error of the reference evaluated in the output
dtype. The repacked layer sends 2..16 rows here and 17 to its own path."""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import poisoned, within_fa_rule  # noqa: F401 (a fixture)

from nano_quant import gemv
from nano_quant.linear import WQLinear_GEMM, awq_dequantize_torch, awq_gemm_torch

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(m: int, k: int, n: int, group_size: int, dtype: torch.dtype, bias: bool):
    torch.manual_seed(m + k + n + group_size)
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=True), group_size)
    x = torch.randn(m, k).to(dtype)
    b = layer.bias.to(dtype) if bias else None
    w = awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, group_size)
    exact = x.double() @ w.double() + (0 if b is None else b.double())
    low = awq_gemm_torch(x, layer.qweight, layer.qzeros, layer.scales, group_size, b)
    return layer, x, b, exact, low


@pytest.mark.parametrize("dtype,m,k,n,group_size,cfg,bias", [
    (torch.float16, 2, 256, 40, 32, (16, 64, 1), False),   # 2 groups a step; 37 of 40 columns: ragged N
    (torch.float32, 16, 384, 24, 128, (16, 256, 2), True),  # K % BLOCK_K != 0 (masked last step), split-K
    (torch.float16, 5, 192, 72, 64, (64, 32, 3), True),     # BLOCK_K below the group, 6 steps over 3 slices
    (torch.float16, 16, 512, 16, 128, (16, 128, 2), False),  # BLOCK_K = group, split-K 2
    (torch.float32, 5, 320, 32, 32, (32, 128, 1), False)])   # 4 groups a step, ragged last step
def test_mma_repacked(poisoned, dtype, m, k, n, group_size, cfg, bias):  # noqa: F811
    layer, x, b, exact, low = _case(m, k, n, group_size, dtype, bias)
    packed = gemv.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, group_size)
    if n == 40:  # the repacked layout has no multiple-of-8 rule on N: keep 37 columns
        packed, exact, low = [t[:37] for t in packed], exact[:, :37], low[:, :37]
        n = 37
    config = {"BLOCK_N": cfg[0], "BLOCK_K": cfg[1], "SPLIT_K": cfg[2], "num_warps": 4, "num_stages": 2}
    ours = gemv.awq_mma_repacked_triton(x, *packed, group_size, b, config=config)
    assert ours.dtype == dtype and ours.shape == (m, n) and within_fa_rule(ours, exact, low)


def test_default_config_runs(poisoned):  # noqa: F811
    """The rule's tiles (split-K where the column tiles are few) compute the same product."""
    layer, x, b, exact, low = _case(3, 512, 64, 128, torch.float16, True)
    cfg = gemv.awq_mma_repacked_config(64, 512, 128, 132)
    assert cfg["SPLIT_K"] == 1 and cfg["BLOCK_K"] == 128  # 4 K steps: no split
    assert gemv.awq_mma_repacked_config(4096, 4096, 128, 132)["SPLIT_K"] > 1
    assert gemv.awq_mma_repacked_config(4096, 96 * 8, 96, 132)["BLOCK_K"] == 32
    packed = gemv.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 128)
    assert within_fa_rule(gemv.awq_mma_repacked_triton(x, *packed, 128, b), exact, low)


def test_module_layer_dispatch(monkeypatch):
    """2..16 rows take the tensor-core kernel (forced here on CPU), one row the GEMV, 17 the layer's own."""
    layer, x, _, _, _ = _case(17, 128, 24, 32, torch.float16, True)
    model = torch.nn.Sequential(layer)
    want = layer(x.float()).to(torch.float16)
    gemv.use_repacked_gemv(model)
    calls = []
    real_mma, real_gemv = gemv.awq_mma_repacked_triton, gemv.awq_gemv_repacked_triton
    monkeypatch.setattr(gemv, "use_triton", lambda t: True)
    monkeypatch.setattr(gemv, "awq_mma_repacked_triton", lambda *a, **k: calls.append("mma") or real_mma(*a, **k))
    monkeypatch.setattr(gemv, "awq_gemv_repacked_triton",
                        lambda *a, **k: calls.append("gemv") or real_gemv(*a, **k))
    for rows in (2, 16):
        y = model(x[:rows].half().view(1, rows, -1))
        assert y.shape == (1, rows, 24)
        assert torch.allclose(y[0].float(), want[:rows].float(), atol=2e-2, rtol=1e-2)
    assert calls == ["mma", "mma"]
    model(x[:1].half())
    assert calls[-1] == "gemv"
    y = model(x.half())  # 17 rows: WQLinear_GEMM's own path
    assert len(calls) == 3 and y.shape == (17, 24)


def test_bad_arguments():
    layer, *_ = _case(2, 64, 16, 32, torch.float32, False)
    packed = gemv.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 32)
    f = gemv.awq_mma_repacked_triton
    with pytest.raises(ValueError, match="awq_mma_repacked: x must be \\(M, K\\) with M <= 16, got \\(17, 64\\)"):
        f(torch.randn(17, 64), *packed, 32)
    with pytest.raises(ValueError, match="awq_mma_repacked: x must be \\(M, K\\)"):
        f(torch.randn(64), *packed, 32)
    with pytest.raises(ValueError, match="awq_mma_repacked: x \\(2, 32\\) does not match qweight_t"):
        f(torch.randn(2, 32), *packed, 32)
    with pytest.raises(ValueError, match="awq_mma_repacked: x \\(2, 64\\) does not match qweight_t .* zeros_t"):
        f(torch.randn(2, 64), packed[0], packed[1], packed[2].half(), 32)
    with pytest.raises(ValueError, match="awq_mma_repacked: BLOCK_K 16 must be a power of two >= 32"):
        f(torch.randn(2, 64), *packed, 32, config={"BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 1})
    with pytest.raises(ValueError, match="awq_mma_repacked: SPLIT_K must be >= 1 and BLOCK_N a power of two"):
        f(torch.randn(2, 64), *packed, 32, config={"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 0})
    with pytest.raises(ValueError, match="awq_mma_repacked: SPLIT_K must be >= 1 and BLOCK_N a power of two"):
        f(torch.randn(2, 64), *packed, 32, config={"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 1})
