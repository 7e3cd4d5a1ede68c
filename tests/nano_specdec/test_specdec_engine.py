"""nano_specdec in nano_vllm's engine: greedy output equals the plain engine's, token for token, with each
drafter (prompt lookup, a small draft model, the target as its own draft) — through stop strings, stop
tokens inside accepted drafts, max_tokens, preemption, prefix-cache hits on blocks filled by accepted
drafts, chunked prefill; every KV block (the target's and the draft's) free after finishing and after an
abort; drafts accepted where they should be; bad speculative configs fail at construction."""

from __future__ import annotations

import pytest
import torch
from specdec_checkpoints import random_prompts

from nano_specdec import LLM, NgramProposer, SpecDecodeEngine
from nano_vllm import LLM as PlainLLM
from nano_vllm import EngineConfig, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3
ARGS = dict(device="cpu", num_kv_blocks=256, max_num_seqs=8, max_model_len=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def spec_config(method: str, draft: str | None = None, k: int = K) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    return {"method": "draft_model", "num_speculative_tokens": k, "model": draft}


@pytest.fixture(params=["ngram", "near_draft", "small_draft", "self_draft"])
def method(request, target):
    """(name, speculative_config) of each drafter: prompt lookup; draft models that agree with the
    target sometimes, almost never, and always."""
    name = request.param
    if name == "ngram":
        return name, spec_config("ngram")
    draft = target if name == "self_draft" else request.getfixturevalue(name)
    return name, spec_config("draft_model", draft)


def plain(target: str, prompts, params, **args) -> list:
    return PlainLLM(target, **{**ARGS, **args}).generate(prompts, params, use_tqdm=False)


def assert_all_free(llm: LLM) -> None:
    engine = llm.engine
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    if hasattr(engine.proposer, "block_manager"):
        dbm = engine.proposer.block_manager
        assert dbm.num_free_blocks == dbm.num_blocks and not engine.proposer.seqs
    assert not engine.scheduler.running and not engine.scheduler.waiting


def same(a: list, b: list) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.outputs[0].finish_reason for o in a] == [o.outputs[0].finish_reason for o in b]
    assert [o.text for o in a] == [o.text for o in b]


# --------------------------------------------------------------------------- greedy equals plain
def test_greedy_equals_the_plain_engine_and_transformers(target, method):
    prompts = random_prompts(0, [5, 19, 33, 8])
    prompts.append(prompts[1][:6] * 4)  # repetitive: prompt lookup finds matches
    llm = LLM(target, speculative_config=method[1], **ARGS)
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    same(got, plain(target, prompts, GREEDY))
    assert_all_free(llm)
    assert llm.engine.num_draft_tokens > 0
    if method[0] in ("ngram", "near_draft", "self_draft"):
        assert llm.engine.num_accepted_tokens > 0
    hf = pytest.importorskip("transformers").AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        ids = torch.tensor([prompts[0]])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                           min_new_tokens=24, do_sample=False, pad_token_id=0)
    assert got[0].token_ids == want[0, len(prompts[0]):].tolist()


def test_stop_conditions_inside_drafts(target, method):
    """A stop token id inside an accepted draft, a stop string, max_tokens mid-draft (a max_tokens that
    is no multiple of k + 1), and the stop text included: the same tokens, text and reasons."""
    prompts = random_prompts(1, [7, 12, 21])
    ref = plain(target, prompts, GREEDY)
    stop_id = ref[0].token_ids[9]  # the 10th output token of the first prompt
    text = ref[1].text
    stop_str = text[len(text) // 2 : len(text) // 2 + 3]
    cases = [SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
             SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_str]),
             SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_str],
                            include_stop_str_in_output=True),
             SamplingParams(temperature=0.0, max_tokens=11)]
    llm = LLM(target, speculative_config=method[1], **ARGS)
    for params in cases:
        got = llm.generate(prompts, params, use_tqdm=False)
        same(got, plain(target, prompts, params))
        assert_all_free(llm)
    assert got[0].outputs[0].finish_reason == "length" and len(got[0].token_ids) == 11


def test_preemption_with_a_tiny_kv_pool(target, method):
    prompts = random_prompts(2, [40, 35, 44, 30])
    args = dict(num_kv_blocks=12, max_num_seqs=4, max_model_len=96)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    llm = LLM(target, speculative_config=method[1], **{**ARGS, **args})
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    same(got, plain(target, prompts, params, **args))
    assert_all_free(llm)


def test_prefix_cache_hits_blocks_filled_by_accepted_drafts(target, method):
    """A second request whose prompt is the first one's prompt and output hits the blocks that
    verification filled (hashed only with accepted tokens): its output is still the plain engine's."""
    first = random_prompts(3, [20])
    llm = LLM(target, speculative_config=method[1], **ARGS)
    out = llm.generate(first, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    again = [first[0] + out[0].token_ids]
    seq = llm.engine.add_request(again[0], GREEDY)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert seq.num_cached_tokens >= 48  # three full blocks of 16 came from the cache
    assert seq.output_token_ids == plain(target, again, GREEDY)[0].token_ids
    # a fully cached prompt (two blocks): its last token is recomputed with the first drafts after it
    whole = [random_prompts(9, [10])[0] * 3 + [5, 6]]
    want = plain(target, whole, GREEDY)[0].token_ids
    assert llm.generate(whole, GREEDY, use_tqdm=False)[0].token_ids == want
    seq = llm.engine.add_request(whole[0], GREEDY)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert seq.num_cached_tokens == 32 and seq.output_token_ids == want
    assert_all_free(llm)


def test_chunked_prefill_mixed_with_verification(target, method):
    prompts = random_prompts(4, [60, 9, 45, 70])
    args = dict(max_num_batched_tokens=16, max_num_seqs=4)
    llm = LLM(target, speculative_config=method[1], **{**ARGS, **args})
    engine = llm.engine
    seqs = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    for _ in range(5):  # the short prompt decodes with drafts while the long one is prefilled
        engine.step()
    seqs += [engine.add_request(p, GREEDY) for p in prompts[2:]]
    bm = engine.block_manager
    while engine.has_unfinished_requests():
        engine.step()
        for s in engine.scheduler.running:  # rejected slots given back: no block past the tokens
            assert len(s.block_table) <= bm.blocks_for(s.num_tokens)
            assert s.num_computed_tokens <= s.num_tokens - 1 or s.num_computed_tokens == 0
    assert [s.output_token_ids for s in seqs] == [o.token_ids for o in
                                                  plain(target, prompts, GREEDY, **args)]
    assert_all_free(llm)


def test_abort_mid_generation_frees_every_block(target, method):
    llm = LLM(target, speculative_config=method[1], **ARGS)
    engine = llm.engine
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=100))
            for p in random_prompts(5, [30, 17, 50])]
    for _ in range(6):
        engine.step()
    assert all(s.num_output_tokens > 0 for s in seqs)
    for s in seqs:
        assert engine.abort_request(s.request_id)
    assert_all_free(llm)


# --------------------------------------------------------------------------- acceptance
def test_ngram_accepts_drafts_on_a_repetitive_prompt(target):
    prompt = random_prompts(6, [10])[0] * 5
    llm = LLM(target, speculative_config=spec_config("ngram"), **ARGS)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
    engine = llm.engine
    assert engine.num_accepted_tokens > 0
    assert engine.num_steps < 48  # one prefill step, then fewer verifications than tokens
    assert out[0].token_ids == plain(target, [prompt], SamplingParams(temperature=0.0,
                                                                      max_tokens=48))[0].token_ids


def test_the_target_as_its_own_draft_accepts_everything(target):
    llm = LLM(target, speculative_config=spec_config("draft_model", target, k=4), **ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=41)  # 1 + 8 verifications of 5 tokens
    out = llm.generate(random_prompts(7, [12, 25]), params, use_tqdm=False)
    stats = llm.engine.spec_decode_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens == 2 * 8 * 4
    assert stats.accepted_by_position == [16, 16, 16, 16]
    assert stats.mean_tokens_per_verification == 5.0
    assert llm.engine.num_steps == 1 + 8
    same(out, plain(target, random_prompts(7, [12, 25]), params))


def test_ngram_lookup_is_the_first_longest_match():
    class S:
        seq_id = 0

    proposer, seq = NgramProposer(1, 3), S()
    seq.token_ids = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert proposer.lookup(seq, 2) == [9, 1]  # "1 2 3" first seen before 9 1
    seq.token_ids += [7, 4, 2]  # "2" alone: its first occurrence is followed by 3 9 1
    assert proposer.lookup(seq, 3) == [3, 9, 1]
    seq.token_ids += [6]  # no match at all
    assert proposer.lookup(seq, 3) == []
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # the incremental index against a brute-force search
        seq.seq_id += 1
        seq.token_ids = []
        for _ in range(8):
            seq.token_ids += torch.randint(0, 4, (5,), generator=g).tolist()
            assert proposer.lookup(seq, 4) == brute_force(seq.token_ids, 1, 3, 4)


def brute_force(ids: list[int], lo: int, hi: int, k: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        for start in range(len(ids) - n):
            if len(ids) >= n and ids[start : start + n] == ids[-n:]:
                return ids[start + n : start + n + k]
    return []


def test_disable_by_batch_size_drafts_only_small_batches(target):
    """vLLM's disable_by_batch_size: while more sequences decode together than it says, steps run
    without drafts; once the batch shrinks to it, drafting resumes. Tokens are the plain engine's."""
    prompts = random_prompts(15, [9, 14, 6])
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (40, 6, 8)]
    config = {**spec_config("draft_model", target), "disable_by_batch_size": 1}
    llm = LLM(target, speculative_config=config, **ARGS)
    seen = []
    propose = llm.engine.proposer.propose

    def record(seqs, ks):
        seen.append(len(seqs))
        return propose(seqs, ks)

    llm.engine.proposer.propose = record
    same(llm.generate(prompts, params, use_tqdm=False), plain(target, prompts, params))
    assert seen and set(seen) == {1}  # only the long request, once it decodes alone
    assert llm.engine.num_draft_tokens > 0
    assert_all_free(llm)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("config, error, match", [
    ({"method": "eagle9", "num_speculative_tokens": 2}, ValueError, "unknown method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, ValueError, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, TypeError, "lookahead"),
    ({"method": "ngram"}, TypeError, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, ValueError,
     "disable_by_batch_size"),
    ("ngram", TypeError, "must be a dict"),
])
def test_bad_speculative_configs_fail_at_construction(target, config, error, match):
    with pytest.raises(error, match=match):
        LLM(target, speculative_config=config, **ARGS)


def test_a_draft_with_another_vocabulary_fails_before_anything_loads(target, other_vocab):
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens.*4096"):
        SpecDecodeEngine(EngineConfig(model=target, **ARGS), spec_config("draft_model", other_vocab))
    with pytest.raises(TypeError, match="needs speculative_config"):
        LLM(target, **ARGS)


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("mixed", [(), (16, 64), None])
def test_cuda_greedy_equals_the_plain_engine(target, method, mixed):
    """With the performance layers nano_vllm runs on CUDA (decode graphs, the warm-up, and mixed-step
    graphs that the verify steps fit where `mixed` captures them; None: the default sizes, k + 1 times
    each decode batch size), fp32: the plain engine's tokens."""
    args = dict(device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_seqs=4,
                max_num_batched_tokens=64, mixed_cudagraph_sizes=mixed)
    prompts = random_prompts(8, [5, 19, 33, 8])
    llm = LLM(target, speculative_config=method[1], **args)
    assert "cudagraph" in llm.engine.layers_applied
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    same(got, PlainLLM(target, **args).generate(prompts, GREEDY, use_tqdm=False))
    assert_all_free(llm)
