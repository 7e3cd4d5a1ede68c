"""AWQ's search against AutoAWQ's: `awq_model` on a Llama decoder equals a transcription of AutoAWQ's
per-layer loop (awq/quantize/quantizer.py: `_search_best_scale`, `_compute_best_scale`, `_compute_best_clip`,
`_search_best_clip`; awq/quantize/scale.py: `apply_scale`, `apply_clip`; awq/models/llama.py:
`get_layers_for_scaling`), written out here from that source as AutoAWQ runs it on an fp16 model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nano_quant.awq import AWQConfig, awq_model
from shared.config import ModelConfig
from shared.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")
G = 64  # group size: two groups per row of the 128-wide model


def pseudo_quantize(w: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's `pseudo_quantize_tensor` (w_bit 4, zero point). Its scales are fp16 because it runs the
    model in fp16; rounding them to fp16 here reproduces that grid."""
    shape, w = w.shape, w.reshape(-1, G)
    hi, lo = w.amax(1, keepdim=True), w.amin(1, keepdim=True)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(lo / scales)).clamp(0, 15)
    return ((torch.clamp(torch.round(w / scales) + zeros, 0, 15) - zeros) * scales).reshape(shape)


def best_scale(fcs: list[nn.Linear], x: torch.Tensor, block) -> torch.Tensor:
    """`_search_best_scale` + `_compute_best_scale` (duo_scaling off): 20 ratios, s = x_mean^r, MSE of
    `block`'s output, weights restored after each ratio."""
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)
    reference, saved = block(x), [fc.weight.data.clone() for fc in fcs]
    best, best_err = None, float("inf")
    for r in range(20):
        s = x_mean.pow(r / 20).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        for fc in fcs:
            fc.weight.data = pseudo_quantize(fc.weight.data * s) / s
        err = (reference - block(x)).float().pow(2).sum().item() / reference.numel()
        if err < best_err:
            best, best_err = s.clone(), err
        for fc, w in zip(fcs, saved):
            fc.weight.data = w.clone()
    return best


def best_clip(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`_compute_best_clip`: n_grid 20, max_shrink 0.5, every (n_tokens // 512)-th token."""
    x = x.reshape(-1, x.shape[-1])
    x = x.reshape(1, x.shape[0], -1, G)[:, :: max(1, x.shape[0] // 512)]
    w = w.reshape(w.shape[0], 1, -1, G)
    full = w.abs().amax(-1, keepdim=True)
    best, min_errs = full.clone(), torch.ones_like(full) * 1e9
    reference = (x * w).sum(-1)
    for i in range(10):
        m = full * (1 - i / 20)
        err = ((x * pseudo_quantize(torch.clamp(w, -m, m))).sum(-1) - reference).pow(2).mean(1)
        err = err.view(min_errs.shape)
        better = err < min_errs
        min_errs[better], best[better] = err[better], m[better]
    return best.squeeze(1)


@torch.no_grad()
def autoawq(model, ids: torch.Tensor) -> None:
    """`AwqQuantizer.quantize` without the final packing: per layer, inputs captured on the float layer
    (its output is the next layer's input), scales searched on the unmodified layer, applied (inputs
    divided for the clip search), then every Linear but q/k clipped."""
    x = model.model.embed_tokens(ids)
    cos, sin = model.model.rope_cos_sin(torch.arange(ids.shape[1]).expand_as(ids))
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        fcs = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj,
               "gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
        feat = {}
        hooks = [fc.register_forward_pre_hook(lambda m, a, n=n, f=feat: f.__setitem__(n, a[0].clone()))
                 for n, fc in fcs.items()]
        h, residual = layer(x, None, cos, sin, None)
        for hook in hooks:
            hook.remove()
        groups = [(layer.input_layernorm, "q k v", lambda t, a=attn: a(t, cos, sin, None)),
                  (attn.v_proj, "o", attn.o_proj),  # llama.py: only when v_proj and o_proj shapes agree
                  (layer.post_attention_layernorm, "gate up", mlp), (mlp.up_proj, "down", mlp.down_proj)]
        scales = [(prev, names.split(), best_scale([fcs[n] for n in names.split()], feat[names.split()[0]],
                                                   block)) for prev, names, block in groups]
        for prev, names, s in scales:
            if isinstance(prev, nn.Linear):
                prev.weight.div_(s.view(-1, 1))
            else:
                prev.weight.div_(s)
            for n in names:
                fcs[n].weight.mul_(s.view(1, -1))
                feat[n] = feat[n] / s.view(1, -1)
        for n in ("v", "o", "gate", "up", "down"):
            fc = fcs[n]
            t = best_clip(fc.weight, feat[n])
            fc.weight.data = torch.clamp(fc.weight.data.reshape(*t.shape[:2], -1), -t, t).reshape(fc.weight.shape)
        x = h + residual


@pytest.mark.slow  # ~3-13 s; runs in the repository suite, not again in the package's fork
def test_awq_model_equals_autoawqs_loop():
    """Scales folded into the norms and v/up_proj, clipped weights: all equal AutoAWQ's on a Llama with
    one kv head per query head (AutoAWQ's o_proj scaling needs v_proj and o_proj of one shape)."""
    cfg = ModelConfig.from_name("tiny").replace(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                                                num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                                qk_norm=False)
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # outlier channels so that the search picks α > 0
        for layer in model.model.layers:
            layer.input_layernorm.weight[:3] *= 20.0
            layer.post_attention_layernorm.weight[60:62] *= 10.0
    ids = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(0))
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    found = awq_model(ours, ids, AWQConfig(group_size=G), progress=False)
    autoawq(theirs, ids)
    assert sum(f.alpha > 0 for f in found.values()) >= 4
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
