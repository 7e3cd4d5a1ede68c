"""Fused projections — a performance layer: q/k/v as one matmul, gate/up as one (vLLM's QKVParallelLinear and
MergedColumnParallelLinear).

shared.model keeps HF's separate `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`, so checkpoints load by
name and a reader sees the paper's formulas. Three matmuls over the same input read it three times and
launch three kernels; their weights stacked on the output dimension give the same products in one
matmul. `fuse_projections(model)` does the stacking once, at load time (a "runner" hook: on CUDA unless
`EngineConfig.fused_projections` is False, anywhere when True; before the KV cache is sized and CUDA
graphs are captured):

* each decoder layer's attention becomes a `FusedAttention` holding `qkv_proj` (weight [Wq; Wk; Wv]) and
  splitting its output into q, k, v — views, no copy;
* each MLP becomes a `FusedMLP` holding `gate_up_proj` ([Wgate; Wup]); `silu_and_mul` reads the two halves
  of its output in place.

Tensor parallelism (§4.6) shards first (nano_vllm.tp: q/k/v, gate and up are column-parallel, each rank
keeps its heads' rows), then each rank fuses its own shards, so rank r's `qkv_proj` is [Wq_r; Wk_r; Wv_r] —
the layout vLLM's QKVParallelLinear loads. The modules are changed in place (their class and their
projections); parameters that are not fused stay the same tensors. Quantized projections (nano_quant's
W8A8Linear, WQLinear_GEMM) fuse too, by their own `stack`: their tensors concatenate the same way.

On CUDA, under PagedAttention, a `FusedAttention` also rotates q and k and writes k and v into the paged
cache in one kernel (`rope_and_store`), where the paper path launches four (RoPE on q, on k, and one
`index_copy_` each for K and V): at a decode step each is a few µs of launch for a few KiB of data, and a
llama3-8b step has 32 layers of them.
A `FusedMLP` whose gate_up layer offers `forward_silu_and_mul` (nano_quant's repacked W4 layer) takes
SwiGLU from that GEMM's epilogue: no (M, 2·intermediate) output and no SwiGLU launch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nano_vllm.attention import PagedAttention
from nano_vllm.config import REGISTRY
from shared import kernels
from shared.kernels import HAS_TRITON, use_triton
from shared.kernels.launch import cdiv, next_pow2
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
        attn = self.attn_fn
        # RoPE and the cache write in one launch, for a cache of q's dtype or an FP8 one (quantized in
        # the same kernel, the codes of nano_flashattn's store_kv_fp8)
        if isinstance(attn, PagedAttention) and use_triton(q) and \
                attn.kv_cache.dtype in (q.dtype, torch.float8_e4m3fn):
            caches = attn.kv_cache[0, self.layer_idx], attn.kv_cache[1, self.layer_idx]
            q, k = rope_and_store(q, k, v, cos, sin, *caches, ctx.slot_mapping,
                                  **attn.scales(self.layer_idx))
            out = attn.attend(q, k, v, self.layer_idx, ctx)
        else:
            q, k = kernels.apply_rope(q, cos, sin), kernels.apply_rope(k, cos, sin)
            out = attn(q, k, v, self.layer_idx, ctx)
        return self.o_proj(out.reshape(b, s, -1))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from nano_flashattn.checks import scale_stride
    from nano_flashattn.kv_fp8 import to_e4m3
    from shared.kernels import pdl_args, pdl_prologue

    @triton.jit(do_not_specialize=["n_rows"])
    def _rope_store_kernel(Q, K, V, COS, SIN, QOUT, KOUT, K_CACHE, V_CACHE, SLOTS, K_SCALE, V_SCALE,
                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                           stride_st, stride_ks, stride_vs, n_rows,
                           HEADS_Q: tl.constexpr, HEADS_KV: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                           PDL: tl.constexpr):
        """Row r = (token t, head h) of the HEADS_Q + 2·HEADS_KV heads of q, k, v: rotated (RoFormer eq. 34,
        rotate_half, fp32) for q and k, as is for v; q → QOUT, k → KOUT and k, v → cache row SLOTS[t].
        FP8: the cache rows hold E4M3(clamp(x / scale, ±448)) of x in q's dtype (`to_e4m3`), scales
        K_SCALE[head · stride_ks] and V_SCALE[head · stride_vs] (stride 0: one per tensor)."""
        pdl_prologue(PDL)  # launch overlap with the previous kernel (nano_flashattn/launch.py)
        heads: tl.constexpr = HEADS_Q + 2 * HEADS_KV
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < n_rows
        t, h = (rows // heads).to(tl.int64), rows % heads
        is_q, is_v = h < HEADS_Q, h >= HEADS_Q + HEADS_KV
        is_k = ~is_q & ~is_v
        hq = tl.minimum(h, HEADS_Q - 1)  # each row's head within q, k and v, clamped where it is not one
        hk = tl.minimum(tl.maximum(h - HEADS_Q, 0), HEADS_KV - 1)
        hv = tl.maximum(h - HEADS_Q - HEADS_KV, 0)
        d = tl.arange(0, BLOCK_D)
        m = ok[:, None] & (d < HALF)[None, :]
        p_q = Q + t[:, None] * stride_qt + hq[:, None] * stride_qh + d[None, :]
        p_k = K + t[:, None] * stride_kt + hk[:, None] * stride_kh + d[None, :]
        p_v = V + t[:, None] * stride_vt + hv[:, None] * stride_vh + d[None, :]
        mq, mk, mv = m & is_q[:, None], m & is_k[:, None], m & is_v[:, None]
        x1 = (tl.load(p_q, mask=mq, other=0.0) + tl.load(p_k, mask=mk, other=0.0)
              + tl.load(p_v, mask=mv, other=0.0)).to(tl.float32)
        x2 = (tl.load(p_q + HALF, mask=mq, other=0.0) + tl.load(p_k + HALF, mask=mk, other=0.0)
              + tl.load(p_v + HALF, mask=mv, other=0.0)).to(tl.float32)
        c = tl.load(COS + t[:, None] * stride_ct + d[None, :], mask=m, other=1.0).to(tl.float32)
        sn = tl.load(SIN + t[:, None] * stride_st + d[None, :], mask=m, other=0.0).to(tl.float32)
        y1 = tl.where(is_v[:, None], x1, x1 * c - x2 * sn).to(QOUT.dtype.element_ty)
        y2 = tl.where(is_v[:, None], x2, x2 * c + x1 * sn).to(QOUT.dtype.element_ty)
        o_q = QOUT + (t * HEADS_Q + hq)[:, None] * (2 * HALF) + d[None, :]
        o_k = KOUT + (t * HEADS_KV + hk)[:, None] * (2 * HALF) + d[None, :]
        tl.store(o_q, y1, mask=mq)
        tl.store(o_q + HALF, y2, mask=mq)
        tl.store(o_k, y1, mask=mk)
        tl.store(o_k + HALF, y2, mask=mk)
        slot = tl.load(SLOTS + t, mask=ok, other=0).to(tl.int64)
        row = (slot * HEADS_KV + tl.where(is_k, hk, hv))[:, None] * (2 * HALF) + d[None, :]
        if FP8:  # k and v rows (q rows' scale is never used: their stores below are masked off)
            scale = tl.where(is_k, tl.load(K_SCALE + hk * stride_ks), tl.load(V_SCALE + hv * stride_vs))
            scale = tl.broadcast_to(scale[:, None], (BLOCK_R, BLOCK_D))
            y1 = to_e4m3(y1, scale)
            y2 = to_e4m3(y2, scale)
        tl.store(K_CACHE + row, y1, mask=mk)
        tl.store(K_CACHE + row + HALF, y2, mask=mk)
        tl.store(V_CACHE + row, y1, mask=mv)
        tl.store(V_CACHE + row + HALF, y2, mask=mv)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.apply_rope` on q and k, then `attention.store_kvcache` of the rotated k and v, in one Triton
    kernel (the same fp32 arithmetic, rounded once). q (B, S, Hq, D), k / v (B, S, Hkv, D), any strides with a
    unit-stride last dim (views of the qkv projection's output); cos / sin (B, S, D/2); caches (blocks,
    block_size, Hkv, D) contiguous, of q's dtype, or float8_e4m3fn with fp32 k_scale / v_scale of 1 or Hkv
    elements (then `store_kv_fp8`'s codes); slot_mapping (B·S,). Returns the rotated q and k, new
    tensors."""
    b, s, heads_q, dim = q.shape
    heads_kv = k.shape[2]
    tokens = b * s
    if (k.shape != v.shape or k.shape[:2] != (b, s) or k.shape[3] != dim or dim % 2 or cos.shape[-1] != dim // 2
            or k_cache.shape[-2:] != (heads_kv, dim) or v_cache.shape != k_cache.shape
            or not k_cache.is_contiguous() or not v_cache.is_contiguous() or slot_mapping.numel() != tokens
            or k_cache.dtype != (q.dtype if k_scale is None else torch.float8_e4m3fn)
            or (k_scale is None) != (v_scale is None) or any(t.stride(-1) != 1 for t in (q, k, v))):
        raise ValueError(f"rope_and_store: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos "
                         f"{tuple(cos.shape)}, caches {tuple(k_cache.shape)} {k_cache.dtype}, slot_mapping "
                         f"{tuple(slot_mapping.shape)} do not fit one another")
    q3, k3, v3 = (t.reshape(tokens, t.shape[2], dim) for t in (q, k, v))  # views: (B, S) merge by strides
    cos2, sin2 = (t.expand(b, s, dim // 2).reshape(tokens, dim // 2) for t in (cos, sin))
    q_out = torch.empty(b, s, heads_q, dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(b, s, heads_kv, dim, dtype=k.dtype, device=k.device)
    n_rows = tokens * (heads_q + 2 * heads_kv)
    block_d = next_pow2(dim // 2)
    block_r = max(1, 2048 // block_d)  # ~2K rotated pairs a program, as `apply_rope`
    if n_rows:
        _rope_store_kernel[(cdiv(n_rows, block_r),)](
            q3, k3, v3, cos2, sin2, q_out, k_out, k_cache, v_cache, slot_mapping, k_scale, v_scale,
            q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1), cos2.stride(0),
            sin2.stride(0), 0 if k_scale is None else scale_stride(k_scale),
            0 if v_scale is None else scale_stride(v_scale), n_rows,
            HEADS_Q=heads_q, HEADS_KV=heads_kv, HALF=dim // 2, BLOCK_R=block_r, BLOCK_D=block_d,
            FP8=k_scale is not None, num_warps=4, **pdl_args(q.device))
    return q_out, k_out


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
        fused_swiglu = getattr(self.gate_up_proj, "forward_silu_and_mul", None)
        if fused_swiglu is not None:  # a quantized layer whose GEMM applies SwiGLU in its epilogue (nano_quant)
            return self.down_proj(fused_swiglu(x))
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
    """The "runner" hook: fuse the loaded model's projections."""
    fuse_projections(runner.model)


REGISTRY.register("runner", apply_fused_projections,
                  applies=lambda runner: runner.config.wants("fused_projections", runner.device))
