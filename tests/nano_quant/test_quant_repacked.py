"""nano_quant.layers.repacked's M = 1 GEMV and M = 2..64 tensor-core kernel under the Triton interpreter: `repack_for_gemv` of random
AutoAWQ-packed weights, then the kernel equals AWQ's dequantize-then-matmul reference (`awq_gemm_torch`):
N not a multiple of BLOCK_N, K a multiple of the group size but not always of a step's groups (masked),
group sizes 32 / 64 / 96 (words padded to a power of two) / 128, one to four groups a step, split-K with a
short last slice, bias on and off, fp16 / fp32 activations, and bf16 ones, which the GEMV reads as int32
pairs and widens with bit operations only. Tolerance as in
test_quant_kernels: at most twice the error of the reference evaluated in the output dtype."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_quant_kernels import poisoned, within_fa_rule  # noqa: F401 (a fixture)

from nano_quant.layers import repacked
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
    (torch.float16, 256, 40, 32, (4, 2, 1), False),    # 2 groups a step; 37 of 40 columns: ragged N
    (torch.float32, 384, 24, 128, (8, 2, 2), True),    # 3 groups, 2 a step: the last slice's step is half empty
    (torch.float16, 192, 72, 64, (2, 1, 3), True),     # one group a step, 3 slices of one step each
    (torch.float16, 512, 16, 128, (1, 4, 1), False),   # one column per program, 4 groups a step
    (torch.float16, 384, 16, 96, (8, 1, 1), False),    # 12 words a group, padded to 16 and masked
    (torch.bfloat16, 384, 24, 64, (4, 4, 2), True)])   # bf16 x read as int32 pairs; 6 groups in slices of 4
def test_repacked_gemv(poisoned, dtype, k, n, group_size, cfg, bias):  # noqa: F811
    layer, x, b, exact, low = _case(k, n, group_size, dtype, bias)
    packed = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, group_size)
    if n == 40:  # the repacked layout has no multiple-of-8 rule on N: keep 37 columns
        packed, exact, low = [t[:37] for t in packed], exact[:, :37], low[:, :37]
        n, b = 37, None
    config = {"BLOCK_N": cfg[0], "GPS": cfg[1], "SPLIT_K": cfg[2], "num_warps": 4, "num_stages": 2}
    ours = repacked.awq_gemv_repacked_triton(x, *packed, group_size, b, config=config)
    assert ours.dtype == dtype and ours.shape == (1, n) and within_fa_rule(ours, exact, low)
    ref = repacked.awq_gemv_repacked_reference(x, *packed, group_size, b)
    assert ref.dtype == dtype and within_fa_rule(ref, exact, low)


def test_repack_layout():
    """Word 4u + c of row n holds q[32u + 2c + 8i + e, n] in nibble 4e + i (the MMA fragment's pairs); scales
    transposed; zeros are −z·s in fp32; the torch dequantization inverts the layout."""
    layer, *_ = _case(64, 16, 32, torch.float32, False)
    qt, st, zt = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 32)
    assert qt.shape == (16, 8) and qt.dtype == torch.int32 and st.shape == zt.shape == (16, 2)
    q = repacked.unpack_awq(layer.qweight)  # (K, N)
    for n in range(16):
        for u, c, i, e in itertools.product(range(2), range(4), range(4), range(2)):
            assert int((qt[n, 4 * u + c] >> (4 * (4 * e + i))) & 0xF) == int(q[32 * u + 2 * c + 8 * i + e, n])
    w = awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, 32)
    assert torch.allclose(repacked.dequantize_repacked_torch(qt, st, zt, 32), w.t(), atol=1e-6, rtol=0)
    z = repacked.unpack_awq(layer.qzeros)
    assert torch.equal(zt, -(z.float() * layer.scales.float()).t()) and torch.equal(st, layer.scales.t())


def test_module_layer(monkeypatch):
    """use_repacked_gemv swaps WQLinear_GEMM in place; a one-row call takes the kernel (forced here on CPU),
    the state dict keeps AutoAWQ's tensors only, and more rows take the layer's own path."""
    layer, x, _, _, _ = _case(128, 24, 32, torch.float16, True)
    model = torch.nn.Sequential(layer)
    want = layer(x.float()).to(torch.float16)
    keys = set(model.state_dict())
    repacked.use_repacked_gemv(model)
    assert type(model[0]) is repacked.RepackedGemvWQLinear and set(model.state_dict()) == keys
    extra = sum(t.numel() * t.element_size() for t in (model[0].qweight_t, model[0].scales_t, model[0].zeros_t))
    assert extra == 24 * 128 // 2 + 24 * 4 * (2 + 4)  # one more 4-bit weight, fp16 scales and fp32 zeros
    calls = []
    real = repacked.awq_gemv_repacked_triton
    monkeypatch.setattr(repacked, "use_triton", lambda t: True)
    monkeypatch.setattr(repacked, "awq_gemv_repacked_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = model(x.half()[None])  # (1, 1, K)
    assert calls and y.shape == (1, 1, 24) and torch.allclose(y[0].float(), want.float(), atol=2e-2, rtol=1e-2)
    model(x.float().expand(2, -1))
    assert len(calls) == 1
    mma = []
    real_mma = repacked.awq_mma_repacked_triton
    monkeypatch.setattr(repacked, "awq_mma_repacked_triton", lambda *a, **k: mma.append(1) or real_mma(*a, **k))
    y3 = model(x.half().expand(3, -1))  # 2..64 rows of fp16 / bf16: the tensor-core kernel
    assert mma == [1] and torch.allclose(y3.float(), want.float().expand(3, -1), atol=2e-2, rtol=1e-2)


def test_group_of_partial_chunks_keeps_autoawq():
    """A group of 16 values does not hold whole 32-value chunks: use_repacked_gemv leaves that layer to AutoAWQ's
    layout and kernels."""
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(64, 16), 16)
    model = repacked.use_repacked_gemv(torch.nn.Sequential(layer), drop_autoawq=True)
    assert type(model[0]) is WQLinear_GEMM and hasattr(model[0], "qweight")


@pytest.mark.parametrize("dtype,m,k,n,group_size,cfg,bias", [
    (torch.float16, 3, 256, 37, 64, (16, 16, 64, 1), True),    # ragged M and N, 4 steps of one group
    (torch.float16, 17, 384, 24, 128, (32, 16, 128, 2), False),  # two row tiles, split-K over 3 steps
    (torch.float32, 5, 256, 64, 32, (16, 32, 32, 3), True),    # fp32 activations, BLOCK_K = group = 32
    (torch.float16, 2, 256, 128, 128, (16, 64, 32, 4), False),  # BLOCK_K 32 of a group of 128: one-chunk tiles
    (torch.float16, 9, 768, 40, 64, (16, 32, 64, 2, 2), True),  # two tiles (groups) a step, 3 steps in 2 slices
    (torch.float16, 40, 256, 24, 64, (64, 16, 64, 2), True),   # 64 rows: the zero point subtracted in the tile
    (torch.float32, 33, 128, 16, 32, (64, 16, 32, 1), False)])  # the same in fp32, one slice
def test_repacked_mma(poisoned, dtype, m, k, n, group_size, cfg, bias):  # noqa: F811
    """The tensor-core kernel (nibbles unpacked to exact integers in nibble-major order, x's tile permuted to
    match, scale and zero per tile) equals AWQ's dequantize-then-matmul within the precision rule, for every
    row of a ragged M."""
    torch.manual_seed(m + k + n)
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n + (-n) % 8, bias=True), group_size)
    packed = [t[:n] for t in repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, group_size)]
    x = (torch.randn(m, k) * 0.05).to(dtype)
    b = layer.bias[:n].to(dtype) if bias else None
    w = awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, group_size)[:, :n]
    exact = x.double() @ w.double() + (0 if b is None else b.double())
    low = (x.float() @ w.float() + (0 if b is None else b.float())).to(dtype)
    config = {"BLOCK_M": cfg[0], "BLOCK_N": cfg[1], "BLOCK_K": cfg[2], "SPLIT_K": cfg[3],
              "K_TILES": cfg[4] if len(cfg) > 4 else 1, "num_warps": 4, "num_stages": 1}
    ours = repacked.awq_mma_repacked_triton(x, *packed, group_size, b, config=config)
    assert ours.dtype == dtype and ours.shape == (m, n) and within_fa_rule(ours, exact, low)
    # split-K: the last slice of a tile sums the partials in a fixed order and hands its ticket back
    assert torch.equal(repacked.awq_mma_repacked_triton(x, *packed, group_size, b, config=config), ours)
    assert not repacked.split_k_tickets(x.device).any()


@pytest.mark.parametrize("block_m", [16, 64])
def test_repacked_mma_zero_scale(block_m):
    """A group whose scale is 0 contributes 0 on both zero-point paths (Σx below 64 rows, q − z from 64)."""
    torch.manual_seed(block_m)
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(128, 16, bias=False), 32)
    layer.scales[1, :5] = 0
    packed = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 32)
    x = (torch.randn(3, 128) * 0.05).half()
    w = awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, 32)
    exact, low = x.double() @ w.double(), (x.float() @ w.float()).half()
    ours = repacked.awq_mma_repacked_triton(x, *packed, 32, config={
        "BLOCK_M": block_m, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 4, "num_stages": 1})
    assert torch.isfinite(ours).all() and within_fa_rule(ours, exact, low)


def test_default_config():
    mma = repacked.awq_mma_repacked_config(16, 4096, 4096, 128, 132)
    assert mma["BLOCK_M"] == 16 and mma["BLOCK_K"] == 128 and mma["SPLIT_K"] >= 1
    assert repacked.awq_mma_repacked_config(40, 1000, 96 * 8, 96, 132)["BLOCK_K"] == 32
    assert repacked.awq_mma_repacked_config(40, 1000, 96 * 8, 96, 132)["BLOCK_M"] == 64
    cfg = repacked.awq_gemv_repacked_config(4096, 4096, 128, 132)  # a measured entry
    assert cfg["GPS"] in (1, 2, 4) and cfg["SPLIT_K"] >= 1 and 4096 // 128 % (cfg["GPS"] * cfg["SPLIT_K"]) == 0
    rule = repacked.awq_gemv_repacked_config(4096, 96 * 8, 96, 132)  # 8 groups, 256 column tiles
    assert rule["GPS"] == 4 and rule["SPLIT_K"] == 1
    few = repacked.awq_gemv_repacked_config(64, 4096, 128, 132)  # 4 column tiles: split K, two steps a slice
    assert few["GPS"] == 4 and few["SPLIT_K"] == 4


def test_bad_arguments():
    layer, *_ = _case(64, 16, 32, torch.float32, False)
    packed = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 32)
    with pytest.raises(ValueError, match="awq_gemv_repacked: x must be \\(1, K\\), got \\(2, 64\\)"):
        repacked.awq_gemv_repacked_triton(torch.randn(2, 64), *packed, 32)
    with pytest.raises(ValueError, match="awq_gemv_repacked: x \\(1, 32\\) does not match qweight_t"):
        repacked.awq_gemv_repacked_triton(torch.randn(1, 32), *packed, 32)
    with pytest.raises(ValueError, match="awq_gemv_repacked: GPS 3 and BLOCK_N 4 must be powers of two"):
        repacked.awq_gemv_repacked_triton(torch.randn(1, 64), *packed, 32,
                                          config={"BLOCK_N": 4, "GPS": 3, "SPLIT_K": 1})
    with pytest.raises(ValueError, match="awq_gemv_repacked: SPLIT_K must be >= 1"):
        repacked.awq_gemv_repacked_triton(torch.randn(1, 64), *packed, 32,
                                          config={"BLOCK_N": 4, "GPS": 1, "SPLIT_K": 0})
    with pytest.raises(ValueError, match="repack_for_gemv: group_size 16 must be a multiple of 32"):
        repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 16)
    with pytest.raises(ValueError, match="repack_for_gemv: qzeros \\(2, 2\\) / scales \\(2, 16\\) do not match"):
        repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, 64)
    with pytest.raises(ValueError, match="repack_for_gemv: qweight and qzeros must be 2-D int32"):
        repacked.repack_for_gemv(layer.qweight.float(), layer.qzeros, layer.scales, 32)
    with pytest.raises(ValueError, match="awq_mma_repacked: x must be \\(M, K\\), got \\(1, 2, 64\\)"):
        repacked.awq_mma_repacked_triton(torch.randn(1, 2, 64), *packed, 32)
    with pytest.raises(ValueError, match="awq_mma_repacked: x \\(2, 32\\) does not match qweight_t"):
        repacked.awq_mma_repacked_triton(torch.randn(2, 32), *packed, 32)
    with pytest.raises(ValueError, match="awq_mma_repacked: BLOCK_K 16 must be a power of two >= 32"):
        repacked.awq_mma_repacked_triton(torch.randn(2, 64), *packed, 32, config={
            "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 1, "num_warps": 4})
    with pytest.raises(ValueError, match="awq_mma_repacked: K_TILES 3 must divide the 2 tiles of BLOCK_K 32"):
        repacked.awq_mma_repacked_triton(torch.randn(2, 64), *packed, 32, config={
            "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "K_TILES": 3, "num_warps": 4})


def test_drop_autoawq(monkeypatch):
    """With AutoAWQ's tensors freed the layer keeps its function: one row (GEMV), a few (tensor cores) and
    more than AWQ_LARGE_M (the repacked weight dequantized by its Triton kernel, then a matmul), and the
    torch path for fp32; dequantize() reads the repacked copy; the state dict no longer holds the weight."""
    layer, *_ = _case(256, 48, 64, torch.float32, True)
    want_w = layer.dequantize()
    model = torch.nn.Sequential(layer)
    x = torch.randn(70, 256) * 0.1
    want = model(x)
    repacked.use_repacked_gemv(model, drop_autoawq=True)
    assert not {"0.qweight", "0.qzeros", "0.scales"} & set(model.state_dict())
    assert torch.allclose(layer.dequantize(), want_w)
    assert torch.allclose(model(x), want, atol=1e-4, rtol=1e-4)  # fp32: torch dequantize + matmul
    monkeypatch.setattr(repacked, "use_triton", lambda t: True)
    for rows in (1, 3, 70):
        y = model(x[:rows].half())
        assert y.dtype == torch.float16 and torch.allclose(y.float(), want[:rows], atol=3e-2, rtol=1e-2), rows
    w16 = repacked.dequantize_repacked_triton(layer.qweight_t, layer.scales_t, layer.zeros_t, 64, torch.float16)
    assert torch.allclose(w16.float(), want_w, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype,k,n,group_size,tile", [
    (torch.float16, 256, 40, 32, 64),     # 2 rows a program: 37 of 40 rows, ragged
    (torch.bfloat16, 384, 24, 96, 256),   # 12 words a group, padded to 16 and masked; 2 rows a program
    (torch.float32, 512, 16, 128, 8192)])  # one program holds every row
def test_dequantize_repacked_triton(dtype, k, n, group_size, tile, monkeypatch):
    """The dequantizing copy (one group of BLOCK_N rows a program) writes the torch dequantization, rounded
    once to `dtype`, for power-of-two and padded groups and a last row block that is partly outside N (bf16:
    within one unit of its last place, the interpreter's fp32 -> bf16 cast truncates)."""
    layer, *_ = _case(k, n, group_size, torch.float32, False)
    packed = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, group_size)
    if n == 40:
        packed = [t[:37] for t in packed]
    monkeypatch.setitem(repacked.DEQUANT_TILE, "values", tile)
    got = repacked.dequantize_repacked_triton(*packed, group_size, dtype)
    want = repacked.dequantize_repacked_torch(*packed, group_size)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.bfloat16:
        assert torch.allclose(got.float(), want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("m,cfg", [(1, {"BLOCK_N": 8, "GPS": 2, "SPLIT_K": 2, "num_warps": 4, "num_stages": 2}),
                                   (5, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2, "K_TILES": 1,
                                        "num_warps": 4, "num_stages": 1}),
                                   (40, {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "K_TILES": 2,
                                         "num_warps": 4, "num_stages": 1})])
def test_silu_and_mul_epilogue(m, cfg):
    """A fused gate_up (gate the first N / 2 columns, up the rest; N / 2 = 20, not a multiple of the tile's
    half) with silu_and_mul=True writes what the plain kernel (one slice of K: the epilogue forces it)
    followed by the SwiGLU kernel writes, fp16 under the interpreter, for the GEMV (M = 1) and the MMA
    kernel; a bias is refused. x holds multiples of 1/64 below 1/8: every product with a 4-bit weight and every
    partial sum is exact in fp32, so the result does not depend on the order in which the interpreter's tl.dot
    (numpy's matmul) sums a tile whose columns differ between the two calls."""
    from shared.kernels import silu_and_mul_triton

    torch.manual_seed(m)
    k, n, group_size = 256, 40, 64
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=False), group_size)
    packed = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, group_size)
    x = (torch.randint(-8, 8, (m, k)) / 64).half()
    kernel = repacked.awq_gemv_repacked_triton if m == 1 else repacked.awq_mma_repacked_triton
    fused = kernel(x, *packed, group_size, config=cfg, silu_and_mul=True)
    plain = kernel(x, *packed, group_size, config={**cfg, "SPLIT_K": 1})
    assert fused.shape == (m, n // 2)
    torch.testing.assert_close(fused, silu_and_mul_triton(*plain.chunk(2, dim=-1)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="silu_and_mul"):
        kernel(x, *packed, group_size, torch.zeros(n, dtype=x.dtype), config=cfg, silu_and_mul=True)


def test_forward_silu_and_mul_falls_back_on_cpu():
    """Off the kernels' path (a CPU tensor) the layer's SwiGLU is forward, then silu_and_mul."""
    from shared.kernels import silu_and_mul

    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(64, 32, bias=False), 32)
    model = repacked.use_repacked_gemv(torch.nn.Sequential(layer))
    x = torch.randn(3, 64)
    torch.testing.assert_close(model[0].forward_silu_and_mul(x), silu_and_mul(*model[0](x).chunk(2, dim=-1)))


def _round(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """v rounded to dtype as the kernels round it here: Triton's interpreter converts fp32 to bf16 by
    truncation (a GPU rounds to nearest even, as torch does); fp16 it rounds as torch does."""
    if dtype == torch.bfloat16:
        return (v.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return v.to(dtype)


def _norm_reference(x, r, w, eps):
    """shared.kernels' add + RMSNorm in x's dtype: the stream x + r rounded, x·rstd rounded, × w rounded."""
    h = x if r is None else _round(x.float() + r.float(), x.dtype)
    rstd = torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)
    return _round(w.float() * _round(h.float() * rstd, x.dtype).float(), x.dtype)


@pytest.mark.parametrize("dtype,cfg,res", [
    (torch.bfloat16, (4, 4, 2), True),    # bf16 rows as int32 pairs, split-K: every slice normalises its x
    (torch.bfloat16, (8, 2, 1), False),   # the norm alone
    (torch.float16, (4, 1, 1), True),     # fp16 rows read as they are
    (torch.float16, (2, 4, 1), False)])   # 6 groups, 4 a step: the last step masked
def test_norm_prologue(poisoned, dtype, cfg, res):  # noqa: F811
    """norm_weight (and residual): the kernel multiplies RMSNorm(x (+ residual)) — the fused decoder layer's
    QKV and gate_up prologue — within the tolerance rule of the same GEMV of the reference's normalised row
    (bf16 under the interpreter: its output truncated, not rounded, so one more bf16 ulp of the output)."""
    torch.manual_seed(7)
    k, n, group_size = 384, 24, 64
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=False), group_size)
    packed = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, group_size)
    x, r = (torch.randn(1, k) * 3).to(dtype), (torch.randn(1, k) if res else torch.zeros(1, k)).to(dtype)
    w = (1 + 0.1 * torch.randn(k)).to(dtype)
    xn = _norm_reference(x, r if res else None, w, 1e-5)
    exact = xn.double() @ awq_dequantize_torch(layer.qweight, layer.qzeros, layer.scales, group_size).double()
    low = awq_gemm_torch(xn, layer.qweight, layer.qzeros, layer.scales, group_size, None)
    config = {"BLOCK_N": cfg[0], "GPS": cfg[1], "SPLIT_K": cfg[2], "num_warps": 4, "num_stages": 2}
    ours = repacked.awq_gemv_repacked_triton(x, *packed, group_size, config=config, norm_weight=w, eps=1e-5,
                                             residual=r if res else None)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 0.0
    assert ours.dtype == dtype and within_fa_rule(ours, exact, low, eps=ulp)


@pytest.mark.parametrize("dtype,two", [(torch.bfloat16, True), (torch.float16, False)])
def test_add_epilogue(poisoned, dtype, two):  # noqa: F811
    """add=(h, r): round(x Ŵ) + the stream round(h + r) (or + h), rounded — the o_proj that returns the new
    residual stream; equal to the plain GEMV's output added as the paper path adds two tensors (the GEMV's sums
    are exact: x holds multiples of 1/64), and bad neighbours are refused by name."""
    torch.manual_seed(3)
    k, n, group_size = 256, 40, 64
    layer = WQLinear_GEMM.from_linear(torch.nn.Linear(k, n, bias=False), group_size)
    packed = repacked.repack_for_gemv(layer.qweight, layer.qzeros, layer.scales, group_size)
    x = (torch.randint(-8, 8, (1, k)) / 64).to(dtype)
    h, r = torch.randn(1, n).to(dtype), torch.randn(1, n).to(dtype)
    config = {"BLOCK_N": 8, "GPS": 2, "SPLIT_K": 2, "num_warps": 4, "num_stages": 2}  # add forces one slice
    ours = repacked.awq_gemv_repacked_triton(x, *packed, group_size, config=config, add=(h, r if two else None))
    plain = repacked.awq_gemv_repacked_triton(x, *packed, group_size, config={**config, "SPLIT_K": 1})
    stream = _round(h.float() + r.float(), dtype) if two else h
    torch.testing.assert_close(ours, _round(plain.float() + stream.float(), dtype), rtol=0, atol=0)
    with pytest.raises(ValueError, match="add"):
        repacked.awq_gemv_repacked_triton(x, *packed, group_size, torch.zeros(n, dtype=dtype), add=(h, None))
    with pytest.raises(ValueError, match="add's h"):
        repacked.awq_gemv_repacked_triton(x, *packed, group_size, add=(h[:, :3], None))
    with pytest.raises(ValueError, match="residual"):
        repacked.awq_gemv_repacked_triton(x, *packed, group_size, residual=x)
    with pytest.raises(ValueError, match="norm_weight"):
        repacked.awq_gemv_repacked_triton(x, *packed, group_size, norm_weight=x.float())
