"""The quantized Linear layers and the module swap that installs them in shared.model.

`W8A8Linear` is SmoothQuant's linear layer (§4, W8A8 precision mapping): INT8 weights with one scale per
output channel (static), the input quantized per token at run time (dynamic), an INT8 × INT8 → INT32 GEMM, and
both scales applied to the INT32 accumulator: Y = (X̄ W̄ᵀ) ⊙ (Δ_X Δ_Wᵀ), out in the input's dtype.
`fmt="fp8"` is the same layer with float8 e4m3 weights and activations (Hopper's FP8 tensor cores).

`WQLinear_GEMM` is AWQ's W4A16 layer in AutoAWQ's "GEMM" layout (its class name): `qweight` int32
(K, N/8) and `qzeros` int32 (K/G, N/8) packed eight nibbles per int32, `scales` fp16 (K/G, N);
Y = X·Ŵ with Ŵ = (q − z)·Δ computed on the fly, activations stay in 16 bits.

Each layer calls its operations through the extension points of `REGISTRY`: a performance layer
(`nano_quant/layers/`: Triton kernels for CUDA tensors) where one applies, else the torch references
here (exact: INT8 products are summed in float64). `performance_layers(False)`
(`nano_flashattn.registry`) runs the references alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nano_flashattn.registry import Registry

from . import quant

# The places a faster implementation may stand in: the three operations of the layers below (dispatch:
# the first layer that applies, else the reference) and a hook that may swap whole modules of a loaded
# model (`swap_modules`). Layer modules load on the first lookup, in this order: the order they are tried.
REGISTRY = Registry("nano_quant",
                    points=("quantize_per_token", "scaled_mm", "awq_gemm", "module_swap"),
                    modules=("gemv", "kernels", "repacked"))
Device = torch.device | str | None


def scaled_mm_torch(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(a bᵀ) ⊙ (scale_a scale_bᵀ) + bias: a (M, K), b (N, K) int8 or fp8, scales fp32 (M,), (N,)."""
    acc = a.double() @ b.double().t()  # exact for INT8 (|sum| < 2^53) and for e4m3 products
    out = acc.float() * scale_a[:, None] * scale_b[None, :]
    return (out if bias is None else out + bias.float()).to(out_dtype)


def awq_dequantize_torch(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                         group_size: int) -> torch.Tensor:
    """The (K, N) fp32 weight Ŵ = (q − z)·Δ of AutoAWQ's GEMM layout."""
    shifts = torch.tensor(quant.AWQ_SHIFTS, device=qweight.device, dtype=torch.int32)
    q = ((qweight[..., None] >> shifts) & 0xF).reshape(qweight.shape[0], -1)
    z = ((qzeros[..., None] >> shifts) & 0xF).reshape(qzeros.shape[0], -1)
    return quant.dequantize_groupwise(q.t(), scales.t(), z.t(), group_size).t()


def awq_gemm_torch(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                   scales: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) @ Ŵ (K, N) + bias in x's dtype."""
    out = x @ awq_dequantize_torch(qweight, qzeros, scales, group_size).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def quantize_per_token(x: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """SmoothQuant's dynamic activation quantization (§2, Eq. 1, per token): a layer's kernel, else
    `quant.quantize_rowwise`."""
    return (REGISTRY.select("quantize_per_token", x, fmt) or quant.quantize_rowwise)(x, fmt)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`scaled_mm_torch`'s product, by a layer's kernel where one applies."""
    args = (a, b, scale_a, scale_b, bias, out_dtype)
    return (REGISTRY.select("scaled_mm", *args) or scaled_mm_torch)(*args)


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`awq_gemm_torch`'s product, by a layer's kernel where one applies (which one may depend on M)."""
    args = (x, qweight, qzeros, scales, group_size, bias)
    return (REGISTRY.select("awq_gemm", *args) or awq_gemm_torch)(*args)


class W8A8Linear(nn.Module):
    """SmoothQuant's W8A8 linear: per-channel static weight scales, per-token dynamic activation scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, fmt: str = "int8",
                 device: Device = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        quant.check_format(fmt)
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        wdtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
        n, k = out_features, in_features
        self.register_buffer("weight", torch.zeros(n, k, dtype=wdtype, device=device))
        self.register_buffer("weight_scale", torch.ones(n, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(n, dtype=dtype, device=device) if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, fmt: str = "int8") -> W8A8Linear:
        """Quantize an nn.Linear's weight per output channel (round to nearest)."""
        w, bias = linear.weight, linear.bias is not None
        m = cls(linear.in_features, linear.out_features, bias, fmt, w.device, w.dtype)
        m.weight, m.weight_scale = quant.quantize_rowwise(w, fmt)
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m

    @classmethod
    def stack(cls, layers: list[W8A8Linear]) -> W8A8Linear:
        """One layer computing the concatenation of `layers`' outputs (one input, e.g. q/k/v): weights,
        scales and biases stacked by output channel. Exact — every channel keeps its scale — and the
        input is quantized once instead of once per layer."""
        first = _check_stackable(layers, "fmt")
        n = sum(m.out_features for m in layers)
        out = cls(first.in_features, n, first.bias is not None, first.fmt, "meta")
        out.weight = torch.cat([m.weight for m in layers])
        out.weight_scale = torch.cat([m.weight_scale for m in layers])
        out.bias = torch.cat([m.bias for m in layers]) if first.bias is not None else None
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        q, scale = quantize_per_token(x2, self.fmt)
        y = scaled_mm(q, self.weight, scale, self.weight_scale, self.bias, x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class WQLinear_GEMM(nn.Module):  # AutoAWQ's class name
    """AWQ's W4A16 linear in AutoAWQ's GEMM layout (group-wise asymmetric INT4, fp16 scales)."""

    def __init__(self, w_bit: int, group_size: int, in_features: int, out_features: int,
                 bias: bool = False, device: Device = None,
                 dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        if w_bit != 4:
            raise ValueError(f"bits must be 4 for AutoAWQ's GEMM layout, got {w_bit!r}")
        quant.check_group_size(in_features, group_size)
        if out_features % 8:
            raise ValueError(f"out_features ({out_features}) must be a multiple of 8 (eight "
                             "nibbles per int32)")
        self.w_bit, self.group_size = w_bit, group_size
        self.in_features, self.out_features = in_features, out_features
        k, n, groups = in_features, out_features, in_features // group_size
        int32 = {"dtype": torch.int32, "device": device}
        self.register_buffer("qweight", torch.zeros(k, n // 8, **int32))
        self.register_buffer("qzeros", torch.zeros(groups, n // 8, **int32))
        self.register_buffer("scales", torch.ones(groups, n, dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.zeros(n, dtype=dtype, device=device) if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group_size: int = 128,
                    zero_point: bool = True) -> WQLinear_GEMM:
        """Round-to-nearest of an nn.Linear's weight (after AWQ's scaling and clipping, or plain: RTN)."""
        w = linear.weight
        bias = linear.bias is not None
        m = cls(4, group_size, linear.in_features, linear.out_features, bias, w.device, w.dtype)
        q, scales, zeros = quant.quantize_groupwise(w, group_size, 4, zero_point)
        if zeros is None:  # symmetric: store q + 8 with zero point 8, the same layout
            q, zeros = q + 8, torch.full_like(scales, 8, dtype=torch.int32)
        m.qweight, m.qzeros = quant.pack_awq(q.t()), quant.pack_awq(zeros.t())
        m.scales = scales.t().contiguous()
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m

    @classmethod
    def stack(cls, layers: list[WQLinear_GEMM]) -> WQLinear_GEMM:
        """One layer computing the concatenation of `layers`' outputs (one input, e.g. q/k/v): the
        packed columns, zero points and scales side by side (each layer's width is a multiple of 8, so no
        int32 holds nibbles of two layers). Exact."""
        first = _check_stackable(layers, "group_size")
        out = cls(4, first.group_size, first.in_features, sum(m.out_features for m in layers),
                  first.bias is not None, "meta")
        for name in ("qweight", "qzeros", "scales"):
            setattr(out, name, torch.cat([getattr(m, name) for m in layers], dim=1))
        out.bias = torch.cat([m.bias for m in layers]) if first.bias is not None else None
        return out

    def dequantize(self) -> torch.Tensor:
        """The (out, in) fp32 weight this layer multiplies by: (q − z)·Δ."""
        return awq_dequantize_torch(self.qweight, self.qzeros, self.scales, self.group_size).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = awq_gemm(x2, self.qweight, self.qzeros, self.scales, self.group_size, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"w_bit={self.w_bit}, group_size={self.group_size}")


def _check_stackable(layers: list[nn.Module], setting: str) -> nn.Module:
    """The first of `layers` if all are one class with one input size, `setting` and bias presence."""
    first = layers[0]

    def same(m: nn.Module) -> bool:
        return (type(m) is type(first) and m.in_features == first.in_features
                and getattr(m, setting) == getattr(first, setting)
                and (m.bias is None) == (first.bias is None))

    if not all(same(m) for m in layers):
        raise ValueError(f"cannot stack {[type(m).__name__ for m in layers]} with in_features "
                         f"{[m.in_features for m in layers]}, {setting} "
                         f"{[getattr(m, setting) for m in layers]} and bias presence differing")
    return first


def replace_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module],
                    skip: Callable[[str], bool] = lambda name: False) -> nn.Module:
    """Swap every nn.Linear of the decoder layers (`model.layers.*`; never the LM head) for `make(name,
    linear)`, in place, and return the model (the torchtitan way: the model file stays plain)."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and full.startswith("model.layers.") and not skip(full):
                setattr(module, child_name, make(full, child))
    return model


def swap_modules(model: nn.Module, serving_only: bool = False) -> nn.Module:
    """Let every performance layer at the "module_swap" point that applies to `model` replace its modules
    in place (the repacked W4A16 kernels take AWQ layers on CUDA), after any stacking of projections;
    `serving_only`: the model is never saved, so a layer may free what only a checkpoint needs. Does
    nothing under `performance_layers(False)`. Returns the model."""
    for swap in REGISTRY.active("module_swap", model):
        swap(model, serving_only=serving_only)
    return model


__all__ = ["REGISTRY", "W8A8Linear", "WQLinear_GEMM", "awq_dequantize_torch", "awq_gemm",
           "awq_gemm_torch", "quantize_per_token", "replace_linears", "scaled_mm",
           "scaled_mm_torch", "swap_modules"]
