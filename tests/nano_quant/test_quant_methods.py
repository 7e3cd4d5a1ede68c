"""SmoothQuant's smoothing and AWQ's search: exactness of the folds, the objective's argmin, the mechanism."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nano_quant.awq import AWQConfig, awq_loss, awq_model, awq_scales, search_clip, search_scale
from nano_quant.calibration import ChannelStats, decoder_linears, input_stats
from nano_quant.linear import W8A8Linear, WQLinear_GEMM
from nano_quant.methods import quantize_model
from nano_quant.quality import synthetic_outliers
from nano_quant.quant import fake_quantize_groupwise
from nano_quant.smoothquant import smooth_lm, smoothing_factors
from shared.config import ModelConfig
from shared.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

# Llama with GQA, Qwen2 (q/k/v bias), Qwen3 (q/k norms): every fold path of the one model.
CONFIGS = {
    "llama": dict(qk_norm=False),
    "qwen2": dict(qk_norm=False, attention_bias=True),
    "qwen3": dict(qk_norm=True),
}


def tiny(kind: str, seed: int = 0):
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                **CONFIGS[kind])
    model = build_model(cfg, seed=seed)
    with torch.no_grad():  # outlier channels, as trained LLMs have them: a few norm weights far above others
        gen = torch.Generator().manual_seed(seed)
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[torch.randperm(128, generator=gen)[:3]] *= 30.0
            if layer.self_attn.q_proj.bias is not None:
                for fc in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    fc.bias.normal_(0, 0.1, generator=gen)
    return model


def samples(n: int = 4, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, 4096, (n, seq), generator=torch.Generator().manual_seed(7))


def test_smoothing_factors_are_eq4():
    act = torch.tensor([1.0, 100.0, 4.0, 0.0])
    w = [torch.tensor([[1.0, -1.0, 2.0, 1.0]]), torch.tensor([[-4.0, 0.5, 1.0, 0.0]])]
    s = smoothing_factors(act, w, 0.5)
    expected = torch.tensor([1.0 / 2.0, 10.0 / 1.0, 2.0 / 2.0**0.5, 1e-5**0.5 / 1.0])
    assert torch.allclose(s, expected)
    assert torch.allclose(smoothing_factors(act, w, 1.0), act.clamp(min=1e-5))
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"alpha \(the migration strength\) must be in \[0, 1\]"):
            smoothing_factors(act, w, bad)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_smoothing_leaves_the_float_function_unchanged(kind):
    """X diag(s)^-1 · diag(s) W = X W: logits equal to fp32 precision, with factors far from 1."""
    model, x = tiny(kind), samples()
    with torch.no_grad():
        before = model(x)
        stats = input_stats(model, x, batch_size=2)
        smooth_lm(model, stats, alpha=0.5)
        after = model(x)
    scale = float(before.abs().max())
    assert float((after - before).abs().max()) <= 1e-5 * scale
    with torch.no_grad():  # and the Linear inputs are flatter: the outlier ratio drops
        flat = input_stats(model, x, batch_size=2)
    q = "model.layers.0.self_attn.q_proj"
    assert stats[q].outlier_ratio() > 10 and flat[q].outlier_ratio() < stats[q].outlier_ratio() / 3


def test_channel_stats_accumulate_over_batches():
    torch.manual_seed(0)
    xs = [torch.randn(3, 5, 16) * torch.rand(16) for _ in range(3)]
    st = ChannelStats(torch.zeros(16), torch.zeros(16))
    for x in xs:
        st.update(x)
    flat = torch.cat([x.reshape(-1, 16) for x in xs]).abs()
    assert torch.allclose(st.absmax, flat.amax(0)) and torch.allclose(st.absmean, flat.mean(0))
    assert st.tokens == 45
    assert st.outlier_ratio() == pytest.approx(float(flat.amax(0).max() / flat.amax(0).median()))


def test_awq_search_returns_the_argmin_of_its_objective():
    """Brute force: L(s_X^α) recomputed for every α of the grid; the search's α is the smallest one's."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 64))
    x = torch.randn(40, 64) * torch.where(torch.rand(64) < 0.05, 20.0, 1.0)
    cfg = AWQConfig(group_size=32, n_grid=10)
    w0 = mlp[0].weight.detach().clone()
    found = search_scale(mlp, [mlp[0]], x, cfg)
    assert torch.equal(mlp[0].weight, w0)  # the search restores the weights
    s_x = x.abs().mean(0)
    reference = mlp(x)
    losses = [awq_loss(mlp, [mlp[0]], x, awq_scales(s_x, i / 10), reference, cfg) for i in range(10)]
    assert losses == pytest.approx(found.losses, rel=1e-6)
    assert found.alpha == min(range(10), key=losses.__getitem__) / 10
    assert torch.allclose(found.scales, awq_scales(s_x, found.alpha))
    assert losses[int(found.alpha * 10)] <= losses[0]  # never worse than plain rounding (α = 0, s = 1)
    s = awq_scales(s_x, 0.7)
    assert float(s.max() * s.min()) == pytest.approx(1.0)


def test_awq_duo_scaling_divides_by_the_weight_magnitude():
    """AutoAWQ's duo_scaling: s = s_X^α / s_W^(1−α), s_W the mean of |W| / its group's max per input channel
    (recomputed by hand here); the search is still the argmin of its own objective."""
    torch.manual_seed(2)
    fc = nn.Linear(64, 48)
    x = torch.randn(40, 64) * torch.where(torch.rand(64) < 0.05, 20.0, 1.0)
    cfg = AWQConfig(group_size=32, n_grid=10, duo_scaling=True)
    found = search_scale(fc, [fc], x, cfg)
    w = fc.weight.detach().abs()
    s_w = torch.cat([w[:, :32] / w[:, :32].amax(1, keepdim=True), w[:, 32:] / w[:, 32:].amax(1, keepdim=True)],
                    1).mean(0)
    s_x = x.abs().mean(0)
    expected = (s_x.pow(found.alpha) / (s_w.pow(1 - found.alpha) + 1e-4)).clamp(min=1e-4)
    expected = expected / (expected.max() * expected.min()).sqrt()
    assert torch.allclose(found.scales, expected, rtol=1e-5)
    assert found.losses[round(found.alpha * 10)] == min(found.losses)


def test_clip_search_brute_force():
    torch.manual_seed(1)
    w, x = torch.randn(6, 64), torch.randn(50, 64)
    cfg = AWQConfig(group_size=32, n_grid=10, max_shrink=0.5)
    thresholds = search_clip(w, x, cfg)
    assert thresholds.shape == (6, 2)
    for o in range(6):
        for g in range(2):
            wg, xg = w[o, g * 32:(g + 1) * 32], x[:, g * 32:(g + 1) * 32]
            full = wg.abs().max()
            errs = []
            for i in range(5):
                m = full * (1 - i / 10)
                q = fake_quantize_groupwise(wg.clamp(-m, m)[None], 32)[0]
                errs.append(float(((xg @ q - xg @ wg) ** 2).mean()))
            best = min(range(5), key=errs.__getitem__)
            assert float(thresholds[o, g]) == pytest.approx(float(full * (1 - best / 10)))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_awq_folds_are_exact(kind):
    """Without clipping, AWQ only rescales: the float model computes the same logits afterwards."""
    model, x = tiny(kind), samples()
    with torch.no_grad():
        before = model(x)
    found = awq_model(model, x, AWQConfig(group_size=32, n_grid=5, clip=False), progress=False)
    assert len(found) == 8 and any(f.alpha > 0 for f in found.values())
    with torch.no_grad():
        assert float((model(x) - before).abs().max()) <= 1e-5 * float(before.abs().max())


def test_the_mechanism_on_the_papers_synthetic_case():
    """1% of the input channels 50x larger: smoothing cuts the W8A8 error, AWQ's scales the W4 error."""
    w8a8, w4 = synthetic_outliers(tokens=256, k=256, n=128)
    assert w8a8["SmoothQuant / AWQ"] < 0.5 * w8a8["naive / RTN"]
    assert w4["SmoothQuant / AWQ"] < w4["naive / RTN"] and w4["AWQ alpha"] > 0


@pytest.mark.parametrize("method", ["rtn-w4", "awq", "naive-w8a8", "smoothquant", "naive-fp8",
                                    "smoothquant-fp8"])
def test_every_method_swaps_the_decoder_linears(method):
    model, x = tiny("llama"), samples()
    with torch.no_grad():
        ref = model(x)
    qcfg = quantize_model(model, method, x, group_size=32) if "w4" in method or method == "awq" else \
        quantize_model(model, method, x)
    assert model.quantization_config is qcfg
    kind = WQLinear_GEMM if qcfg.quant_method == "awq" else W8A8Linear
    layers = [m for n, m in model.named_modules() if ".layers." in n and isinstance(m, (nn.Linear, kind))]
    assert len(layers) == 14 and all(isinstance(m, kind) for m in layers)
    assert type(model.lm_head) is nn.Linear  # the head stays in high precision
    with torch.no_grad():
        rel = float((model(x) - ref).norm() / ref.norm())
    # loose: a random 2-layer model with 30x outlier channels; quality is measured on a trained one
    assert rel < (0.6 if qcfg.bits == 4 else 0.3 if qcfg.format == "fp8" else 0.1)


def test_quantize_model_errors_and_exclusions():
    model = tiny("llama")
    with pytest.raises(ValueError, match="method must be one of"):
        quantize_model(model, "gptq")
    with pytest.raises(ValueError, match="disagrees with the checkpoint's quantization_config"):
        quantize_model(model, "awq", samples(), awq=AWQConfig(group_size=64), group_size=32)
    with pytest.raises(ValueError, match=r"group_size \(48\) must be a positive int dividing"):
        quantize_model(model, "rtn-w4", group_size=48)
    model = tiny("llama")
    quantize_model(model, "naive-w8a8", modules_to_not_convert=["mlp.down_proj"])
    kinds = {n: type(m) for n, m in decoder_linears(model).items()} | {
        n: type(m) for n, m in model.named_modules() if isinstance(m, W8A8Linear)}
    assert kinds["model.layers.0.mlp.down_proj"] is nn.Linear
    assert kinds["model.layers.0.mlp.up_proj"] is W8A8Linear
