"""Tensor parallelism (§4.6) on 2 gloo processes: same greedy tokens as transformers, blocks shared."""

from __future__ import annotations

import pytest
import torch
from vllm_checkpoints import make_checkpoint, random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.tp import shard_model
from shared.checkpoint import load_model


@pytest.fixture(scope="module")
def gqa_ckpt(tmp_path_factory):
    # 4 query heads over 2 kv heads, so each of 2 ranks holds 2 query heads and 1 kv head
    return make_checkpoint(tmp_path_factory.mktemp("gqa"), "llama", num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=192)


# The runner layers (every rank applies them from the same EngineConfig): fused projections over each
# rank's shards, the GEMV layer's module swap, fused sampling on rank 0. Overlapped steps need one device.
TP_LAYERS = {"fused_projections": True, "fused_sampling": True, "gemv_max_tokens": 16}


@pytest.mark.slow
@pytest.mark.parametrize("layers", [{}, TP_LAYERS], ids=["paper_path", "layers"])
def test_tensor_parallel_2_matches_transformers(gqa_ckpt, hf_greedy, layers):
    prompts = random_prompts(20, [3, 18, 40])
    llm = LLM(gqa_ckpt, tensor_parallel_size=2, max_model_len=96, num_kv_blocks=12, **layers)
    try:
        assert llm.engine.model_runner.num_kv_heads == 1  # each rank caches its own kv head
        if layers:
            assert type(llm.engine.model_runner.model.model.layers[0].self_attn).__name__ == "FusedAttention"
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.token_ids == hf_greedy(gqa_ckpt, p, 10)
    finally:
        llm.shutdown()


def test_shard_model_rejects_indivisible_heads(gqa_ckpt):
    model = load_model(gqa_ckpt)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        shard_model(model, 0, 4)


def test_shards_hold_disjoint_slices(gqa_ckpt):
    full = load_model(gqa_ckpt)
    shards = [shard_model(load_model(gqa_ckpt), r, 2) for r in range(2)]
    q = torch.cat([s.model.layers[0].self_attn.q_proj.weight for s in shards])
    o = torch.cat([s.model.layers[0].self_attn.o_proj.linear.weight for s in shards], dim=1)
    assert torch.equal(q, full.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(o, full.model.layers[0].self_attn.o_proj.weight)
