"""`QuantizationConfig`: what a quantized checkpoint's `config.json` says about its weights.

Two layouts, each recognised by `quant_method` (the key vLLM and transformers dispatch on):

* `"awq"` — AutoAWQ's format, so real AWQ checkpoints load and ours load elsewhere:
  `{"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}`;
  each quantized Linear stores `qweight`, `qzeros`, `scales` (`nano_quant.linear.WQLinear_GEMM`).
  Written by the methods `awq` and `rtn-w4`.
* `"w8a8"` — SmoothQuant's W8A8 (ours; there is no single ecosystem format for it):
  `{"quant_method": "w8a8", "bits": 8, "format": "int8" | "fp8", "activation_scheme": "dynamic"}`;
  each quantized Linear stores `weight` (int8 / float8_e4m3fn) and `weight_scale` (fp32 per output
  channel, vLLM's name). Written by `smoothquant`, `naive-w8a8`, `smoothquant-fp8`, `naive-fp8`; the
  smoothing itself is already folded into the norms and v/up weights, so it needs no tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .quant import FORMATS

QUANT_METHODS = ("awq", "w8a8")
# method (what `python -m nano_quant.quantize method=...` runs) -> how it is stored
METHODS: dict[str, dict[str, Any]] = {
    "awq": {"quant_method": "awq", "bits": 4},
    "rtn-w4": {"quant_method": "awq", "bits": 4},
    "smoothquant": {"quant_method": "w8a8", "bits": 8, "format": "int8"},
    "naive-w8a8": {"quant_method": "w8a8", "bits": 8, "format": "int8"},
    "smoothquant-fp8": {"quant_method": "w8a8", "bits": 8, "format": "fp8"},
    "naive-fp8": {"quant_method": "w8a8", "bits": 8, "format": "fp8"},
}


@dataclass
class QuantizationConfig:
    """HF `quantization_config` fields. `bits` must be 4 (awq) or 8 (w8a8)."""

    quant_method: str
    bits: int
    group_size: int = 128  # awq: input channels per scale / zero point
    zero_point: bool = True  # awq: asymmetric groups (AutoAWQ's default)
    version: str = "gemm"  # awq: the packing; only "gemm" is implemented
    format: str = "int8"  # w8a8: "int8" | "fp8" (float8 e4m3)
    activation_scheme: str = "dynamic"  # w8a8: activations are quantized per token at run time
    modules_to_not_convert: list[str] | None = None  # Linear names (substrings) left in high precision

    def __post_init__(self) -> None:
        if self.quant_method not in QUANT_METHODS:
            raise ValueError(f"quantization_config.quant_method must be one of {QUANT_METHODS}, "
                             f"got {self.quant_method!r}")
        if self.bits not in (4, 8):
            raise ValueError(f"quantization_config.bits must be 4 or 8, got {self.bits!r}")
        if self.quant_method == "awq":
            if self.bits != 4:
                raise ValueError(f"quantization_config.bits must be 4 for quant_method 'awq', got "
                                 f"{self.bits}")
            if not isinstance(self.group_size, int) or self.group_size <= 0:
                raise ValueError("quantization_config.group_size must be a positive int, got "
                                 f"{self.group_size!r}")
            if str(self.version).lower() != "gemm":
                raise ValueError(f"quantization_config.version {self.version!r} is not supported "
                                 "(only 'gemm')")
        else:
            if self.bits != 8:
                raise ValueError(f"quantization_config.bits must be 8 for quant_method 'w8a8', got "
                                 f"{self.bits}")
            if self.format not in FORMATS:
                raise ValueError(f"quantization_config.format must be one of {FORMATS}, got {self.format!r}")
            if self.activation_scheme != "dynamic":
                raise ValueError("quantization_config.activation_scheme must be 'dynamic', got "
                                 f"{self.activation_scheme!r}")

    @classmethod
    def for_method(cls, method: str, **overrides: Any) -> QuantizationConfig:
        """The config a method writes (`METHODS`), e.g. `for_method("awq", group_size=64)`."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
        return cls(**{**METHODS[method], **overrides})

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "quantization_config") -> QuantizationConfig:
        """Parse a checkpoint's `quantization_config`; errors name `source` (the config.json path)."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: quantization_config must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        if "w_bit" in d:  # AutoAWQ's own spelling of bits / group_size
            d.setdefault("bits", d.pop("w_bit"))
        if "q_group_size" in d:
            d.setdefault("group_size", d.pop("q_group_size"))
        if "quant_method" not in d or "bits" not in d:
            raise ValueError(f"{source}: quantization_config needs 'quant_method' and 'bits', got "
                             f"{sorted(d)}")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The `quantization_config` written to config.json (only the fields of this quant_method)."""
        if self.quant_method == "awq":
            keys = ("quant_method", "bits", "group_size", "zero_point", "version", "modules_to_not_convert")
        else:
            keys = ("quant_method", "bits", "format", "activation_scheme", "modules_to_not_convert")
        return {k: getattr(self, k) for k in keys}
