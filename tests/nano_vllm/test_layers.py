"""The engine's extension points and the performance layers' hooks, on a CPU.

Extension points: a subclass swaps the Sequence, BlockManager, Scheduler or ModelRunner class and keeps the
rest (what nano_sglang builds on). Hooks: the step timer sees every step and leaves the engine as it was;
the performance layers change no token.
"""

from __future__ import annotations

import functools

import pytest
import torch
from vllm_checkpoints import LAYERS, random_prompts

from nano_vllm import LLM, EngineConfig, LLMEngine, SamplingParams
from nano_vllm.bench.step_timing import PHASES, StepTimer
from nano_vllm.block_manager import BlockManager
from nano_vllm.config import engine_args_from
from nano_vllm.layers.cudagraph import DecodeCudaGraphs, EagerReplay, capture_cudagraphs
from nano_vllm.model_runner import ModelRunner
from nano_vllm.scheduler import Scheduler
from nano_vllm.sequence import Sequence

SMALL = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64}


class TaggedSequence(Sequence):
    def __init__(self, *args, tag: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag  # per-request state a subclass engine needs, declared instead of attached later


class CountingBlockManager(BlockManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.admitted = 0

    def match_prefix(self, seq):
        self.admitted += 1
        return super().match_prefix(seq)


class LastInFirstScheduler(Scheduler):
    def schedule(self):
        self.waiting.reverse()  # a different policy, same mechanism
        try:
            return super().schedule()
        finally:
            self.waiting.sort(key=lambda s: s.seq_id)


class RecordingRunner(ModelRunner):
    def execute(self, out):
        self.executed = getattr(self, "executed", 0) + 1
        return super().execute(out)


class PolicyScheduler(Scheduler):
    def __init__(self, *args, policy: str = "fcfs", **kwargs):
        super().__init__(*args, **kwargs)
        self.policy = policy


class PolicyEngine(LLMEngine):
    def __init__(self, config: EngineConfig, policy: str):
        # an extra constructor argument
        self.scheduler_cls = functools.partial(PolicyScheduler, policy=policy)
        super().__init__(config)


class CustomEngine(LLMEngine):
    sequence_cls = TaggedSequence
    block_manager_cls = CountingBlockManager
    scheduler_cls = LastInFirstScheduler
    model_runner_cls = RecordingRunner


def test_extension_points_swap_one_part_each(qwen3_ckpt, hf_greedy):
    engine = CustomEngine(EngineConfig(model=qwen3_ckpt, **SMALL))
    assert isinstance(engine.block_manager, CountingBlockManager)
    assert isinstance(engine.scheduler, LastInFirstScheduler)
    assert engine.scheduler.block_manager is engine.block_manager
    assert isinstance(engine.model_runner, RecordingRunner)
    prompts = random_prompts(50, [5, 9])
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=4), tag=f"t{i}")
            for i, p in enumerate(prompts)]
    assert all(isinstance(s, TaggedSequence) for s in seqs) and [s.tag for s in seqs] == ["t0", "t1"]
    while engine.has_unfinished_requests():
        engine.step()
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == hf_greedy(qwen3_ckpt, p, 4)
    assert engine.block_manager.admitted >= 2 and engine.model_runner.executed == engine.num_steps
    with pytest.raises(TypeError, match="tag"):
        LLMEngine(EngineConfig(model="tiny", **SMALL)).add_request([1, 2], tag="x")  # plain Sequence: no tag
    assert PolicyEngine(EngineConfig(model="tiny", **SMALL), "lpm").scheduler.policy == "lpm"


def test_step_timer_sees_every_step_and_uninstalls(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, **SMALL)
    engine = llm.engine
    seen = []
    timer = StepTimer(engine, on_step=lambda out, seconds: seen.append((out.num_new_tokens, seconds)))
    steps0 = engine.num_steps
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    llm.generate(random_prompts(51, [3, 20, 40]), sp, use_tqdm=False)
    n = engine.num_steps - steps0
    assert timer.num_steps == len(seen) == n > 0
    assert timer.num_eager_steps == n  # a CPU runs every step eagerly
    assert set(timer.seconds) == set(PHASES) and all(v > 0 for v in timer.seconds.values())
    assert timer.seconds["prepare"] <= timer.seconds["execute"]
    assert timer.step_seconds == pytest.approx(sum(v for k, v in timer.seconds.items() if k != "prepare"))
    assert all(s > 0 for _, s in seen) and set(timer.per_step_ms()) == set(PHASES)
    timer.remove()
    for obj, name in ((engine.scheduler, "schedule"), (engine.scheduler, "postprocess"),
                      (engine.model_runner, "prepare"), (engine.model_runner, "execute"),
                      (engine.model_runner, "forward")):
        assert name not in vars(obj)  # the class's methods again
    llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert timer.num_steps == n  # removed: counts nothing more


def test_step_timer_stacks_on_another_wrapper(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, **SMALL)
    sched, calls = llm.engine.scheduler, []
    original = sched.schedule

    def mine():
        calls.append(1)
        return original()

    sched.schedule = mine
    timer = StepTimer(llm.engine)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert timer.num_steps == 3 and len(calls) >= 3
    timer.remove()
    assert sched.schedule is mine


def test_performance_layers_change_no_token(qwen3_ckpt, monkeypatch):
    """On a CPU no layer applies by default (the warm-up it runs on CUDA is tested in test_engine_vs_hf).
    The decode graphs (an eager stand-in for the capture) return the rows a step asks for in the order it
    asks: a prompt-scoring subclass puts extra rows first."""
    llm = LLM(qwen3_ckpt, **SMALL)
    assert llm.engine.layers_applied == [] and llm.engine.num_steps == 0
    runner = llm.engine.model_runner
    prompts = random_prompts(52, [4, 7, 12])
    seqs = [llm.engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=2)) for p in prompts]
    llm.engine.step()  # the prefills; the next step decodes all three
    out = llm.engine.scheduler.schedule()
    inputs = runner.prepare(out)
    assert inputs.is_decode and inputs.sample_rows == [0, 1, 2]
    inputs.sample_rows = [2, 0, 1, 1]
    monkeypatch.setattr(DecodeCudaGraphs, "capture", lambda self, body: EagerReplay(body))
    [graphs] = capture_cudagraphs(runner)
    assert graphs.fits(inputs)
    with torch.inference_mode():  # as in ModelRunner.run
        torch.testing.assert_close(graphs.replay(inputs), runner.forward(inputs))
    assert all(s.num_output_tokens == 1 for s in seqs)


def test_engine_args_from_drops_nulls_and_names_unknown_keys():
    assert engine_args_from({"max_model_len": None, "max_num_seqs": 4}) == {"max_num_seqs": 4}
    with pytest.raises(TypeError, match=r"unknown engine argument\(s\) \['bogus'\]"):
        engine_args_from({"bogus": 1})
    with pytest.raises(TypeError, match=r"unknown engine argument\(s\) \['bogus'\]"):
        LLM("tiny", bogus=1)


def test_every_layer_registers_at_its_point_in_load_order():
    """One mechanism: each layer module registers into nano_vllm.config.REGISTRY when it loads; the runner
    hooks run in the order the registry lists the modules (the projections are fused before the GEMV swaps
    every Linear)."""
    from nano_vllm.config import REGISTRY

    names = {p: [layer.module.rpartition(".")[2] for layer in REGISTRY.layers(p)]
             for p in ("runner", "graphs", "engine")}
    assert names == {"runner": ["fused", "gemv", "fused_decode", "fused_sampling", "overlap"], "graphs": ["cudagraph"],
                     "engine": ["overlap", "warmup"]}
    assert REGISTRY.missing == {}


def test_engine_reports_the_layers_it_applied_and_the_switch_turns_them_all_off(qwen3_ckpt):
    """Asked for on a CPU, the runner and engine layers apply and are named; `performance_layers=False`
    builds and steps the paper path alone, with the same greedy tokens."""
    prompts = random_prompts(61, [5, 9])
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    fast = LLM(qwen3_ckpt, **SMALL, **LAYERS)
    assert fast.engine.layers_applied == ["fused", "gemv", "fused_sampling", "overlap"]
    paper = LLM(qwen3_ckpt, **SMALL, performance_layers=False)
    assert paper.engine.layers_applied == []
    assert type(paper.engine).step is LLMEngine.step and "step" not in vars(paper.engine)  # no overlap
    assert ([o.token_ids for o in fast.generate(prompts, greedy, use_tqdm=False)]
            == [o.token_ids for o in paper.generate(prompts, greedy, use_tqdm=False)])
    with pytest.raises(ValueError, match="gemv_max_tokens=1 asks for the performance layer gemv"):
        LLM(qwen3_ckpt, **SMALL, performance_layers=False, gemv_max_tokens=1)


@pytest.mark.parametrize("switch", [True, False])
def test_the_bench_takes_the_switch(switch):
    """`python -m nano_vllm.bench performance_layers=false` builds the paper-path engine (the server's
    build: test_llm_api)."""
    from omegaconf import OmegaConf

    from nano_vllm.bench.throughput import make_llm

    engine = {**SMALL, "device": "cpu", "fused_sampling": True if switch else None}
    cfg = OmegaConf.create({"model": "tiny", "performance_layers": switch, "engine": engine})
    llm = make_llm(cfg)
    assert llm.engine.config.performance_layers is switch
    assert llm.engine.layers_applied == (["fused_sampling"] if switch else [])
