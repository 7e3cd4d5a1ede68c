"""Checkpoints whose head_dim is not 32: greedy output of the engine == transformers' greedy `generate`.

A Llama checkpoint with head_dim 64 and a Qwen3 checkpoint with head_dim 96 (the paged kernels pad its tiles
to 128), random-init, fp32, through the public API only (`LLM`, `SamplingParams`, engine arguments), with
prefix caching (shared prefixes hit the cache: `num_cached_tokens`), chunked prefill (a 16-token step budget
cuts every longer prompt into chunks) and preemption (the workload and 8-block KV cache of
test_engine_vs_hf.py's preemption case, which asserts that requests are preempted there; scheduling does not
depend on head_dim). On a CPU the engine attends with the torch reference, which takes any head_dim, so a
head_dim the kernels cannot tile (20) runs too; on CUDA it is refused up front.
"""

from __future__ import annotations

import pytest
import torch
from vllm_checkpoints import make_checkpoint, random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.attention import check_head_dim

LENGTHS = [1, 5, 17, 33, 64, 70]
MAX_TOKENS = [20, 7, 30, 12, 25, 16]

CASES = {
    "prefix_cache": {},
    "chunked_prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preemption": {"num_kv_blocks": 8},  # 128 token slots for 6 requests of up to 89 tokens
}
CHECKPOINTS = {"llama_hd64": ("llama", 64), "qwen3_hd96": ("qwen3", 96)}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def wide_ckpt(request, tmp_path_factory):
    family, head_dim = CHECKPOINTS[request.param]
    return make_checkpoint(tmp_path_factory.mktemp(request.param), family, head_dim=head_dim)


def _check_greedy(llm, ckpt, hf_greedy, prompts, max_tokens):
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
                        use_tqdm=False)
    for prompt, n, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == hf_greedy(ckpt, prompt, n), f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"
    return outs


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(wide_ckpt, hf_greedy, case):
    llm = LLM(wide_ckpt, max_model_len=128, **CASES[case])
    _check_greedy(llm, wide_ckpt, hf_greedy, random_prompts(0, LENGTHS), MAX_TOKENS)


def test_prefix_cache_hits(wide_ckpt, hf_greedy):
    """Prompts sharing a 40-token prefix: the later ones read its two full blocks from the cache."""
    base = random_prompts(1, [40])[0]
    prompts = [base + tail for tail in random_prompts(2, [3, 9, 16])]
    llm = LLM(wide_ckpt, max_model_len=128)
    first = _check_greedy(llm, wide_ckpt, hf_greedy, prompts[:1], [10])
    rest = _check_greedy(llm, wide_ckpt, hf_greedy, prompts[1:], [10, 10])
    assert first[0].num_cached_tokens == 0 and all(o.num_cached_tokens >= 32 for o in rest)


def test_cpu_engine_runs_a_head_dim_the_kernels_cannot_tile(tmp_path, hf_greedy):
    ckpt = make_checkpoint(tmp_path, "llama", head_dim=20)
    llm = LLM(ckpt, max_model_len=96, max_num_batched_tokens=16, max_num_seqs=4)
    _check_greedy(llm, ckpt, hf_greedy, random_prompts(3, [5, 40]), [12, 8])


def test_check_head_dim():
    for d in (16, 40, 64, 96, 200, 256):
        check_head_dim(d, "cuda")
    for d in (20, 12, 264):
        check_head_dim(d, "cpu")  # the torch reference takes any head_dim
        with pytest.raises(ValueError, match=rf"^head_dim {d} is not supported by the paged kernels on CUDA; "
                                             r"supported: multiples of 8 from 16 to 256"):
            check_head_dim(d, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_greedy_matches_transformers(wide_ckpt, hf_greedy, case):
    """The Triton paged kernels (padded to 128 for head_dim 96), CUDA graphs on; fp32 (no TF32)."""
    llm = LLM(wide_ckpt, device="cuda", dtype="float32", max_model_len=128, **{"num_kv_blocks": 512, **CASES[case]})
    _check_greedy(llm, wide_ckpt, hf_greedy, random_prompts(0, LENGTHS), MAX_TOKENS)


@pytest.mark.gpu
def test_cuda_engine_refuses_a_head_dim_the_kernels_cannot_tile(tmp_path):
    ckpt = make_checkpoint(tmp_path, "llama", head_dim=20)
    with pytest.raises(ValueError, match=r"^head_dim 20 is not supported by the paged kernels on CUDA"):
        LLM(ckpt, device="cuda", dtype="float32", max_model_len=64, num_kv_blocks=64)
