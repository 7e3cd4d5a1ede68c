"""Token-level constrained decoding over a character FSM (SGLang, arXiv 2312.07104, §4).

`TokenIndex` holds every token's text in a character trie. The tokens allowed in FSM state q are those
whose whole text the DFA can read from q: one walk of the trie alongside the DFA finds all of them at
once (shared prefixes of token texts are walked once), and the result is cached per (FSM, state), so a
state is analysed once however many requests pass through it. End-of-sequence is allowed in accepting
states. Tokens whose text is not clean UTF-8 on its own (a piece of a multi-byte character) are never
allowed: the FSM reads characters.

`Constraint` is one request's position in its FSM; the scheduler advances it after each sampled token
and, with jump-forward on, asks it for the forced string of the compressed edge it stands on (§4).
"""

from __future__ import annotations

import functools

import torch

from nano_sglang.fsm import RegexFSM, compile_regex, json_schema_to_regex


class TokenIndex:
    """Every token's text in a character trie, for the allowed-token sets of FSM states (module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(t for t in eos_token_ids if t < vocab_size)
        self.strings: dict[int, str] = {}
        self.trie: dict = {}  # char -> (child trie, token ids ending here) as [dict, list]
        for t in range(vocab_size):
            if t in eos_token_ids:
                continue
            try:
                s = tokenizer.decode([t])
            except Exception:  # ids the tokenizer does not know
                continue
            if not s or "\ufffd" in s:
                continue
            self.strings[t] = s
            node = self.trie
            for c in s[:-1]:
                node = node.setdefault(c, [{}, []])[0]
            node.setdefault(s[-1], [{}, []])[1].append(t)

    def allowed(self, fsm: RegexFSM, state: int) -> list[int]:
        """Token ids whose text the FSM can read from `state` (plus EOS where it accepts)."""
        out: list[int] = []
        stack = [(self.trie, state)]
        while stack:
            node, q = stack.pop()
            trans = fsm.trans[q]
            for c, (child, ids) in node.items():
                nq = trans.get(c)
                if nq is None:
                    continue
                out.extend(ids)
                if child:
                    stack.append((child, nq))
        if state in fsm.accept:
            out.extend(self.eos_token_ids)
        return out

    def mask(self, fsm: RegexFSM, state: int, device: torch.device) -> torch.Tensor:
        """The allowed tokens of `state` as a boolean vocabulary mask on `device`, cached on the FSM."""
        key = (id(self), state, str(device))
        m = fsm.mask_cache.get(key)
        if m is None:
            m = torch.zeros(self.vocab_size, dtype=torch.bool)
            m[self.allowed(fsm, state)] = True
            m = fsm.mask_cache[key] = m.to(device)
        return m


# Compiled FSMs are shared by every request with the same regex (and so are their token masks).
cached_fsm = functools.lru_cache(maxsize=256)(compile_regex)


class Constraint:
    """One request's state in a regex FSM."""

    def __init__(self, fsm: RegexFSM, index: TokenIndex, jump_forward: bool = True):
        self.fsm, self.index, self.tokenizer = fsm, index, index.tokenizer
        self.state = 0
        self.jump_forward = jump_forward
        self.num_jump_tokens = 0  # tokens appended by jump-forward (no model call)
        if not index.allowed(fsm, 0):
            raise ValueError(f"regex {fsm.pattern!r}: no token of the vocabulary can start a match")

    @classmethod
    def build(cls, index: TokenIndex, regex: str | None = None, json_schema: dict | None = None,
              jump_forward: bool = True) -> Constraint:
        """A request's constraint from exactly one of a regex or a JSON schema (ValueError otherwise)."""
        if (regex is None) == (json_schema is None):
            raise ValueError("give exactly one of regex / json_schema")
        pattern = regex if regex is not None else json_schema_to_regex(json_schema)
        return cls(cached_fsm(pattern), index, jump_forward)

    def mask(self, device: torch.device) -> torch.Tensor:
        """The tokens allowed next."""
        return self.index.mask(self.fsm, self.state, device)

    def advance(self, token_id: int) -> None:
        """Read a sampled token's text (the mask allowed only tokens the FSM can read)."""
        self.advance_string(self.index.strings.get(token_id), f"token {token_id} ")

    def advance_string(self, text: str | None, what: str = "") -> None:
        """Read `text` (a token's, or jump-forward's forced string)."""
        nxt = None if text is None else self.fsm.step(self.state, text)
        if nxt is None:
            raise RuntimeError(f"{what}{text!r} violates regex {self.fsm.pattern!r} "
                               f"in state {self.state}")
        self.state = nxt

    def forced_string(self) -> str:
        """§4: the string forced from here (the compressed edge), what jump-forward appends."""
        return self.fsm.forced_string(self.state)

    def is_terminal(self) -> bool:
        """The FSM accepts and nothing may follow: the request is done."""
        return self.fsm.is_terminal(self.state)
