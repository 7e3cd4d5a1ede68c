"""Stop strings, log-probabilities and parallel sampling (n) of the engine, against references nobody here
wrote: transformers' logits (fp32, CPU) for the log-probabilities, a whole-text decode cut at the first
match for the stop strings. Each on the paper path alone and with the performance layers (`layer_args`:
overlapped steps, fused sampling ...), and through the mechanisms that move a request's tokens around:
chunked prefill, preemption, the prefix cache.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from vllm_checkpoints import random_prompts

from nano_vllm import LLM, SamplingParams

# fp32 on a CPU: the engine's packed, paged attention and transformers' eager attention sum in different
# orders; log-softmax values of a 4096-token vocabulary agree to ~1e-5.
ATOL = 1e-4

CASES = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    "preemption": {"num_kv_blocks": 8},
}


def check_entry(entry: dict, token: int, row: torch.Tensor, k: int) -> None:
    """One position's {token id: Logprob} against the reference distribution `row`."""
    assert next(iter(entry)) == token  # the scored token first
    assert entry[token].logprob == pytest.approx(row[token].item(), abs=ATOL)
    assert entry[token].rank == int((row > row[token]).sum()) + 1 or abs(
        row.sort(descending=True).values[entry[token].rank - 1] - row[token]) < ATOL  # a near tie
    top = row.topk(k)
    for r, (tid, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
        if tid in entry and tid != token:
            assert entry[tid].rank == r and entry[tid].logprob == pytest.approx(lp, abs=ATOL)
    assert len(entry) in (k, k + 1) and set(top.indices.tolist()) <= set(entry)


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_equal_transformers_log_softmax(ckpt, layer_args, case, hf_logprobs):
    prompts = random_prompts(3, [1, 9, 40, 70])
    llm = LLM(ckpt, max_model_len=128, **CASES[case], **layer_args)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ref = hf_logprobs(ckpt, prompt + out.token_ids)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            check_entry(out.prompt_logprobs[i], prompt[i], ref[i - 1], 2)
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 6
        for j, token in enumerate(c.token_ids):
            check_entry(c.logprobs[j], token, ref[len(prompt) - 1 + j], 3)
            assert c.logprobs[j][token].rank == 1  # greedy: the argmax
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids)))
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_logprobs_are_raw_at_any_temperature(llama_ckpt, layer_args, hf_logprobs):
    """vLLM's default logprobs_mode: the model's log-softmax, not the temperature-scaled distribution."""
    prompt = random_prompts(4, [12])[0]
    llm = LLM(llama_ckpt, max_model_len=64, **layer_args)
    out = llm.generate([prompt], SamplingParams(temperature=0.7, top_k=50, seed=3, max_tokens=5,
                                                logprobs=0), use_tqdm=False)[0]
    ref = hf_logprobs(llama_ckpt, prompt + out.token_ids)
    for j, (entry, token) in enumerate(zip(out.outputs[0].logprobs, out.token_ids)):
        assert list(entry) == [token]  # logprobs=0: the sampled token alone
        assert entry[token].logprob == pytest.approx(ref[len(prompt) - 1 + j, token].item(), abs=ATOL)


def test_prompt_logprobs_skip_the_prefix_cache(llama_ckpt, hf_logprobs):
    """A cached token's logits are never computed: a prompt_logprobs request recomputes its prompt."""
    prompt = random_prompts(5, [48])[0]
    llm = LLM(llama_ckpt, max_model_len=64, performance_layers=False)
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # its blocks are now cached
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and all(e is not None for e in out.prompt_logprobs[1:])
    ref = hf_logprobs(llama_ckpt, prompt)
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i][prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=ATOL)


# ---------------------------------------------------------------------------------------- stop strings
def first_stop(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """The reference: (start, end, string) of the match that a reader of the growing text meets first —
    the earliest end, then the longest — or None."""
    found = [(text.find(s) + len(s), -len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    end, _, start, stop = min(found)
    return start, end, stop


def boundary_stop(llm, ids: list[int], text: str) -> str:
    """A stop string that spans a token boundary: the last 2 characters of one token's text and the first 2
    of the next's, taken where both tokens have at least 2 characters and the string is new in the text."""
    pieces = [llm.tokenizer.decode([t]) for t in ids]
    pos = 0
    for a, b in itertools.pairwise(pieces):
        pos += len(a)
        stop = a[-2:] + b[:2]
        if len(a) >= 2 and len(b) >= 2 and text[pos - 2: pos + 2] == stop and text.find(stop) == pos - 2:
            return stop
    pytest.skip("no token boundary with two characters on each side in this output")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_equal_a_whole_text_cut(llama_ckpt, layer_args, include):
    prompts = random_prompts(6, [5, 20, 33])
    llm = LLM(llama_ckpt, max_model_len=128, **layer_args)
    full = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    for prompt, ref in zip(prompts, full):
        stops = [boundary_stop(llm, ref.token_ids[5:], ref.text[len(llm.tokenizer.decode(ref.token_ids[:5])):]),
                 "\x00never\x00"]
        start, end, stop = first_stop(ref.text, stops)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, stop=stops,
                                                    include_stop_str_in_output=include), use_tqdm=False)[0]
        c = out.outputs[0]
        assert c.text == ref.text[: end if include else start]
        assert (c.finish_reason, c.stop_reason) == ("stop", stop)
        # the tokens stop at the one whose text completes the string (vLLM keeps them all)
        n = len(c.token_ids)
        assert c.token_ids == ref.token_ids[:n]
        assert stop in llm.tokenizer.decode(ref.token_ids[:n]) and stop not in llm.tokenizer.decode(
            ref.token_ids[: n - 1])


def test_several_stop_strings_the_first_met_wins(llama_ckpt):
    llm = LLM(llama_ckpt, max_model_len=128, performance_layers=False)
    prompt = random_prompts(7, [10])[0]
    ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].text
    assert len(ref) > 30
    # a long string that starts first but ends after a short one that starts later
    stops = [ref[8:30], ref[20:22]]
    start, _, stop = first_stop(ref, stops)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, stop=stops),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.stop_reason) == (ref[:start], stop)


def test_stop_token_id_is_the_stop_reason(llama_ckpt):
    llm = LLM(llama_ckpt, max_model_len=64, performance_layers=False)
    prompt = random_prompts(8, [6])[0]
    ref = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    stop_id = ref.token_ids[3]
    n = ref.token_ids.index(stop_id) + 1
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.stop_reason, out.finish_reason) == (ref.token_ids[:n], stop_id, "stop")
    assert out.text == llm.tokenizer.decode(ref.token_ids[: n - 1])  # the stop token's text left out


# ---------------------------------------------------------------------------------------- n samples
def test_n_samples_share_the_prompt_blocks_and_are_seeded(llama_ckpt, layer_args):
    prompt = random_prompts(9, [64])[0]  # four full blocks of 16
    llm = LLM(llama_ckpt, max_model_len=128, **layer_args)
    bm = llm.engine.block_manager
    used, allocate = [], bm.allocate_slots

    def record(*a, **k):
        ok = allocate(*a, **k)
        used.append(bm.num_blocks - bm.num_free_blocks)
        return ok

    bm.allocate_slots = record
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12)
    a = llm.generate([prompt], params, use_tqdm=False)[0]
    # the first step admits all four on the prompt's 4 blocks, held once; the 12 output tokens of each
    # sample then take one block of their own (16 blocks without the sharing)
    assert used[:4] == [4, 4, 4, 4] and max(used) == 4 + 4, used
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]
    b = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # reproducible
    assert len({tuple(c.token_ids) for c in a.outputs}) == 4  # and distinct
    one = llm.generate([prompt], SamplingParams(temperature=1.0, seed=12, max_tokens=12), use_tqdm=False)[0]
    assert one.token_ids == a.outputs[1].token_ids  # sample j draws from seed + j
    greedy = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    assert bm.num_free_blocks == bm.num_blocks


def test_aborting_n_samples_frees_every_block(llama_ckpt):
    llm = LLM(llama_ckpt, max_model_len=128, performance_layers=False)
    engine, prompt = llm.engine, random_prompts(10, [40])[0]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=50)
    seqs = [engine.add_request(prompt, params.child(j), request_id=f"r-{j}") for j in range(4)]
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for seq in seqs:
        assert engine.abort_request(seq.request_id)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, field", [
    ({"stop": [""]}, "empty string"), ({"stop": [1]}, "stop"), ({"n": 0}, "n"), ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_limits_are_checked_before_anything_is_queued(llama_ckpt):
    llm = LLM(llama_ckpt, max_model_len=64, performance_layers=False, max_logprobs=5)
    for params in (SamplingParams(logprobs=6), [SamplingParams(), SamplingParams(prompt_logprobs=9)]):
        with pytest.raises(ValueError, match="max_logprobs: 5"):
            llm.generate([[1, 2], [3, 4]], params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="n=2"):
        llm.engine.add_request([1, 2], SamplingParams(n=2))
