"""The methods, as recipes over the pieces above: what `python -m nano_quant.quantize method=...` runs.

| method | weights | activations | before rounding |
|---|---|---|---|
| `rtn-w4` | INT4, groups of 128, zero points | 16-bit | nothing (round to nearest) |
| `awq` | same | 16-bit | AWQ's scale search and clipping (`awq.awq_model`) |
| `naive-w8a8` | INT8 per channel | INT8 per token | nothing |
| `smoothquant` | INT8 per channel | INT8 per token | smoothing, α = 0.5 (`smoothquant.smooth_lm`) |
| `naive-fp8`, `smoothquant-fp8` | FP8 e4m3 per channel | FP8 e4m3 per token | as above |
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shared.model import CausalLM

from .awq import AWQConfig, awq_model
from .calibration import calibration_samples, input_stats
from .config import METHODS, QuantizationConfig
from .linear import W8A8Linear, WQLinear_GEMM, replace_linears
from .smoothquant import smooth_lm

CALIBRATED = ("awq", "smoothquant", "smoothquant-fp8")
ON_THE_FLY = tuple(m for m in METHODS if m not in CALIBRATED)  # rtn-w4, naive-w8a8, naive-fp8


def check_quantization(quantization: object, model: str = "DIR") -> None:
    """An engine's `quantization=` argument (vLLM's name): None, or a method that needs no calibration
    (`ON_THE_FLY`). Calibrated methods run offline on `model` (`python -m nano_quant.quantize`)."""
    if quantization is None:
        return
    if not isinstance(quantization, str):
        raise TypeError(f"quantization must be a str or None, got {type(quantization).__name__}")
    if quantization in CALIBRATED:
        raise ValueError(f"quantization={quantization!r} needs calibration: run `python -m "
                         f"nano_quant.quantize model={model} method={quantization} out=DIR` and "
                         "load DIR")
    if quantization not in ON_THE_FLY:
        raise ValueError(f"quantization must be one of {list(ON_THE_FLY)} or None, got "
                         f"{quantization!r} (awq / smoothquant checkpoints are made offline by "
                         "`python -m nano_quant.quantize` and load with quantization unset)")


def quantized_linear(linear: nn.Linear, qcfg: QuantizationConfig) -> nn.Module:
    """Round an nn.Linear to the layout `qcfg` describes."""
    if qcfg.quant_method == "awq":
        return WQLinear_GEMM.from_linear(linear, qcfg.group_size, qcfg.zero_point)
    return W8A8Linear.from_linear(linear, qcfg.format)


def empty_quantized_linear(linear: nn.Linear, qcfg: QuantizationConfig,
                           dtype: torch.dtype) -> nn.Module:
    """The same layer with uninitialised buffers on the meta device, for a checkpoint to fill in."""
    bias = linear.bias is not None
    with torch.device("meta"):
        if qcfg.quant_method == "awq":
            return WQLinear_GEMM(4, qcfg.group_size, linear.in_features, linear.out_features, bias,
                                 dtype=dtype)
        return W8A8Linear(linear.in_features, linear.out_features, bias, qcfg.format, dtype=dtype)


def skip_fn(qcfg: QuantizationConfig):
    """Linear names that `modules_to_not_convert` keeps in high precision."""
    keep = qcfg.modules_to_not_convert or []
    return lambda name: any(k in name for k in keep)


@torch.no_grad()
def quantize_model(model: CausalLM, method: str, samples: torch.Tensor | None = None,
                   alpha: float = 0.5, awq: AWQConfig | None = None, progress: bool = True,
                   **config: Any) -> QuantizationConfig:
    """Quantize `model` in place with one of the METHODS; return (and set as `model.quantization_config`)
    the config its checkpoint carries. `samples` (n, seqlen) calibrate awq / smoothquant (default: 128 ×
    512 tokens of the stdlib corpus); `alpha` is SmoothQuant's migration strength; `config` overrides
    QuantizationConfig fields (group_size=64, ...). Methods without calibration work on the fly."""
    qcfg = QuantizationConfig.for_method(method, **config)
    if method in CALIBRATED and samples is None:
        samples = calibration_samples()
    if method.startswith("smoothquant"):
        smooth_lm(model, input_stats(model, samples, progress=progress), alpha)
    elif method == "awq":
        awq = awq or AWQConfig(group_size=qcfg.group_size, zero_point=qcfg.zero_point)
        ours = (awq.group_size, awq.zero_point, awq.bits)
        if ours != (qcfg.group_size, qcfg.zero_point, qcfg.bits):
            raise ValueError(f"awq (group_size={awq.group_size}, zero_point={awq.zero_point}, "
                             f"bits={awq.bits}) disagrees with the checkpoint's "
                             f"quantization_config {qcfg.to_dict()}")
        awq_model(model, samples, awq, progress=progress)
    replace_linears(model, lambda name, fc: quantized_linear(fc, qcfg), skip_fn(qcfg))
    model.quantization_config = qcfg
    return qcfg
