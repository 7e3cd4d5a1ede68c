"""Overlapped scheduling (nano_vllm.layers.overlap) on a CPU: one step of lag, placeholders resolved on the device,
and the fallbacks when a sequence stops, is preempted or aborted while the next step is in flight.

On a CPU "the device runs step t" happens in the same thread, but the logic is the GPU's: step t+1 is
scheduled and launched with placeholder ids for step t's tokens (the host does not know them), and only
the embedding lookup on the device turns them into tokens. Outputs are compared with transformers.
"""

from __future__ import annotations

import pytest
import torch
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, EngineConfig, LLMEngine, SamplingParams
from nano_vllm.layers.overlap import FutureTokens, OverlapScheduler
from nano_vllm.model_runner import ModelRunner

ON = {"async_scheduling": True}


def _spy(llm):
    """Record, for every step, the last token the scheduler sees for each sequence it schedules and the
    token ids the runner packs."""
    seen, packed = [], []
    schedule, prepare = llm.engine.scheduler.schedule, llm.engine.model_runner.prepare

    def schedule_spy():
        out = schedule()
        seen.append([s.token_ids[-1] for s in out.seqs])
        return out

    def prepare_spy(out):
        inputs = prepare(out)
        packed.append(list(inputs.token_ids))
        return inputs

    llm.engine.scheduler.schedule = schedule_spy
    llm.engine.model_runner.prepare = prepare_spy
    return seen, packed


def test_decodes_run_on_placeholders_resolved_on_the_device(qwen3_ckpt, hf_greedy):
    prompts = random_prompts(60, [5, 12, 30])
    llm = LLM(qwen3_ckpt, max_model_len=64, **ON)
    seen, packed = _spy(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(qwen3_ckpt, p, 8)
    # After the prefill every step is scheduled before the previous one's tokens are known: each decode's
    # last token is a placeholder when it is scheduled and when it is packed into the batch.
    assert all(t < 0 for step in seen[1:] for t in step) and all(t < 0 for step in packed[1:] for t in step)
    assert all(t >= 0 for o in outs for t in o.token_ids)
    assert llm.engine.num_steps == len([s for s in seen if s]) == 8  # the last call only resolved
    assert not llm.engine.has_unfinished_requests()


def test_between_steps_no_placeholder_is_visible(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, max_model_len=64, **ON)
    engine = llm.engine
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=6)) for p in random_prompts(61, [3, 9])]
    stepped_total = 0
    while engine.has_unfinished_requests():
        stepped, finished = engine.step()
        stepped_total += len(stepped)
        assert all(t >= 0 for s in seqs for t in s.token_ids)  # what a server streams from
        assert all(s.is_finished for s in finished)
        assert len(seqs[0].token_times) == seqs[0].num_output_tokens
    assert stepped_total == 12 and all(s.finish_reason == "length" for s in seqs)
    times = seqs[0].token_times
    assert times == sorted(times) and times[0] >= seqs[0].arrival_time


@pytest.mark.parametrize("extra", [{}, {"num_kv_blocks": 6}, {"max_num_batched_tokens": 16, "max_num_seqs": 4}])
def test_stop_tokens_while_the_next_step_is_in_flight(llama_ckpt, hf_greedy, extra):
    """Each request stops at a token of its own greedy continuation: the sequence sits in the step launched
    before its stop token was known; nothing after the stop token is emitted, nothing before is lost, and
    every block comes back — also when the small cache preempts sequences and when prompts are chunked."""
    lengths, n = [30, 31, 20, 25, 15, 2], 24
    prompts = random_prompts(62, lengths)
    refs = [hf_greedy(llama_ckpt, p, n) for p in prompts]
    params, expected = [], []
    for i, ref in enumerate(refs):
        stop = ref[8 + 3 * i]
        k = ref.index(stop)
        params.append(SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=[stop]))
        expected.append(ref[: k + 1])
    llm = LLM(llama_ckpt, max_model_len=96, **ON, **extra)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, e in zip(outs, expected):
        assert o.token_ids == e and o.outputs[0].finish_reason == "stop"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    if extra.get("num_kv_blocks"):
        assert llm.engine.scheduler.num_preemptions > 0


def test_stop_token_on_the_last_allowed_token_is_stop(qwen3_ckpt, hf_greedy):
    """max_tokens ends the sequence when its step is postprocessed (before the token is known); a stop token
    drawn there still makes the finish reason "stop", as on the paper path."""
    prompt, ref = next((p, r) for seed in range(63, 93) for p in random_prompts(seed, [7])
                       if (r := hf_greedy(qwen3_ckpt, p, 6))[5] not in r[:5])
    llm = LLM(qwen3_ckpt, max_model_len=64, **ON)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[ref[5]]),
                       use_tqdm=False)[0]
    assert out.token_ids == ref and out.outputs[0].finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[ref[5]]),
                       use_tqdm=False)[0]
    assert out.token_ids == ref[:5] and out.outputs[0].finish_reason == "length"


def test_abort_while_a_step_is_in_flight_frees_blocks(qwen3_ckpt, hf_greedy):
    llm = LLM(qwen3_ckpt, max_model_len=64, **ON)
    engine = llm.engine
    keep, drop = random_prompts(64, [6, 20])
    a = engine.add_request(keep, SamplingParams(temperature=0.0, max_tokens=10))
    b = engine.add_request(drop, SamplingParams(temperature=0.0, max_tokens=10))
    for _ in range(3):
        engine.step()
    assert engine.abort_request(b.request_id)  # b sits in the step in flight
    assert b.finish_reason == "abort" and b.block_table == [] and all(t >= 0 for t in b.token_ids)
    emitted = b.num_output_tokens
    while engine.has_unfinished_requests():
        engine.step()
    assert b.num_output_tokens == emitted  # its token from the step in flight is dropped
    assert a.output_token_ids == hf_greedy(qwen3_ckpt, keep, 10)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_output_blocks_are_hashed_with_their_tokens(qwen3_ckpt, hf_greedy):
    """A block whose last token was a placeholder when its step was scheduled is re-hashed once the token
    is known: a later prompt made of the first request's prompt and output hits it."""
    prompt = random_prompts(65, [10])[0]
    llm = LLM(qwen3_ckpt, max_model_len=96, **ON)
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)[0]
    follow = prompt + first.token_ids  # 40 tokens: 2 full blocks, the second ends in generated tokens
    out = llm.generate([follow], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    assert out.token_ids == hf_greedy(qwen3_ckpt, follow, 4)


def test_a_failed_step_leaves_no_placeholder_and_forgets_hashes(qwen3_ckpt, hf_greedy, monkeypatch):
    llm = LLM(qwen3_ckpt, max_model_len=64, **ON)
    engine, runner = llm.engine, llm.engine.model_runner
    prompt = random_prompts(66, [40])[0]
    seq = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()
    engine.step()
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda inputs: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert all(t >= 0 for t in seq.token_ids) and not engine.block_manager.cache.hash_to_block
    engine.abort_request(seq.request_id)
    assert not engine.has_unfinished_requests()
    monkeypatch.setattr(runner, "run", run)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(qwen3_ckpt, prompt, 5)


def test_seeded_sampling_does_not_depend_on_overlap_or_batch(qwen3_ckpt):
    sp = SamplingParams(temperature=0.9, top_k=40, max_tokens=12, seed=5)
    plain = SamplingParams(temperature=1.0, max_tokens=12, seed=9)
    runs = []
    for args in ({"fused_sampling": True}, {"fused_sampling": True, **ON}):
        llm = LLM(qwen3_ckpt, max_model_len=64, **args)
        alone = llm.generate([[1, 2, 3]], sp, use_tqdm=False)[0].token_ids
        batched = llm.generate([[5, 6], [1, 2, 3], [7] * 20], [plain, sp, plain], use_tqdm=False)
        assert batched[1].token_ids == alone
        runs.append((alone, batched[0].token_ids))
    assert runs[0] == runs[1]


def test_future_tokens_resolve_placeholders():
    future = FutureTokens(8, torch.device("cpu"))
    future.ring[:3] = torch.tensor([11, 12, 13])
    ids = torch.tensor([[5, -1, 7, -3]])
    assert future.resolve(ids).tolist() == [[5, 11, 7, 13]]
    # the CUDA path's kernel (here under the interpreter), across program blocks
    ids = torch.randint(0, 1000, (1, 2500))
    ids[0, ::3] = -torch.randint(1, 9, (len(ids[0, ::3]),))
    assert torch.equal(future.resolve_triton(ids), future.resolve_torch(ids))


def test_needs_the_paper_path_runner_and_one_device(qwen3_ckpt):
    class OwnExecute(ModelRunner):
        def execute(self, out):
            return super().execute(out)

    class Engine(LLMEngine):
        model_runner_cls = OwnExecute

    with pytest.raises(ValueError, match="async_scheduling needs nano_vllm's ModelRunner.prepare / execute"):
        Engine(EngineConfig(model=qwen3_ckpt, max_model_len=64, **ON))
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size 1"):
        EngineConfig(model=qwen3_ckpt, tensor_parallel_size=2, **ON)
    with pytest.raises(TypeError, match="async_scheduling must be a bool"):
        EngineConfig(model=qwen3_ckpt, async_scheduling="yes")
    engine = LLMEngine(EngineConfig(model=qwen3_ckpt, max_model_len=64, **ON))
    assert isinstance(engine.step.__self__, OverlapScheduler)


def test_engine_loop_streams_and_aborts_with_overlap(qwen3_ckpt, hf_greedy):
    """The server's engine thread over an overlapped engine: streams carry real tokens equal to
    transformers', and a request aborted mid-stream (a client gone) gives its blocks back."""
    from server_client import wait_for

    from nano_vllm.serve.engine_loop import EngineLoop

    engine = LLMEngine(EngineConfig(model=qwen3_ckpt, max_model_len=128, max_num_seqs=8, **ON))
    loop = EngineLoop(engine).start()
    try:
        keep, drop = random_prompts(67, [9, 14])
        a = loop.submit(keep, SamplingParams(temperature=0.0, max_tokens=20))
        b = loop.submit(drop, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        got = []
        while len(got) < 3:
            event = b.get(timeout=30)
            assert event is not None and all(t >= 0 for t in event.token_ids)
            got += event.token_ids
        loop.abort(b.request_id)
        tokens, done = [], False
        while not done:
            event = a.get(timeout=30)
            assert event is not None
            tokens += event.token_ids
            done = event.finished
        assert tokens == hf_greedy(qwen3_ckpt, keep, 20)
        bm = engine.block_manager
        wait_for(lambda: not loop.num_active and bm.num_free_blocks == bm.num_blocks, "every block free")
    finally:
        loop.stop()


def test_layer_defaults_and_switch_errors():
    """None runs a layer where it applies (on CUDA; the overlap and the mixed-step graphs on one device
    only), False turns it off, True asks for it anywhere; bad values are errors."""
    from nano_vllm.layers.cudagraph import mixed_sizes

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    config = EngineConfig(device="cpu")
    assert config.fused_sampling is None and config.performance_layers is True
    assert config.wants("fused_sampling", cuda) and not config.wants("fused_sampling", cpu)
    assert not config.replace(fused_sampling=False).wants("fused_sampling", cuda)
    assert config.replace(fused_sampling=True).wants("fused_sampling", cpu)
    assert not config.replace(gemv_max_tokens=0).wants("gemv_max_tokens", cuda)
    assert not config.replace(performance_layers=False).wants("fused_sampling", cuda)
    assert mixed_sizes(config.replace(max_num_batched_tokens=300, max_num_seqs=256)) == (128, 256)
    assert mixed_sizes(config.replace(mixed_cudagraph_sizes=[64])) == (64,)
    # a runner verifying k = 4 drafts: 5 tokens a sequence at each decode batch size (1, 2, 4, 8, 16, 32)
    assert mixed_sizes(config.replace(max_num_batched_tokens=300, max_num_seqs=32), 5) == \
        (5, 10, 20, 40, 80, 128, 160, 256)
    assert mixed_sizes(config.replace(mixed_cudagraph_sizes=[64]), 5) == (64,)
    assert mixed_sizes(config.replace(mixed_cudagraph_sizes=[])) == ()
    with pytest.raises(TypeError, match="gemv_max_tokens must be an int"):
        EngineConfig(gemv_max_tokens=2.5)
    with pytest.raises(ValueError, match=r"gemv_max_tokens must be in \[0, 16\]"):
        EngineConfig(gemv_max_tokens=17)
    with pytest.raises(TypeError, match="fused_projections must be a bool"):
        EngineConfig(fused_projections=1)
    with pytest.raises(TypeError, match="performance_layers must be a bool"):
        EngineConfig(performance_layers=None)
    with pytest.raises(ValueError, match="fused_projections=True asks for the performance layer fused, but "
                                         "performance_layers=False"):
        EngineConfig(performance_layers=False, fused_projections=True)
    EngineConfig(performance_layers=False, fused_projections=False, gemv_max_tokens=0)  # no conflict


def test_an_eager_step_resolves_the_step_in_flight_before_its_launch(llama_ckpt, hf_greedy, monkeypatch):
    """With CUDA graphs, a step that runs eagerly (a prefill) has a host-bound launch: the step in flight is
    resolved first, so a new request's first token does not wait for it. Here every step that is not pure
    decode counts as eager; arrivals between steps make mixed prefill + decode steps. Outputs, stop tokens
    and freed blocks are those of the paper path."""
    monkeypatch.setattr(OverlapScheduler, "_host_bound", lambda self, inputs: not inputs.is_decode)
    order = []
    resolve, launch = OverlapScheduler._resolve, OverlapScheduler._launch
    monkeypatch.setattr(OverlapScheduler, "_resolve", lambda self, f: order.append("resolve") or resolve(self, f))
    monkeypatch.setattr(OverlapScheduler, "_launch",
                        lambda self, out, inputs: order.append("decode" if inputs.is_decode else "eager")
                        or launch(self, out, inputs))
    prompts = random_prompts(67, [9, 30, 17, 4])
    refs = [hf_greedy(llama_ckpt, p, 10) for p in prompts]
    stop = refs[1][6]
    params = [SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop] if i == 1 else None)
              for i in range(len(prompts))]
    engine = LLM(llama_ckpt, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4, **ON).engine
    seqs = [engine.add_request(prompts[0], params[0])]
    while engine.has_unfinished_requests():
        engine.step()
        if len(seqs) < len(prompts) and engine.num_steps % 3 == 1:  # arrivals while decodes run
            seqs.append(engine.add_request(prompts[len(seqs)], params[len(seqs)]))
    assert seqs[1].output_token_ids == refs[1][: refs[1].index(stop) + 1]
    assert [s.output_token_ids for i, s in enumerate(seqs) if i != 1] == [r for i, r in enumerate(refs) if i != 1]
    # every eager launch after the first follows a resolve; decode launches run ahead of their resolve
    eager = [i for i, e in enumerate(order) if e == "eager"]
    assert len(eager) > 2 and all(order[i - 1] == "resolve" for i in eager[1:])
    assert any(order[i : i + 2] == ["decode", "decode"] or order[i : i + 2] == ["eager", "decode"]
               for i in range(len(order) - 1))
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
