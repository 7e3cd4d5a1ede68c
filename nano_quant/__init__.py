"""nano_quant: SmoothQuant (W8A8) and AWQ (W4A16) on shared.model, with Triton kernels.

    from nano_quant import quantize_model, load_quantized_model, save_quantized
    qcfg = quantize_model(model, "awq")              # in place; calibrates on the stdlib corpus
    save_quantized(model, "out/")                     # AutoAWQ's GEMM layout for awq / rtn-w4
    model = load_quantized_model("out/", "cuda", torch.bfloat16)   # ours or an AutoAWQ checkpoint
    model = load_for_inference(path, "cuda", torch.bfloat16, quantization="rtn-w4")  # what engines call

On CUDA tensors the quantized layers run the Triton kernels of `nano_quant/layers/` (registered into
`linear.REGISTRY` on its first lookup; `performance_layers(False)` from `nano_flashattn.registry` runs the
torch references alone). `swap_modules(model)` lets a layer replace modules of a loaded model (the
repacked W4A16 kernels), after any stacking of projections.
"""

from .awq import AWQConfig, awq_model
from .calibration import calibration_samples, input_stats
from .checkpoint import (
    dequantize_model,
    load_for_inference,
    load_quantized_model,
    quantization_config_of,
    save_quantized,
)
from .config import METHODS, QuantizationConfig
from .linear import W8A8Linear, WQLinear_GEMM, replace_linears, swap_modules
from .methods import ON_THE_FLY, check_quantization, quantize_model
from .smoothquant import smooth_lm

__all__ = [
    "METHODS",
    "ON_THE_FLY",
    "AWQConfig",
    "QuantizationConfig",
    "W8A8Linear",
    "WQLinear_GEMM",
    "awq_model",
    "calibration_samples",
    "check_quantization",
    "dequantize_model",
    "input_stats",
    "load_for_inference",
    "load_quantized_model",
    "quantization_config_of",
    "quantize_model",
    "replace_linears",
    "save_quantized",
    "smooth_lm",
    "swap_modules",
]
