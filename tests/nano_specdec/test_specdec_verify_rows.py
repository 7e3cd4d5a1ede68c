"""A verify step's draft chains go through the decode kernel, a row at a time (nano_vllm's
`ModelRunner.prepare`, `StepInputs.decode_rows`): the varlen kernel's 128-row query tiles would make a
k + 1 row chain pay a whole tile's pass over its context. Same logits as the varlen kernel's, on a CPU
(the kernels' torch references)."""

from __future__ import annotations

import torch

from nano_specdec.bench.cost import CostSeq, make_runner
from nano_vllm.config import EngineConfig
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
