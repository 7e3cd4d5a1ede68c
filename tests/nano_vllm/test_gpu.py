"""GPU-only checks (marker `gpu`; run by hand on a GPU machine: `pytest tests/nano_vllm -m gpu`).

The Triton paged kernels, CUDA graphs, KV sizing from free memory, device sampling and NCCL tensor
parallelism. fp32 keeps token-for-token comparisons with transformers meaningful (nano_flashattn's fp32
uses full-precision products and torch's fp32 matmuls do not use TF32 by default).
"""

from __future__ import annotations

import pytest
import torch
from vllm_checkpoints import make_checkpoint, random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.bench.step_timing import StepTimer
from nano_vllm.layers.cudagraph import DecodeCudaGraphs, MixedStepGraphs

pytestmark = pytest.mark.gpu

# A fixed KV pool: an engine sized from free memory would take 90% of the GPU and leave the next test
# (or a second engine in the same test, or a parallel test process) none; only
# test_kv_cache_sized_from_free_memory sizes from memory, on a card of its own (`gpu_of_this_process`).
KV = {"num_kv_blocks": 512}
LENGTHS, MAX_TOKENS = [1, 17, 33, 70, 5], [20, 30, 12, 16, 40]


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("extra", [{}, {"num_kv_blocks": 8}, {"max_num_batched_tokens": 16, "max_num_seqs": 4},
                                   {"max_num_batched_tokens": 64, "max_num_seqs": 4, "mixed_cudagraph_sizes": [16, 64]}])
def test_cuda_greedy_matches_transformers(ckpt, hf_greedy, eager, extra):
    prompts = random_prompts(40, LENGTHS)
    # Mixed-step graphs only where `extra` asks for them; the kernel warm-up ran as the engine was built.
    llm = LLM(ckpt, device="cuda", dtype="float32", max_model_len=128, enforce_eager=eager,
              **{**KV, "mixed_cudagraph_sizes": (), **extra})
    assert ("warmup" in llm.engine.layers_applied) and ("cudagraph" in llm.engine.layers_applied) != eager
    runner = llm.engine.model_runner
    mixed = bool(extra.get("mixed_cudagraph_sizes")) and not eager
    graphs = [] if eager else [DecodeCudaGraphs] + [MixedStepGraphs] * mixed
    assert [type(g) for g in runner.cudagraphs] == graphs
    timer = StepTimer(llm.engine)
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS],
                        use_tqdm=False)
    for p, n, o in zip(prompts, MAX_TOKENS, outs):
        assert o.token_ids == hf_greedy(ckpt, p, n)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    if eager:
        assert timer.num_eager_steps == timer.num_steps
    elif mixed:  # every step fits a graph: at most 64 tokens, at most 4 sequences
        assert timer.num_eager_steps == 0
    else:  # decode graphs only: the steps that carry prompt tokens run eagerly
        assert 0 < timer.num_eager_steps < timer.num_steps


def test_kv_cache_sized_from_free_memory(qwen3_ckpt, gpu_of_this_process):
    """§5: the KV cache takes what `gpu_memory_utilization` of the card leaves after the weights and the
    profiled step — on a card only this process uses (`gpu_of_this_process`), as parallel test processes
    share the real one."""
    total = gpu_of_this_process
    llm = LLM(qwen3_ckpt, device="cuda", gpu_memory_utilization=0.3, max_model_len=128)
    r = llm.engine.model_runner
    assert 0.2 * total < r.num_blocks * r.block_bytes < 0.3 * total and r.num_blocks > 1000
    assert r.kv_cache.dtype == torch.bfloat16 and r.kv_cache.is_cuda


def test_bf16_graphs_and_seeded_sampling(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, device="cuda", max_model_len=128, **KV)
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=24, seed=11)
    a = llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0].token_ids
    b = llm.generate([[7, 8], [1, 2, 3], [9] * 30], [SamplingParams(temperature=1.0)] + [sp] * 2,
                     use_tqdm=False)[1].token_ids
    assert a == b and len(a) == 24


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_nccl(tmp_path, hf_greedy):
    ckpt = make_checkpoint(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts(41, [3, 40])
    llm = LLM(ckpt, device="cuda", dtype="float32", tensor_parallel_size=2, max_model_len=96, **KV)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.token_ids == hf_greedy(ckpt, p, 20)
    finally:
        llm.shutdown()


def test_no_kernel_compiles_mid_serving_for_new_token_counts(ckpt):
    """Eager steps whose token counts differ only in Triton's "multiple of 16" / "equals 1" pattern must reuse
    the compiled kernels (a new variant stalls serving ~1 s; integer arguments that vary per step are
    declared do_not_specialize)."""
    from shared.bench import KernelCompiles

    llm = LLM(ckpt, device="cuda", dtype="float32", max_model_len=128, mixed_cudagraph_sizes=(), **KV)
    assert "warmup" in llm.engine.layers_applied  # the kernel warm-up ran as the engine was built
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(random_prompts(41, [17]), one, use_tqdm=False)  # warm-up: one prefill of 17 tokens
    with KernelCompiles() as built:
        for lengths in ([32], [16, 48], [2], [21, 7, 3]):  # 32, 64, 2, 31 tokens per step
            llm.generate(random_prompts(42 + len(lengths), lengths), one, use_tqdm=False)
    if not built.available:
        pytest.skip("this Triton has no jit_cache_hook")
    assert built.names == [], built.summary()
