"""The CUDA-graph paths' bookkeeping, on a CPU: static buffers, padding to the captured batch size (decode)
or token count (mixed steps: empty padding sequences, tokens of no sequence), block-table columns left
stale from earlier steps. A stand-in "graph" replays the same eager computation on the static buffers, so
everything but the capture itself runs and is compared with transformers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, EngineConfig, SamplingParams
from nano_vllm.config import REGISTRY
from nano_vllm.layers.cudagraph import (
    DecodeCudaGraphs,
    EagerReplay,
    MixedStepGraphs,
    capture_cudagraphs,
    cudagraph_batch_sizes,
    install_cudagraphs,
)


def test_batch_size_ladder():
    assert cudagraph_batch_sizes(1) == [1]
    assert cudagraph_batch_sizes(6) == [1, 2, 4, 6]
    assert cudagraph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert cudagraph_batch_sizes(512)[-3:] == [480, 496, 512]


def test_cudagraphs_are_a_registered_layer():
    """The paper path's runner knows no graphs: the layer registers its capture at the "graphs" point, and
    applies on CUDA only, unless enforce_eager."""
    [layer] = REGISTRY.layers("graphs")
    assert layer.impl is install_cudagraphs
    runner = LLM("tiny", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64).engine.model_runner
    assert runner.cudagraphs == [] and "cudagraph" not in runner.layers_applied  # a CPU captures nothing
    cuda = SimpleNamespace(device=torch.device("cuda"), config=runner.config)
    assert layer.applies(cuda) and not layer.applies(runner)
    assert not layer.applies(SimpleNamespace(device=cuda.device, config=EngineConfig(enforce_eager=True)))


def _captured(llm, monkeypatch):
    """The runner of `llm` with the graph layer captured on a CPU (each graph an EagerReplay)."""
    monkeypatch.setattr(DecodeCudaGraphs, "capture", lambda self, body: EagerReplay(body))
    runner = llm.engine.model_runner
    runner.cudagraphs = capture_cudagraphs(runner)
    return runner


def test_padded_static_buffer_decode_matches_transformers(qwen3_ckpt, hf_greedy, monkeypatch):
    llm = LLM(qwen3_ckpt, max_model_len=128, max_num_seqs=6, mixed_cudagraph_sizes=())
    runner = _captured(llm, monkeypatch)
    [decode] = runner.cudagraphs
    assert sorted(decode.graphs) == [1, 2, 4, 6]
    prompts = random_prompts(30, [40, 3, 70, 9, 22])  # 5 requests decode in the graph of 6 (1 padded row)
    max_tokens = [12, 30, 5, 20, 16]  # as they finish the batch shrinks through the graphs of 4, 2, 1
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
                        use_tqdm=False)
    for p, n, o in zip(prompts, max_tokens, outs):
        assert o.token_ids == hf_greedy(qwen3_ckpt, p, n)
    used = {bs for bs, g in decode.graphs.items() if g.replays}
    assert used == {1, 2, 4, 6}, used


def test_small_decode_graphs_take_the_greedy_argmax(qwen3_ckpt, hf_greedy, monkeypatch):
    """With the fused sampling layer, the decode graphs of up to GREEDY_IN_GRAPH rows take each row's argmax:
    a greedy step of such a batch launches no argmax after its graph, a larger batch's does, and the tokens
    are transformers' either way."""
    from nano_vllm.layers import fused_sampling
    from nano_vllm.layers.cudagraph import GREEDY_IN_GRAPH

    llm = LLM(qwen3_ckpt, max_model_len=128, max_num_seqs=12, mixed_cudagraph_sizes=(), fused_sampling=True)
    runner = _captured(llm, monkeypatch)
    [decode] = runner.cudagraphs
    assert GREEDY_IN_GRAPH == 8 and decode.takes_greedy(8) and not decode.takes_greedy(12)
    eager = []
    launch = fused_sampling.greedy_tokens
    monkeypatch.setattr(fused_sampling, "greedy_tokens", lambda logits: eager.append(len(logits)) or launch(logits))
    prompts = random_prompts(33, [9] * 10)
    max_tokens = [3, 4, 5, 6, 7, 8, 9, 10, 11, 14]  # the batch shrinks from 10 (graph 12) through 8 and below
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
                        use_tqdm=False)
    for p, n, o in zip(prompts, max_tokens, outs):
        assert o.token_ids == hf_greedy(qwen3_ckpt, p, n)
    assert eager and min(eager) > GREEDY_IN_GRAPH  # the prefill and the steps of 9 and 10 rows only
    assert {bs for bs, g in decode.graphs.items() if g.replays} == {1, 2, 4, 8, 12}
    # a step that samples still draws: the graph's argmax is not its tokens
    sampled = llm.generate(prompts[:1], SamplingParams(temperature=5.0, max_tokens=8, seed=1), use_tqdm=False)
    assert len(set(sampled[0].token_ids)) > 1


def test_padded_mixed_step_graphs_match_transformers(qwen3_ckpt, hf_greedy, monkeypatch):
    """Every step replays a graph: prefill chunks, prefix-cache hits and decodes mixed with prefills in the
    mixed graphs of 8 and 32 tokens (padded tokens, empty sequences up to max_num_seqs), decodes alone in
    the decode graphs."""
    llm = LLM(qwen3_ckpt, max_model_len=128, max_num_seqs=6, max_num_batched_tokens=32,
              mixed_cudagraph_sizes=[32, 8, 8])
    runner = _captured(llm, monkeypatch)
    decode, mixed = runner.cudagraphs
    assert isinstance(decode, DecodeCudaGraphs) and isinstance(mixed, MixedStepGraphs)
    assert sorted(mixed.graphs) == [8, 32]

    def no_eager_step(inputs):
        raise AssertionError(f"an eager step: {len(inputs.token_ids)} tokens, decode={inputs.is_decode}")

    monkeypatch.setattr(runner, "forward", no_eager_step)
    base = random_prompts(31, [40, 3, 70, 9, 22])
    prompts = [*base, [*base[0][:35], 5, 6, 7]]  # the last shares 2 full blocks with the first: a cache hit
    max_tokens = [12, 30, 5, 20, 16, 9]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
                        use_tqdm=False)
    short = random_prompts(32, [5])[0]  # alone: a 5-token prefill in the graph of 8
    outs += llm.generate([short], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    for p, n, o in zip([*prompts, short], [*max_tokens, 4], outs):
        assert o.token_ids == hf_greedy(qwen3_ckpt, p, n)
    assert {n for n, g in mixed.graphs.items() if g.replays} == {8, 32}
    assert sum(o.num_cached_tokens for o in outs) >= 32
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("sizes", [[0], [33], ["8"], 8])
def test_mixed_cudagraph_sizes_are_checked(sizes):
    with pytest.raises(ValueError, match="mixed_cudagraph_sizes"):
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, mixed_cudagraph_sizes=sizes)
