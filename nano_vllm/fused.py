"""Fused projections — a performance layer: q/k/v as one matmul, gate/up as one (vLLM's QKVParallelLinear and
MergedColumnParallelLinear).

shared.model keeps HF's separate `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`, so checkpoints load by
name and a reader sees the paper's formulas. Three matmuls over the same input read it three times and
launch three kernels; their weights stacked on the output dimension give the same products in one
matmul. `fuse_projections(model)` does the stacking once, at load time (the runner applies it when
`EngineConfig.fused_projections` is on, before the KV cache is sized and CUDA graphs are captured):

* each decoder layer's attention becomes a `FusedAttention` holding `qkv_proj` (weight [Wq; Wk; Wv]) and
  splitting its output into q, k, v — views, no copy;
* each MLP becomes a `FusedMLP` holding `gate_up_proj` ([Wgate; Wup]); `silu_and_mul` reads the two halves
  of its output in place.

Tensor parallelism (§4.6) shards first (nano_vllm.tp: q/k/v, gate and up are column-parallel, each rank
keeps its heads' rows), then each rank fuses its own shards, so rank r's `qkv_proj` is [Wq_r; Wk_r; Wv_r] —
the layout vLLM's QKVParallelLinear loads. The modules are changed in place (their class and their
projections); parameters that are not fused stay the same tensors. Quantized projections (nano_quant's
W8A8Linear, WQLinear_GEMM) fuse too, by their own `stack`: their tensors concatenate the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shared import kernels
from shared.model import MLP, Attention, CausalLM


def stackable(linears: list[nn.Module]) -> bool:
    """Whether `stack_linears` fuses these: all nn.Linear, or all of one quantized layer class that stacks
    itself (nano_quant's `W8A8Linear.stack`, `WQLinear_GEMM.stack`). Other mixes stay unfused."""
    kind = type(linears[0])
    return all(type(m) is kind for m in linears) and (issubclass(kind, nn.Linear) or hasattr(kind, "stack"))


def stack_linears(linears: list[nn.Module]) -> nn.Module:
    """One Linear whose output is the concatenation of `linears`' outputs (weights and biases stacked); a
    quantized layer class stacks its own tensors (`stack`)."""
    first = linears[0]
    if not stackable(linears):
        raise ValueError(f"cannot stack layers of types {[type(m).__name__ for m in linears]}: they must be "
                         "all nn.Linear or all one quantized class with a `stack` method")
    if not isinstance(first, nn.Linear):
        return type(first).stack(linears)
    if any(m.in_features != first.in_features for m in linears):
        raise ValueError(f"cannot stack Linear layers of different input sizes "
                         f"{[m.in_features for m in linears]}")
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("cannot stack Linear layers where only some have a bias")
    grad = first.weight.requires_grad
    with torch.device("meta"):  # no allocation: the parameters are the stacked tensors below
        fused = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=all(has_bias))
    fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=grad)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=grad)
    return fused


class FusedAttention(Attention):
    """shared.model's Attention with q, k and v from one matmul (`qkv_proj`); everything after the
    projections is Attention.forward's."""

    qkv_proj: nn.Linear
    qkv_sizes: tuple[int, int, int]

    @classmethod
    def fuse(cls, attn: Attention) -> FusedAttention:
        """Turn `attn` into a FusedAttention in place (its q/k/v projections replaced by `qkv_proj`)."""
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        attn.qkv_proj = stack_linears(projections)
        attn.qkv_sizes = tuple(m.out_features for m in projections)
        del attn.q_proj, attn.k_proj, attn.v_proj
        attn.__class__ = cls
        return attn

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: Any) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in self.qkv_proj(x).split(self.qkv_sizes, dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = kernels.apply_rope(q, cos, sin), kernels.apply_rope(k, cos, sin)
        out = self.attn_fn(q, k, v, self.layer_idx, ctx)
        return self.o_proj(out.reshape(b, s, -1))


class FusedMLP(MLP):
    """shared.model's SwiGLU MLP with gate and up from one matmul (`gate_up_proj`)."""

    gate_up_proj: nn.Linear

    @classmethod
    def fuse(cls, mlp: MLP) -> FusedMLP:
        """Turn `mlp` into a FusedMLP in place (gate/up replaced by `gate_up_proj`)."""
        mlp.gate_up_proj = stack_linears([mlp.gate_proj, mlp.up_proj])
        del mlp.gate_proj, mlp.up_proj
        mlp.__class__ = cls
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(kernels.silu_and_mul(gate, up))


def fuse_projections(model: CausalLM) -> CausalLM:
    """Fuse q/k/v and gate/up of every decoder layer of `model` in place; returns it. Layers already fused
    are left as they are, and so are projections `stack_linears` cannot stack (`stackable`: say a quantized
    q_proj beside a 16-bit k_proj)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, FusedAttention) and stackable([attn.q_proj, attn.k_proj, attn.v_proj]):
            FusedAttention.fuse(attn)
        if not isinstance(mlp, FusedMLP) and stackable([mlp.gate_proj, mlp.up_proj]):
            FusedMLP.fuse(mlp)
    return model


def apply_fused_projections(runner: Any) -> None:
    """The runner layer (`ModelRunner.runner_layers`): fuse the loaded model when the config asks."""
    if runner.config.fused_projections:
        fuse_projections(runner.model)
