"""Greedy output of the engine == transformers' greedy `generate`, token for token (fp32, CPU).

Each engine configuration exercises one mechanism of the paper on the same mixed-length batch: prefix
caching on/off (§4.2), chunked prefill mixed with decodes, a KV cache so small that requests are
preempted and recomputed (§4.5), no chunking at all — each on the paper path alone and with the
performance layers (`layer_args`: overlapped steps, whose decodes run on placeholder tokens resolved on the
device, fused projections, fused sampling).
"""

from __future__ import annotations

import pytest
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.layers.warmup import warm_up

LENGTHS = [1, 5, 17, 33, 64, 70]
MAX_TOKENS = [20, 7, 30, 12, 25, 16]

CASES = {
    "prefix_cache": {},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "no_chunked_prefill": {"enable_chunked_prefill": False, "max_num_batched_tokens": 128, "max_num_seqs": 8},
    "preemption": {"num_kv_blocks": 8},  # 128 token slots for 6 requests of up to 86 tokens
}


def _record_steps(llm):
    """Wrap the scheduler to keep every step's (num_new_tokens, samples)."""
    steps, schedule = [], llm.engine.scheduler.schedule

    def wrapped():
        out = schedule()
        steps.append((list(out.num_new_tokens), list(out.samples)))
        return out

    llm.engine.scheduler.schedule = wrapped
    return steps


def _record_mixed_steps(llm):
    """Wrap the runner's attention metadata to keep each mixed step's (fresh, number of decodes)."""
    mixed, runner = [], llm.engine.model_runner
    make = runner.attention_context

    def wrapped(inputs):
        ctx = make(inputs)
        if not ctx.is_decode and ctx.decode_lens is not None:
            mixed.append((ctx.fresh, ctx.decode_lens.numel()))
        return ctx

    runner.attention_context = wrapped
    return mixed


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(ckpt, hf_greedy, case, layer_args):
    prompts = random_prompts(0, LENGTHS)
    llm = LLM(ckpt, max_model_len=128, **CASES[case], **layer_args)
    steps, mixed = _record_steps(llm), _record_mixed_steps(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, n, out in zip(prompts, MAX_TOKENS, outs):
        assert out.token_ids == hf_greedy(ckpt, prompt, n), f"prompt of {len(prompt)} tokens"
        assert out.prompt_token_ids == prompt and out.outputs[0].finish_reason == "length"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block back once all requests finished
    if case == "chunked_prefill":
        assert max(sum(n) for n, _ in steps) <= 16
        # a step mixing a prompt chunk (> 1 token, not sampled) with decodes (1 token, sampled)
        assert any(any(k > 1 and not s for k, s in zip(n, smp)) and 1 in n for n, smp in steps)
        # a later chunk beside decodes reads its cached chunks through the pages (not `fresh`)
        assert any(not fresh for fresh, _ in mixed)
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if case == "no_chunked_prefill":  # every prompt in one piece
        assert all(not (k > 1 and not s) for n, smp in steps for k, s in zip(n, smp))
        # a whole prompt admitted beside running decodes attends to its own K/V directly (`fresh`)
        assert any(fresh for fresh, _ in mixed)


def test_prefix_cache_hits_keep_outputs_exact(ckpt, hf_greedy, layer_args):
    """Shared prefixes, identical prompts in one step, then the same batch again (all hits)."""
    base = random_prompts(1, [40])[0]
    tails = random_prompts(2, [3, 9, 16])
    prompts = [base + t for t in tails] + [base + tails[0], base[:32], base[:32]]
    llm = LLM(ckpt, max_model_len=128, **layer_args)
    sp = SamplingParams(temperature=0.0, max_tokens=10)
    for round_ in range(2):
        outs = llm.generate(prompts, sp, use_tqdm=False)
        for p, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(ckpt, p, 10), (round_, len(p))
        cached = [o.num_cached_tokens for o in outs]
        if round_ == 0:  # the first prompt computes the 40-token prefix (2 full blocks) the others reuse
            assert cached[0] == 0 and all(c >= 32 for c in cached[1:])
        else:  # everything is cached; a 32-token prompt is fully cached and recomputes its last token only
            assert cached[-1] == 32 and all(c >= 32 for c in cached)
    # Only fully cached prompts: the first step is all one-token queries, i.e. the decode path
    # (flash_attn_with_kvcache / the CUDA graph), reading K/V it never wrote.
    steps = _record_steps(llm)
    outs = llm.generate([base[:32], base[:32]], sp, use_tqdm=False)
    assert steps[0] == ([1, 1], [True, True]) and all(o.num_cached_tokens == 32 for o in outs)
    assert all(o.token_ids == hf_greedy(ckpt, base[:32], 10) for o in outs)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_stop_tokens_and_length(ckpt, hf_greedy, layer_args):
    prompt = random_prompts(3, [12])[0]
    ref = hf_greedy(ckpt, prompt, 12)
    stop = ref[5]
    k = ref.index(stop)  # the first occurrence ends the request, the stop token included
    llm = LLM(ckpt, max_model_len=20, **layer_args)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]),
                       use_tqdm=False)[0]
    assert out.token_ids == ref[: k + 1] and out.outputs[0].finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert out.token_ids == ref[:8] and out.outputs[0].finish_reason == "length"  # max_model_len = 12 + 8


def test_failed_step_forgets_hashes_of_uncomputed_blocks(qwen3_ckpt, hf_greedy, monkeypatch):
    llm = LLM(qwen3_ckpt, max_model_len=128)
    prompt = random_prompts(4, [40])[0]
    runner = llm.engine.model_runner
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda out: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    bm = llm.engine.block_manager
    assert not bm.cache.hash_to_block and bm.num_free_blocks == bm.num_blocks  # aborted, nothing cached
    monkeypatch.setattr(runner, "execute", execute)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == hf_greedy(qwen3_ckpt, prompt, 5)


class _NoGraphFits:
    """A stand-in for a runner's CUDA graph set that counts the steps offered to it."""

    asked = 0

    def fits(self, inputs) -> bool:
        self.asked += 1
        return False


@pytest.mark.parametrize("extra", [{}, {"num_kv_blocks": 8}, {"block_size": 64},
                                   {"enable_prefix_caching": False}])
def test_kernel_warmup_leaves_the_engine_clean(ckpt, hf_greedy, extra, layer_args):
    """The compile warm-up layer (an "engine" hook on CUDA; called by hand here): it runs every step
    eagerly (the variants a step too large for any CUDA graph needs), exercises a mixed step over cached
    keys (the paged varlen kernel; without prefix caching too) and one whose prompt is whole (`fresh`),
    then leaves no request, no used block, no cached hash and no step count behind."""
    llm = LLM(ckpt, max_model_len=64, **extra, **layer_args)
    engine = llm.engine
    steps, mixed = _record_steps(llm), _record_mixed_steps(llm)
    runner, graphs = engine.model_runner, _NoGraphFits()
    runner.cudagraphs = [graphs]
    warm_up(engine)
    assert not graphs.asked and runner.cudagraphs == [graphs]  # every step ran eagerly; the graphs are back
    runner.cudagraphs = []
    assert any(len(n) == 2 and 1 in n and max(n) > 1 for n, _ in steps)  # decode + prefill chunk
    assert {fresh for fresh, _ in mixed} == {True, False}
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
    assert engine.num_steps == 0
    prompts = random_prompts(5, [3, 35])
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in outs)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ckpt, p, 8)


@pytest.mark.parametrize("max_model_len", [2, 8, 17])
def test_kernel_warmup_at_a_short_max_model_len(qwen3_ckpt, hf_greedy, max_model_len):
    """A context too short for some warm-up prompt (the 16-aligned one needs 20 tokens) skips it: the
    engine is still built (on CUDA the warm-up runs inside `LLM(...)`) and left clean."""
    llm = LLM(qwen3_ckpt, max_model_len=max_model_len)
    warm_up(llm.engine)
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
    prompt = random_prompts(6, [1])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(qwen3_ckpt, prompt, 1)
