"""Text <-> token ids for the engine: the checkpoint's own tokenizer when we can read it, else shared's.

A checkpoint directory that ships `tokenizer.json` is read with the `tokenizers` library (when
installed); everything else — presets with random weights, checkpoints saved by nano_megatron / nano_zero
— uses shared.tokenizer (a 4096-token byte-level BPE). Chat prompts use the checkpoint's Jinja chat
template when it has one and jinja2 is installed, else a plain ChatML layout.

The ids that end a generation come from the checkpoint alone (`checkpoint_eos_ids`), never from the
fallback tokenizer: to a model that did not ship it, its `<|endoftext|>` is an ordinary token.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from shared.config import ModelConfig


class Tokenizer:
    """encode / decode plus the ids that end a generation."""

    name: str = "tokenizer"
    eos_token_ids: set[int]
    from_checkpoint: bool = False  # shipped by the checkpoint (its EOS counts), not the fallback
    chat_template: str | None = None
    special_tokens: dict[str, str]  # passed to the chat template (bos_token, eos_token, ...)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its longest vocabulary entry): a text of more than
        n times this many characters is more than n tokens, known without tokenizing it (the server's
        bound on a prompt). Assumes the tokenizer drops no character before splitting, as byte-level BPE
        (Llama, Qwen) and SentencePiece do."""
        return max(1, self._max_token_chars())

    def _max_token_chars(self) -> int:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (`<|endoftext|>`, `<|im_end|>`, ...) are left out unless
        `skip_special_tokens` is False (vLLM's `SamplingParams.skip_special_tokens`)."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        """The prompt for a chat: the checkpoint's template, or ChatML ending in an open assistant turn."""
        if self.chat_template is not None:
            try:
                import jinja2

                env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = _raise
                return env.from_string(self.chat_template).render(
                    messages=messages, add_generation_prompt=True, **self.special_tokens)
            except ImportError:
                pass
        parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        return "".join(parts) + "<|im_start|>assistant\n"


def _raise(message: str) -> None:
    raise ValueError(message)


class SharedTokenizer(Tokenizer):
    """shared.tokenizer's tiktoken encoding ("nano-infra-4k")."""

    name = "nano-infra-4k"

    def __init__(self) -> None:
        from shared.tokenizer import get_tokenizer

        self.enc = get_tokenizer()
        self.eos_token_ids = {self.enc.eot_token}
        self.special_tokens = {"eos_token": "<|endoftext|>"}
        self.special_ids = {self.enc.encode_single_token(t) for t in self.enc.special_tokens_set}

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def _max_token_chars(self) -> int:  # bytes bound characters: a character is at least one byte
        return max([*map(len, self.enc.token_byte_values()), *map(len, self.enc.special_tokens_set)])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        n = self.enc.n_vocab  # a model with a larger vocabulary can emit ids the tokenizer does not know
        skip = self.special_ids if skip_special_tokens else set()
        return self.enc.decode([i for i in ids if i < n and i not in skip], errors="replace")


class HFTokenizer(Tokenizer):
    """A checkpoint's `tokenizer.json` through the `tokenizers` library."""

    from_checkpoint = True

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
        self.name = path.name
        cfg = _read_json(path / "tokenizer_config.json")
        self.chat_template = cfg.get("chat_template") if isinstance(cfg.get("chat_template"), str) else None
        self.special_tokens = {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
        self.eos_token_ids = set()
        eos = cfg.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and self.tok.token_to_id(eos) is not None:
            self.eos_token_ids.add(self.tok.token_to_id(eos))

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it): a server's other threads run on
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    def _max_token_chars(self) -> int:
        # A vocabulary entry is at least as long as the text it stands for: byte-level BPE spells each byte
        # as one character, SentencePiece a space as "▁", byte fallback one byte as "<0x0A>".
        return max(map(len, self.tok.get_vocab(with_added_tokens=True)))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def checkpoint_eos_ids(model: str, model_config: ModelConfig, tokenizer: Tokenizer) -> set[int]:
    """The ids that end a generation: config.json's `eos_token_id` plus generation_config.json's (Qwen3
    ends chat turns with either), else the EOS of a tokenizer the checkpoint ships. A checkpoint that
    declares none stops only at `max_tokens` / `stop_token_ids`, as transformers' `generate` does."""
    ids: set[int] = set()
    generation_config = _read_json(Path(model) / "generation_config.json")
    for eos in (model_config.eos_token_id, generation_config.get("eos_token_id")):
        if isinstance(eos, int) and not isinstance(eos, bool):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(e for e in eos if isinstance(e, int) and not isinstance(e, bool))
    return ids or (set(tokenizer.eos_token_ids) if tokenizer.from_checkpoint else set())


def get_engine_tokenizer(model: str) -> Tokenizer:
    """The tokenizer for `model` (a checkpoint directory or a preset name)."""
    path = Path(model)
    if os.path.isdir(path) and (path / "tokenizer.json").is_file():
        try:
            return HFTokenizer(path)
        except ImportError:  # `tokenizers` is not installed
            pass
    return SharedTokenizer()


class IncrementalDetokenizer:
    """The text of a growing token list, a few tokens decoded at a time (for stop strings and streaming).

    Each `step` decodes only the tokens since the last text it produced, with those of that text before
    them as context (`ids[prefix:read]`): merges across the boundary and a tokenizer that drops a leading
    space at the start of a decode come out as in one decode of the whole list, at a cost per step that
    does not grow with the output. A step whose text ends in U+FFFD (an incomplete UTF-8 character) adds
    nothing until the character completes, or `final`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.prefix = self.read = 0  # ids[prefix:read]: the context; ids[read:]: not yet in the text

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """Append the text of `token_ids[read:]` (the list only ever grows); returns what was appended."""
        if self.read >= len(token_ids):
            return ""
        decode = self.tokenizer.decode
        context = decode(token_ids[self.prefix:self.read], self.skip_special_tokens)
        text = decode(token_ids[self.prefix:], self.skip_special_tokens)
        if (not final and text.endswith("\ufffd")) or not text.startswith(context):
            return ""  # wait for the character to complete (or for the text to settle)
        delta = text[len(context):]
        self.text += delta
        self.prefix, self.read = self.read, len(token_ids)
        return delta


class StopChecker:
    """vLLM's stop strings, matched on the output text as it grows: the request stops at the first token
    whose text completes one of `params.stop` (several completed by one token: the one that ends first,
    then the longest), and its text is cut before the string (after it with
    `include_stop_str_in_output`). Without stop strings it is the streaming text alone.

    `visible(final)` is the text a stream may show: all but the last (longest stop string - 1)
    characters until the request ends, so a stop string being completed is never shown and then taken
    back.
    """

    def __init__(self, tokenizer: Tokenizer, params: Any):
        self.stops: list[str] = list(params.stop or ())
        self.include = params.include_stop_str_in_output
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.hold = max(map(len, self.stops), default=1) - 1
        self.ids: list[int] = []
        self.matched: str | None = None
        self.end: int | None = None  # where the output text ends once a stop string matched

    @property
    def text(self) -> str:
        return self.detok.text if self.end is None else self.detok.text[: self.end]

    def step(self, token_id: int) -> str | None:
        """Take the next output token; returns the stop string it completes, or None."""
        self.ids.append(token_id)
        if self.matched is not None:
            return self.matched
        before = len(self.detok.text)
        self.detok.step(self.ids)
        text = self.detok.text
        best = None  # (end, -length, start, string) of the earliest-ending match in the new text
        for stop in self.stops:
            start = text.find(stop, max(0, before - len(stop) + 1))
            if start >= 0:
                best = min(best or (1 << 62,), (start + len(stop), -len(stop), start, stop))
        if best is not None:
            end, _, start, self.matched = best
            self.end = end if self.include else start
        return self.matched

    def visible(self, final: bool = False) -> str:
        """The text a stream may show now (all of it once `final`)."""
        if final and self.end is None:
            self.detok.step(self.ids, final=True)
        if final or self.end is not None:
            return self.text
        return self.detok.text[: max(0, len(self.detok.text) - self.hold)]
