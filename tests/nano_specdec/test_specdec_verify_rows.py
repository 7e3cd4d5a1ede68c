"""A verify step's draft chains go through the decode kernel, a row at a time (nano_vllm's
`ModelRunner.prepare`, `StepInputs.decode_rows`): the varlen kernel's 128-row query tiles would make a
k + 1 row chain pay a whole tile's pass over its context. Same logits as the varlen kernel's, on a CPU
(the kernels' torch references)."""

from __future__ import annotations

import torch
from specdec_checkpoints import random_prompts

from nano_specdec import LLM
from nano_specdec.bench.cost import CostSeq, make_runner
from nano_vllm import LLM as PlainLLM
from nano_vllm import SamplingParams
from nano_vllm.config import EngineConfig
from nano_vllm.layers.cudagraph import DecodeCudaGraphs, EagerReplay, capture_cudagraphs
from nano_vllm.model_runner import StepInputs
from nano_vllm.scheduler import SchedulerOutput


def test_decode_rows_give_each_row_its_key_count_and_sequence():
    inputs = StepInputs(token_ids=[0] * 16, positions=[0] * 16, slot_mapping=[0] * 16,
                        cu_seqlens_q=[0, 1, 4, 6, 16], cu_seqlens_k=[0, 10, 30, 37, 60],
                        block_tables=[[0]] * 4, sample_rows=[], is_decode=False, num_decodes=3)
    # sequence 1 holds 20 keys after its 3 rows: they see 18, 19 and 20 of them
    assert inputs.decode_rows == ([10, 18, 19, 20, 6, 7], [0, 1, 1, 1, 2, 2])
    assert inputs.cu_seqlens_q_attn == [6, 6, 6, 6, 16]  # the varlen kernel sees only the last one


def test_chains_through_the_decode_kernel_give_the_varlen_kernels_logits():
    base = EngineConfig(model="tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=64)
    per_seq = 6  # blocks of 16 tokens
    verifier = make_runner(base, "tiny", 4, per_seq, per_seq * 16, rows_per_seq=4)
    plain = make_runner(base, "tiny", 4, per_seq, per_seq * 16)
    # a decode, chains of 4 and 3 rows, then a prefill chunk of 9 after 20 cached tokens
    spec = [(40, 1), (33, 4), (17, 3), (20, 9)]
    seqs = [CostSeq(i, c, n, list(range(i * per_seq, (i + 1) * per_seq))) for i, (c, n) in enumerate(spec)]
    out = SchedulerOutput(seqs, [n for _, n in spec])
    got = verifier.prepare(out)
    assert got.num_decodes == 3 and plain.prepare(out).num_decodes == 1
    got.sample_rows = list(range(len(got.token_ids)))
    logits = verifier.run(got)
    got.num_decodes = 0  # every row through the varlen kernel
    want = verifier.run(got)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_verify_steps_replay_the_mixed_graphs_with_the_plain_engines_tokens(target, near_draft, monkeypatch):
    """The graph path (captured on a CPU: each graph an EagerReplay of its body) with the chains' rows in
    its decode-row buffer: greedy tokens equal the plain engine's."""
    monkeypatch.setattr(DecodeCudaGraphs, "capture", lambda self, body: EagerReplay(body))
    args = dict(device="cpu", max_model_len=128, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    config = {"method": "draft_model", "model": near_draft, "num_speculative_tokens": 3}
    llm = LLM(target, speculative_config=config, **args)
    runner = llm.engine.model_runner
    runner.cudagraphs = capture_cudagraphs(runner)
    _, mixed = runner.cudagraphs
    assert {4, 8, 16} <= set(mixed.graphs)  # k + 1 rows times each decode batch size
    chains, replay = [], mixed.replay

    def counted(inputs):  # rows of the leading sequences past one each: the drafts in the decode rows
        chains.append(inputs.cu_seqlens_q[inputs.num_decodes] - inputs.num_decodes)
        return replay(inputs)

    monkeypatch.setattr(mixed, "replay", counted)
    prompts = random_prompts(8, [5, 19, 33, 8])
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    got = llm.generate(prompts, greedy, use_tqdm=False)
    want = PlainLLM(target, **args).generate(prompts, greedy, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max(chains) >= 3 and llm.engine.num_accepted_tokens > 0
