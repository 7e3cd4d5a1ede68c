"""The torch reference of nano_vllm's FP8 KV cache (`kv_cache_dtype="fp8"`): a 16-bit engine whose
cache holds what the FP8 cache means. Each new K/V row is rounded through E4M3 by nano_quant.kv
(`quantize_fp8`, then `dequantize_fp8`, scale 1.0: the engine's uncalibrated default) before the paper
path's `store_kvcache`, so every read of the cache sees code x scale, as the FP8 kernels do; a step with
nothing cached yet attends to the fresh K/V, unrounded, as the FP8 engine does.

`FakeQuantAttention` wraps a `PagedAttention` instead of subclassing it, so the fused RoPE + store layer
(`layers/fused.py`, which writes 16-bit K/V itself) never takes it: both engines rotate through the paper
path's RoPE.
"""

from __future__ import annotations

import pytest
import torch

from nano_vllm import LLM, model_runner
from nano_vllm.attention import AttentionContext, PagedAttention, store_kvcache

kv = pytest.importorskip("nano_quant.kv")  # a fork without nano_quant has no reference to test against


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """x rounded to what an FP8 cache holds, in x's dtype: E4M3(x / 1.0) * 1.0."""
    one = torch.ones((), device=x.device)
    return kv.dequantize_fp8(kv.quantize_fp8(x, one), one, x.dtype)


class FakeQuantAttention:
    """PagedAttention over a 16-bit cache whose store rounds K/V through E4M3 first."""

    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None):
        assert kv_scales is None, "the reference engine's cache is 16-bit"
        self.kv_cache, self.paged = kv_cache, PagedAttention(kv_cache)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                 ctx: AttentionContext) -> torch.Tensor:
        caches = self.kv_cache[0, layer_idx], self.kv_cache[1, layer_idx]
        store_kvcache(fake_fp8(k), fake_fp8(v), *caches, ctx.slot_mapping)
        return self.paged.attend(q, k, v, layer_idx, ctx)


def reference_llm(model: str, monkeypatch: pytest.MonkeyPatch, **engine_args) -> LLM:
    """A 16-bit `LLM` (kv_cache_dtype="auto") with `FakeQuantAttention` as its attention call."""
    with monkeypatch.context() as m:
        m.setattr(model_runner, "PagedAttention", FakeQuantAttention)
        llm = LLM(model, kv_cache_dtype="auto", **engine_args)
    return llm

