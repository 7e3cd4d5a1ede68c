"""SGLEngine end to end on a random transformers checkpoint: greedy outputs with radix-cache hits equal the
cache off and transformers; eviction under a small pool; no leaked block after aborts and bad inputs."""

from __future__ import annotations

import random

import pytest

from nano_sglang.engine import SGLEngine
from nano_sglang.scheduler import CacheAwareConfig
from nano_vllm import EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_engine(ckpt, policy="lpm", **kw) -> SGLEngine:
    args = dict(model=ckpt, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=40)
    args.update(kw)
    return SGLEngine(EngineConfig(**args), CacheAwareConfig(policy, defer_threshold=16))


def assert_no_leak(engine: SGLEngine) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and not bm.locked and not bm.matched
    assert bm.tree.protected_size == 0
    assert bm.num_free_blocks + bm.tree.total_pages() == bm.num_blocks
    cached, stack = set(), [bm.tree.root]
    while stack:  # every page the tree holds
        node = stack.pop()
        cached.update(node.pages)
        stack += node.children.values()
    assert all(c == (1 if b in cached else 0) for b, c in enumerate(bm.pool.ref_counts))


def shared_prompts(seed: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    preamble = [rng.randrange(4000) for _ in range(40)]
    branches = [[rng.randrange(4000) for _ in range(10)] for _ in range(2)]
    return [preamble + rng.choice(branches) + [rng.randrange(4000) for _ in range(rng.randint(1, 12))]
            for _ in range(n)]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_greedy_with_cache_hits_equals_cache_off_and_transformers(ckpt, hf_greedy, policy):
    prompts = shared_prompts(0)
    on = make_engine(ckpt, policy)
    first = on.generate(prompts, GREEDY)
    second = on.generate(prompts, GREEDY)  # every prompt is now (nearly) fully cached
    off = make_engine(ckpt, policy, enable_prefix_caching=False).generate(prompts, GREEDY)
    for p, a, b, c in zip(prompts, first, second, off):
        assert a.token_ids == b.token_ids == c.token_ids == hf_greedy(tuple(p), 6)
    assert sum(o.num_cached_tokens for o in first) > 0
    assert all(o.num_cached_tokens >= 48 for o in second)
    assert_no_leak(on)


def test_small_pool_evicts_cache_before_preempting(ckpt, hf_greedy):
    engine = make_engine(ckpt, num_kv_blocks=16, max_num_batched_tokens=256)  # 256 tokens of KV
    rng = random.Random(1)
    prompts = [[rng.randrange(4000) for _ in range(rng.randint(20, 60))] for _ in range(10)]
    outs = engine.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(tuple(p), 6)
    assert engine.block_manager.num_evicted_blocks > 0
    assert_no_leak(engine)


def test_duplicate_outputs_share_blocks_after_rematch(ckpt, hf_greedy):
    """Two identical prompts decode identical tokens into different blocks; re-matching points the second
    at the first's blocks and frees the duplicates."""
    engine = make_engine(ckpt)
    prompt = list(range(100, 130))
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    a = engine.add_request(prompt, sp)
    b = engine.add_request(prompt, sp)
    while engine.has_unfinished_requests():
        engine.step()
        if a.block_table and b.block_table and not a.is_finished:
            full = min(a.num_computed_tokens, b.num_computed_tokens) // 16 - 1
            assert a.block_table[:full] == b.block_table[:full]
    assert a.output_token_ids == b.output_token_ids == hf_greedy(tuple(prompt), 40)
    assert_no_leak(engine)


def test_abort_between_match_and_allocation_leaks_nothing(ckpt):
    engine = make_engine(ckpt)
    prompts = shared_prompts(2, 4)
    engine.generate(prompts[:2], GREEDY)
    seq = engine.add_request(prompts[2], GREEDY)
    engine.scheduler.order_waiting()  # matches the prefix (the step would allocate next)
    assert engine.block_manager.matched
    assert engine.abort_request(seq.request_id)
    assert_no_leak(engine)
    # and an abort of a running request mid-prefill
    seq = engine.add_request(prompts[3] + list(range(100)), GREEDY)
    engine.step()
    assert seq.block_table and engine.block_manager.locked
    engine.abort_request(seq.request_id)
    assert_no_leak(engine)


def test_bad_inputs_raise_and_leak_nothing(ckpt):
    engine = make_engine(ckpt)
    engine.generate(shared_prompts(3, 2), GREEDY)
    with pytest.raises(ValueError, match="more than max_model_len"):
        engine.add_request(list(range(300)), GREEDY)
    with pytest.raises(ValueError, match="invalid regex"):
        engine.add_request([1, 2, 3], GREEDY, regex="(ab")
    with pytest.raises(ValueError, match="matches no string"):
        engine.add_request([1, 2, 3], GREEDY, regex="[^\\x20-\\x7e\\t\\n]")
    with pytest.raises(ValueError, match="give exactly one of regex / json_schema"):
        engine.add_request([1, 2, 3], GREEDY, regex="a", json_schema={"type": "null"})
    with pytest.raises(ValueError, match="score_from must be in"):
        engine.add_request([1, 2, 3], GREEDY, score_from=3)
    with pytest.raises(ValueError, match="policy must be one of"):
        CacheAwareConfig("random")
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        SGLEngine(EngineConfig(model=ckpt, tensor_parallel_size=2))
    assert_no_leak(engine)


def test_deferral_and_aging(ckpt):
    engine = make_engine(ckpt)
    sched = engine.scheduler
    prompts = shared_prompts(4, 4)
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    order, deferred = sched.order_waiting()
    assert len(order) == 1 and len(deferred) == 3  # they share 40+ uncached tokens with the first
    sched.num_steps += sched.policy.max_wait_steps  # now every request has waited too long
    order, deferred = sched.order_waiting()
    assert [s.seq_id for s in order] == [s.seq_id for s in seqs] and not deferred
    for s in seqs:
        engine.abort_request(s.request_id)
    assert_no_leak(engine)
