"""The CUDA-graph decode path's bookkeeping, on a CPU: static buffers, padding to the captured batch
size, block-table columns left stale from earlier steps. A stand-in "graph" replays the same eager
computation on the static buffers, so everything but the capture itself runs and is compared with
transformers."""

from __future__ import annotations

from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams
from nano_vllm.model_runner import ModelRunner, cudagraph_batch_sizes


class EagerReplay:
    def __init__(self, runner: ModelRunner, bs: int, ctx):
        self.runner, self.bs, self.ctx = runner, bs, ctx
        self.replays = 0

    def replay(self) -> None:
        r = self.runner
        r.g_logits[: self.bs] = r._decode_logits(r.g_ids[: self.bs], r.g_positions[: self.bs], self.ctx)
        self.replays += 1


def test_batch_size_ladder():
    assert cudagraph_batch_sizes(1) == [1]
    assert cudagraph_batch_sizes(6) == [1, 2, 4, 6]
    assert cudagraph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert cudagraph_batch_sizes(512)[-3:] == [480, 496, 512]


def test_padded_static_buffer_decode_matches_transformers(qwen3_ckpt, hf_greedy, monkeypatch):
    monkeypatch.setattr(ModelRunner, "_capture", lambda self, bs, ctx: EagerReplay(self, bs, ctx))
    llm = LLM(qwen3_ckpt, max_model_len=128, max_num_seqs=6)
    runner = llm.engine.model_runner
    runner.capture_cudagraphs()
    assert sorted(runner.graphs) == [1, 2, 4, 6]
    prompts = random_prompts(30, [40, 3, 70, 9, 22])  # 5 requests decode in the graph of 6 (1 padded row)
    max_tokens = [12, 30, 5, 20, 16]  # as they finish the batch shrinks through the graphs of 4, 2, 1
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
                        use_tqdm=False)
    for p, n, o in zip(prompts, max_tokens, outs):
        assert o.token_ids == hf_greedy(qwen3_ckpt, p, n)
    used = {bs for bs, g in runner.graphs.items() if g.replays}
    assert used == {1, 2, 4, 6}, used
