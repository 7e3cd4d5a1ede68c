"""The compressed finite-state machine of SGLang (arXiv 2312.07104, §4) and the string jump-forward reads.

Constrained decoding keeps a DFA over *characters*; at each step only tokens whose text the DFA can read
from its current state are allowed (nano_sglang.constrained). §4's observation: many states have a single
outgoing character (a JSON key, punctuation), and a chain of such *singular transitions* can be compressed
into one edge labelled with a string. When decoding reaches the start of such an edge the whole string is
forced, so it is appended without running the model ("jump-forward", `RegexFSM.forced_string`).

The DFA itself comes from a regex (or a JSON schema written as one) through nano_sglang.compiler: parser,
Thompson NFA, subset construction, dead states pruned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nano_sglang.compiler import json_schema_to_regex, regex_to_dfa

__all__ = ["RegexFSM", "compile_regex", "json_schema_to_regex"]


@dataclass
class RegexFSM:
    """A DFA over characters: `trans[state][char] -> state`; start state 0; no dead states."""

    pattern: str
    trans: list[dict[str, int]]
    accept: set[int]
    _forced: dict[int, str] = field(default_factory=dict, repr=False)
    # state -> allowed tokens (constrained.py)
    mask_cache: dict = field(default_factory=dict, repr=False)

    def step(self, state: int, text: str) -> int | None:
        """The state after reading `text` from `state`, or None when the FSM cannot read it."""
        for c in text:
            state = self.trans[state].get(c)
            if state is None:
                return None
        return state

    def matches(self, text: str) -> bool:
        """Whether the regex matches all of `text`."""
        s = self.step(0, text)
        return s is not None and s in self.accept

    def is_terminal(self, state: int) -> bool:
        """Accepting and nothing may follow: generation is complete."""
        return state in self.accept and not self.trans[state]

    def forced_string(self, state: int) -> str:
        """§4: the label of the compressed edge leaving `state` — the characters forced by a chain of
        singular transitions (one outgoing character, not accepting). Empty when the next character is a
        choice."""
        if state not in self._forced:
            out, s = [], state
            while s not in self.accept and len(self.trans[s]) == 1 and len(out) < 4096:
                (c, s), = self.trans[s].items()
                out.append(c)
            self._forced[state] = "".join(out)
        return self._forced[state]

    def compressed_edges(self) -> dict[int, tuple[str, int]]:
        """§4's compressed FSM: every maximal chain of singular transitions as one (string, target) edge."""
        edges = {}
        for s in range(len(self.trans)):
            forced = self.forced_string(s)
            if len(forced) > 1:
                edges[s] = (forced, self.step(s, forced))
        return edges


def compile_regex(pattern: str) -> RegexFSM:
    """Regex → DFA (nano_sglang.compiler). Raises ValueError for invalid or unsupported syntax or a regex
    that matches no string."""
    trans, accept = regex_to_dfa(pattern)
    return RegexFSM(pattern, trans, accept)
