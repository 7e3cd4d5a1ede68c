"""Quantized tiny checkpoints for nano_vllm's tests, and the float models they must decode like.

Three checkpoints: AWQ W4A16 (calibrated, ours), SmoothQuant W8A8 INT8 (ours), and one in AutoAWQ's own
spelling (`w_bit`, `q_group_size`, `"version": "GEMM"`, every float tensor fp16) holding random 4-bit
values, zero points and scales, with q/k/v biases (Qwen2). The reference of each is shared.model with the
dequantized weights — for the AutoAWQ file also checked against the random integers themselves, (q − z)·Δ,
not by unpacking — and for W8A8 with every decoder Linear's input rounded per token (absmax INT8 / e4m3)
and back, which is what the W8A8 layer computes. nano_quant's tests prove the formats; these prove that
the engine (paged attention, batching, fused layers) runs the quantized model as shared.model does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from nano_quant import dequantize_model, load_quantized_model, quantize_model, save_quantized
from nano_quant.quant import dequantize_rowwise, pack_awq, quantize_rowwise
from shared.checkpoint import save_checkpoint
from shared.config import ModelConfig
from shared.model import CausalLM, build_model

GROUP = 32
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def tiny_config(**changes) -> ModelConfig:
    """Qwen3-style (q/k norms, tied embeddings), 2 layers, hidden 128: group sizes 32 and 128 divide it."""
    return ModelConfig.from_name("tiny").replace(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                 max_position_embeddings=256, **changes)


def trained_like(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """Random weights with a larger spread (and random biases), so greedy decoding has clear winners."""
    model = build_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(8.0)
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def save_float(path: Path, cfg: ModelConfig | None = None) -> Path:
    cfg = cfg or tiny_config()
    return save_checkpoint(trained_like(cfg), cfg, path)


def save_ours(path: Path, method: str) -> Path:
    """`method` (awq / smoothquant / ...) applied to a trained-like tiny model, calibrated on random ids."""
    model = trained_like(tiny_config())
    calib = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(3))
    kwargs = {"group_size": GROUP} if method in ("awq", "rtn-w4") else {}
    quantize_model(model, method, calib, progress=False, **kwargs)
    return save_quantized(model, path, dtype=None)


def save_autoawq(path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Qwen2 (q/k/v bias, untied) checkpoint as AutoAWQ writes one; returns it and its dense weights."""
    cfg = tiny_config(qk_norm=False, attention_bias=True, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(5)
    state = {k: v.half() for k, v in trained_like(cfg, seed=1).state_dict().items()}
    dense = {}
    for i in range(cfg.num_hidden_layers):
        for proj in PROJECTIONS:
            name = f"model.layers.{i}.{proj}"
            n, k = state.pop(name + ".weight").shape
            q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
            zeros = torch.randint(0, 16, (k // GROUP, n), generator=gen, dtype=torch.int32)
            scales = (torch.rand(k // GROUP, n, generator=gen) * 0.04 + 0.01).half()
            state[name + ".qweight"], state[name + ".qzeros"] = pack_awq(q), pack_awq(zeros)
            state[name + ".scales"] = scales
            dense[name + ".weight"] = ((q - zeros.repeat_interleave(GROUP, 0)) * scales.float()
                                       .repeat_interleave(GROUP, 0)).t()
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    hf = cfg.to_hf() | {"torch_dtype": "float16", "quantization_config": {
        "quant_method": "awq", "w_bit": 4, "q_group_size": GROUP, "zero_point": True, "version": "GEMM"}}
    (path / "config.json").write_text(json.dumps(hf))
    return path, dense


def fake_quantize_inputs(model: CausalLM, fmt: str) -> CausalLM:
    """Round every decoder Linear's input per token (absmax INT8, or e4m3) and back, as W8A8 layers do
    (nano_quant's number format, tested against its own spec in tests/nano_quant)."""

    def hook(module, args):
        return (dequantize_rowwise(*quantize_rowwise(args[0], fmt)).to(args[0].dtype),)

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and ".layers." in name:
            m.register_forward_pre_hook(hook)
    return model


def dequantized_reference(path: Path) -> CausalLM:
    """shared.model with the checkpoint's dequantized weights (fp32), W8A8 inputs fake-quantized."""
    model = load_quantized_model(path)
    qcfg = model.quantization_config
    model = dequantize_model(model)
    return fake_quantize_inputs(model, qcfg.format) if qcfg.quant_method == "w8a8" else model
