"""The torch reference of nano_vllm's KIVI cache (`kv_cache_dtype="kivi2" | "kivi4"`): a 16-bit engine whose
cache holds what the KIVI pool means, computed by nano_quant.kv (the paper path), not by nano_flashattn.

Every new value row is rounded through `kv.quantize` / `kv.dequantize` per token (groups of G channels)
before the paper path's `store_kvcache`; keys are stored exact, and each time a step writes the slot that
ends a key group (slot % G == G - 1), the group's G keys — all exact in the cache until then — are
replaced by their per-channel round trip (`kv.KEY_AXIS`). So every read sees what the KIVI engine reads:
quantized values, quantized closed key groups and the 16-bit open group. A step with nothing cached yet
attends to the fresh K/V, as both engines do.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from nano_vllm import LLM, model_runner
from nano_vllm.attention import AttentionContext, PagedAttention, store_kvcache

kv = pytest.importorskip("nano_quant.kv")  # a fork without nano_quant has no reference to test against


def round_trip(x: torch.Tensor, bits: int, group: int, axis: int) -> torch.Tensor:
    """x (tokens, heads, head_dim) as KIVI stores it, in x's dtype."""
    return kv.dequantize(*kv.quantize(x, bits, group, axis), bits, group, axis, x.dtype)


class FakeKIVIAttention:
    """PagedAttention over a 16-bit cache holding KIVI's round trips (module docstring)."""

    bits = group = 0  # set by `reference_llm`
    instances: ClassVar[list] = []

    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None):
        assert kv_scales is None, "the reference engine's cache is 16-bit"
        self.kv_cache, self.paged = kv_cache, PagedAttention(kv_cache)
        # per key group of the pool: did its last write close it (its keys are codes now)
        self.closed = torch.zeros(kv_cache[0, 0].numel() // kv_cache.shape[-1] // kv_cache.shape[-2]
                                  // self.group, dtype=torch.bool)
        self.instances.append(self)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                 ctx: AttentionContext) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache[0, layer_idx], self.kv_cache[1, layer_idx]
        heads, dim = k_cache.shape[-2:]
        stored = round_trip(v.reshape(-1, heads, dim), self.bits, self.group, kv.VALUE_AXIS)
        store_kvcache(k, stored, k_cache, v_cache, ctx.slot_mapping)
        keys, G = k_cache.view(-1, heads, dim), self.group
        for slot in ctx.slot_mapping.tolist():
            if layer_idx == 0:
                self.closed[slot // G] = slot % G == G - 1
            if slot % G == G - 1:  # the slot closes a key group: quantize it per channel
                keys[slot - G + 1 : slot + 1] = round_trip(keys[slot - G + 1 : slot + 1], self.bits, G,
                                                           kv.KEY_AXIS)
        return self.paged.attend(q, k, v, layer_idx, ctx)


def reference_llm(model: str, monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str,
                  kv_cache_group_size: int, **engine_args) -> LLM:
    """A 16-bit `LLM` (kv_cache_dtype="auto") with `FakeKIVIAttention` as its attention call."""
    attention = type("FakeKIVI", (FakeKIVIAttention,), {"bits": {"kivi2": 2, "kivi4": 4}[kv_cache_dtype],
                                                         "group": kv_cache_group_size, "instances": []})
    with monkeypatch.context() as m:
        m.setattr(model_runner, "PagedAttention", attention)
        llm = LLM(model, kv_cache_dtype="auto", **engine_args)
    llm.kivi_reference = attention.instances[-1]  # its `closed` groups
    return llm
