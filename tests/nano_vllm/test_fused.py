"""Fused projections (nano_vllm.layers.fused): q/k/v and gate/up as one matmul each give the unfused model's
outputs, keep shared.model unfused, and shard correctly under tensor parallelism (§4.6)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nano_vllm.layers.fused import FusedAttention, FusedMLP, fuse_projections, stack_linears
from nano_vllm.tp import shard_model
from shared.config import ModelConfig
from shared.model import Attention, build_model

CFG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, initializer_range=0.1)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # q/k norm; q/k/v bias
def test_fused_model_computes_the_unfused_logits(family):
    cfg = CFG.replace(qk_norm=True) if family == "qwen3" else CFG.replace(attention_bias=True)
    ref = build_model(cfg, seed=1)
    if family == "qwen2":  # non-zero biases, so a misplaced bias would show
        with torch.no_grad():
            for layer in ref.model.layers:
                for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    m.bias.normal_()
    fused = fuse_projections(copy.deepcopy(ref))
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), ref(ids), rtol=1e-5, atol=1e-5)
    layer = fused.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP)
    assert layer.self_attn.qkv_proj.weight.shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in ref.parameters())
    assert hasattr(Attention(cfg, 0), "q_proj")  # shared.model itself stays unfused
    assert fuse_projections(fused) is fused  # fusing twice changes nothing


def test_each_rank_fuses_its_own_shards():
    """Shard (column-parallel q/k/v and gate/up), then fuse: rank r's qkv_proj is [Wq_r; Wk_r; Wv_r] and its
    outputs are rank r's slices of the unfused projections (vLLM's QKVParallelLinear layout)."""
    full = build_model(CFG, seed=2)
    x = torch.randn(3, 5, CFG.hidden_size)
    attn, mlp = full.model.layers[0].self_attn, full.model.layers[0].mlp
    qs, ks, vs, gates, ups = [], [], [], [], []
    for rank in range(2):
        shard = fuse_projections(shard_model(build_model(CFG, seed=2), rank, 2))
        a, m = shard.model.layers[0].self_attn, shard.model.layers[0].mlp
        q, k, v = a.qkv_proj(x).split(a.qkv_sizes, dim=-1)
        gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
        for acc, t in zip((qs, ks, vs, gates, ups), (q, k, v, gate, up)):
            acc.append(t)
    with torch.no_grad():
        for parts, proj in zip((qs, ks, vs, gates, ups), (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj,
                                                          mlp.up_proj)):
            torch.testing.assert_close(torch.cat(parts, dim=-1), proj(x), rtol=1e-5, atol=1e-5)


def test_stack_linears_errors():
    with pytest.raises(ValueError, match="different input sizes"):
        stack_linears([nn.Linear(4, 2), nn.Linear(5, 2)])
    with pytest.raises(ValueError, match="only some have a bias"):
        stack_linears([nn.Linear(4, 2), nn.Linear(4, 2, bias=False)])
    a, b = nn.Linear(4, 2), nn.Linear(4, 3)
    fused = stack_linears([a, b])
    x = torch.randn(2, 4)
    torch.testing.assert_close(fused(x), torch.cat([a(x), b(x)], dim=-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("dim,qk_norm", [(32, False), (80, True)])  # 80: the half (40) padded to 64, masked
@pytest.mark.parametrize("b,s", [(3, 1), (1, 5)])  # a decode step, a packed prefill
def test_rope_and_store_is_rope_then_the_cache_write(dtype, dim, qk_norm, b, s):
    """The fused kernel (Triton interpreter) writes what `apply_rope` + `store_kvcache` write: the rotated q and
    k it returns, k and v in the cache rows of `slot_mapping`, and no other cache row."""
    from nano_vllm.attention import store_kvcache
    from nano_vllm.layers.fused import rope_and_store
    from shared.kernels import apply_rope_torch

    g = torch.Generator().manual_seed(dim + b)
    heads_q, heads_kv, blocks, page = 4, 2, 3, 4
    qkv = torch.randn(b, s, (heads_q + 2 * heads_kv) * dim, generator=g).to(dtype)
    q, k, v = (t.view(b, s, -1, dim) for t in qkv.split([heads_q * dim, heads_kv * dim, heads_kv * dim], -1))
    if qk_norm:  # Qwen3: q and k are the norm's new tensors, v stays a view
        q, k = q.contiguous(), k.contiguous()
    pos = torch.randint(0, 100, (b, s), generator=g).float()[..., None] / (10.0 ** torch.arange(dim // 2) / dim)
    cos, sin = pos.cos(), pos.sin()
    slots = torch.randperm(blocks * page, generator=g)[: b * s]
    caches = [torch.full((blocks, page, heads_kv, dim), 7.0, dtype=dtype) for _ in range(4)]
    q_ref, k_ref = apply_rope_torch(q, cos, sin), apply_rope_torch(k, cos, sin)
    store_kvcache(k_ref, v, caches[0], caches[1], slots)
    q_out, k_out = rope_and_store(q, k, v, cos, sin, caches[2], caches[3], slots)
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(caches[2], caches[0], rtol=0, atol=0)  # untouched rows still hold 7.0
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="rope_and_store"):
        rope_and_store(q, k, v[..., :-2], cos, sin, caches[2], caches[3], slots)
    # an FP8 cache (per-tensor and per-kv-head scales): the codes nano_flashattn's store writes
    from nano_flashattn import store_kv_fp8

    for k_scale, v_scale in ((torch.tensor([0.05]), torch.tensor([0.02])),
                             (torch.tensor([0.05, 0.1]), torch.tensor([0.02, 0.3]))):
        fp8 = [torch.zeros(blocks, page, heads_kv, dim, dtype=torch.float8_e4m3fn) for _ in range(4)]
        store_kv_fp8(k_ref, v, fp8[0], fp8[1], slots, k_scale, v_scale)
        q_out, k_out = rope_and_store(q, k, v, cos, sin, fp8[2], fp8[3], slots, k_scale, v_scale)
        torch.testing.assert_close(q_out, q_ref, rtol=0, atol=0)
        assert torch.equal(fp8[2].view(torch.uint8), fp8[0].view(torch.uint8))
        assert torch.equal(fp8[3].view(torch.uint8), fp8[1].view(torch.uint8))
    with pytest.raises(ValueError, match="rope_and_store"):
        rope_and_store(q, k, v, cos, sin, fp8[2], fp8[3], slots)  # an FP8 cache needs its scales


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("b,s", [(8, 1), (2, 37)])
def test_gpu_rope_and_store_fp8_codes_are_the_stores(dim, b, s):
    """On the GPU, where each thread holds many elements: the FP8 rows the fused kernel writes are
    `store_kv_fp8`'s codes of the k it returns and of v, per-tensor and per-kv-head scales."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from nano_flashattn import store_kv_fp8
    from nano_vllm.layers.fused import rope_and_store

    g = torch.Generator(device="cuda").manual_seed(dim + s)
    heads_q, heads_kv, blocks, page = 16, 8, 8, 16
    qkv = torch.randn(b, s, (heads_q + 2 * heads_kv) * dim, generator=g, device="cuda").bfloat16() * 4
    q, k, v = (t.view(b, s, -1, dim) for t in qkv.split([heads_q * dim, heads_kv * dim, heads_kv * dim], -1))
    pos = torch.arange(b * s, device="cuda").view(b, s, 1).float() / (10.0 ** torch.arange(dim // 2, device="cuda")
                                                                      / dim)
    cos, sin = pos.cos(), pos.sin()
    slots = torch.randperm(blocks * page, generator=g, device="cuda")[: b * s]
    for scales in ((0.01,), (0.01, 0.003, 0.02, 0.5, 1.0, 0.007, 0.05, 0.1)):
        k_scale = torch.tensor(scales, device="cuda")
        v_scale = k_scale.flip(0) * 2
        fp8 = [torch.zeros(blocks, page, heads_kv, dim, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(4)]
        _, k_out = rope_and_store(q, k, v, cos, sin, fp8[2], fp8[3], slots, k_scale, v_scale)
        store_kv_fp8(k_out, v, fp8[0], fp8[1], slots, k_scale, v_scale)
        assert torch.equal(fp8[2].view(torch.uint8), fp8[0].view(torch.uint8))
        assert torch.equal(fp8[3].view(torch.uint8), fp8[1].view(torch.uint8))
