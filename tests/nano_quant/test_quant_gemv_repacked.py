"""nano_quant.gemv's repacked M = 1 GEMV under the Triton interpreter: `repack_for_gemv` of random
AutoAWQ-packed weights, then the kernel equals AWQ's dequantize-then-matmul reference (`awq_gemm_torch`):
N not a multiple of BLOCK_N, K a multiple of the group size but not always of BLOCK_K, group sizes
32 / 64 / 128, BLOCK_K below and above the group size, split-K, bias on and off, fp16 / fp32
activations, and bf16 ones, which the kernel reads as int32 pairs and widens with bit operations only. Tolerance as in
test_quant_kernels: at most twice the error of the reference evaluated in the output dtype."""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import poisoned, within_fa_rule  # noqa: F401 (a fixture)

from nano_quant import gemv
from nano_quant.linear import WQLinear_GEMM, awq_dequantize_torch, awq_gemm_torch

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(k: int, n: int, group_size: int, dtype: torch.dtype, bias: bool):
    torch.manual_seed(k + n + group_size)
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=True), group_size)
    x = torch.randn(1, k).to(dtype)
    b = layer.bias.to(dtype) if bias else None
    w = awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, group_size)
    exact = x.double() @ w.double() + (0 if b is None else b.double())
    low = awq_gemm_torch(x, layer.qweight, layer.qzeros, layer.scales, group_size, b)
    return layer, x, b, exact, low


@pytest.mark.parametrize("dtype,k,n,group_size,cfg,bias", [
    (torch.float16, 256, 40, 32, (4, 64, 1), False),   # 2 groups a step; 37 of 40 columns: ragged N
    (torch.float32, 384, 24, 128, (8, 256, 2), True),    # K % BLOCK_K != 0 (masked), split-K
    (torch.float16, 192, 72, 64, (2, 32, 3), True),    # BLOCK_K below the group, 6 steps over 3 slices
    (torch.float16, 512, 16, 128, (1, 512, 1), False),  # one column per program, 4 groups a step
    (torch.bfloat16, 384, 24, 64, (4, 256, 2), True)])  # bf16 x read as int32 pairs; K % BLOCK_K != 0
def test_repacked_gemv(poisoned, dtype, k, n, group_size, cfg, bias):  # noqa: F811
    layer, x, b, exact, low = _case(k, n, group_size, dtype, bias)
    packed = gemv.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, group_size)
    if n == 40:  # the repacked layout has no multiple-of-8 rule on N: keep 37 columns
        packed, exact, low = [t[:37] for t in packed], exact[:, :37], low[:, :37]
        n, b = 37, None
    config = {"BLOCK_N": cfg[0], "BLOCK_K": cfg[1], "SPLIT_K": cfg[2], "num_warps": 4,
              "num_stages": 2}
    ours = gemv.awq_gemv_repacked_triton(x, *packed, group_size, b, config=config)
    assert ours.dtype == dtype and ours.shape == (1, n) and within_fa_rule(ours, exact, low)
    ref = gemv.awq_gemv_repacked_reference(x, *packed, group_size, b)
    assert ref.dtype == dtype and within_fa_rule(ref, exact, low)


def test_repack_layout():
    """Word j of row n holds q[8j + i, n] in nibble i; scales transposed; zeros are −z·s in fp32."""
    layer, *_ = _case(64, 16, 32, torch.float32, False)
    qt, st, zt = gemv.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 32)
    assert qt.shape == (16, 8) and qt.dtype == torch.int32 and st.shape == zt.shape == (16, 2)
    q = gemv.unpack_awq(layer.qweight)  # (K, N)
    n, j, i = 5, 3, 6
    assert int((qt[n, j] >> (4 * i)) & 0xF) == int(q[8 * j + i, n])
    z = gemv.unpack_awq(layer.qzeros)
    assert torch.equal(zt, -(z.float() * layer.scales.float()).t()) and torch.equal(st, layer.scales.t())


def test_module_layer(monkeypatch):
    """use_repacked_gemv swaps WQLinear_GEMM in place; a one-row call takes the kernel (forced here on CPU),
    the state dict keeps AutoAWQ's tensors only, and more rows take the layer's own path."""
    layer, x, _, _, _ = _case(128, 24, 32, torch.float16, True)
    model = torch.nn.Sequential(layer)
    want = layer(x.float()).to(torch.float16)
    keys = set(model.state_dict())
    gemv.use_repacked_gemv(model)
    assert type(model[0]) is gemv.RepackedGemvWQLinear and set(model.state_dict()) == keys
    extra = sum(t.numel() * t.element_size() for t in (model[0].qweight_t, model[0].scales_t, model[0].zeros_t))
    assert extra == 24 * 128 // 2 + 24 * 4 * (2 + 4)  # one more 4-bit weight, fp16 scales and fp32 zeros
    calls = []
    real = gemv.awq_gemv_repacked_triton
    monkeypatch.setattr(gemv, "use_triton", lambda t: True)
    monkeypatch.setattr(gemv, "awq_gemv_repacked_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = model(x.half()[None])  # (1, 1, K)
    assert calls and y.shape == (1, 1, 24) and torch.allclose(y[0].float(), want.float(), atol=2e-2, rtol=1e-2)
    model(x.float().expand(2, -1))
    assert len(calls) == 1


def test_default_config():
    cfg = gemv.awq_gemv_repacked_config(4096, 4096, 128, 132)
    assert cfg["BLOCK_K"] % 128 == 0 and cfg["BLOCK_K"] // 2 >= 256 and cfg["SPLIT_K"] >= 1
    assert gemv.awq_gemv_repacked_config(4096, 96 * 8, 96, 132)["BLOCK_K"] == 32


def test_bad_arguments():
    layer, *_ = _case(64, 16, 32, torch.float32, False)
    packed = gemv.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 32)
    with pytest.raises(ValueError, match="awq_gemv_repacked: x must be \\(1, K\\), got \\(2, 64\\)"):
        gemv.awq_gemv_repacked_triton(torch.randn(2, 64), *packed, 32)
    with pytest.raises(ValueError, match="awq_gemv_repacked: x \\(1, 32\\) does not match qweight_t"):
        gemv.awq_gemv_repacked_triton(torch.randn(1, 32), *packed, 32)
    with pytest.raises(ValueError, match="awq_gemv_repacked: BLOCK_K 48 must be a power of two"):
        gemv.awq_gemv_repacked_triton(torch.randn(1, 64), *packed, 32,
                                      config={"BLOCK_N": 4, "BLOCK_K": 48, "SPLIT_K": 1})
    with pytest.raises(ValueError, match="awq_gemv_repacked: SPLIT_K must be >= 1"):
        gemv.awq_gemv_repacked_triton(torch.randn(1, 64), *packed, 32,
                                      config={"BLOCK_N": 4, "BLOCK_K": 32, "SPLIT_K": 0})
    with pytest.raises(ValueError, match="repack_for_gemv: group_size 12 must be a multiple of 8"):
        gemv.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 12)
    with pytest.raises(ValueError, match="repack_for_gemv: qzeros \\(2, 2\\) / scales \\(2, 16\\) do not match"):
        gemv.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 16)
    with pytest.raises(ValueError, match="repack_for_gemv: qweight and qzeros must be 2-D int32"):
        gemv.repack_for_gemv(layer.qweight.float(), layer.qzeros, layer.scales, 32)
