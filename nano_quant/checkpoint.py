"""Quantized checkpoints: an HF directory whose `config.json` carries a `quantization_config`.

`save_quantized` writes what `quantize_model` produced (AutoAWQ's GEMM layout for awq / rtn-w4, ours for
W8A8); `load_quantized_model` reads those and real AutoAWQ checkpoints of Llama / Qwen2 / Qwen3, and plain
checkpoints too (no `quantization_config`: `shared.checkpoint.load_model`). Every tensor is checked
against what the config implies — name, shape, dtype — and a disagreement is a ValueError naming the
tensor, the file and the config key, never a silently wrong model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from shared.checkpoint import _IGNORED_SUFFIXES, load_model, load_state_dict, read_json, save_checkpoint
from shared.config import ModelConfig
from shared.model import CausalLM

from .config import QuantizationConfig
from .linear import W8A8Linear, WQLinear_GEMM, replace_linears
from .methods import check_quantization, empty_quantized_linear, quantize_model, skip_fn
from .quant import dequantize_rowwise

_QUANTIZED = ("qweight", "qzeros", "weight_scale")  # tensors whose dtype the layout fixes


def quantization_config_of(path: str | os.PathLike) -> QuantizationConfig | None:
    """The checkpoint's `quantization_config` (None for a plain checkpoint); errors name config.json."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no config.json at {str(file)!r}")
    q = read_json(file).get("quantization_config")
    return None if q is None else QuantizationConfig.from_dict(q, source=str(file))


def save_quantized(model: CausalLM, path: str | os.PathLike, qcfg: QuantizationConfig | None = None,
                   dtype: torch.dtype | None = torch.float16) -> Path:
    """Write `model` (quantized in place by `quantize_model`) as an HF directory: the quantized buffers
    as they are (int32 `qweight` / `qzeros`, fp16 `scales`; int8 or fp8 `weight`, fp32 `weight_scale`),
    every other floating tensor in `dtype` (AutoAWQ writes fp16; None keeps them), and config.json with
    `quantization_config`, written once after the tensors (shared.checkpoint.save_checkpoint): a save
    killed at any instant never leaves quantized tensors under a float config."""
    qcfg = qcfg or getattr(model, "quantization_config", None)
    if qcfg is None:
        raise ValueError("model has no quantization_config: quantize it with quantize_model or pass qcfg")
    state = {}
    for name, t in model.state_dict().items():
        keep = name.endswith((*_QUANTIZED, ".scales")) or not t.is_floating_point() or t.element_size() == 1
        state[name] = t if keep or dtype is None else t.to(dtype)
    float_dtype = str(dtype or model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    # config.json is written once, after the tensors and atomically, already saying they are quantized
    extra = {"quantization_config": qcfg.to_dict(), "torch_dtype": float_dtype, "dtype": float_dtype}
    return save_checkpoint(state, model.config, path, config_extra=extra)


def _layout_dtype(name: str, meta: torch.Tensor) -> torch.dtype | None:
    """The dtype the layout fixes for a tensor (None: a float tensor, cast to the load dtype)."""
    if name.endswith((".qweight", ".qzeros")):
        return torch.int32
    if name.endswith(".weight_scale"):
        return torch.float32
    return meta.dtype if meta.element_size() == 1 else None  # a W8A8 weight: int8 or float8_e4m3fn


def load_quantized_model(path: str | os.PathLike, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32) -> CausalLM:
    """shared.model with quantized Linear layers from a checkpoint directory (ours or AutoAWQ's GEMM
    layout); a checkpoint without `quantization_config` loads as a plain model. Float tensors (norms,
    embeddings, LM head, biases) are cast to `dtype`, AWQ scales stay fp16.

    Raises FileNotFoundError (no directory / config / weights) or ValueError naming the offending tensor
    and file when a tensor is missing, unexpected, or has the wrong shape or dtype for the config."""
    qcfg = quantization_config_of(path)
    if qcfg is None:
        return load_model(path, device=device, dtype=dtype)
    p = Path(path)
    cfg = ModelConfig.from_hf(p)
    with torch.device("meta"):
        model = CausalLM(cfg)
    replace_linears(model, lambda name, fc: empty_quantized_linear(fc, qcfg, dtype), skip_fn(qcfg))
    expected = dict(model.state_dict())
    state = {k: v for k, v in load_state_dict(p).items() if not k.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    what = f"quantization_config {qcfg.to_dict()}"
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {str(p)!r} is missing tensor(s) {missing[:5]}{more} that its {what} "
                         "implies")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"checkpoint {str(p)!r} has unexpected tensor(s) {unexpected[:5]} for its {what}")
    for name, meta in expected.items():
        t = state[name]
        if tuple(t.shape) != tuple(meta.shape):
            raise ValueError(f"tensor {name!r} in {str(p)!r} has shape {tuple(t.shape)}, expected "
                             f"{tuple(meta.shape)} from config.json ({what})")
        want = _layout_dtype(name, meta)
        if want is not None and t.dtype != want:
            raise ValueError(f"tensor {name!r} in {str(p)!r} has dtype {t.dtype}, expected {want} for its "
                             f"{what}")
        if want is None and t.is_floating_point() and not name.endswith(".scales"):
            t = t.to(dtype)
        state[name] = t.to(device)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.quantization_config = qcfg
    return model


def load_for_inference(path: str | os.PathLike, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32, quantization: str | None = None) -> CausalLM:
    """What an engine calls: a checkpoint with `quantization_config` (ours or AutoAWQ's) loads quantized; a
    float checkpoint loads as is, or quantized on the fly when `quantization` names a method that needs no
    calibration (rtn-w4, naive-w8a8, naive-fp8). Calibrated methods are run offline by
    `python -m nano_quant.quantize`; asking for one here, or re-quantizing a quantized checkpoint, is a
    ValueError naming the argument."""
    check_quantization(quantization, str(path))
    if quantization is None:
        return load_quantized_model(path, device, dtype)
    qcfg = quantization_config_of(path)
    if qcfg is not None:
        raise ValueError(f"quantization={quantization!r} was requested, but {str(path)!r} is already "
                         f"quantized ({qcfg.to_dict()}); leave quantization unset to use its own")
    model = load_model(path, device=device, dtype=dtype)
    quantize_model(model, quantization)
    return model


@torch.no_grad()
def dequantize_model(model: CausalLM) -> CausalLM:
    """Replace every quantized Linear by an nn.Linear holding its dequantized weight, in place: the float
    model the quantized one approximates (W8A8 layers then compute with unquantized activations)."""
    def plain(name: str, module: nn.Module) -> nn.Module:
        if isinstance(module, WQLinear_GEMM):
            w = module.dequantize()
        elif isinstance(module, W8A8Linear):
            w = dequantize_rowwise(module.weight, module.weight_scale)
        else:
            return module
        dtype = module.bias.dtype if module.bias is not None else model.model.embed_tokens.weight.dtype
        fc = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                       device=w.device, dtype=dtype)
        fc.weight.copy_(w)
        if module.bias is not None:
            fc.bias.copy_(module.bias)
        return fc

    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, (WQLinear_GEMM, W8A8Linear)):
                setattr(parent, child_name, plain(child_name, child))
    if hasattr(model, "quantization_config"):
        del model.quantization_config
    return model
