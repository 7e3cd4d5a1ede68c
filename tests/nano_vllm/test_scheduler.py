"""The scheduler (§4.5 and continuous batching) without a model: a brute-force KV model checks every step."""

from __future__ import annotations

import random

from kv_model import KVModel

from nano_vllm.block_manager import BlockManager
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.scheduler import Scheduler, SchedulerConfig
from nano_vllm.sequence import Sequence, SequenceStatus


def _run_step(sched: Scheduler, kv: KVModel, rng: random.Random):
    out = sched.schedule()
    kv.copy(out.copies)
    for seq, n in zip(out.seqs, out.num_new_tokens):  # every layer writes all K/V first ...
        kv.write(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
    for seq, n in zip(out.seqs, out.num_new_tokens):  # ... then attention reads
        kv.check_reads(seq, seq.num_computed_tokens + n)
    sampled = [rng.randrange(3) for s in out.samples if s]
    return out, sched.postprocess(out, sampled)


def test_random_workload_against_brute_force():
    rng = random.Random(0)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=24)
    bm = BlockManager(num_blocks=10, block_size=4)
    sched, kv = Scheduler(cfg, bm), KVModel(bm)
    bases = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    requests, finished, steps = [], [], 0
    while len(requests) < 150 or sched.has_unfinished():
        if len(requests) < 150 and rng.random() < 0.5:
            prompt = rng.choice(bases) + [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
            seq = Sequence(prompt, SamplingParams(max_tokens=rng.randrange(1, 10)))
            sched.add(seq)
            requests.append(seq)
        if sched.running and rng.random() < 0.03:  # a client goes away
            victim = rng.choice(sched.running + sched.waiting)
            assert sched.abort(victim.request_id) is victim and victim.finish_reason == "abort"
        out, done = _run_step(sched, kv, rng)
        finished += done
        steps += 1
        assert out.num_tokens <= cfg.max_num_batched_tokens and len(sched.running) <= cfg.max_num_seqs
        assert all(not s.block_table for s in sched.waiting)
        assert sched.waiting == sorted(sched.waiting, key=lambda s: s.seq_id)
        kv.check_invariants(sched.running)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.pool.ref_counts)
    for seq in requests:
        assert seq.is_finished
        if seq.finish_reason != "abort":
            want = min(seq.sampling_params.max_tokens, cfg.max_model_len - seq.num_prompt_tokens)
            assert seq.num_output_tokens == want
    assert sched.num_preemptions > 5 and any(s.num_cached_tokens for s in requests), steps


def test_identical_prompts_in_one_step_share_blocks():
    bm = BlockManager(num_blocks=16, block_size=16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=128), bm)
    prompt = list(range(40))
    a, b = Sequence(prompt), Sequence(prompt)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a, b] and out.num_new_tokens == [40, 8]  # b reuses a's two full blocks
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 32 and bm.num_free_blocks == 16 - 4


def test_fully_cached_prompt_schedules_its_last_token():
    bm = BlockManager(num_blocks=16, block_size=16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=128), bm)
    first = Sequence(list(range(32)), SamplingParams(max_tokens=1))
    sched.add(first)
    out = sched.schedule()
    sched.postprocess(out, [7])
    assert first.is_finished
    again = Sequence(list(range(32)))
    sched.add(again)
    out = sched.schedule()
    assert out.num_new_tokens == [1] and out.samples == [True]
    assert again.num_computed_tokens == 31 and again.num_cached_tokens == 32
    assert again.block_table == first_blocks(bm, 2)


def first_blocks(bm: BlockManager, n: int) -> list[int]:
    return bm.match_prefix(Sequence(list(range(16 * n))))


def test_decodes_first_then_chunks_and_budget():
    bm = BlockManager(num_blocks=32, block_size=16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=128), bm)
    short = Sequence([1, 2, 3], SamplingParams(max_tokens=5))
    sched.add(short)
    out = sched.schedule()
    sched.postprocess(out, [4])
    long_ = Sequence(list(range(100, 130)), SamplingParams(max_tokens=5))
    sched.add(long_)
    out = sched.schedule()  # the decode of `short`, then 9 tokens of the new prompt
    assert out.seqs == [short, long_] and out.num_new_tokens == [1, 9] and out.samples == [True, False]
    sched.postprocess(out, [5])
    out = sched.schedule()
    assert out.seqs == [short, long_] and out.num_new_tokens == [1, 9]


def test_preemption_latest_first_and_resume_in_arrival_order():
    bm = BlockManager(num_blocks=4, block_size=16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), bm)
    seqs = [Sequence([i] * 16, SamplingParams(max_tokens=40)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()  # three 16-token prompts: three full blocks, one left
    assert out.seqs == seqs
    sched.postprocess(out, [1, 1, 1])
    out = sched.schedule()  # each decode needs a new block: seq 0 takes the last one, seq 1 preempts seq 2
    assert out.seqs == seqs[:2] and out.num_preempted == 1
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].block_table == []
    sched.postprocess(out, [2, 2])
    # seq 1 preempted too once memory is short again; the waiting queue stays in arrival order
    sched._preempt(seqs[1])
    assert [s.seq_id for s in sched.waiting] == [seqs[1].seq_id, seqs[2].seq_id]
    out = sched.schedule()
    assert out.seqs[0] is seqs[0] and seqs[1] in out.seqs  # resumes first, recomputing prompt + outputs
    # ... except its first block, still in the prefix cache: 16 tokens cached, 2 recomputed
    assert out.num_new_tokens[out.seqs.index(seqs[1])] == 2 and seqs[1].num_cached_tokens == 16
