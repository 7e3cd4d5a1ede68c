"""Quantized checkpoints: AutoAWQ's GEMM layout round trip, AutoAWQ-written checkpoints, greedy decoding of
a quantized checkpoint equal to shared.model run with the dequantized weights, and every config/tensor
disagreement rejected with an error that names it.

The references here are independent of nano_quant's unpacking: AutoAWQ's packer and unpacker transcribed
in test_quant_formats, and W8A8 simulated with a per-token fake-quantization hook on plain nn.Linear.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quant_formats import autoawq_dequantize, autoawq_pack

from nano_quant import (
    dequantize_model,
    load_for_inference,
    load_quantized_model,
    quantization_config_of,
    quantize_model,
    save_quantized,
)
from nano_quant.linear import W8A8Linear, WQLinear_GEMM
from shared.checkpoint import save_checkpoint
from shared.config import ModelConfig
from shared.model import CausalLM, build_model, greedy_generate

pytestmark = pytest.mark.usefixtures("one_thread")
G = 32
PROMPT = [17, 400, 9, 2211, 5, 77]


def tiny_cfg() -> ModelConfig:
    return ModelConfig.from_name("tiny").replace(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def trained_like(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """Random weights with a larger spread, so greedy decoding has clear winners."""
    model = build_model(cfg, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model


def linear_names(cfg: ModelConfig) -> list[str]:
    return [f"model.layers.{i}.{m}" for i in range(cfg.num_hidden_layers)
            for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def plain_from(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> CausalLM:
    model = build_model(cfg)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=not cfg.tie_word_embeddings)
    model.tie_weights()
    return model


def test_awq_round_trip_and_layout(tmp_path):
    cfg = tiny_cfg()
    model = trained_like(cfg)
    quantize_model(model, "rtn-w4", group_size=G)
    path = save_quantized(model, tmp_path / "q")
    hf = json.loads((path / "config.json").read_text())
    expected = {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    assert hf["quantization_config"] == expected
    tensors = load_file(path / "model.safetensors")
    q = "model.layers.0.mlp.down_proj"
    assert tensors[q + ".qweight"].dtype == torch.int32 and tensors[q + ".qweight"].shape == (256, 128 // 8)
    assert tensors[q + ".qzeros"].dtype == torch.int32
    assert tensors[q + ".qzeros"].shape == (256 // G, 128 // 8)
    assert tensors[q + ".scales"].dtype == torch.float16 and tensors[q + ".scales"].shape == (256 // G, 128)
    assert q + ".weight" not in tensors and tensors["model.norm.weight"].dtype == torch.float16
    loaded = load_quantized_model(path)
    assert quantization_config_of(path).group_size == G
    for name, buf in model.named_buffers():
        assert torch.equal(dict(loaded.named_buffers())[name], buf), name
    assert isinstance(loaded.model.layers[1].self_attn.o_proj, WQLinear_GEMM)


def test_checkpoint_written_by_autoawq_loads(tmp_path):
    """Tensors packed by AutoAWQ's own loop, config in AutoAWQ's spelling: the loaded layers dequantize to
    AutoAWQ's weights, and the model computes shared.model's logits with those weights."""
    cfg = tiny_cfg()
    gen = torch.Generator().manual_seed(5)
    state = {k: v.half() for k, v in build_model(cfg, seed=1).state_dict().items()}
    dense = dict(state)
    for name in linear_names(cfg):
        w = state.pop(name + ".weight")
        n, k = w.shape
        intweight = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
        zeros = torch.randint(0, 16, (k // G, n), generator=gen, dtype=torch.int32)
        scales = (torch.rand(k // G, n, generator=gen) * 0.02 + 0.001).half()
        state[name + ".qweight"], state[name + ".qzeros"] = autoawq_pack(intweight), autoawq_pack(zeros)
        state[name + ".scales"] = scales
        qweight, qzeros = state[name + ".qweight"], state[name + ".qzeros"]
        dense[name + ".weight"] = autoawq_dequantize(qweight, qzeros, scales, G).t()
    state.pop("lm_head.weight", None)
    (tmp_path / "awq").mkdir()
    save_file(state, str(tmp_path / "awq" / "model.safetensors"))
    hf = cfg.to_hf() | {"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": G,
                                                "zero_point": True, "version": "GEMM"}}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(hf))
    model = load_quantized_model(tmp_path / "awq")
    for name in linear_names(cfg):
        layer = model.get_submodule(name)
        assert torch.equal(layer.dequantize(), dense[name + ".weight"].float()), name
    reference = plain_from(cfg, {k: v for k, v in dense.items() if k != "lm_head.weight"})
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x), rtol=1e-4, atol=1e-4)


def fake_quant_inputs(model: CausalLM, fmt: str) -> None:
    """Per-token absmax fake quantization (INT8 or e4m3) of every decoder Linear's input (W8A8's inputs)."""
    qmax = 127 if fmt == "int8" else 448

    def hook(module, args):
        x = args[0]
        scale = (x.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-8)
        y = x / scale
        if fmt == "int8":
            y = y.round().clamp(-127, 127)
        else:
            y = y.clamp(-448, 448).to(torch.float8_e4m3fn).float()
        return (y * scale,)

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and ".layers." in name:
            m.register_forward_pre_hook(hook)


@pytest.mark.parametrize("method", ["awq", "smoothquant", "smoothquant-fp8"])
def test_greedy_decoding_equals_the_dequantized_model(tmp_path, method):
    cfg = tiny_cfg()
    model = trained_like(cfg)
    calib = torch.randint(0, 4096, (4, 32), generator=torch.Generator().manual_seed(3))
    kwargs = {"group_size": G} if method == "awq" else {}
    quantize_model(model, method, calib, progress=False, **kwargs)
    path = save_quantized(model, tmp_path / method, dtype=None)
    quantized = load_quantized_model(path)
    tensors = load_file(path / "model.safetensors")
    layout = (".qweight", ".qzeros", ".scales", "weight_scale")
    dense = {k: v for k, v in tensors.items() if not k.endswith(layout)}
    for name in linear_names(cfg):
        if method == "awq":
            packed = [tensors[name + suffix] for suffix in (".qweight", ".qzeros", ".scales")]
            dense[name + ".weight"] = autoawq_dequantize(*packed, G).t()
        else:
            scale = tensors[name + ".weight_scale"][:, None]
            dense[name + ".weight"] = tensors[name + ".weight"].float() * scale
    reference = plain_from(cfg, dense)
    if method != "awq":
        fake_quant_inputs(reference, "fp8" if method.endswith("fp8") else "int8")
    ours = greedy_generate(quantized, PROMPT, 16)
    assert ours == greedy_generate(reference, PROMPT, 16)
    assert len(set(ours)) > 1
    with torch.no_grad():
        x = torch.tensor([PROMPT])
        assert torch.allclose(quantized(x), reference(x), rtol=1e-4, atol=1e-4)
    # dequantize_model gives the float model back (W8A8: without the activation rounding)
    plain = dequantize_model(quantized)
    assert not any(isinstance(m, (WQLinear_GEMM, W8A8Linear)) for m in plain.modules())


def _save_awq(tmp_path, edit_config=None, edit_tensors=None):
    model = trained_like(tiny_cfg())
    quantize_model(model, "rtn-w4", group_size=G)
    path = save_quantized(model, tmp_path / "ckpt")
    if edit_config:
        hf = json.loads((path / "config.json").read_text())
        edit_config(hf["quantization_config"])
        (path / "config.json").write_text(json.dumps(hf))
    if edit_tensors:
        tensors = load_file(path / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, str(path / "model.safetensors"))
    return path


QZ = "model.layers.0.self_attn.q_proj.qzeros"


@pytest.mark.parametrize("edit_config,edit_tensors,error", [
    (lambda q: q.update(group_size=64), None, rf"tensor '{QZ}' in .* has shape \(4, 16\), expected \(2, 16\) "
                                              r"from config.json .*'group_size': 64"),
    (lambda q: q.update(bits=3), None, r"config.json: quantization_config.bits must be 4 or 8, got 3"),
    (lambda q: q.update(bits=8), None,
     r"config.json: quantization_config.bits must be 4 for quant_method 'awq'"),
    (lambda q: q.update(quant_method="gptq"), None,
     r"config.json: quantization_config.quant_method must be one of"),
    (lambda q: q.update(version="gemv"), None,
     r"config.json: quantization_config.version 'gemv' is not supported"),
    (lambda q: q.update(group_size=48), None, r"group_size \(48\) must be a positive int dividing the input"),
    (lambda q: q.pop("bits"), None, r"config.json: quantization_config needs 'quant_method' and 'bits'"),
    (None, lambda t: t.pop(QZ), rf"is missing tensor\(s\) \['{QZ}'\] that its quantization_config"),
    (None, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(256, 128)}),
     r"unexpected tensor\(s\) \['model.layers.0.mlp.up_proj.weight'\]"),
    (None, lambda t: t.update({QZ: t[QZ].float()}),
     rf"tensor '{QZ}' in .* has dtype torch.float32, expected torch.int32"),
])
def test_config_and_tensors_that_disagree(tmp_path, edit_config, edit_tensors, error):
    path = _save_awq(tmp_path, edit_config, edit_tensors)
    with pytest.raises(ValueError, match=error):
        load_quantized_model(path)


def test_more_bad_inputs(tmp_path):
    cfg = tiny_cfg()
    model = trained_like(cfg)
    quantize_model(model, "naive-w8a8")
    path = save_quantized(model, tmp_path / "w8")
    w = "model.layers.1.mlp.gate_proj.weight"
    tensors = load_file(path / "model.safetensors")
    tensors[w] = tensors[w].float()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor '{w}' in .* has dtype torch.float32, expected torch.int8"):
        load_quantized_model(path)
    hf = json.loads((path / "config.json").read_text())
    hf["quantization_config"] = ["awq"]
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="config.json: quantization_config must be a JSON object, got list"):
        quantization_config_of(path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_quantized_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="model has no quantization_config"):
        save_quantized(build_model(cfg), tmp_path / "plain")
    plain = save_checkpoint(build_model(cfg), cfg, tmp_path / "float")  # no quantization_config: a plain load
    assert quantization_config_of(plain) is None
    assert not any(isinstance(m, W8A8Linear) for m in load_quantized_model(plain).modules())


def test_load_for_inference(tmp_path):
    """The one call an engine makes: quantized checkpoints load quantized, float ones as they are or quantized
    on the fly by a method that needs no calibration."""
    cfg = tiny_cfg()
    plain = save_checkpoint(trained_like(cfg), cfg, tmp_path / "float")
    assert not any(isinstance(m, WQLinear_GEMM) for m in load_for_inference(plain).modules())
    model = load_for_inference(plain, quantization="naive-w8a8")
    assert isinstance(model.model.layers[0].mlp.up_proj, W8A8Linear)
    assert model.quantization_config.format == "int8"
    quantized = trained_like(cfg)
    quantize_model(quantized, "rtn-w4", group_size=G)
    path = save_quantized(quantized, tmp_path / "w4")
    assert isinstance(load_for_inference(path).model.layers[0].mlp.up_proj, WQLinear_GEMM)
    with pytest.raises(ValueError, match="quantization='naive-w8a8' was requested, but .* is already"):
        load_for_inference(path, quantization="naive-w8a8")
    with pytest.raises(ValueError, match="quantization='awq' needs calibration: run `python -m nano_quant"):
        load_for_inference(plain, quantization="awq")
    with pytest.raises(ValueError, match=r"quantization must be one of \[.*\] or None, got 'int4'"):
        load_for_inference(plain, quantization="int4")


@pytest.mark.parametrize("before", ["empty", "float checkpoint"])
def test_a_save_killed_at_any_step_never_leaves_quantized_tensors_under_a_float_config(tmp_path, monkeypatch,
                                                                                     before):
    """`save_quantized` killed before each file it writes (and before its closing directory sync), into an
    empty directory or over a float checkpoint: the directory holds a float config with float tensors, a
    quantized config with quantized tensors, or no config.json (an error naming it); never a mix."""
    from shared import checkpoint

    cfg = tiny_cfg()
    model = trained_like(cfg)
    quantize_model(model, "rtn-w4", group_size=G)
    real = {name: getattr(checkpoint, name) for name in ("_write_atomic", "_fsync_dir")}
    seen = []
    for kill_at in range(10):
        out = tmp_path / f"kill{kill_at}"
        if before == "float checkpoint":
            save_checkpoint(trained_like(cfg, seed=1), cfg, out)
        calls = []

        def killed(name, *args, calls=calls, kill_at=kill_at):
            calls.append(name)
            if len(calls) == kill_at + 1:
                raise KeyboardInterrupt(f"killed before {name}{args[:1]}")
            return real[name](*args)

        for name in real:
            monkeypatch.setattr(checkpoint, name, lambda *args, name=name: killed(name, *args))
        try:
            save_quantized(model, out)
            done = True
        except KeyboardInterrupt:
            done = False
        monkeypatch.undo()
        if not (out / "config.json").is_file():
            with pytest.raises(FileNotFoundError, match="no config.json"):
                load_quantized_model(out)
            seen.append("no config")
        else:
            quantized_config = "quantization_config" in json.loads((out / "config.json").read_text())
            quantized_tensors = any(k.endswith(".qweight") for k in load_file(out / "model.safetensors"))
            assert quantized_config == quantized_tensors, f"killed at step {kill_at}: {calls}"
            load_quantized_model(out)
            seen.append("quantized" if quantized_config else "float")
        if done:
            break
    assert done and seen[-1] == "quantized" and "no config" in seen, seen
