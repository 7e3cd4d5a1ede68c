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


def dfa_samples(fsm, rng: random.Random, n: int, max_len: int = 40) -> list[str]:
    """Random walks of the DFA from its start to an accepting state, heading for acceptance once the walk
    has no more than `max_len` characters to go."""
    dist = dict.fromkeys(fsm.accept, 0)  # characters from each state to acceptance
    changed = True
    while changed:
        changed = False
        for state, trans in enumerate(fsm.trans):
            d = min((dist[t] + 1 for t in trans.values() if t in dist), default=None)
            if d is not None and d < dist.get(state, max_len * 10):
                dist[state], changed = d, True
    out = []
    for _ in range(n):
        s, state = "", 0
        while not (state in fsm.accept and (not fsm.trans[state] or rng.random() < 0.25)):
            moves = sorted(fsm.trans[state].items())
            if len(s) + dist[state] >= max_len:
                moves = [(c, t) for c, t in moves if dist[t] < dist[state]]
            c, state = rng.choice(moves)
            s += c
        out.append(s)
    return out


@pytest.mark.parametrize(("pattern", "example"), [
    ("a+", "xay"), ("^[a-z]{2,4}$", "abc"), (r"^\d{3}-\d{4}$", "123-4567"), ("^(ab|cd)+", "cdab!"),
    ("x$", "a x"), ("^a.c$", "a-c"), ("^a|b$", "ab"), (r"(?P<initial>[A-Z])\.", "J. R."),
    (r"^\x41\u0042", "AB+")])
def test_json_schema_pattern_outputs_are_json_strings_python_re_finds_the_pattern_in(pattern, example):
    """JSON Schema's `pattern` must match somewhere in the string (Python's re.search; anchors where
    written): every string the schema's FSM accepts parses as JSON and holds a match; the FSM accepts a
    string that holds one, and refuses one that does not."""
    fsm = compile_regex(json_schema_to_regex({"type": "string", "pattern": pattern}))
    for s in dfa_samples(fsm, random.Random(0), 300):
        value = json.loads(s)
        assert isinstance(value, str) and re.search(pattern, value), s
    assert re.search(pattern, example) and fsm.matches(json.dumps(example))
    assert not re.search(pattern, "_") and not fsm.matches('"_"')


def test_json_schema_pattern_in_an_object_with_the_model(ckpt):
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": r"^[A-Z]{2}-\d{3}$"},
                                               "note": {"type": "string", "pattern": "^(ok|no)!?$"}}}
    engine = SGLEngine(EngineConfig(model=ckpt, max_model_len=256, max_num_seqs=8, num_kv_blocks=64))
    outs = engine.generate(["Item: ", "Next: "], SamplingParams(temperature=1.0, max_tokens=40, seed=3),
                           json_schema=schema)
    for o in outs:
        obj = json.loads(o.text)
        assert re.search(r"^[A-Z]{2}-\d{3}$", obj["id"]) and re.search("^(ok|no)!?$", obj["note"]), o.text
        assert o.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "string", "pattern": '^"$'}, "no JSON string without escapes"),
    ({"type": "string", "pattern": "^a$", "maxLength": 3}, "both pattern and minLength / maxLength"),
    ({"type": "string", "pattern": "a(?=b)"}, "lookarounds"),
    ({"type": "string", "pattern": 5}, "pattern must be a string, got int"),
    ({"type": "string", "format": "email"}, r"keyword\(s\) \['format'\] are not supported"),
    ({"type": "integer", "exclusiveMinimum": 1}, r"\['exclusiveMinimum'\]"),
    ({"enum": ["a", "b"], "pattern": "a"}, r"\['pattern'\] are not supported"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["b"]}, r"required properties \['b'\]"),
    ({"type": ["string", "null"]}, "unsupported JSON schema"),
])
def test_json_schema_keywords_it_cannot_honour_are_value_errors(schema, message):
    with pytest.raises(ValueError, match=message):
        json_schema_to_regex(schema)


def test_json_schema_annotations_are_read_past():
    plain = json_schema_to_regex({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    annotated = json_schema_to_regex({"type": "object", "title": "T", "description": "d", "additionalProperties": False,
                                      "properties": {"a": {"type": "boolean", "description": "flag"}}})
    assert plain == annotated


@pytest.mark.parametrize(("pattern", "message"), [
    (r"\p{L}+", r"Unicode property classes \(\\p\{\.\.\.\}, \\P\{\.\.\.\}\) are not supported"),
    (r"\P{Lu}", r"Unicode property classes"),
    (r"\X", r"the escape \\X is not supported"),
    (r"\bword\b", r"word boundaries \(\\b\) are not supported"),
    (r"(a)\1", r"backreferences \(\\1\) are not supported"),
    (r"(?P<x>a)(?P=x)", r"backreferences"),
    (r"(?=a)a", r"lookarounds"),
    (r"(?<!a)b", r"lookarounds"),
    (r"(?i)abc", r"inline flag '\(\?i' is not supported"),
    (r"\q", r"the escape \\q is not supported"),
    (r"a^b", r"\^ and \$ are supported only at the start and the end"),
    (r"a{2,1}", r"max < min"),
    (r"a{x}", r"bad \{m,n\} quantifier"),
])
def test_regex_syntax_the_fsm_cannot_read_is_a_clear_value_error(ckpt, pattern, message):
    with pytest.raises(ValueError, match=message):
        compile_regex(pattern)
    if pattern == r"\p{L}+":
        engine = SGLEngine(EngineConfig(model=ckpt, max_model_len=256, max_num_seqs=8, num_kv_blocks=64))
        with pytest.raises(ValueError, match="Unicode property classes"):
            engine.generate(["x"], SamplingParams(max_tokens=4), regex=pattern)
        assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(("pattern", "python"), [("^abc$", "abc"), ("^a|b$", "a|b"), (r"a\$", r"a\$"),
                                                 (r"(?:x|y)(?P<n>z)", "(x|y)z")])
def test_anchors_and_named_groups_mean_what_python_re_says(pattern, python):
    fsm = compile_regex(pattern)
    for s in ["abc", "a", "b", "a$", "xz", "yz", "z", "ab"]:
        assert fsm.matches(s) == bool(re.fullmatch(python, s)) == bool(re.fullmatch(pattern, s)), s
