"""nano_vllm serving quantized models (nano_quant): checkpoints recognised by their `quantization_config`
(AWQ W4A16, SmoothQuant W8A8, a checkpoint in AutoAWQ's own spelling), the `quantization=` engine argument
on the fly, the fused-projection and GEMV layers on quantized Linears, the weight memory reported, and every
bad input named. Greedy decoding is compared with shared.model run with the dequantized weights (and, for
W8A8, per-token fake-quantized inputs), on the paper path and with the bench's performance layers.
"""

from __future__ import annotations

import copy
import json
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("nano_quant")  # a copy of nano_vllm without nano_quant serves 16-bit models only

from quant_checkpoints import (
    GROUP,
    dequantized_reference,
    save_autoawq,
    save_float,
    save_ours,
    tiny_config,
    trained_like,
)

from nano_quant import ON_THE_FLY, load_quantized_model, quantize_model
from nano_quant.linear import W8A8Linear, WQLinear_GEMM
from nano_vllm import LLM, SamplingParams, kv_cache
from nano_vllm.config import import_nano_quant
from nano_vllm.kv_cache import kv_cache_summary, weight_bytes
from nano_vllm.layers.fused import FusedAttention, FusedMLP, fuse_projections, stack_linears
from nano_vllm.layers.gemv import GemvLinear, apply_gemv
from shared.checkpoint import load_model
from shared.config import PRESETS
from shared.model import build_model, greedy_generate

PROMPTS = [[17, 400, 9, 2211, 5], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], list(range(100, 123))]
N = 10
ENGINE = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64}
QUANTIZED = (W8A8Linear, WQLinear_GEMM)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    autoawq, dense = save_autoawq(root / "autoawq")
    return {"awq": save_ours(root / "awq", "awq"), "smoothquant": save_ours(root / "sq", "smoothquant"),
            "autoawq": autoawq, "float": save_float(root / "float"), "autoawq_dense": dense}


def generate(llm: LLM, prompts=PROMPTS, n: int = N) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", ["awq", "smoothquant", "autoawq"])
def test_quantized_checkpoint_decodes_like_its_dequantized_model(ckpts, name, layer_args):
    llm = LLM(str(ckpts[name]), **ENGINE, **layer_args)
    layers = llm.engine.model_runner.model.model.layers
    assert all(isinstance(m, QUANTIZED) for m in layers[0].modules() if isinstance(m, (nn.Linear, *QUANTIZED)))
    if layer_args.get("fused_projections"):  # quantized projections fuse by stacking their tensors
        assert isinstance(layers[0].self_attn, FusedAttention) and isinstance(layers[0].mlp, FusedMLP)
        assert isinstance(layers[0].self_attn.qkv_proj, QUANTIZED)
    reference = dequantized_reference(ckpts[name])
    outs = generate(llm)
    assert outs == [greedy_generate(reference, p, N) for p in PROMPTS]
    assert len({t for o in outs for t in o}) > 3
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_autoawq_checkpoint_loads_its_own_integers(ckpts):
    """The reference above unpacks through nano_quant; here the loaded layers equal (q − z)·Δ computed from
    the random integers written into the AutoAWQ-spelled file."""
    model = load_quantized_model(ckpts["autoawq"])
    for name, w in ckpts["autoawq_dense"].items():
        assert torch.equal(model.get_submodule(name.removesuffix(".weight")).dequantize(), w), name


@pytest.mark.parametrize("method", ON_THE_FLY)
def test_quantization_on_the_fly(ckpts, method):
    """`quantization=` quantizes a 16-bit checkpoint as nano_quant's quantize_model does offline."""
    llm = LLM(str(ckpts["float"]), quantization=method, **ENGINE)
    model = llm.engine.model_runner.model
    assert model.quantization_config.quant_method == ("awq" if method == "rtn-w4" else "w8a8")
    assert isinstance(model.model.layers[1].mlp.down_proj, QUANTIZED)
    offline = load_model(ckpts["float"])
    quantize_model(offline, method)
    assert generate(llm) == [greedy_generate(offline, p, N) for p in PROMPTS]


def test_quantization_of_a_preset():
    """A preset's seeded random weights quantized on the fly: what `nano_vllm.bench quantization=` serves."""
    llm = LLM("tiny", quantization="rtn-w4", **ENGINE)
    offline = build_model(PRESETS["tiny"], seed=0)
    quantize_model(offline, "rtn-w4")
    assert generate(llm, PROMPTS[:1], 6) == [greedy_generate(offline, PROMPTS[0], 6)]


def test_bench_passes_quantization_through():
    from omegaconf import OmegaConf

    from nano_vllm.bench.throughput import make_llm

    cfg = OmegaConf.create({"model": "tiny", "quantization": "naive-w8a8", "engine": {**ENGINE, "device": "cpu"}})
    llm = make_llm(cfg)
    assert llm.engine.config.quantization == "naive-w8a8"
    assert isinstance(llm.engine.model_runner.model.model.layers[0].mlp.gate_proj, W8A8Linear)


def test_weight_memory_is_reported(ckpts):
    cfg = tiny_config()
    plain = LLM(str(ckpts["float"]), **ENGINE)
    w4 = LLM(str(ckpts["float"]), quantization="rtn-w4", **ENGINE)
    float_bytes = weight_bytes(plain.engine.model_runner.model)
    assert float_bytes == sum(p.numel() * p.element_size() for p in build_model(cfg).parameters())
    # every decoder Linear (K in, N out): K·N/2 bytes of 4-bit weights, fp16 scales and 4-bit zeros per group
    k_n = [(cfg.hidden_size, cfg.q_size), (cfg.hidden_size, cfg.kv_size), (cfg.hidden_size, cfg.kv_size),
           (cfg.q_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size),
           (cfg.hidden_size, cfg.intermediate_size), (cfg.intermediate_size, cfg.hidden_size)]
    linear_fp32 = sum(k * n * 4 for k, n in k_n) * cfg.num_hidden_layers
    linear_w4 = sum(k * n // 2 + (k // 128) * n * (2 + 0.5) for k, n in k_n) * cfg.num_hidden_layers
    assert weight_bytes(w4.engine.model_runner.model) == float_bytes - linear_fp32 + linear_w4
    summary = kv_cache_summary(plain.engine.model_runner)
    assert summary.startswith("weights: ") and "(float32)" in summary
    assert "'quant_method': 'awq'" in kv_cache_summary(w4.engine.model_runner)


def test_compact_only_moves_a_cuda_model_the_host_can_hold(monkeypatch):
    """kv_cache.compact re-packs a model built or quantized in place on a GPU through host memory; on a CPU
    it is a no-op, and on a GPU it is skipped when the host has less than twice the model free."""
    model = build_model(tiny_config())
    moved = []
    monkeypatch.setattr(model, "to", lambda *a, **k: moved.append(a) or model)
    assert kv_cache.compact(model, torch.device("cpu")) is model and not moved
    monkeypatch.setattr(kv_cache, "host_free_bytes", lambda: 2 * weight_bytes(model) - 1)
    assert kv_cache.compact(model, torch.device("cuda")) is model and not moved


# ------------------------------------------------------------------ the layers meet the quantized Linears
@pytest.mark.parametrize("kind", ["w8a8-int8", "w8a8-fp8", "awq"])
def test_stacked_quantized_layers_compute_the_concatenated_outputs(kind):
    gen = torch.Generator().manual_seed(0)
    linears = [nn.Linear(64, n, bias=True) for n in (64, 32, 32)]
    for fc in linears:
        with torch.no_grad():
            fc.weight.copy_(torch.randn(fc.weight.shape, generator=gen))
            fc.bias.copy_(torch.randn(fc.bias.shape, generator=gen))
    if kind == "awq":
        layers = [WQLinear_GEMM.from_linear(fc, group_size=GROUP) for fc in linears]
    else:
        layers = [W8A8Linear.from_linear(fc, kind.removeprefix("w8a8-")) for fc in linears]
    fused = stack_linears(layers)
    assert type(fused) is type(layers[0]) and fused.out_features == 128
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(fused(x), torch.cat([m(x) for m in layers], dim=-1), rtol=1e-6, atol=1e-6)
    mixed = [*layers[:2], W8A8Linear.from_linear(linears[2], "fp8" if kind == "w8a8-int8" else "int8")]
    with pytest.raises(ValueError, match="cannot stack"):
        stack_linears(mixed)


def test_fusion_skips_projections_it_cannot_stack():
    """k_proj left in 16 bits (`modules_to_not_convert`): q/k/v stay unfused, gate/up fuse; same logits."""
    model = trained_like(tiny_config())
    quantize_model(model, "naive-w8a8", modules_to_not_convert=["k_proj"])
    fused = fuse_projections(copy.deepcopy(model))
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert type(attn.k_proj) is nn.Linear and not isinstance(attn, FusedAttention)
    assert isinstance(mlp, FusedMLP) and isinstance(mlp.gate_up_proj, W8A8Linear)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_gemv_layer_leaves_quantized_linears_alone():
    model = trained_like(tiny_config())
    quantize_model(model, "rtn-w4")
    runner = SimpleNamespace(model=model, config=SimpleNamespace(gemv_max_tokens=16), device=torch.device("cpu"))
    apply_gemv(runner)
    assert type(model.lm_head) is GemvLinear  # the 16-bit LM head takes the GEMV
    assert all(type(m) is WQLinear_GEMM for n, m in model.named_modules() if n.endswith("_proj"))


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("value,error,match", [
    ("int4", ValueError, r"quantization must be one of \['rtn-w4', 'naive-w8a8', 'naive-fp8'\] or None, got 'int4'"),
    ("awq", ValueError, r"quantization='awq' needs calibration: run `python -m nano_quant.quantize model=.* "
                        r"method=awq out=DIR`"),
    ("smoothquant", ValueError, r"quantization='smoothquant' needs calibration"),
    (4, TypeError, r"quantization must be a str or None, got int"),
])
def test_bad_quantization_values(ckpts, value, error, match):
    with pytest.raises(error, match=match):
        LLM(str(ckpts["float"]), quantization=value, **ENGINE)


def test_quantized_checkpoint_refuses_another_quantization_and_tensor_parallelism(ckpts):
    with pytest.raises(ValueError, match=r"quantization='rtn-w4' was requested, but .* is already quantized"):
        LLM(str(ckpts["awq"]), quantization="rtn-w4", **ENGINE)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 is not supported with the quantized "
                                         r"checkpoint .*: nano_quant's quantized layers are not sharded"):
        LLM(str(ckpts["awq"]), tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 is not supported with quantization='rtn-w4'"):
        LLM(str(ckpts["float"]), quantization="rtn-w4", tensor_parallel_size=2, **ENGINE)


@pytest.mark.parametrize("edit,match", [
    (lambda hf, t: hf["quantization_config"].update(q_group_size=64),
     r"tensor 'model.layers.0.self_attn.q_proj.qzeros' in .* has shape \(4, 16\), expected \(2, 16\) from "
     r"config.json"),
    (lambda hf, t: t.pop("model.layers.1.mlp.up_proj.scales"),
     r"missing tensor\(s\) \['model.layers.1.mlp.up_proj.scales'\] that its quantization_config"),
    (lambda hf, t: hf["quantization_config"].update(w_bit=8), r"quantization_config.bits must be 4 for quant_method"),
])
def test_checkpoint_whose_config_and_tensors_disagree(ckpts, tmp_path, edit, match):
    from safetensors.torch import load_file, save_file

    src = ckpts["autoawq"]
    hf, tensors = json.loads((src / "config.json").read_text()), load_file(src / "model.safetensors")
    edit(hf, tensors)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), **ENGINE)


def test_missing_nano_quant_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "nano_quant", None)  # as in a copy of nano_vllm without nano_quant
    with pytest.raises(ImportError, match=r"quantization='rtn-w4' needs the nano_quant package"):
        import_nano_quant("quantization='rtn-w4'")
    with pytest.raises(ImportError, match=r"needs the nano_quant package"):
        LLM("tiny", quantization="rtn-w4", **ENGINE)
