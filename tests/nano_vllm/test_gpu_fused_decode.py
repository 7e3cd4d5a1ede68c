"""GPU checks of the fused decoder layer (nano_vllm.layers.fused_decode; marker `gpu`): each fused op in bf16
at the qwen3-0.6b and llama3-8b shapes against its torch definition (the rule of test_fused_decode.py), and
the engine with every layer on (CUDA graphs, PDL on Hopper) against the same engine without the fused layer,
token for token, on one request (one-row steps) and on four (the layer steps aside)."""

from __future__ import annotations

import pytest
import torch
from test_fused_decode import _close, _streams
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.layers import fused_decode as fd

pytestmark = pytest.mark.gpu
SHAPES = {"qwen3-0.6b": (1024, 16, 8, 128, 3072, True), "llama3-8b": (4096, 32, 8, 128, 14336, False)}


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_ops_bf16_at_model_shapes(shape):
    hidden, hq, hkv, d, inter, qk_norm = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(hidden)
    dt = torch.bfloat16

    def rand(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(dt)

    x, r = rand(hidden), rand(hidden)
    nw = (torch.rand(hidden, device="cuda", generator=g) + 0.5).to(dt)
    wqkv = rand((hq + 2 * hkv) * d, hidden, scale=hidden**-0.5)
    qn = kn = None
    if qk_norm:
        qn, kn = ((torch.rand(d, device="cuda", generator=g) + 0.5).to(dt) for _ in range(2))
    inv = 1.0 / 10000 ** (torch.arange(d // 2, device="cuda") / (d // 2))
    cos, sin = (300 * inv).cos(), (300 * inv).sin()
    qkv = fd.norm_qkv(x, r, nw, 1e-6, wqkv, None)
    _close(qkv, fd.reference_norm_qkv, x, r, nw, 1e-6, wqkv, None)
    o, h = rand(hq * d), rand(hidden)
    wo = rand(hidden, hq * d, scale=(hq * d) ** -0.5)
    _close(fd.o_proj_residual(o, wo, h, r), fd.reference_o_proj_residual, o, wo, h, r)
    wgu, wd = rand(2 * inter, hidden, scale=hidden**-0.5), rand(hidden, inter, scale=inter**-0.5)
    _close(fd.norm_gate_up_swiglu(x, nw, 1e-6, wgu), fd.reference_swiglu, x, nw, 1e-6, wgu)
    act = rand(inter)
    _close(fd.down(act, wd), torch.nn.functional.linear, act, wd)
    pages = 300
    k_cache, v_cache = rand(pages, 16, hkv, d), rand(pages, 16, hkv, d)
    table = torch.randperm(pages, device="cuda", generator=g)[:256].int()
    for keys in (1, 17, 384, 4000):
        ws = fd.Workspace(hkv, hq // hkv, d, k_cache.device)
        q = rand(hq, d)
        seqlen = torch.tensor([keys], device="cuda", dtype=torch.int32)
        out = fd.decode_attention(q, k_cache, v_cache, table, seqlen, ws)
        pos = torch.arange(keys, device="cuda")
        rows = table[pos // 16].long(), pos % 16
        _close(out, fd.reference_attention, q, k_cache[rows], v_cache[rows])
        # (b) on (a)'s output: the new key's row stale (NaN) before, written by the kernel
        slot = rows[0][-1] * 16 + rows[1][-1]
        k_old, v_old = k_cache[rows][:-1].clone(), v_cache[rows][:-1].clone()
        k_cache.view(-1, hkv, d)[slot] = v_cache.view(-1, hkv, d)[slot] = float("nan")
        out = fd.rope_store_attention(qkv, hq, cos, sin, qn, kn, 1e-6, k_cache, v_cache, slot.view(1), table,
                                      seqlen, ws)
        _close((out, k_cache.view(-1, hkv, d)[slot], v_cache.view(-1, hkv, d)[slot]),
               fd.reference_rope_store_attention, qkv, cos, sin, hq, hkv, qn, kn, 1e-6, k_old, v_old)


def _equal_up_to_near_ties(ours: list[list[int]], ref_outputs, margin: float) -> int:
    """Token lists equal to the reference's, except that from a first difference on, which must fall where
    the reference's own two candidates were within `margin` nats of each other (a near-tie that bf16's
    8-bit significand cannot order the same way under another summation order). Returns the differences."""
    differences = 0
    for tokens, ref in zip(ours, ref_outputs):
        out = ref.outputs[0]
        first = next((i for i, (a, b) in enumerate(zip(tokens, out.token_ids)) if a != b), None)
        if first is None:
            continue
        differences += 1
        scores = out.logprobs[first]
        assert tokens[first] in scores, (first, tokens[first], scores)  # our token is in their top 5
        gap = scores[out.token_ids[first]].logprob - scores[tokens[first]].logprob
        assert 0 <= gap <= margin, (first, gap)
    return differences


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("num_prompts", [1, 4])
def test_engine_with_the_fused_layer_gives_the_same_tokens(family, num_prompts, request):
    """bf16: every token equal to the engine without the fused layer (CUDA graphs and every other layer on
    in both) until a near-tie, if any. fp32 (TF32 off in every kernel of the layer): transformers' greedy
    tokens, exactly."""
    ckpt = request.getfixturevalue(f"{family}_ckpt")
    prompts = random_prompts(5, [9, 30, 17, 64][:num_prompts])
    common = {"dtype": "bfloat16", "num_kv_blocks": 256}
    ref = LLM(ckpt, fused_decode=False, **common).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5), use_tqdm=False)
    llm = LLM(ckpt, **common)
    assert "fused_decode" in llm.engine.layers_applied
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    out = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    # bf16 logits carry ~2^-8 relative error: a gap of 0.05 nats is within a few units of it
    assert _equal_up_to_near_ties(out, ref, margin=0.05) <= max(1, num_prompts // 2)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_layer_fp32_gives_transformers_greedy_tokens(family, request, hf_greedy):
    ckpt = request.getfixturevalue(f"{family}_ckpt")
    prompt = random_prompts(6, [21])[0]
    llm = LLM(ckpt, dtype="float32", num_kv_blocks=256, max_num_seqs=1)
    assert "fused_decode" in llm.engine.layers_applied
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert llm.generate([prompt], sp, use_tqdm=False)[0].token_ids == hf_greedy(ckpt, prompt, 40)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_steps_equal_the_unfused_layer_by_layer_fp32(family, request):
    """The residual stream after every layer of every one-row decode step, fused against unfused, fp32 (eager:
    a forward hook does not run inside a graph replay; PDL on): the same numbers up to summation order."""
    ckpt = request.getfixturevalue(f"{family}_ckpt")
    prompt = random_prompts(7, [13])[0]
    common = {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 1, "enforce_eager": True}
    ref_tokens, ref = _streams(LLM(ckpt, fused_decode=False, **common), prompt, 12)
    tokens, ours = _streams(LLM(ckpt, **common), prompt, 12)
    assert tokens == ref_tokens and len(ours) == len(ref) > 0
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_engine_with_the_fused_w4a16_layer_gives_the_same_tokens(tmp_path):
    """W4A16 (rtn-w4, group 32, a Llama-style model; the engine swaps in nano_quant's repacked layers on CUDA):
    fused_decode=True takes the six W4 kernels, and bf16 tokens equal the unfused W4 engine's (CUDA graphs and
    every other layer on in both) until a near-tie, if any."""
    from quant_checkpoints import tiny_config, trained_like

    from nano_quant import quantize_model, save_quantized

    model = trained_like(tiny_config(qk_norm=False))
    quantize_model(model, "rtn-w4", progress=False, group_size=32)
    ckpt = save_quantized(model, tmp_path / "w4", dtype=None)
    prompts = random_prompts(8, [9])
    common = {"dtype": "bfloat16", "num_kv_blocks": 256, "max_num_seqs": 1}
    ref = LLM(ckpt, fused_decode=False, **common).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5), use_tqdm=False)
    llm = LLM(ckpt, fused_decode=True, **common)
    assert all(isinstance(m, fd.FusedDecoderLayer) and m.w4 for m in llm.engine.model_runner.model.model.layers)
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    out = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert _equal_up_to_near_ties(out, ref, margin=0.05) <= 1
