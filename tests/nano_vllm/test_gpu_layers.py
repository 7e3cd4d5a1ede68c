"""GPU checks of the performance layers (marker `gpu`; run on a GPU machine:
`pytest tests/nano_vllm/test_gpu_layers.py -m gpu`).

The Triton halves in bf16 (the interpreter cannot check bf16) against torch, the whole engine with every
layer on against transformers (fp32) and against the eager paper path (bf16), CUDA-graph replays of the
split-K GEMV, and no kernel compiled mid-serving.
"""

from __future__ import annotations

import pytest
import torch
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.bench.step_timing import StepTimer
from nano_vllm.layers.fused_sampling import sample_reference, sample_triton
from nano_vllm.layers.gemv import GemvConfig, GemvWorkspace, gemv_triton

pytestmark = pytest.mark.gpu
KV = {"num_kv_blocks": 512}  # a fixed pool: an engine sized from free memory leaves the next none
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # fused qkv, o, fused gate_up, down


@pytest.mark.parametrize("n,k", LLAMA3_8B)
@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize("split_k", [1, 2, 8])
def test_gemv_bf16_llama3_shapes(n, k, m, split_k):
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    exact = x.double() @ w.double().t()
    config = GemvConfig(16 if m == 1 else 32, 512 if m == 1 else 256, split_k)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ws = GemvWorkspace(split_k * m * n, -(-n // config.block_n), x.device)
    gemv_triton(x, w, config=config, workspace=ws, out=out)
    ours = (out.double() - exact).abs().max().item()
    cublas = (torch.nn.functional.linear(x, w).double() - exact).abs().max().item()
    assert ours <= 2 * cublas + 1e-3, (ours, cublas)
    assert ws.counters.eq(0).all()


@pytest.mark.parametrize("n,k", [*LLAMA3_8B, (4100, 4104)])  # and a ragged N and K
@pytest.mark.parametrize("config", [GemvConfig(4, 2048, 1, 8, 4), GemvConfig(8, 1024, 1, 8, 3),
                                    GemvConfig(16, 512, 2, 4, 1), GemvConfig(32, 256, 4, 4, 2)])
def test_gemv_bf16_m1_tiles_and_stages(n, k, config):
    """M = 1 with compiled pipelines (num_stages > 1 puts the loads in cp.async stages) against fp64."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    exact = x.double() @ w.double().t()
    out = torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ws = GemvWorkspace(config.split_k * n, -(-n // config.block_n), x.device)
    gemv_triton(x, w, config=config, workspace=ws, out=out)
    ours = (out.double() - exact).abs().max().item()
    cublas = (torch.nn.functional.linear(x, w).double() - exact).abs().max().item()
    assert ours <= 2 * cublas + 1e-3, (ours, cublas)
    assert ws.counters.eq(0).all()


@pytest.mark.parametrize("m,config", [(4, GemvConfig(32, 256, 4)), (1, GemvConfig(8, 1024, 4, 8, 3))])
def test_gemv_replays_in_a_cuda_graph(m, config):
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    ws = GemvWorkspace(config.split_k * m * 4096, 4096 // config.block_n, x.device)
    out = torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16)
    gemv_triton(x, w, config=config, workspace=ws, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_triton(x, w, config=config, workspace=ws, out=out)
    for _ in range(3):
        x.normal_()
        graph.replay()
        torch.testing.assert_close(out, gemv_triton(x, w, config=config), rtol=0, atol=0)


@pytest.mark.parametrize("b,s", [(16, 1), (1, 300)])  # a decode step, a prefill chunk
def test_rope_and_store_bf16_is_bit_identical(b, s):
    """The fused RoPE + cache write (nano_vllm.layers.fused) in bf16 writes what the paper path's `apply_rope` and
    `store_kvcache` write: the same fp32 arithmetic rounded once, so at most one bf16 ulp apart where the
    compiler contracts a multiply-add differently (the interpreter checks fp16 / fp32 bit for bit)."""
    from nano_vllm.attention import store_kvcache
    from nano_vllm.layers.fused import rope_and_store
    from shared.kernels import apply_rope

    g = torch.Generator(device="cuda").manual_seed(b)
    d, hq, hkv = 128, 32, 8
    qkv = torch.randn(b, s, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (t.view(b, s, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], -1))
    pos = torch.arange(b * s, device="cuda").view(b, s).float() * 3 + 11
    inv = 500000.0 ** (-torch.arange(0, d, 2, device="cuda").float() / d)
    cos, sin = (pos[..., None] * inv).cos(), (pos[..., None] * inv).sin()
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[: b * s]
    caches = [torch.zeros(64, 16, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    q_ref, k_ref = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    store_kvcache(k_ref, v, caches[0], caches[1], slots)
    q_out, k_out = rope_and_store(q, k, v, cos, sin, caches[2], caches[3], slots)
    for ours, ref in [(q_out, q_ref), (k_out, k_ref), (caches[2], caches[0])]:
        torch.testing.assert_close(ours, ref, rtol=2**-7, atol=1e-30)  # one ulp of bf16's 8-bit significand
        assert (ours != ref).float().mean() < 1e-3
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)  # v is copied, not computed


def test_fused_sampling_kernel_on_cuda():
    rows, vocab = 64, 151_936
    logits = (4 * torch.randn(rows, vocab, device="cuda")).to(torch.bfloat16)
    temps = torch.tensor([0.0, 0.6, 1.0, 1.7] * (rows // 4), device="cuda")
    seeds = torch.randint(0, 1 << 32, (rows,), device="cuda")
    offsets = torch.randint(0, 4096, (rows,), device="cuda")
    ours = sample_triton(logits, temps, seeds, offsets)
    ref = sample_reference(logits, temps, seeds, offsets)
    assert ours[::4].tolist() == ref[::4].tolist() == logits[::4].argmax(-1).tolist()  # temperature 0
    # Sampled rows draw the reference's token unless the GPU's fast log / division flip a near-tie.
    assert (ours != ref).float().mean().item() <= 2 / rows


@pytest.mark.parametrize("extra", [{}, {"num_kv_blocks": 8}, {"max_num_batched_tokens": 64, "max_num_seqs": 4,
                                                               "mixed_cudagraph_sizes": [16, 64]}])
def test_layers_match_transformers_fp32(ckpt, hf_greedy, extra):
    prompts, max_tokens = random_prompts(90, [1, 17, 33, 70, 5]), [20, 30, 12, 16, 40]
    llm = LLM(ckpt, device="cuda", dtype="float32", max_model_len=128, **{**KV, **extra})  # every layer
    timer = StepTimer(llm.engine, timeline=True)
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
                        use_tqdm=False)
    for p, n, o in zip(prompts, max_tokens, outs):
        assert o.token_ids == hf_greedy(ckpt, p, n)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    summary = timer.timeline.summary()
    assert summary["steps"] == timer.num_steps and summary["device_busy_ms_per_step"] > 0


def test_layers_match_the_eager_paper_path_bf16(ckpt):
    """bf16 with every layer (a plain LLM: CUDA graphs, overlap, fused projections, GEMV, fused sampling,
    the warm-up) against the paper path alone: the prefill logits agree to bf16 accuracy and the greedy
    tokens agree."""
    prompts = random_prompts(91, [3, 12, 40, 7])
    fast = LLM(ckpt, device="cuda", max_model_len=128, **KV)
    plain = LLM(ckpt, device="cuda", max_model_len=128, performance_layers=False, **KV)
    assert fast.engine.layers_applied == ["fused", "gemv", "fused_decode", "fused_sampling", "overlap", "cudagraph",
                                          "warmup"]
    assert plain.engine.layers_applied == [] and plain.engine.model_runner.cudagraphs == []
    logits = []
    for llm in (fast, plain):
        for p in prompts:
            llm.engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=1))
        runner, out = llm.engine.model_runner, llm.engine.scheduler.schedule()
        with torch.inference_mode():
            logits.append(runner.run(runner.prepare(out)).float())
        for p in list(llm.engine.scheduler.running):
            llm.engine.abort_request(p.request_id)
    # bf16 keeps 8 bits: two orders of summation differ by a few units of 2^-8 of the logits' range.
    assert (logits[0] - logits[1]).abs().max() <= 8 * 2**-8 * logits[1].abs().max()
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    a = [o.token_ids for o in fast.generate(prompts, sp, use_tqdm=False)]
    b = [o.token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    agree = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t)) / sum(map(len, b))
    assert agree >= 0.9 and all(s[0] == t[0] for s, t in zip(a, b)), (a, b)


def test_seeded_sampling_with_layers_bf16(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, device="cuda", max_model_len=128, **KV)
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=24, seed=11)
    plain = SamplingParams(temperature=0.6, max_tokens=24, seed=3)
    alone = llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0].token_ids
    batched = llm.generate([[7, 8], [1, 2, 3], [9] * 30], [plain, sp, plain], use_tqdm=False)
    assert batched[1].token_ids == alone and len(alone) == 24


def test_no_kernel_compiles_mid_serving_with_layers(ckpt):
    from shared.bench import KernelCompiles

    llm = LLM(ckpt, device="cuda", max_model_len=128, **KV)
    one = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate(random_prompts(92, [17]), one, use_tqdm=False)
    with KernelCompiles() as built:
        for lengths in ([32], [16, 48], [2], [21, 7, 3], [5] * 9, [3] * 16):
            llm.generate(random_prompts(93 + len(lengths), lengths), one, use_tqdm=False)
    if not built.available:
        pytest.skip("this Triton has no jit_cache_hook")
    assert built.names == [], built.summary()
