"""SGLEngine is nano_vllm's engine with SGLang's parts plugged into its extension points: each part is built
once, every request is an SGLSequence carrying only declared state, and nano_vllm's performance layers —
the CUDA graphs (replayed eagerly on a CPU), fused projections and sampling, the GEMV — change neither
constrained outputs, jump-forward nor `select`'s prompt scores. The runtime sizes mixed-step graphs for
jump-forward; overlapped scheduling is refused by name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import nano_sglang as sgl
from nano_sglang.backend.runtime import MIXED_CUDAGRAPH_SIZES
from nano_sglang.block_manager import RadixBlockManager
from nano_sglang.engine import SGLEngine
from nano_sglang.model_runner import SGLModelRunner
from nano_sglang.scheduler import CacheAwareConfig, CacheAwareScheduler
from nano_sglang.sequence import SGLSequence
from nano_vllm import EngineConfig, SamplingParams
from nano_vllm.block_manager import BlockManager
from nano_vllm.layers.cudagraph import DecodeCudaGraphs, MixedStepGraphs, capture_cudagraphs
from nano_vllm.scheduler import Scheduler

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "ok": {"type": "boolean"}}}


def engine_args(ckpt, **kw) -> dict:
    return dict(model=ckpt, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=64,
                **kw)


def test_each_part_is_built_once(ckpt, monkeypatch):
    built = {"block_manager": 0, "scheduler": 0}
    for cls, key in ((BlockManager, "block_manager"), (Scheduler, "scheduler")):
        init = cls.__init__

        def counting(self, *args, _init=init, _key=key, **kwargs):
            built[_key] += 1
            _init(self, *args, **kwargs)
        monkeypatch.setattr(cls, "__init__", counting)
    policy = CacheAwareConfig("dfs-weight")
    engine = SGLEngine(EngineConfig(**engine_args(ckpt)), policy)
    assert built == {"block_manager": 1, "scheduler": 1}
    assert type(engine.block_manager) is RadixBlockManager and type(engine.model_runner) is SGLModelRunner
    assert type(engine.scheduler) is CacheAwareScheduler and engine.scheduler.policy is policy
    assert engine.scheduler.block_manager is engine.block_manager


def test_requests_are_sgl_sequences_with_declared_state_only(ckpt):
    engine = SGLEngine(EngineConfig(**engine_args(ckpt)))
    declared = set(vars(SGLSequence([1, 2, 3])))
    scored = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=1), score_from=2)
    constrained = engine.add_request([5, 6], SamplingParams(max_tokens=8), regex=r"[a-z]{1,3}")
    plain = engine.add_request("hello", SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    for seq in (scored, constrained, plain):
        assert type(seq) is SGLSequence and set(vars(seq)) == declared
    assert len(scored.prompt_logprobs) == 2 and plain.constraint is None and plain.score_from is None


def test_score_from_is_checked_for_text_prompts_too(ckpt):
    engine = SGLEngine(EngineConfig(**engine_args(ckpt)))
    n = len(engine.tokenizer.encode("one two three"))
    with pytest.raises(ValueError, match=rf"score_from must be in \[1, {n}\), got {n}"):
        engine.add_request("one two three", score_from=n)
    with pytest.raises(ValueError, match="score_from must be in"):
        SGLSequence([1, 2], score_from=0)
    assert not engine.has_unfinished_requests()


def test_generate_leaves_nothing_queued_when_a_later_prompt_is_bad(ckpt):
    engine = SGLEngine(EngineConfig(**engine_args(ckpt)))
    with pytest.raises(ValueError, match="more than max_model_len"):
        engine.generate([[1, 2, 3], list(range(300))], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    assert bm.num_free_blocks + bm.tree.total_pages() == bm.num_blocks and not bm.locked


def test_mixed_step_graphs_keep_constraints_jump_forward_and_scores(ckpt, monkeypatch):
    """Jump-forward's extend steps and a prompt-scoring step replay the mixed-step graphs: same tokens, same
    scores as the eager engine."""
    results, mixed_replays = [], []
    # a stand-in for a captured graph on a CPU: replaying runs its body again on the static buffers
    monkeypatch.setattr(DecodeCudaGraphs, "capture", lambda self, body: SimpleNamespace(replay=body))
    replay = MixedStepGraphs.replay
    monkeypatch.setattr(MixedStepGraphs, "replay", lambda self, inputs: mixed_replays.append(inputs) or
                        replay(self, inputs))
    for graphs in (False, True):
        engine = SGLEngine(EngineConfig(**engine_args(ckpt, mixed_cudagraph_sizes=(32, 64, 128))))
        if graphs:
            engine.model_runner.cudagraphs = capture_cudagraphs(engine.model_runner)
        outs = engine.generate([f"Item {i}: " for i in range(3)], SamplingParams(temperature=0.0, max_tokens=64),
                               json_schema=SCHEMA)
        scored = engine.add_request(list(range(40, 90)), SamplingParams(max_tokens=1), score_from=45)
        while engine.has_unfinished_requests():
            engine.step()
        results.append(([o.token_ids for o in outs], scored.prompt_logprobs))
        assert len(scored.prompt_logprobs) == 5
        if graphs:  # the scoring step (50 tokens, 5 scored rows + 1 sampled) fits the graph of 64 tokens
            assert any(len(i.token_ids) == 50 and len(i.sample_rows) == 6 for i in mixed_replays)
        for o in outs:
            assert set(json.loads(o.text)) == {"name", "ok"}, o.text
        assert bool(mixed_replays) == graphs
    (eager_ids, eager_scores), (graph_ids, graph_scores) = results
    assert graph_ids == eager_ids
    assert graph_scores == pytest.approx(eager_scores, abs=1e-4)


def test_runtime_sizes_mixed_step_graphs_for_jump_forward(ckpt):
    """The runtime captures mixed-step graphs at 64-512 tokens (jump-forward's extends) unless given sizes;
    an engine built directly takes nano_vllm's default."""
    assert SGLEngine(EngineConfig(**engine_args(ckpt))).config.mixed_cudagraph_sizes is None
    runtime = sgl.Runtime(ckpt, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128,
                          num_kv_blocks=64)
    try:
        assert runtime.engine.config.mixed_cudagraph_sizes == tuple(s for s in MIXED_CUDAGRAPH_SIZES if s <= 128)
    finally:
        runtime.shutdown()
    runtime = sgl.Runtime(ckpt, max_model_len=256, max_num_seqs=8, num_kv_blocks=64, mixed_cudagraph_sizes=[])
    try:
        assert runtime.engine.config.mixed_cudagraph_sizes == ()
    finally:
        runtime.shutdown()


# nano_vllm's layers that run by default on CUDA besides the graphs and the warm-up, asked for here (a CPU
# runs none unless asked): nano_sglang's engine is fast by default with them.
LAYERS = {"fused_projections": True, "fused_sampling": True, "gemv_max_tokens": 1}


def test_nano_vllm_layers_keep_constraints_jump_forward_and_scores(ckpt):
    """With nano_vllm's layers (fused projections, fused sampling, the GEMV) an SGLEngine gives the paper
    path's greedy constrained tokens, jump-forward and `select` scores; seeded sampling stays valid."""
    results = []
    for args in ({"performance_layers": False}, LAYERS):
        engine = SGLEngine(EngineConfig(**engine_args(ckpt, **args)))
        assert engine.layers_applied == ([] if args == {"performance_layers": False}
                                         else ["fused", "gemv", "fused_sampling"])
        greedy = engine.generate([f"Item {i}: " for i in range(3)], SamplingParams(temperature=0.0, max_tokens=64),
                                 json_schema=SCHEMA)
        sampled = engine.generate(["Q: "] * 2, SamplingParams(temperature=1.0, max_tokens=64, seed=5),
                                  json_schema=SCHEMA)
        scored = engine.add_request(list(range(40, 90)), SamplingParams(max_tokens=1), score_from=45)
        while engine.has_unfinished_requests():
            engine.step()
        for o in greedy + sampled:
            assert set(json.loads(o.text)) == {"name", "ok"}, o.text
        results.append(([o.token_ids for o in greedy], scored.prompt_logprobs))
    (paper_ids, paper_scores), (layer_ids, layer_scores) = results
    assert layer_ids == paper_ids
    assert layer_scores == pytest.approx(paper_scores, abs=1e-4)


def test_overlapped_scheduling_is_refused_by_name(ckpt):
    """nano_sglang reads each step's tokens in its postprocess: nano_vllm's overlapped scheduling stays off
    by default and, asked for, is a ValueError naming the switch."""
    with pytest.raises(ValueError, match=r"async_scheduling needs nano_vllm.s .*SGLModelRunner overrides"):
        SGLEngine(EngineConfig(**engine_args(ckpt, async_scheduling=True)))


def test_program_state_rejects_what_it_cannot_add_and_keeps_running():
    state = sgl.ProgramState(backend=None)
    with pytest.raises(TypeError, match="cannot add int to a program state"):
        state += 5
    state += "still here"
    assert state.text() == "still here"
