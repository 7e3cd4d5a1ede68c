"""Constrained decoding (§4): every output parses and matches its regex / JSON schema, with and without
jump-forward; jump-forward produces the same kind of output with fewer model steps; the FSM itself
against Python's `re`."""

from __future__ import annotations

import json
import random
import re

import pytest

from nano_sglang.engine import SGLEngine
from nano_sglang.fsm import compile_regex, json_schema_to_regex
from nano_sglang.scheduler import CacheAwareConfig
from nano_vllm import EngineConfig, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "member": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2}}}


def valid(obj) -> bool:
    return (isinstance(obj, dict) and list(obj) == ["name", "age", "member", "tags"]
            and isinstance(obj["name"], str) and len(obj["name"]) <= 6
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 99 and isinstance(obj["member"], bool)
            and isinstance(obj["tags"], list) and len(obj["tags"]) <= 2
            and all(t in ("red", "green") for t in obj["tags"]))


@pytest.mark.parametrize("pattern", [r"(a|bc)*d{2,3}[0-9]+", r"[A-Z][a-z]{0,4}( [A-Z][a-z]+)?\.", r"\d{3}-\d{4}",
                                     r'"[^"\\]{0,5}"', r"(true|false|null)"])
def test_fsm_agrees_with_python_re(pattern):
    fsm = compile_regex(pattern)
    rng = random.Random(0)
    alphabet = "abcdAZxyz019.- \"\\tfrulen"
    for _ in range(2000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        assert fsm.matches(s) == bool(re.fullmatch(pattern, s)), s


def test_compressed_edges_are_the_forced_strings():
    fsm = compile_regex(json_schema_to_regex(SCHEMA))
    assert fsm.forced_string(0) == '{"name":"'
    edges = fsm.compressed_edges()
    assert edges[0] == ('{"name":"', fsm.step(0, '{"name":"'))
    assert all(len(s) > 1 and t is not None for s, t in edges.values())


def test_json_outputs_parse_and_match_with_and_without_jump_forward(ckpt):
    engine = SGLEngine(EngineConfig(model=ckpt, max_model_len=256, max_num_seqs=8, num_kv_blocks=64),
                       CacheAwareConfig("lpm"))
    prompts = [f"Person {i}: " for i in range(3)]
    steps = {}
    for jf in (False, True):
        params = SamplingParams(temperature=1.0, max_tokens=96, seed=1)
        before = engine.num_steps
        outs = engine.generate(prompts, params, json_schema=SCHEMA, jump_forward=jf)
        steps[jf] = engine.num_steps - before
        for o in outs:
            obj = json.loads(o.text)
            assert valid(obj), o.text
            assert o.outputs[0].finish_reason == "stop"
    assert steps[True] < steps[False]


def test_regex_outputs_match_greedy_and_sampled(ckpt):
    engine = SGLEngine(EngineConfig(model=ckpt, max_model_len=256, max_num_seqs=8, num_kv_blocks=64))
    pattern = r"(yes|no), [a-z]{1,6} (\d{1,3}|none)\."
    for temp in (0.0, 1.0):
        outs = engine.generate([f"Q{i}: " for i in range(5)], SamplingParams(temperature=temp, max_tokens=40),
                               regex=pattern)
        assert all(re.fullmatch(pattern, o.text) for o in outs), [o.text for o in outs]
    bm = engine.block_manager
    assert bm.num_free_blocks + bm.tree.total_pages() == bm.num_blocks


def test_masks_touch_only_the_constrained_rows_of_a_mixed_batch(ckpt, hf_greedy):
    """Constrained and free requests decode in the same steps: the constrained rows match their regex, the
    free rows are transformers' greedy tokens (the masks were applied to no other row)."""
    engine = SGLEngine(EngineConfig(model=ckpt, max_model_len=256, max_num_seqs=8, num_kv_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    pattern = r"[a-z]{2,6} (\d{1,3}|none)\."
    prompts = [[11 + i, 300 + 7 * i, 42, 9 + i] for i in range(6)]
    seqs = [engine.add_request(p, params, regex=pattern) if i % 2 else engine.add_request(p, params)
            for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    for i, seq in enumerate(seqs):
        if i % 2:
            assert re.fullmatch(pattern, engine.tokenizer.decode(seq.output_token_ids)), seq.output_token_ids
        else:
            assert seq.output_token_ids == hf_greedy(tuple(prompts[i]), 10)


@pytest.mark.parametrize("pattern", [r"(a|b)*c{1000}", r"c{1000}"])
def test_jump_forward_stops_at_max_tokens_and_says_length(ckpt, pattern):
    """Forced tokens count against max_tokens: the jump is cut to what is left of the budget, the FSM
    advances by what was appended, and the request ends with "length" (its text a prefix of a match)."""
    engine = SGLEngine(EngineConfig(model=ckpt, max_model_len=256, max_num_seqs=8, num_kv_blocks=64))
    seq = engine.add_request("x", SamplingParams(temperature=0.0, max_tokens=8), regex=pattern)
    while engine.has_unfinished_requests():
        engine.step()
    text = engine.tokenizer.decode(seq.output_token_ids)
    assert len(seq.output_token_ids) == 8 and seq.finish_reason == "length", (text, seq.finish_reason)
    assert seq.constraint.state == seq.constraint.fsm.step(0, text) and not re.fullmatch(pattern, text)


def test_jump_forward_stops_at_max_model_len_and_says_length(ckpt):
    engine = SGLEngine(EngineConfig(model=ckpt, max_model_len=256, max_num_seqs=8, num_kv_blocks=64))
    seq = engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1000), regex=r"c{3000}")
    while engine.has_unfinished_requests():
        engine.step()
    text = engine.tokenizer.decode(seq.output_token_ids)
    assert seq.num_tokens == 256 and seq.finish_reason == "length" and text == "c" * len(text)
    assert seq.constraint.state == seq.constraint.fsm.step(0, text)
    bm = engine.block_manager
    assert bm.num_free_blocks + bm.tree.total_pages() == bm.num_blocks


def test_a_jump_that_completes_the_match_within_the_budget_says_stop(ckpt):
    engine = SGLEngine(EngineConfig(model=ckpt, max_model_len=256, max_num_seqs=8, num_kv_blocks=64))
    for max_tokens in (8, 5):  # 5: the forced tokens fill the budget exactly and complete the match
        out, = engine.generate(["x"], SamplingParams(temperature=0.0, max_tokens=max_tokens), regex=r"c{5}")
        assert out.text == "ccccc" and out.outputs[0].finish_reason == "stop"
