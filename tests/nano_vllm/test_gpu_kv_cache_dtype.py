"""The FP8 and KIVI KV caches on a CUDA GPU (marker `gpu`; run by hand:
`pytest tests/nano_vllm/test_gpu_kv_cache_dtype.py -m gpu`): a bf16 engine with every layer (CUDA
graphs included) writing through nano_flashattn's `store_kv_fp8` (`store_kv_kivi`) and reading E4M3
(packed 2/4-bit) blocks in the Triton kernels, against the same engine over a bf16 cache holding the
E4M3-rounded K/V (fp8_reference.py; KIVI's round trips, kivi_reference.py). Both read the same values;
the kernels differ in arithmetic order, so greedy agreement is high, not total.
"""

from __future__ import annotations

import pytest
import torch
from fp8_reference import reference_llm
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu
ENGINE = {"device": "cuda", "dtype": "bfloat16", "max_model_len": 256, "max_num_seqs": 8,
          "kv_cache_memory_bytes": 8 << 20}
TOKENS = 32


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=TOKENS), use_tqdm=False)
    return [o.token_ids for o in outs]


def _first_differences(outs: list[list[int]], scored) -> list[tuple[int, float]]:
    """Per sequence that differs from the reference: the first position it differs at, and the
    reference's log-probability of its token there minus that of ours (a near-tie or not; inf where ours
    is not among the reference's top 5)."""
    found = []
    for tokens, ref in zip(outs, scored):
        want = ref.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
        if first is not None:
            top = ref.outputs[0].logprobs[first]
            ours = top[tokens[first]].logprob if tokens[first] in top else float("-inf")
            found.append((first, top[want[first]].logprob - ours))
    return found


NEAR_TIE = 0.1  # nats: an E4M3 round trip moves K/V by up to 2^-4 relative, the logits by a few hundredths


def test_fp8_engine_agrees_with_its_reference(qwen3_ckpt, monkeypatch):
    prompts = random_prompts(5, [7, 40, 100, 150])
    llm = LLM(qwen3_ckpt, kv_cache_dtype="fp8", **ENGINE)
    ref = reference_llm(qwen3_ckpt, monkeypatch, **ENGINE)
    runner, ref_runner = llm.engine.model_runner, ref.engine.model_runner
    assert runner.kv_cache.dtype == torch.float8_e4m3fn and ref_runner.kv_cache.dtype == torch.bfloat16
    assert runner.num_blocks == 2 * ref_runner.num_blocks  # one byte an element: 2x the blocks
    assert runner.cudagraphs and ref_runner.cudagraphs  # the FP8 path is captured as it is
    outs = greedy(llm, prompts)
    scored = ref.generate(prompts, SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=5),
                          use_tqdm=False)
    ref_outs = [o.outputs[0].token_ids for o in scored]
    for out, want in zip(outs, ref_outs):
        assert out[0] == want[0]
    # Greedy decoding of a random model meets near-ties (logits nearly flat), and one flipped near-tie
    # changes the rest of its sequence: so each sequence must agree with the reference up to its first
    # difference, and that difference must be a near-tie of the reference (its token and ours within
    # NEAR_TIE nats). On an H100 (2026-12-07) the two differences were gaps of 0.016 and 0.008 nats.
    differences = _first_differences(outs, scored)  # (position, gap) per sequence that differs
    assert all(gap <= NEAR_TIE for _, gap in differences), differences
    for engine in (llm.engine, ref.engine):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("dtype", ["kivi2", "kivi4"])
def test_kivi_engine_agrees_with_its_reference(qwen3_ckpt, monkeypatch, dtype):
    """KIVI on the GPU: the Triton write and Flash-Decoding over packed blocks (decode steps captured in
    CUDA graphs, prefill steps over dequantized pages), against a bf16 engine over nano_quant.kv's round
    trips of the same K/V (kivi_reference.py). 4.5x the blocks of bf16 at least (2-bit, G = 32)."""
    from kivi_reference import reference_llm as kivi_reference

    args = {**ENGINE, "block_size": 32, "max_num_batched_tokens": 64}  # chunked prompts: paged prefill
    prompts = random_prompts(5, [7, 40, 100, 150])
    # no 16-bit window: the reference holds each token's round trip from its write on
    llm = LLM(qwen3_ckpt, kv_cache_dtype=dtype, kv_cache_residual=0, **args)
    # the reference's store reads slots back on the host: eager, no CUDA graph
    ref = kivi_reference(qwen3_ckpt, monkeypatch, dtype, 32, **args, enforce_eager=True)
    runner = llm.engine.model_runner
    assert runner.kv_cache.dtype == torch.uint8 and runner.config.kv_cache_group_size == 32
    assert runner.cudagraphs and runner.config.mixed_cudagraph_sizes == ()
    auto = LLM(qwen3_ckpt, **args).engine.model_runner
    assert runner.num_blocks >= (4.5 if dtype == "kivi2" else 2.5) * auto.num_blocks
    outs, ref_outs = greedy(llm, prompts), greedy(ref, prompts)
    for out, want in zip(outs, ref_outs):
        assert out[0] == want[0]
    agree = sum(a == b for out, want in zip(outs, ref_outs) for a, b in zip(out, want))
    assert agree >= 0.8 * TOKENS * len(prompts), (outs, ref_outs)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_kivi_window_as_wide_as_the_sequence_decodes_the_16_bit_tokens(qwen3_ckpt):
    """KIVI's 16-bit window (kv_cache_residual) covering every position, through the Triton write, the
    window ring and Flash-Decoding with decode CUDA graphs: fp32, so greedy output is the 16-bit fp32
    engine's (the kernels differ only in the order of fp32 sums)."""
    args = {**ENGINE, "dtype": "float32", "block_size": 32, "enable_prefix_caching": False}
    prompts = random_prompts(6, [7, 40, 100, 150])
    want = greedy(LLM(qwen3_ckpt, **args), prompts)
    llm = LLM(qwen3_ckpt, kv_cache_dtype="kivi2", kv_cache_residual=256, **args)
    assert llm.engine.model_runner.cudagraphs
    assert greedy(llm, prompts) == want
