"""JSON schema → regex (a subset of JSON Schema), for constrained decoding of JSON (SGLang, arXiv
2312.07104, §4): the regex describes compact JSON (no whitespace, strings without escapes) that the
schema accepts, and nano_sglang.compiler.regex compiles it to a DFA like any other."""

from __future__ import annotations

import json
import re

from nano_sglang.compiler.regex import ALPHABET, regex_to_dfa, split_anchors

# What a JSON string may hold without an escape: the output is compact JSON whose strings carry no escapes.
_JSON_STRING_CHARS = ALPHABET - frozenset('"\\\n\t')
_STRING_CHAR = r'[^"\\\n\t]'
# Keywords that only describe a schema; json_schema_to_regex reads past them.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment"})
# The keywords json_schema_to_regex honours, per type (besides "type"); any other is a ValueError.
_KEYWORDS = {"object": {"properties", "required", "additionalProperties"},
             "string": {"minLength", "maxLength", "pattern"}, "integer": {"minimum", "maximum"},
             "number": set(), "boolean": set(), "null": set(), "array": {"items", "minItems", "maxItems"}}


def json_schema_to_regex(schema: dict) -> str:
    """A compact-JSON regex for a schema subset: object (properties in order, all emitted; `required`
    must name some of them), string (minLength / maxLength, or pattern; enum / const), integer (minimum 0
    and maximum 10^k - 1 supported exactly), number, boolean, null, array (items, minItems / maxItems),
    anyOf / oneOf; annotations (title, description, ...) are read past. Any other keyword: ValueError."""
    if not isinstance(schema, dict):
        raise ValueError(f"JSON schema must be an object, got {type(schema).__name__}")
    for key in ("enum", "const", "anyOf", "oneOf"):
        if key in schema:
            _check_keywords(schema, {key})
            if key in ("enum", "const"):
                values = schema["enum"] if key == "enum" else [schema["const"]]
                return "(" + "|".join(re.escape(json.dumps(v, separators=(",", ":"))) for v in values) + ")"
            return "(" + "|".join(json_schema_to_regex(s) for s in schema[key]) + ")"
    t = schema.get("type")
    if not isinstance(t, str) or t not in _KEYWORDS:
        raise ValueError(f"unsupported JSON schema (type {t!r}): {schema}")
    _check_keywords(schema, _KEYWORDS[t])
    if t == "object":
        props = schema.get("properties", {})
        missing = sorted(set(schema.get("required", [])) - set(props))
        if missing:
            raise ValueError(f"JSON schema: required properties {missing} are not among its properties")
        parts = [re.escape(json.dumps(k)) + ":" + json_schema_to_regex(v) for k, v in props.items()]
        return r"\{" + ",".join(parts) + r"\}"
    if t == "string":
        if "pattern" in schema:
            if "minLength" in schema or "maxLength" in schema:
                raise ValueError("JSON schema: a string with both pattern and minLength / maxLength is "
                                 "not supported; put the length into the pattern")
            return f'"{json_string_pattern(schema["pattern"])}"'
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        return f'"{_STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'
    if t == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo not in (None, 0) or (hi is not None and (hi < 1 or str(hi) != "9" * len(str(hi)))):
            raise ValueError("integer bounds other than minimum 0 / maximum 10^k - 1 are not supported")
        digits = r"[0-9]*" if hi is None else f"[0-9]{{0,{len(str(hi)) - 1}}}"
        return ("" if lo == 0 else "-?") + f"(0|[1-9]{digits})"
    if t == "number":
        return r"-?(0|[1-9][0-9]*)(\.[0-9]+)?"
    if t == "boolean":
        return "(true|false)"
    if t == "null":
        return "null"
    item = json_schema_to_regex(schema.get("items", {"type": "string"}))  # an array
    lo, hi = schema.get("minItems", 0), schema.get("maxItems")
    if hi is not None and hi < lo:
        raise ValueError(f"array maxItems ({hi}) < minItems ({lo})")
    if hi == 0:
        return r"\[\]"
    rest = f"(,{item}){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
    body = f"{item}{rest}"
    return r"\[" + (body if lo > 0 else f"({body})?") + r"\]"


def _check_keywords(schema: dict, allowed: set[str]) -> None:
    unknown = sorted(set(schema) - allowed - _ANNOTATIONS - {"type"})
    if unknown:
        raise ValueError(f"JSON schema keyword(s) {unknown} are not supported here (schema {schema}); "
                         f"supported beside 'type': {sorted(allowed)}")


def json_string_pattern(pattern: str) -> str:
    """A JSON schema `pattern` as the regex of a JSON string's content. The pattern must match somewhere
    in the string (JSON Schema's rule), so an alternative not anchored by `^` / `$` may have any text
    before / after it; and the content holds no character a JSON string must escape (`"`, `\\`, control
    characters), which every character class leaves out. ValueError if no string is left, or for syntax
    the compiler does not read."""
    if not isinstance(pattern, str):
        raise ValueError(f"JSON schema pattern must be a string, got {type(pattern).__name__}")
    anything = _regex_of(("rep", ("set", _JSON_STRING_CHARS), 0, None))
    alternatives = [("" if start else anything) + _regex_of(_restrict(branch)) + ("" if end else anything)
                    for branch, start, end in split_anchors(pattern)]
    regex = "(" + "|".join(alternatives) + ")"
    try:
        regex_to_dfa(regex)
    except ValueError:
        raise ValueError(f"JSON schema pattern {pattern!r}: no JSON string without escapes (no \", \\ or "
                         "control character) matches it") from None
    return regex


def _restrict(node):
    """The AST `node` with every character class cut to what a JSON string holds unescaped."""
    kind = node[0]
    if kind == "set":
        return ("set", node[1] & _JSON_STRING_CHARS)
    if kind in ("cat", "alt"):
        return (kind, [_restrict(n) for n in node[1]])
    return ("rep", _restrict(node[1]), node[2], node[3])


def _regex_of(node) -> str:
    """Regex text for an AST (the inverse of `_Parser.parse`)."""
    kind = node[0]
    if kind == "set":
        if not node[1]:
            return r"\x00"  # no character: \x00 is outside the alphabet
        return "[" + "".join("\\" + c if c in "\\]^-[" else c for c in sorted(node[1])) + "]"
    if kind == "cat":
        return "".join(_regex_of(n) for n in node[1])
    if kind == "alt":
        return "(?:" + "|".join(_regex_of(n) for n in node[1]) + ")"
    _, sub, lo, hi = node
    return f"(?:{_regex_of(sub)}){{{lo},{'' if hi is None else hi}}}"
