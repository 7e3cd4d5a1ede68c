"""Stop strings, log-probabilities and n samples on a GPU with every performance layer (marker `gpu`):
decode steps replayed from CUDA graphs, overlapped steps (the scores read back one step later), fused
sampling. Against transformers' logits (fp32; Triton's fp32 dots run in TF32, hence the tolerance) and
against the paper path on the same card."""

from __future__ import annotations

import pytest
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu
KV = {"num_kv_blocks": 512}
TF32_ATOL = 2e-2  # TF32 keeps 10 mantissa bits: attention scores off by ~1e-3 relative


def test_logprobs_with_layers_match_transformers_fp32(ckpt, hf_logprobs):
    prompts = random_prompts(95, [3, 20, 70])
    llm = LLM(ckpt, device="cuda", dtype="float32", max_model_len=128, **KV)
    assert "cudagraph" in llm.engine.layers_applied and "overlap" in llm.engine.layers_applied
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, prompt_logprobs=2)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ref = hf_logprobs(ckpt, prompt + out.token_ids)
        for i in range(1, len(prompt)):
            got = out.prompt_logprobs[i][prompt[i]].logprob
            assert got == pytest.approx(ref[i - 1, prompt[i]].item(), abs=TF32_ATOL)
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 12
        for j, token in enumerate(c.token_ids):
            entry = c.logprobs[j]
            assert next(iter(entry)) == token and entry[token].rank == 1 and len(entry) == 3
            assert entry[token].logprob == pytest.approx(ref[len(prompt) - 1 + j, token].item(), abs=TF32_ATOL)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_stop_strings_and_n_with_layers_bf16(qwen3_ckpt):
    fast = LLM(qwen3_ckpt, device="cuda", max_model_len=128, **KV)
    plain = LLM(qwen3_ckpt, device="cuda", max_model_len=128, performance_layers=False, **KV)
    prompt = random_prompts(96, [9])[0]
    full = fast.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].text
    stop = full[15:18]
    for llm in (fast, plain):
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], n=3),
                           use_tqdm=False)[0]
        ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].text
        assert [c.text for c in out.outputs] == [ref[: ref.find(stop)]] * 3
        assert all(c.stop_reason == stop for c in out.outputs)
        seeded = SamplingParams(temperature=1.0, max_tokens=16, n=4, seed=9, logprobs=1)
        a, b = (llm.generate([prompt], seeded, use_tqdm=False)[0] for _ in range(2))
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert len({tuple(c.token_ids) for c in a.outputs}) == 4
        assert all(len(c.logprobs) == 16 and all(e[t].logprob <= 0 for e, t in zip(c.logprobs, c.token_ids))
                   for c in a.outputs)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
