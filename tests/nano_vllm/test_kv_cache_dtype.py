"""`kv_cache_dtype` (vLLM's name): the engine's FP8 KV cache on a CPU.

Greedy output with kv_cache_dtype="fp8" equals the same engine's output through the torch reference of
the quantized cache (fp8_reference.py: a 16-bit cache holding E4M3-rounded K/V, from nano_quant.kv), with
chunked prefill, prefix-cache hits and preemption, on the paper path and with the layers; the two caches
end up holding the same values. Copy-on-write block copies and nano_distserve's block transfer move FP8
bytes. The same memory holds 2x the blocks of
bf16 (4x those of the fp32 CPU engine); bad values are a ValueError at construction.
"""

from __future__ import annotations

import pytest
import torch
from fp8_reference import reference_llm
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.config import EngineConfig
from nano_vllm.kv_cache import kv_cache_summary

FP8 = torch.float8_e4m3fn
CASES = {
    "chunked_prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "prefix_cache": {},
    "preemption": {"num_kv_blocks": 8},  # 128 token slots for requests of up to 84 tokens
}


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed lengths (for KIVI: key groups closed mid-prompt, mid-decode, exactly at a block's end), a shared
    40-token prefix (cache hits), a prompt twice (a full hit), and two greedy samples of one prompt (n=2)."""
    base = random_prompts(1, [40])[0]
    prompts = random_prompts(0, [1, 17, 64]) + [base + t for t in random_prompts(2, [3, 9])]
    prompts += [base[:32], base[:32], base[:21]]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (20, 12, 20, 10, 10, 8, 8)]
    return prompts, [*params, SamplingParams(temperature=0.0, max_tokens=12, n=2)]


def run(llm: LLM) -> list[list[list[int]]]:
    """Every completion's tokens (the workload twice: the second round hits the prefix cache)."""
    prompts, params = workload()
    outs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block back at the end
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_engine_equals_the_torch_reference(ckpt, case, layer_args, monkeypatch):
    args = dict(max_model_len=128, **CASES[case], **layer_args)
    llm = LLM(ckpt, kv_cache_dtype="fp8", **args)
    runner = llm.engine.model_runner
    assert runner.kv_cache.dtype == FP8 and runner.kv_scales.dtype == torch.float32
    assert runner.kv_scales.shape == (2, runner.model_config.num_hidden_layers, 1)
    assert bool((runner.kv_scales == 1.0).all())  # vLLM's default for an uncalibrated model
    ref = reference_llm(ckpt, monkeypatch, **args)
    outs = run(llm)
    assert outs == run(ref)
    assert len({t for o in outs for c in o for t in c}) > 3
    # the same steps wrote the same rows: the FP8 codes are the reference's values
    assert torch.equal(runner.kv_cache.float(), ref.engine.model_runner.kv_cache)
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions == ref.engine.scheduler.num_preemptions > 0


def test_fused_rope_store_quantizes_into_an_fp8_cache(llama_ckpt, monkeypatch):
    """layers/fused.py's RoPE + store kernel (use_triton forced on: the Triton interpreter) writes an FP8
    cache itself, the codes the paper path's store writes: the same tokens and the same cache bytes."""
    import nano_vllm.layers.fused as fused

    calls = []
    kernel = fused.rope_and_store
    monkeypatch.setattr(fused, "use_triton", lambda t: True)
    monkeypatch.setattr(fused, "rope_and_store", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    runs = {}
    for fuse in (True, False):
        llm = LLM(llama_ckpt, kv_cache_dtype="fp8", max_model_len=64, fused_projections=fuse)
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        runs[fuse] = [o.token_ids for o in out], llm.engine.model_runner.kv_cache.view(torch.uint8)
    assert calls and all("k_scale" in kw for kw in calls)
    assert runs[True][0] == runs[False][0]
    assert torch.equal(runs[True][1], runs[False][1])


def test_fp8_holds_more_blocks_in_the_same_memory(llama_ckpt):
    """§5's sizing counts 1-byte elements: 2x the blocks of bf16, 4x those of fp32; the summary says so."""
    args = dict(max_model_len=64, kv_cache_memory_bytes=1 << 20)
    runners = {(d, c): LLM(llama_ckpt, dtype=d, kv_cache_dtype=c, **args).engine.model_runner
               for d in ("float32", "bfloat16") for c in ("auto", "fp8")}
    blocks = {k: r.num_blocks for k, r in runners.items()}
    assert blocks["float32", "fp8"] == blocks["bfloat16", "fp8"] == 4 * blocks["float32", "auto"]
    assert blocks["bfloat16", "fp8"] == 2 * blocks["bfloat16", "auto"]
    for (_, c), r in runners.items():
        assert r.kv_cache.dtype == (FP8 if c == "fp8" else r.config.torch_dtype)
        assert r.kv_cache.nbytes == (r.num_blocks + 1) * r.block_bytes  # the scratch block beside
    summary = kv_cache_summary(runners["bfloat16", "fp8"])
    per_gib = 2**30 // runners["bfloat16", "fp8"].block_bytes * 16
    assert "KV cache (float8_e4m3fn)" in summary and f"{per_gib} tokens per GiB" in summary
    assert "KV cache (bfloat16)" in kv_cache_summary(runners["bfloat16", "auto"])


def test_copy_blocks_copies_fp8_bytes(llama_ckpt):
    """Copy-on-write (§4.4) duplicates FP8 blocks byte for byte (torch indexes them as uint8)."""
    runner = LLM(llama_ckpt, kv_cache_dtype="fp8", max_model_len=64).engine.model_runner
    codes = torch.randint(0, 256, runner.kv_cache.shape, dtype=torch.uint8)
    codes[codes.bitwise_and(0x7F) == 0x7F] = 0  # no NaN codes, so equality below is by value
    runner.kv_cache.view(torch.uint8).copy_(codes)
    runner.copy_blocks([(0, 3), (2, 1)])
    cache = runner.kv_cache.view(torch.uint8)
    assert torch.equal(cache[:, :, 3], codes[:, :, 0]) and torch.equal(cache[:, :, 1], codes[:, :, 2])
    assert torch.equal(cache[:, :, 0], codes[:, :, 0])


def test_fp8_blocks_move_between_instances(llama_ckpt):
    """nano_distserve's transfer moves the cache's bytes whatever its dtype; the geometry names it."""
    kv_transfer = pytest.importorskip("nano_distserve.kv_transfer")
    transport = pytest.importorskip("nano_distserve.transport")
    a, b = (LLM(llama_ckpt, kv_cache_dtype=c, max_model_len=64).engine.model_runner
            for c in ("fp8", "fp8"))
    a.kv_cache.copy_(torch.randn(a.kv_cache.shape).to(FP8))
    buf = kv_transfer.export_blocks(a.kv_cache, [1, 4])
    kv_transfer.import_blocks(b.kv_cache, [2, 0], buf)
    assert torch.equal(b.kv_cache[:, :, [2, 0]].float(), a.kv_cache[:, :, [1, 4]].float())
    geometry = transport.KVGeometry.of_cache(a.kv_cache)
    assert geometry.dtype == "float8_e4m3fn"
    auto = LLM(llama_ckpt, max_model_len=64).engine.model_runner
    with pytest.raises(ValueError, match="dtype float8_e4m3fn != float32"):
        geometry.check_compatible(transport.KVGeometry.of_cache(auto.kv_cache), "a", "b")


@pytest.mark.parametrize("value, match", [
    ("int3", r"kv_cache_dtype must be one of \('auto', 'fp8', 'kivi2', 'kivi4'\), got 'int3'"),
    (8, "kv_cache_dtype must be one of"),
    (["fp8"], "kv_cache_dtype must be one of"),
])
def test_bad_kv_cache_dtype_is_a_value_error(llama_ckpt, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=llama_ckpt, kv_cache_dtype=value)
    if value == "int3":
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            LLM(llama_ckpt, kv_cache_dtype=value)
