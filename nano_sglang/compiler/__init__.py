"""The compiler behind constrained decoding (nano_sglang.fsm): `regex.py` turns a regex into a character
DFA (parser, Thompson NFA, subset construction, dead states pruned); `json_schema.py` writes a JSON schema
as such a regex."""

from nano_sglang.compiler.json_schema import json_schema_to_regex
from nano_sglang.compiler.regex import regex_to_dfa

__all__ = ["json_schema_to_regex", "regex_to_dfa"]
