"""The regex → automaton compiler behind constrained decoding — a tool module: regular expressions and
JSON schemas → character-level DFAs, which nano_sglang.fsm turns into SGLang's compressed FSM (arXiv
2312.07104, §4).

Pipeline: `_Parser` (recursive descent) → AST → Thompson NFA (`_NFA`) → DFA by subset construction
(`regex_to_dfa`) → dead states pruned (a state from which no accepting state is reachable is never
entered, so a constrained request can always finish). Supported syntax: literals, escapes (\\d \\w \\s
\\D \\W \\S, \\xHH, \\. etc.), classes `[a-z_]` / `[^"]`, `.`, groups `( )` / `(?: )`, `|`, `* + ?`,
`{m}` `{m,}` `{m,n}`. The alphabet is printable ASCII plus tab and newline. `json_schema_to_regex` writes
a JSON schema (a subset) as such a regex.
"""

from __future__ import annotations

import json
import re
import string

ALPHABET = frozenset(string.printable) - frozenset("\r\x0b\x0c")
_CLASSES = {"d": frozenset(string.digits), "w": frozenset(string.ascii_letters + string.digits + "_"),
            "s": frozenset(" \t\n")}
MAX_STATES = 20000


class _Parser:
    def __init__(self, pattern: str):
        self.p, self.i = pattern, 0

    def error(self, msg: str) -> ValueError:
        return ValueError(f"invalid regex {self.p!r} at position {self.i}: {msg}")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        if self.i >= len(self.p):
            raise self.error("unexpected end")
        self.i += 1
        return self.p[self.i - 1]

    def parse(self):
        node = self.alt()
        if self.i != len(self.p):
            raise self.error(f"unexpected {self.p[self.i]!r}")
        return node

    def alt(self):
        branches = [self.concat()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.concat())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def concat(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repeat())
        return ("cat", items)

    def repeat(self):
        node = self.atom()
        while self.peek() in ("*", "+", "?", "{"):
            c = self.take()
            if c == "*":
                node = ("rep", node, 0, None)
            elif c == "+":
                node = ("rep", node, 1, None)
            elif c == "?":
                node = ("rep", node, 0, 1)
            else:
                m = re.match(r"(\d+)(,(\d*))?\}", self.p[self.i:])
                if m is None:
                    raise self.error("bad {m,n} quantifier")
                self.i += m.end()
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                if hi is not None and hi < lo:
                    raise self.error(f"quantifier {{{lo},{hi}}} has max < min")
                node = ("rep", node, lo, hi)
        return node

    def atom(self):
        c = self.take()
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            node = self.alt()
            if self.take() != ")":
                raise self.error("missing )")
            return node
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", ALPHABET - {"\n"})
        if c == "\\":
            return ("set", self.escape())
        if c in "*+?{":
            raise self.error(f"nothing to repeat before {c!r}")
        if c == ")":
            raise self.error("unbalanced )")
        return ("set", frozenset(c))

    def escape(self) -> frozenset[str]:
        c = self.take()
        if c.lower() in _CLASSES:
            chars = _CLASSES[c.lower()]
            return ALPHABET - chars if c.isupper() else chars
        if c == "x":
            digits = self.p[self.i : self.i + 2]
            if len(digits) != 2 or any(d not in string.hexdigits for d in digits):
                raise self.error("\\x needs two hex digits")
            self.i += 2
            return frozenset(chr(int(digits, 16)))
        return frozenset({"n": "\n", "t": "\t"}.get(c, c))

    def char_class(self) -> frozenset[str]:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        chars: set[str] = set()
        first = True
        while first or self.peek() != "]":
            first = False
            c = self.take()
            lo = self.escape() if c == "\\" else frozenset(c)
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]" and len(lo) == 1:
                self.i += 1
                hi_c = self.take()
                hi = next(iter(self.escape())) if hi_c == "\\" else hi_c
                a = next(iter(lo))
                if ord(hi) < ord(a):
                    raise self.error(f"bad range {a}-{hi}")
                chars |= {chr(x) for x in range(ord(a), ord(hi) + 1)}
            else:
                chars |= lo
        self.i += 1
        return frozenset(ALPHABET - chars if negate else chars & ALPHABET)


class _NFA:
    def __init__(self):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[frozenset[str], int]]] = []

    def state(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node) -> tuple[int, int]:
        kind = node[0]
        s, e = self.state(), self.state()
        if kind == "set":
            self.edges[s].append((node[1], e))
        elif kind == "cat":
            cur = s
            for item in node[1]:
                a, b = self.build(item)
                self.eps[cur].append(a)
                cur = b
            self.eps[cur].append(e)
        elif kind == "alt":
            for item in node[1]:
                a, b = self.build(item)
                self.eps[s].append(a)
                self.eps[b].append(e)
        else:  # rep: `lo` copies, then (hi - lo) optional copies or a loop
            _, sub, lo, hi = node
            cur = s
            for _ in range(lo):
                a, b = self.build(sub)
                self.eps[cur].append(a)
                cur = b
            if hi is None:
                a, b = self.build(sub)
                self.eps[cur] += [a, e]
                self.eps[b] += [a, e]
            else:
                for _ in range(hi - lo):
                    a, b = self.build(sub)
                    self.eps[cur] += [a, e]
                    cur = b
            self.eps[cur].append(e)
        return s, e

    def closure(self, states) -> frozenset[int]:
        seen, stack = set(states), list(states)
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)


def regex_to_dfa(pattern: str) -> tuple[list[dict[str, int]], set[int]]:
    """Regex → character DFA `(trans, accept)`: `trans[state][char] -> state`, start state 0, every state
    able to reach acceptance. Raises ValueError for invalid syntax or a regex that matches no string."""
    if not isinstance(pattern, str):
        raise ValueError(f"regex must be a string, got {type(pattern).__name__}")
    nfa = _NFA()
    start, end = nfa.build(_Parser(pattern).parse())
    alphabet = sorted(ALPHABET)
    index = {nfa.closure([start]): 0}
    sets, trans = [next(iter(index))], [{}]
    i = 0
    while i < len(sets):  # subset construction: DFA state = the closure of the NFA states it stands for
        cur = sets[i]
        for c in alphabet:
            nxt = {t for s in cur for chars, t in nfa.edges[s] if c in chars}
            if not nxt:
                continue
            key = nfa.closure(nxt)
            if key not in index:
                if len(sets) >= MAX_STATES:
                    raise ValueError(f"regex {pattern!r} needs more than {MAX_STATES} DFA states")
                index[key] = len(sets)
                sets.append(key)
                trans.append({})
            trans[i][c] = index[key]
        i += 1
    accept = {k for k, s in enumerate(sets) if end in s}
    live = set(accept)  # states that can still reach acceptance
    changed = True
    while changed:
        changed = False
        for k, t in enumerate(trans):
            if k not in live and any(v in live for v in t.values()):
                live.add(k)
                changed = True
    if 0 not in live:
        raise ValueError(f"regex {pattern!r} matches no string (over the alphabet of printable ASCII)")
    return [{c: v for c, v in t.items() if v in live} for t in trans], accept


# ---------------------------------------------------------------------- JSON schema → regex
_STRING_CHAR = r'[^"\\\n\t]'


def json_schema_to_regex(schema: dict) -> str:
    """A compact-JSON regex for a schema subset: object (properties in order, all emitted), string
    (minLength / maxLength / enum / const), integer (minimum 0 and maximum 10^k - 1 supported exactly),
    number, boolean, null, array (items, minItems / maxItems), anyOf / oneOf. Other keywords: ValueError."""
    if not isinstance(schema, dict):
        raise ValueError(f"JSON schema must be an object, got {type(schema).__name__}")
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return "(" + "|".join(re.escape(json.dumps(v, separators=(",", ":"))) for v in values) + ")"
    if "anyOf" in schema or "oneOf" in schema:
        return "(" + "|".join(json_schema_to_regex(s) for s in schema.get("anyOf", schema.get("oneOf"))) + ")"
    t = schema.get("type")
    if t == "object":
        props = schema.get("properties", {})
        parts = [re.escape(json.dumps(k)) + ":" + json_schema_to_regex(v) for k, v in props.items()]
        return r"\{" + ",".join(parts) + r"\}"
    if t == "string":
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
    if t == "array":
        item = json_schema_to_regex(schema.get("items", {"type": "string"}))
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if hi is not None and hi < lo:
            raise ValueError(f"array maxItems ({hi}) < minItems ({lo})")
        if hi == 0:
            return r"\[\]"
        rest = f"(,{item}){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
        body = f"{item}{rest}"
        return r"\[" + (body if lo > 0 else f"({body})?") + r"\]"
    raise ValueError(f"unsupported JSON schema (type {t!r}): {schema}")
