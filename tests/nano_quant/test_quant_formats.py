"""nano_quant.quant: the number formats, their analytic error bounds, and AutoAWQ's packing.

The group-wise INT4 math is checked against torch's own int4 kernel (tinygemm's CPU twin,
`_weight_int4pack_mm_for_cpu`), and the packing against a literal transcription of AutoAWQ's packer loop
(awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear) and unpacker (awq/utils/packing_utils.py).
"""

from __future__ import annotations

import pytest
import torch

from nano_quant.linear import awq_dequantize_torch
from nano_quant.quant import (
    dequantize_groupwise,
    dequantize_rowwise,
    fake_quantize_groupwise,
    pack_awq,
    quantize_groupwise,
    quantize_rowwise,
    unpack_awq,
)

AUTOAWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AUTOAWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def autoawq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's loop: packed column `col`, nibble i (bits 4i..4i+3) holds column col*8 + order_map[i]."""
    rows, cols = intweight.shape
    qweight = torch.zeros(rows, cols // 8, dtype=torch.int32)
    for col in range(cols // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AUTOAWQ_ORDER[i]].to(torch.int32) << (i * 4)
    return qweight


def autoawq_dequantize(qweight, qzeros, scales, group_size):
    """AutoAWQ's dequantize_gemm: unpack nibbles in bit order, undo the interleave, (q - z) * s."""
    shifts = torch.arange(0, 32, 4)
    iw = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).reshape(qweight.shape[0], -1)
    iz = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).reshape(qzeros.shape[0], -1)
    order = torch.arange(iw.shape[-1]).view(-1, 8)[:, AUTOAWQ_REVERSE_ORDER].reshape(-1)
    iw, iz = iw[:, order] & 15, iz[:, order] & 15
    return (iw - iz.repeat_interleave(group_size, 0)) * scales.float().repeat_interleave(group_size, 0)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_rowwise_bounds(fmt):
    torch.manual_seed(0)
    t = torch.randn(33, 300) * torch.logspace(-3, 2, 33)[:, None]  # rows of very different ranges
    t[5] = 0.0
    q, scale = quantize_rowwise(t, fmt)
    assert scale.shape == (33,) and scale.dtype == torch.float32 and torch.isfinite(scale).all()
    err = (dequantize_rowwise(q, scale) - t).abs()
    if fmt == "int8":
        assert q.dtype == torch.int8 and int(q.abs().max()) == 127
        assert torch.all(err <= scale[:, None] / 2 * (1 + 1e-6))  # round to nearest: half a step
        assert torch.equal(q[5], torch.zeros(300, dtype=torch.int8))
    else:  # e4m3: 3 mantissa bits (relative 2^-4 half-step), subnormal step 2^-9 below 2^-6
        assert q.dtype == torch.float8_e4m3fn and float(q.float().abs().max()) == 448.0
        assert torch.all(err <= t.abs() * 2**-4 + scale[:, None] * 2**-10)


@pytest.mark.parametrize("bits,group_size,zero_point", [(4, 128, True), (4, 32, True), (4, 64, False),
                                                        (8, 64, True)])
def test_groupwise_bound_per_group(bits, group_size, zero_point):
    torch.manual_seed(1)
    w = torch.randn(24, 384) * 0.05
    w[3, :group_size] = w[3, :group_size].abs() + 0.1  # a one-signed group: 0 joins its range
    w[7, group_size:2 * group_size] = 0.0  # a zero group
    q, scales, zeros = quantize_groupwise(w, group_size, bits, zero_point)
    assert q.shape == w.shape and scales.shape == (24, 384 // group_size) and scales.dtype == torch.float16
    if zero_point:
        assert int(q.min()) >= 0 and int(q.max()) <= 2**bits - 1
        assert 0 <= int(zeros.min()) <= int(zeros.max()) < 2**bits
    else:
        assert zeros is None and -(2 ** (bits - 1)) <= int(q.min()) and int(q.max()) < 2 ** (bits - 1)
    err = (dequantize_groupwise(q, scales, zeros, group_size) - w).abs().reshape(24, -1, group_size)
    # |w - Q(w)| <= Δ/2 per group; the fp16 rounding of Δ stretches the grid by at most (2^bits - 1)·2^-11·Δ
    bound = scales.float() * (0.5 + (2**bits - 1) * 2**-11) + 1e-7
    assert torch.all(err <= bound[..., None])
    assert torch.equal(fake_quantize_groupwise(w, group_size, bits, zero_point),
                       dequantize_groupwise(q, scales, zeros, group_size))


def test_groupwise_matches_torch_int4_kernel():
    """(q - z)·Δ is what torch's tinygemm computes as (q - 8)·Δ + (8 - z)·Δ."""
    torch.manual_seed(2)
    n, k, g = 64, 256, 64
    w, x = torch.randn(n, k), torch.randn(5, k)
    q, scales, zeros = quantize_groupwise(w, g)
    scales_and_zeros = torch.stack([scales.float(), (8 - zeros).float() * scales.float()], -1).transpose(0, 1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, scales_and_zeros.contiguous())
    ref = x @ dequantize_groupwise(q, scales, zeros, g).t()
    assert torch.allclose(y, ref, rtol=0, atol=1e-4 * float(ref.abs().max()))


def test_awq_packing_is_autoawqs():
    torch.manual_seed(3)
    q = torch.randint(0, 16, (48, 64), dtype=torch.int32)
    packed = pack_awq(q)
    assert packed.dtype == torch.int32 and packed.shape == (48, 8)
    assert torch.equal(packed, autoawq_pack(q))
    assert torch.equal(unpack_awq(packed), q)
    # a whole layer: our (K, N/8) buffers dequantize to the same weight under AutoAWQ's own unpacker
    w = torch.randn(40, 256)
    qw, scales, zeros = quantize_groupwise(w, 64)
    qweight, qzeros, s = pack_awq(qw.t()), pack_awq(zeros.t()), scales.t().contiguous()
    ours = awq_dequantize_torch(qweight, qzeros, s, 64)
    assert torch.equal(ours, autoawq_dequantize(qweight, qzeros, s, 64))
    assert torch.equal(ours.t(), dequantize_groupwise(qw, scales, zeros, 64))


def test_bad_arguments():
    w = torch.randn(8, 256)
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        quantize_groupwise(w, 128, bits=3)
    with pytest.raises(ValueError, match=r"group_size \(100\) must be a positive int dividing the input "
                                         r"dimension K = 256"):
        quantize_groupwise(w, 100)
    with pytest.raises(ValueError, match=r"group_size \(0\)"):
        quantize_groupwise(w, 0)
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_rowwise(w, "int4")
    with pytest.raises(ValueError, match="packed dimension must be a multiple of 8, got 12"):
        pack_awq(torch.zeros(4, 12, dtype=torch.int32))
