"""SmoothQuant (Xiao et al. 2022, arXiv 2211.10438): migrate the activations' outliers into the weights.

§3: weights are easy to quantize, activations are not — a few fixed channels carry outliers 10-100x the
rest, and a per-token scale set by them leaves the other channels a handful of levels. §4, Eq. 3: for
any s > 0, Y = (X diag(s)⁻¹)·(diag(s) W), so dividing input channel j of X by s_j and multiplying the
weights that read it by s_j (column j of an nn.Linear weight) changes nothing in exact arithmetic, while
Eq. 4, s_j = max|X_j|^α / max|W_j|^(1−α), moves a fraction α of the difficulty to the weights (α = 0.5
balances the two; the migration strength).

The division of X is folded offline into the operator that produces X, so it is free at run time:

| input of | folded into | why it is exact |
|---|---|---|
| q/k/v_proj | input_layernorm.weight | RMSNorm's output is its weight times the normalised input |
| gate/up_proj | post_attention_layernorm.weight | same |
| o_proj | v_proj's output rows (and bias) | attention is a per-channel linear map of V |
| down_proj | up_proj's output rows | SwiGLU's silu(gate)·up is linear in up |

The paper smooths the inputs that follow a norm. We also smooth o_proj and down_proj: both folds are
exact, and free for INT8 — v_proj and up_proj are quantized per output channel, and scaling a row scales
its absmax with it, so their integer weights do not change. down_proj's input (the SwiGLU product) is
where Llama-family models carry their largest activation outliers. With grouped-query attention one
channel of v feeds the same channel of every query head of its group, so those o_proj inputs share one
factor (Eq. 4 over the group's maxima).
"""

from __future__ import annotations

import torch

from shared.model import Attention, CausalLM, DecoderLayer

from .calibration import ChannelStats


def smoothing_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor],
                      alpha: float) -> torch.Tensor:
    """Eq. 4: s_j = max|X_j|^α / max|W_j|^(1−α), W_j the input channel j of every weight (out_i, K) that
    reads X; fp32, shape (K,). Both maxima are floored at 1e-5 (a dead channel would give 0 or inf)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha (the migration strength) must be in [0, 1], got {alpha!r}")
    w_absmax = torch.cat([w.detach().abs().float() for w in weights]).amax(0)
    return act_absmax.float().clamp(min=1e-5).pow(alpha) / w_absmax.clamp(min=1e-5).pow(1 - alpha)


def kv_channels(t: torch.Tensor, attn: Attention) -> torch.Tensor:
    """Reduce o_proj input channels (last dim, q heads × head_dim) to v channels (kv heads × head_dim) by
    the max over the query heads that share each kv head (grouped-query attention)."""
    n_kv = attn.v_proj.out_features // attn.head_dim
    return t.reshape(*t.shape[:-1], n_kv, -1, attn.head_dim).amax(-2).flatten(-2)


def q_channels(s: torch.Tensor, attn: Attention) -> torch.Tensor:
    """The inverse direction: repeat a per-v-channel factor for every query head of its group."""
    n_kv = attn.v_proj.out_features // attn.head_dim
    group = attn.o_proj.in_features // attn.v_proj.out_features
    return s.reshape(n_kv, 1, attn.head_dim).expand(n_kv, group, attn.head_dim).reshape(-1)


@torch.no_grad()
def fold_scales(prev: torch.nn.Module, linears: list[torch.nn.Linear], s: torch.Tensor,
                s_in: torch.Tensor | None = None) -> None:
    """X → X diag(s)⁻¹ folded into `prev` (a norm's weight, or a Linear's output rows and bias), and
    W → W diag(s_in) for each Linear reading X (`s_in` = s unless a GQA layout repeats it)."""
    s_in = s if s_in is None else s_in
    if isinstance(prev, torch.nn.Linear):
        prev.weight.div_(s.to(prev.weight.dtype)[:, None])
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    else:
        prev.weight.div_(s.to(prev.weight.dtype))
    for fc in linears:
        fc.weight.mul_(s_in.to(fc.weight.dtype))


def smooth_layer(layer: DecoderLayer, stats: dict[str, ChannelStats], prefix: str,
                 alpha: float = 0.5) -> None:
    """Smooth the four Linear inputs of one decoder layer (table above); `stats` by HF Linear name."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    s = smoothing_factors(stats[prefix + "self_attn.q_proj"].absmax, [fc.weight for fc in qkv],
                          alpha)
    fold_scales(layer.input_layernorm, qkv, s)
    gate_up = [mlp.gate_proj, mlp.up_proj]
    s = smoothing_factors(stats[prefix + "mlp.gate_proj"].absmax, [fc.weight for fc in gate_up],
                          alpha)
    fold_scales(layer.post_attention_layernorm, gate_up, s)
    s = smoothing_factors(kv_channels(stats[prefix + "self_attn.o_proj"].absmax, attn),
                          [kv_channels(attn.o_proj.weight.abs(), attn)], alpha)
    fold_scales(attn.v_proj, [attn.o_proj], s, q_channels(s, attn))
    s = smoothing_factors(stats[prefix + "mlp.down_proj"].absmax, [mlp.down_proj.weight], alpha)
    fold_scales(mlp.up_proj, [mlp.down_proj], s)


def smooth_lm(model: CausalLM, stats: dict[str, ChannelStats], alpha: float = 0.5) -> CausalLM:
    """Apply Eq. 4 smoothing to every decoder layer in place (`stats` from `calibration.input_stats` on
    the unsmoothed model); the float function is unchanged, its Linear inputs are flatter."""
    for i, layer in enumerate(model.model.layers):
        smooth_layer(layer, stats, f"model.layers.{i}.", alpha)
    return model
