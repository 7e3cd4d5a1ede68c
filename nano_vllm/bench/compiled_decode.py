"""The batch-1 peer of `python -m nano_vllm.bench workload=batch1 peer=compiled`: gpt-fast's decode.

gpt-fast (pytorch-labs/gpt-fast) decodes with plain torch ops — a static KV cache, SDPA over the whole
cache under a position mask, the projections as `F.linear` — and `torch.compile` of the one-token step
(inductor fuses the norms, RoPE and residual adds into the GEMVs' neighbours and, with "max-autotune",
replays the step as a CUDA graph and autotunes its matmuls). That is what a user who does not want a
serving engine gets for batch-1 latency, so it is the bar for nano_vllm's batch-1 row. Here it runs on
shared.model's weights (the same architecture, random weights from the same seed as the engine's); the
prompt is prefilled eagerly in one forward, every output token after it is one compiled step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nano_vllm.bench.throughput import sync
from shared.kernels import apply_rope_torch
from shared.model import CausalLM, build_model, rope_inv_freq


class StaticDecoder(nn.Module):
    """gpt-fast's Transformer over shared.model's weights: the K/V cache and RoPE's frequencies are buffers
    (static addresses, so the compiled step's CUDA graph may write the cache in place)."""

    def __init__(self, model: CausalLM, max_len: int):
        super().__init__()
        cfg = model.config
        self.model, self.cfg = model, cfg
        p = model.lm_head.weight
        for i in range(cfg.num_hidden_layers):
            for kv in "kv":
                self.register_buffer(f"{kv}{i}", p.new_zeros(1, cfg.num_key_value_heads, max_len, cfg.head_dim))
        self.register_buffer("inv_freq", rope_inv_freq(cfg, p.device))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits of the last position of `tokens` (B, S) at `positions` (S,), their K/V written into the
        cache: gpt-fast's Transformer.forward."""
        cfg, model = self.cfg, self.model
        eps, d = cfg.rms_norm_eps, cfg.head_dim
        b, s = tokens.shape
        freqs = positions.float()[:, None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        mask = torch.arange(self.k0.shape[2], device=tokens.device)[None, :] <= positions[:, None]
        x = model.model.embed_tokens(tokens)
        for i, layer in enumerate(model.model.layers):
            a, k_cache, v_cache = layer.self_attn, getattr(self, f"k{i}"), getattr(self, f"v{i}")
            h = F.rms_norm(x, (x.shape[-1],), layer.input_layernorm.weight, eps)
            q = F.linear(h, a.q_proj.weight, a.q_proj.bias).view(b, s, -1, d)
            k = F.linear(h, a.k_proj.weight, a.k_proj.bias).view(b, s, -1, d)
            v = F.linear(h, a.v_proj.weight, a.v_proj.bias).view(b, s, -1, d)
            if a.q_norm is not None:
                q = F.rms_norm(q, (d,), a.q_norm.weight, eps)
                k = F.rms_norm(k, (d,), a.k_norm.weight, eps)
            q, k = apply_rope_torch(q, cos[None], sin[None]), apply_rope_torch(k, cos[None], sin[None])
            k_cache.index_copy_(2, positions, k.transpose(1, 2))
            v_cache.index_copy_(2, positions, v.transpose(1, 2))
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache, v_cache, attn_mask=mask,
                                               enable_gqa=True)
            x = x + F.linear(o.transpose(1, 2).reshape(b, s, -1), a.o_proj.weight)
            h = F.rms_norm(x, (x.shape[-1],), layer.post_attention_layernorm.weight, eps)
            m = layer.mlp
            x = x + F.linear(F.silu(F.linear(h, m.gate_proj.weight)) * F.linear(h, m.up_proj.weight),
                             m.down_proj.weight)
        x = F.rms_norm(x[:, -1], (x.shape[-1],), model.model.norm.weight, eps)
        return model.lm_head(x)


def run_compiled_decode(model_config: Any, prompt: list[int], max_tokens: int, device: str,
                        dtype: torch.dtype, mode: str = "max-autotune", seed: int = 0) -> dict:
    """Greedy decode of one prompt, the prompt in one eager forward, then the compiled one-token step (on
    CUDA); returns the bench row (output tok/s counts the prefill, as nano_vllm's row does) and the tokens
    (`_tokens`)."""
    if max_tokens < 1 or not prompt:
        raise ValueError(f"run_compiled_decode: needs a prompt and max_tokens >= 1, got {len(prompt)} prompt "
                         f"tokens and max_tokens={max_tokens}")
    model = build_model(model_config, device, dtype, seed=seed).requires_grad_(False)
    decoder = StaticDecoder(model, len(prompt) + max_tokens)
    cuda = str(device).startswith("cuda")
    if cuda:  # gpt-fast's inductor settings
        torch._inductor.config.coordinate_descent_tuning = True
        torch._inductor.config.triton.unique_kernel_names = True
    step = torch.compile(decoder, mode=mode, fullgraph=True, dynamic=False) if cuda else decoder
    ids = torch.tensor([prompt], device=device)

    def generate() -> list[int]:
        with torch.no_grad():
            tok = decoder(ids, torch.arange(len(prompt), device=device)).argmax(-1, keepdim=True)
            pos = torch.tensor([len(prompt)], device=device)
            out = [tok]
            for _ in range(max_tokens - 1):
                tok = step(tok, pos).argmax(-1, keepdim=True)
                pos += 1
                out.append(tok)
            return torch.cat(out, 1)[0].tolist()

    t0 = time.perf_counter()
    generate()  # compile (and autotune) outside the timing, every step shape included
    sync()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = generate()
    sync()
    seconds = time.perf_counter() - t0
    return {"system": f"torch.compile decode ({mode}, gpt-fast)", "requests": 1, "output tokens": len(tokens),
            "seconds": seconds, "output tok/s": len(tokens) / seconds, "steps": len(tokens),
            "ms/step": 1e3 * seconds / len(tokens), "compile s": compile_s, "_tokens": tokens}
