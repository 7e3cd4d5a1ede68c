"""Medusa's heads and EAGLE's draft layer in nano_vllm's engine, with drafts trained by nano_specdec.train
on the cycle target: the engine tests of test_specdec_engine.py run again with each (greedy output equals
the plain engine's through stop strings, stop tokens inside accepted drafts, max_tokens mid-draft,
preemption, prefix-cache hits, chunked prefill; every block free after finishing and after an abort);
the hidden states the drafters receive are the target's own; trained drafts are accepted; sampled
requests run the exact rule on the draft's q; EAGLE-2's tree knobs and bad drafts are errors at
construction."""

from __future__ import annotations

import pytest
import torch
from specdec_checkpoints import random_prompts
from test_specdec_engine import (  # noqa: F401  (run again here with Medusa and EAGLE)
    ARGS,
    GREEDY,
    assert_all_free,
    plain,
    test_abort_mid_generation_frees_every_block,
    test_chunked_prefill_mixed_with_verification,
    test_cuda_greedy_equals_the_plain_engine,
    test_greedy_equals_the_plain_engine_and_transformers,
    test_preemption_with_a_tiny_kv_pool,
    test_prefix_cache_hits_blocks_filled_by_accepted_drafts,
    test_stop_conditions_inside_drafts,
)

from nano_specdec import LLM, SpecDecodeEngine
from nano_vllm import EngineConfig, SamplingParams
from nano_vllm.layers.cudagraph import EagerReplay

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3


def spec(method: str, drafts: dict, k: int = K, **knobs) -> dict:
    return {"method": method, "model": drafts[method][0], "num_speculative_tokens": k, **knobs}


@pytest.fixture
def target(cycle_target):
    """The engine tests' target, here the one the drafts were trained for."""
    return cycle_target


@pytest.fixture(params=["medusa", "eagle"])
def method(request, trained_drafts):
    return request.param, spec(request.param, trained_drafts)


# --------------------------------------------------------------------------- in the engine
def test_trained_drafts_are_accepted_and_rejected(cycle_target, method):
    """Random prompts: drafts are rejected while the target enters its cycle, accepted after."""
    llm = LLM(cycle_target, speculative_config=method[1], **ARGS)
    prompts = random_prompts(11, [6, 20, 9])
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
    stats = llm.engine.spec_decode_stats
    assert stats.mean_tokens_per_verification > 2.0
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert [o.token_ids for o in got] == [o.token_ids for o in plain(
        cycle_target, prompts, SamplingParams(temperature=0.0, max_tokens=30))]
    assert_all_free(llm)
    assert not getattr(llm.engine.proposer, "last", {})  # Medusa's features, released


def test_abort_forgets_the_drafters_state(cycle_target, method):
    llm = LLM(cycle_target, speculative_config=method[1], **ARGS)
    engine = llm.engine
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=60))
            for p in random_prompts(17, [25, 9, 40])]
    for _ in range(4):
        engine.step()
    state = getattr(engine.proposer, "last", None) or engine.proposer.seqs
    assert len(state) == 3 and engine.num_draft_tokens > 0
    for s in seqs:
        assert engine.abort_request(s.request_id)
    assert not state
    assert_all_free(llm)


def test_the_drafters_receive_the_targets_hidden_states(cycle_target, method):
    """Every position's feature handed to the proposer (prefill rows, plain decodes, the accepted rows
    of each verification) equals the target's last hidden state there, recomputed from scratch."""
    from shared.checkpoint import load_model

    llm = LLM(cycle_target, speculative_config=method[1], **{**ARGS, "max_num_batched_tokens": 24})
    proposer, seen = llm.engine.proposer, {}
    observe = proposer.observe

    def record(seq, start, hidden):
        for i, row in enumerate(hidden):
            seen.setdefault(seq.seq_id, {})[start + i] = row.clone()
        observe(seq, start, hidden)

    proposer.observe = record
    prompts = random_prompts(12, [30, 7])
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    model = load_model(cycle_target).eval()
    for (_, rows), p, o in zip(sorted(seen.items()), prompts, out):
        ids = torch.tensor([p + o.token_ids])
        with torch.no_grad():
            want = model.model(ids)[0]
        assert sorted(rows) == list(range(len(p) + len(o.token_ids) - 1))  # each position, once
        got = torch.stack([rows[i] for i in sorted(rows)])
        torch.testing.assert_close(got, want[: len(got)], rtol=1e-4, atol=1e-4)
    assert llm.engine.num_accepted_tokens > 0


def test_sampled_requests_verify_the_drafts_q_and_repeat_with_a_seed(cycle_target, method):
    """Temperature 0.8: Medusa's chain is one-hot (its q is None), EAGLE's is drawn from its q; the
    exact rule runs on either (it checks q gives each draft mass) and a seed repeats the output."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=3)
    prompts = random_prompts(13, [9, 14])
    runs = []
    for _ in range(2):
        llm = LLM(cycle_target, speculative_config=method[1], **ARGS)
        runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.num_draft_tokens > 0
        assert_all_free(llm)
    assert runs[0] == runs[1]


def test_eagle_drafts_follow_the_request_sampling(cycle_target, trained_drafts):
    """EAGLE's q is the draft's distribution after the request's temperature and top-k (one token at
    top_k=1, so the draw is the argmax); a greedy request records no q."""
    llm = LLM(cycle_target, speculative_config=spec("eagle", trained_drafts), **ARGS)
    engine = llm.engine
    seqs = [engine.add_request(p, SamplingParams(temperature=0.7, top_k=1, max_tokens=12, seed=1))
            for p in random_prompts(14, [10])]
    seqs.append(engine.add_request(random_prompts(15, [10])[0], GREEDY))
    engine.step()  # the prefill
    drafts, probs = engine.proposer.propose(seqs, [K, K])
    assert probs[1] is None and len(drafts[1]) == K
    assert probs[0].shape == (K, 4096)
    assert (probs[0].max(-1).values == 1).all()
    assert probs[0].argmax(-1).tolist() == drafts[0]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("knobs, match", [
    ({"eagle_topk": 4}, "eagle_topk"),
    ({"num_draft_tokens": 8}, "num_draft_tokens"),
    ({"num_steps": 5}, "num_steps"),
    ({"eagle_topk": 0}, "eagle_topk must be an int >= 1"),
])
def test_eagle2_tree_knobs_name_what_the_engine_cannot_run(cycle_target, trained_drafts, knobs, match):
    with pytest.raises(ValueError, match=match):
        LLM(cycle_target, speculative_config=spec("eagle", trained_drafts, **knobs), **ARGS)


def test_a_chain_spelled_with_sglangs_knobs_runs(cycle_target, trained_drafts):
    config = spec("eagle", trained_drafts, num_steps=K, eagle_topk=1, num_draft_tokens=K + 1)
    llm = LLM(cycle_target, speculative_config=config, **ARGS)
    out = llm.generate(random_prompts(16, [8]), GREEDY, use_tqdm=False)
    assert out[0].token_ids == plain(cycle_target, random_prompts(16, [8]), GREEDY)[0].token_ids


def test_a_draft_of_another_kind_or_shape_fails_at_construction(cycle_target, trained_drafts,
                                                                 tmp_path):
    eagle, medusa = trained_drafts["eagle"][0], trained_drafts["medusa"][0]
    with pytest.raises(ValueError, match="draft for method 'eagle'.*not 'medusa'"):
        SpecDecodeEngine(EngineConfig(model=cycle_target, **ARGS),
                         {"method": "medusa", "num_speculative_tokens": 2, "model": eagle})
    with pytest.raises(ValueError, match="draft for method 'draft_model'.*not 'eagle'"):
        LLM(cycle_target, speculative_config={"method": "eagle", "num_speculative_tokens": 2,
                                              "model": cycle_target}, **ARGS)
    with pytest.raises(ValueError, match="draft for method 'medusa'.*not 'draft_model'"):
        LLM(cycle_target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                              "model": medusa}, **ARGS)
    with pytest.raises(ValueError, match="exceeds the 3 Medusa heads"):
        LLM(cycle_target, speculative_config=spec("medusa", trained_drafts, k=4), **ARGS)
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(cycle_target, speculative_config={"method": "eagle", "num_speculative_tokens": 2}, **ARGS)
    # heads trained for a target of another hidden size
    import json
    import shutil

    other = tmp_path / "medusa_wide"
    shutil.copytree(medusa, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    with pytest.raises(ValueError, match="hidden states of size 128, the target's are 64"):
        LLM(cycle_target, speculative_config={"method": "medusa", "num_speculative_tokens": 2,
                                              "model": str(other)}, **ARGS)


def test_graph_steps_hand_over_hidden_states_and_draft(cycle_target, method, monkeypatch):
    """nano_vllm's CUDA-graph bookkeeping on a CPU, each graph an eager replay of its body: every target
    step replays a graph (prefill chunks and verifications in the mixed-step graphs of the default
    sizes, k + 1 times each batch size; plain decodes in the decode graphs), the hidden states reach the
    drafter from the graphs' buffer, EAGLE's draft decodes replay its own graphs; tokens and τ are the
    eager engine's."""
    from nano_vllm.layers.cudagraph import DecodeCudaGraphs, capture_cudagraphs

    args = {**ARGS, "max_num_batched_tokens": 32}
    prompts = random_prompts(13, [30, 7, 12])
    eager = LLM(cycle_target, speculative_config=method[1], **args)
    want = [o.token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    monkeypatch.setattr(DecodeCudaGraphs, "capture", lambda self, body: EagerReplay(body))
    llm = LLM(cycle_target, speculative_config=method[1], **args)
    target = llm.engine.model_runner
    runners = [target] + ([llm.engine.proposer.runner] if method[0] == "eagle" else [])
    for runner in runners:
        runner.cudagraphs = capture_cudagraphs(runner)
    mixed = target.cudagraphs[1]
    assert sorted(mixed.graphs) == [K + 1, 2 * (K + 1), 4 * (K + 1), 8 * (K + 1)]

    def no_eager_step(inputs):
        raise AssertionError(f"an eager target step: {len(inputs.token_ids)} tokens")

    monkeypatch.setattr(target, "forward", no_eager_step)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    assert llm.engine.spec_decode_stats.mean_tokens_per_verification == \
        eager.engine.spec_decode_stats.mean_tokens_per_verification > 2.0
    assert any(g.replays for n, g in mixed.graphs.items() if n <= K + 1)  # a verification alone
    if method[0] == "eagle":
        assert any(g.replays for g in runners[1].cudagraphs[0].graphs.values())
    assert_all_free(llm)


@pytest.mark.parametrize("kind", ["eagle", "draft_model"])
def test_draft_chain_gives_the_loops_drafts(cycle_target, trained_drafts, kind, monkeypatch):
    """nano_specdec's draft_chain layer on a CPU stand-in for the graphs: a greedy proposal's k − 1 later
    draft forwards replay one chained graph (argmax fed back on the device, EAGLE's f̂ too), reading
    the drafts once; tokens, τ and the drafts' acceptance are the loop's, and every block is free after.
    A sampled request, and a proposal cut short by max_tokens, take the loop."""
    from nano_specdec.layers.draft_chain import install_draft_chain
    from nano_vllm.layers.cudagraph import DecodeCudaGraphs, capture_cudagraphs

    args = {**ARGS, "max_num_batched_tokens": 64}
    prompts = random_prompts(14, [30, 7, 12])
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=9)]
    eager = LLM(cycle_target, speculative_config=spec(kind, trained_drafts), **args)
    want = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(DecodeCudaGraphs, "capture", lambda self, body: EagerReplay(body))
    llm = LLM(cycle_target, speculative_config=spec(kind, trained_drafts), **args)
    proposer = llm.engine.proposer
    proposer.runner.cudagraphs = capture_cudagraphs(proposer.runner)
    install_draft_chain(llm.engine)
    assert proposer.chain.steps == K - 1
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats, ref = llm.engine.spec_decode_stats, eager.engine.spec_decode_stats
    assert stats.accepted_by_position == ref.accepted_by_position and stats.num_draft_tokens == ref.num_draft_tokens
    assert stats.mean_tokens_per_verification > 2.0
    assert sum(g.replays for g in proposer.chain.graphs.values()) > 0
    assert_all_free(llm)
    sampled = SamplingParams(temperature=0.8, max_tokens=12, seed=3)
    a = llm.generate(prompts[:1], sampled, use_tqdm=False)[0].token_ids
    assert a == eager.generate(prompts[:1], sampled, use_tqdm=False)[0].token_ids
