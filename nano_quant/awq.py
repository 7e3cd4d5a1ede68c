"""AWQ (Lin et al. 2023, arXiv 2306.00978): activation-aware weight quantization, W4A16 with groups of 128.

§3.1: keeping 1% of the weight channels in fp16 recovers most of the INT4 loss — if the channels are
chosen by *activation* magnitude, not weight magnitude. §3.2: mixed precision is unfriendly to hardware,
so AWQ protects those channels by scaling instead: multiplying a salient channel's weights by s > 1 before
rounding and its input by 1/s barely changes the group's step Δ, so that channel's rounding error, as
seen at the output, shrinks by about 1/s. §3.3 ("searching to scale"): with s_X the average magnitude of
each input channel, s = s_X^α and α* = argmin_α L(s_X^α), L(s) = ‖Q(W·diag(s))·(diag(s)⁻¹·X) − W·X‖²
(Eq. 4-5), α over a grid of 20 points in [0, 1), measured on the output of the block the weights belong
to (attention for q/k/v, the MLP for gate/up). The division of X is folded into the preceding operator
as in SmoothQuant (`smoothquant.fold_scales`). A weight clipping search then shrinks each group's range
where that lowers the group's output error. No gradients, no reconstruction: calibration only measures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from shared.model import CausalLM, DecoderLayer

from .quant import check_bits, fake_quantize_groupwise
from .smoothquant import fold_scales, kv_channels, q_channels

TensorFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class AWQConfig:
    """The search (AutoAWQ's defaults): INT4, groups of 128, zero points, 20 α points, clipping on."""

    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    n_grid: int = 20
    clip: bool = True
    max_shrink: float = 0.5  # clipping tries max|w|·(1 − i/n_grid) for i < max_shrink·n_grid
    clip_tokens: int = 512  # calibration tokens the clipping search looks at
    duo_scaling: bool = False  # AutoAWQ's option: s = s_X^α / s_W^(1−α) instead of §3.3's s_X^α

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if self.n_grid < 1 or not 0 <= self.max_shrink < 1:
            raise ValueError(f"AWQConfig needs n_grid >= 1 and 0 <= max_shrink < 1, got "
                             f"{self.n_grid}, {self.max_shrink}")


@dataclass
class ScaleSearch:
    """The outcome of one search: α*, its per-input-channel scales s, and L(s_X^α) for every α tried."""

    alpha: float
    scales: torch.Tensor
    losses: list[float] = field(default_factory=list)


def awq_scales(s_x: torch.Tensor, alpha: float, s_w: torch.Tensor | None = None) -> torch.Tensor:
    """s = s_X^α (or s_X^α / s_W^(1−α) with AutoAWQ's `duo_scaling`), normalised so that max(s)·min(s) = 1
    (a common factor of s changes nothing but the range of the scaled weights; centring it keeps them near
    the originals)."""
    s = s_x.float().pow(alpha)
    if s_w is not None:
        s = s / (s_w.float().pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def weight_magnitude(linears: list[nn.Linear], group_size: int) -> torch.Tensor:
    """s_W for `duo_scaling`: the mean over output rows of |W| relative to its group's max|W|, per input
    channel (the weight-side twin of s_X; a channel whose weights already sit near the group's max gains
    little from a larger s)."""
    w = torch.cat([fc.weight.detach().float() for fc in linears])
    groups = w.abs().reshape(-1, group_size)
    return (groups / (groups.amax(-1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)


@torch.no_grad()
def awq_loss(block: TensorFn, linears: list[nn.Linear], x: torch.Tensor, s: torch.Tensor,
             reference: torch.Tensor, cfg: AWQConfig) -> float:
    """L(s) of Eq. 4: mean squared error of the block's output with each weight W of `linears` replaced
    by Q(W·diag(s))·diag(s)⁻¹ (equivalently, quantized scaled weights fed with X/s). Weights restored."""
    saved = [fc.weight.data for fc in linears]
    try:
        for fc in linears:
            scaled = fc.weight.data * s.to(fc.weight.dtype)
            q = fake_quantize_groupwise(scaled, cfg.group_size, cfg.bits, cfg.zero_point)
            fc.weight.data = q / s
        return float((block(x) - reference).float().pow(2).mean())
    finally:
        for fc, w in zip(linears, saved):
            fc.weight.data = w


@torch.no_grad()
def search_scale(block: TensorFn, linears: list[nn.Linear], x: torch.Tensor, cfg: AWQConfig,
                 tie: TensorFn | None = None) -> ScaleSearch:
    """α* = argmin over {0, 1/n, ..., (n−1)/n} of L(s_X^α) (§3.3); `x` is the input of `linears`, `block`
    maps it to the output whose error counts. `tie` projects s onto factors a GQA fold can realise."""
    s_x = x.reshape(-1, x.shape[-1]).abs().float().mean(0)  # s_X: mean magnitude per input channel
    s_w = weight_magnitude(linears, cfg.group_size) if cfg.duo_scaling else None
    reference = block(x)
    best = ScaleSearch(alpha=-1.0, scales=torch.ones_like(s_x))
    for i in range(cfg.n_grid):
        s = awq_scales(s_x, i / cfg.n_grid, s_w)
        s = s if tie is None else tie(s)
        best.losses.append(awq_loss(block, linears, x, s, reference, cfg))
        if best.losses[-1] < min(best.losses[:-1], default=float("inf")):
            best.alpha, best.scales = i / cfg.n_grid, s
    return best


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, cfg: AWQConfig,
                rows_per_batch: int = 256) -> torch.Tensor:
    """Clipping thresholds (out, K / group_size): for each output channel and group, the shrunk range
    max|w|·(1 − i/n_grid) whose quantized group gives the least error on that group's share of the
    output, Σ_k x_k w_k over the group's K-slice, on up to `clip_tokens` calibration tokens."""
    g = cfg.group_size
    x = x.reshape(-1, x.shape[-1])
    x = x[:: max(1, x.shape[0] // cfg.clip_tokens)].float().reshape(-1, x.shape[-1] // g, g)
    thresholds = []
    for wb in w.float().split(rows_per_batch):
        wg = wb.reshape(wb.shape[0], -1, g)
        full = wg.abs().amax(-1, keepdim=True)
        reference = torch.einsum("tgk,ogk->otg", x, wg)
        best, best_err = full.clone(), torch.full_like(full, float("inf"))
        for i in range(int(cfg.max_shrink * cfg.n_grid)):
            m = full * (1 - i / cfg.n_grid)
            clipped = wg.clamp(-m, m).reshape(wb.shape)
            q = fake_quantize_groupwise(clipped, g, cfg.bits, cfg.zero_point).reshape(wg.shape)
            err = (torch.einsum("tgk,ogk->otg", x, q) - reference).pow(2).mean(1)[..., None]
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, m, best)
        thresholds.append(best[..., 0])
    return torch.cat(thresholds)


@torch.no_grad()
def clip_weight(fc: nn.Linear, thresholds: torch.Tensor, group_size: int) -> None:
    """Clamp every group of `fc.weight` to ±its threshold, in place."""
    w = fc.weight.data.view(fc.out_features, -1, group_size)
    t = thresholds.to(w.dtype)[..., None]
    w.copy_(torch.maximum(torch.minimum(w, t), -t))


@torch.no_grad()
def awq_layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cfg: AWQConfig) -> tuple[torch.Tensor, dict[str, ScaleSearch]]:
    """Search, fold and clip one decoder layer in place. `x` is its input (the residual stream); returns
    the layer's output computed before any change (the next layer calibrates on float activations, as
    AutoAWQ does) and the four searches by the name of the Linear input they scale."""
    attn, mlp = layer.self_attn, layer.mlp
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: inputs.__setitem__(n, args[0]))
             for n, m in (("qkv", attn.q_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_proj),
                          ("down", mlp.down_proj))]
    try:
        h, residual = layer(x, None, cos, sin, None)
    finally:
        for hook in hooks:
            hook.remove()
    qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
    searches = {
        "qkv": search_scale(lambda t: attn(t, cos, sin, None), qkv, inputs["qkv"], cfg),
        "gate_up": search_scale(mlp, gate_up, inputs["gate_up"], cfg),
        "o": search_scale(attn.o_proj, [attn.o_proj], inputs["o"], cfg,
                          tie=lambda s: q_channels(kv_channels(s, attn), attn)),
        "down": search_scale(mlp.down_proj, [mlp.down_proj], inputs["down"], cfg),
    }
    fold_scales(layer.input_layernorm, qkv, searches["qkv"].scales)
    fold_scales(layer.post_attention_layernorm, gate_up, searches["gate_up"].scales)
    s_o = searches["o"].scales
    fold_scales(attn.v_proj, [attn.o_proj], kv_channels(s_o, attn), s_o)
    fold_scales(mlp.up_proj, [mlp.down_proj], searches["down"].scales)
    # q and k are left unclipped: their errors meet in q·kᵀ, which the search does not see.
    if cfg.clip:
        for name, fcs in (("qkv", [attn.v_proj]), ("o", [attn.o_proj]), ("gate_up", gate_up),
                          ("down", [mlp.down_proj])):
            x_scaled = inputs[name] / searches[name].scales.to(inputs[name].dtype)
            for fc in fcs:
                clip_weight(fc, search_clip(fc.weight, x_scaled, cfg), cfg.group_size)
    return h + residual, searches


@torch.no_grad()
def awq_model(model: CausalLM, samples: torch.Tensor, cfg: AWQConfig | None = None,
              progress: bool = True) -> dict[str, ScaleSearch]:
    """Run the AWQ search over every decoder layer in order, in place (weights stay float: quantize them
    afterwards with `WQLinear_GEMM.from_linear`). `samples` (n, seqlen) are calibration token ids.
    Returns every search by Linear-input name (`model.layers.3.gate_up`)."""
    cfg = cfg or AWQConfig()
    dev = next(model.parameters()).device
    ids = samples.to(dev)
    x = model.model.embed_tokens(ids)
    cos, sin = model.model.rope_cos_sin(torch.arange(ids.shape[1], device=dev).expand_as(ids))
    found: dict[str, ScaleSearch] = {}
    layers = tqdm(model.model.layers, desc="AWQ", unit="layer", disable=not progress)
    for i, layer in enumerate(layers):
        x, searches = awq_layer(layer, x, cos, sin, cfg)
        found.update({f"model.layers.{i}.{k}": v for k, v in searches.items()})
    return found
