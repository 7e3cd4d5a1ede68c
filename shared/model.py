"""The one decoder-only Transformer of nano-infra: Llama / Qwen2 / Qwen3 (Vaswani et al. 2017, arXiv 1706.03762).

Pre-norm decoder blocks with RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021),
grouped-query attention (Ainslie et al. 2023), a SwiGLU MLP (Shazeer 2020), optional per-head q/k RMSNorm
(Qwen3) and q/k/v bias (Qwen2), tied or untied embeddings.

Three properties every other package relies on:

* **Hugging Face names.** Module paths equal HF's (`model.layers.0.self_attn.q_proj.weight`, ...), so HF
  checkpoints load without renaming (shared.checkpoint) and ours load in `transformers`.
* **One replaceable attention call.** Each layer computes q, k, v, applies RoPE, then calls
  `attn_fn(q, k, v, layer_idx, ctx)` with (batch, seqlen, heads, head_dim) tensors. The default is causal
  attention (nano_flashattn on CUDA, torch SDPA elsewhere); nano_vllm installs a paged-KV backend with
  `model.set_attention(fn)` and passes its per-step context as `attn_ctx`.
* **Plain layers, sharded from outside.** Every projection is an `nn.Linear`, the vocabulary an
  `nn.Embedding`, called as modules; head counts are read off the projected tensors, not the config,
  so tensor parallelism (nano_megatron) can swap modules for column/row-parallel ones without edits here.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shared import kernels
from shared.config import ModelConfig


class AttentionFn(Protocol):
    """q: (B, Sq, Hq, D) after RoPE; k, v: (B, Sk, Hkv, D); returns (B, Sq, Hq, D)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                 ctx: Any) -> torch.Tensor: ...


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int = 0,
                   ctx: Any = None) -> torch.Tensor:
    """Causal attention with torch SDPA. When Sq < Sk the queries are the *last* Sq positions
    (bottom-right aligned mask, flash-attn's convention), which is what decoding with a cache needs."""
    sq, sk = q.shape[1], k.shape[1]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if kt.shape[1] != qt.shape[1]:  # GQA: each kv head serves Hq / Hkv query heads
        rep = qt.shape[1] // kt.shape[1]
        kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
    if sq == sk:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        mask = torch.arange(sk, device=q.device)[None, :] <= i
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return out.transpose(1, 2)


def default_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int = 0,
                      ctx: Any = None) -> torch.Tensor:
    """Causal self-attention: nano_flashattn's FlashAttention-2 kernel on CUDA for the head sizes it
    supports (multiples of 8 from 16 to 256), torch SDPA for everything else. nano_flashattn runs its
    performance layers (Hopper kernels, the split head axis) wherever they apply, found by its registry:
    nothing here names them, and `nano_flashattn.performance_layers(False)` runs its paper path."""
    if q.is_cuda and _flash_attn_func is not None and q.shape[-1] in _FLASH_HEAD_DIMS:
        return _flash_attn_func(q, k, v, causal=True)
    return sdpa_attention(q, k, v, layer_idx, ctx)


try:  # shared stands on nano_flashattn (DESIGN.md dependency rule); absent in a fork of shared alone
    from nano_flashattn import flash_attn_func as _flash_attn_func
    from nano_flashattn.checks import HEAD_DIMS as _FLASH_HEAD_DIMS
except ImportError:  # pragma: no cover - depends on what is installed
    _flash_attn_func, _FLASH_HEAD_DIMS = None, ()


def rope_inv_freq(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """θ_i = base^(-2i/d) of RoFormer eq. (15), with Llama-3's frequency-dependent scaling if configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    if cfg.rope_scaling is not None:  # "llama3": stretch low frequencies, keep high ones, blend between
        s = cfg.rope_scaling
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / lo, inv_freq / factor,
                               torch.where(wavelen < old_len / hi, inv_freq, scaled))
    return inv_freq.float()


class RMSNorm(nn.Module):
    """RMSNorm; `forward(x, residual)` fuses the residual add (returns the normed sum and the sum)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)


@torch.no_grad()
def init_module_(module: nn.Module, std: float, gen: torch.Generator | None = None) -> None:
    """Initialise one module's own parameters as HF does: N(0, std) matrices, zero biases, unit norms.
    Applied over `modules()` in order with one generator it is `CausalLM.init_weights`; engines that
    materialise a model piece by piece (ZeRO-3) call it per module and draw the same numbers."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.weight.normal_(0.0, std, generator=gen)
    if isinstance(module, nn.Linear) and module.bias is not None:
        module.bias.zero_()
    if isinstance(module, RMSNorm):
        module.weight.fill_(1.0)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=False)
        if cfg.qk_norm:  # Qwen3: RMSNorm over head_dim of each q and k head, before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn_fn: AttentionFn = default_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: Any) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the projections' widths, so a tensor-parallel shard just works.
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = kernels.apply_rope(q, cos, sin), kernels.apply_rope(k, cos, sin)
        out = self.attn_fn(q, k, v, self.layer_idx, ctx)
        return self.o_proj(out.reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mlp_half(*self.attention_half(h, residual, cos, sin, ctx))

    # The two halves of forward, separately callable (nano_megatron interleaves two micro-batches at this
    # granularity). The residual stream is carried separately so each norm fuses "add the branch, then
    # normalise" into one pass over memory (x + f(x) followed by RMSNorm of the sum).
    def attention_half(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        return self.self_attn(h, cos, sin, ctx), residual

    def mlp_half(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class TransformerModel(nn.Module):
    """The decoder stack without the LM head (HF's `LlamaModel`): token ids -> final hidden states."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of position·θ_i, shape positions.shape + (head_dim/2,), fp32 (computed per call: cheap)."""
        inv = self._inv_freq.get(positions.device)
        if inv is None:
            inv = self._inv_freq[positions.device] = rope_inv_freq(self.config, positions.device)
        freqs = positions.float()[..., None] * inv
        return freqs.cos(), freqs.sin()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn_ctx: Any = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        cos, sin = self.rope_cos_sin(positions)
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, attn_ctx)
        h, _ = self.norm(h, residual)
        return h


class CausalLM(nn.Module):
    """HF's `*ForCausalLM`: `model` (the decoder stack) plus `lm_head`; forward returns logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = TransformerModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config says so (re-run after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> CausalLM:
        """HF-style init: N(0, initializer_range) for matrices, zeros for biases, ones for norms.
        Works after `to_empty(device=...)` of a model built on the meta device."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        for module in self.modules():
            init_module_(module, self.config.initializer_range, gen)
        self.model._inv_freq.clear()
        return self

    def set_attention(self, fn: AttentionFn) -> None:
        """Route every layer's attention through `fn(q, k, v, layer_idx, ctx)` (e.g. a paged KV cache)."""
        for layer in self.model.layers:
            layer.self_attn.attn_fn = fn

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn_ctx: Any = None) -> torch.Tensor:
        return self.compute_logits(self.model(input_ids, positions, attn_ctx))


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = 0) -> CausalLM:
    """A randomly initialised model (built on the meta device first, so large presets allocate once)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model.to(dtype)


@torch.no_grad()
def greedy_generate(model: CausalLM, input_ids: list[int] | torch.Tensor, max_new_tokens: int,
                    eos_token_id: int | None = None) -> list[int]:
    """Step-by-step greedy decoding by recomputing the whole prefix each step (no KV cache): slow but
    obviously right, the oracle the engines' outputs are compared with."""
    dev = model.lm_head.weight.device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=dev).reshape(1, -1)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model(ids)[0, -1].argmax())
        out.append(nxt)
        if eos_token_id is not None and nxt == eos_token_id:
            break
        ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
    return out


__all__ = [
    "MLP",
    "Attention",
    "AttentionFn",
    "CausalLM",
    "DecoderLayer",
    "RMSNorm",
    "TransformerModel",
    "build_model",
    "default_attention",
    "greedy_generate",
    "init_module_",
    "rope_inv_freq",
    "sdpa_attention",
]
