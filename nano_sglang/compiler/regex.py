"""Regex → character DFA, the compiler behind constrained decoding: nano_sglang.fsm turns the DFA into
SGLang's compressed FSM (arXiv 2312.07104, §4).

Pipeline: `_Parser` (recursive descent) → AST → Thompson NFA (`_NFA`) → DFA by subset construction
(`regex_to_dfa`) → dead states pruned (a state from which no accepting state is reachable is never
entered, so a constrained request can always finish). Supported syntax: literals, escapes (\\d \\w \\s
\\D \\W \\S, \\xHH, \\uHHHH, \\n \\t, \\. etc.), classes `[a-z_]` / `[^"]`, `.`, groups `( )` / `(?: )` /
`(?P<name> )`, `|`, `* + ?`, `{m}` `{m,}` `{m,n}`, and `^` / `$` at the start / end of a top-level
alternative (the FSM matches whole strings, so there they change nothing). What a DFA over characters
cannot express, or this compiler does not read, is a ValueError naming it: Unicode property classes
(\\p{..}, \\P{..}), \\X, word boundaries, backreferences, lookarounds, inline flags, anchors elsewhere. The
alphabet is printable ASCII plus tab and newline.
"""

from __future__ import annotations

import re
import string

ALPHABET = frozenset(string.printable) - frozenset("\r\x0b\x0c")
_CLASSES = {"d": frozenset(string.digits), "w": frozenset(string.ascii_letters + string.digits + "_"),
            "s": frozenset(" \t\n")}
# Escapes of control characters (all but \n and \t outside the alphabet: a regex that needs one matches nothing).
_CONTROL = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
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

    def unsupported(self, what: str) -> ValueError:
        return ValueError(f"regex {self.p!r} at position {self.i}: {what} not supported (constrained "
                          "decoding compiles the regex to a DFA over printable ASCII characters)")

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
            if self.peek() == "?":
                self.group_kind()
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
        if c in "^$":
            return ("anchor", c)
        if c in "*+?{":
            raise self.error(f"nothing to repeat before {c!r}")
        if c == ")":
            raise self.error("unbalanced )")
        return ("set", frozenset(c))

    def group_kind(self) -> None:
        """After `(?`: a non-capturing or named group reads as a group; anything else is refused."""
        rest = self.p[self.i + 1 :]
        named = re.match(r"P?<([A-Za-z_]\w*)>", rest)
        if rest.startswith(":") or named:
            self.i += 2 if rest.startswith(":") else 1 + named.end()
        elif rest[:1] in ("=", "!") or rest[:2] in ("<=", "<!"):
            raise self.unsupported("lookarounds ((?=...), (?!...), (?<=...), (?<!...)) are")
        elif rest.startswith("P="):
            raise self.unsupported("backreferences ((?P=name), \\1) are")
        else:
            raise self.unsupported(f"the group or inline flag '(?{rest[:1]}' is")

    def escape(self) -> frozenset[str]:
        c = self.take()
        if c.lower() in _CLASSES:
            chars = _CLASSES[c.lower()]
            return ALPHABET - chars if c.isupper() else chars
        if c in "xu":
            n = 2 if c == "x" else 4
            digits = self.p[self.i : self.i + n]
            if len(digits) != n or any(d not in string.hexdigits for d in digits):
                raise self.error(f"\\{c} needs {n} hex digits")
            self.i += n
            return frozenset(chr(int(digits, 16)))
        if c in "pP":
            raise self.unsupported("Unicode property classes (\\p{...}, \\P{...}) are")
        if c in "bB":
            raise self.unsupported(f"word boundaries (\\{c}) are")
        if c in "123456789":
            raise self.unsupported(f"backreferences (\\{c}) are")
        if c in _CONTROL:
            return frozenset(_CONTROL[c])
        if c.isascii() and c.isalnum():  # \X, \A, \Z, \G, ... (Python's re refuses unknown ones too)
            raise self.unsupported(f"the escape \\{c} is")
        return frozenset(c)

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


def split_anchors(pattern: str) -> list[tuple[tuple, bool, bool]]:
    """`pattern`'s top-level alternatives, parsed, each without its anchors: [(AST, anchored at the start
    by `^`, anchored at the end by `$`)]. An anchor anywhere else is a ValueError."""
    if not isinstance(pattern, str):
        raise ValueError(f"regex must be a string, got {type(pattern).__name__}")
    tree = _Parser(pattern).parse()
    out = []
    for _, items in tree[1] if tree[0] == "alt" else [tree]:
        start = bool(items) and items[0] == ("anchor", "^")
        end = len(items) > start and items[-1] == ("anchor", "$")
        items = items[int(start) : len(items) - int(end)]
        if any(_has_anchor(item) for item in items):
            raise ValueError(f"regex {pattern!r}: ^ and $ are supported only at the start and the end of a "
                             "top-level alternative")
        out.append((("cat", items), start, end))
    return out


def _has_anchor(node) -> bool:
    kind = node[0]
    if kind in ("cat", "alt"):
        return any(_has_anchor(n) for n in node[1])
    return kind == "anchor" or (kind == "rep" and _has_anchor(node[1]))


def regex_to_dfa(pattern: str) -> tuple[list[dict[str, int]], set[int]]:
    """Regex → character DFA `(trans, accept)`: `trans[state][char] -> state`, start state 0, every state
    able to reach acceptance. The regex matches whole strings (`^` / `$` at its ends change nothing).
    Raises ValueError for invalid or unsupported syntax, or a regex that matches no string."""
    nfa = _NFA()
    start, end = nfa.build(("alt", [branch for branch, _, _ in split_anchors(pattern)]))
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
