"""The bench's prompts, from the standard library's held-out modules (`shared.data.stdlib_split` "val":
5% of the files, never seen by a model trained on the stdlib corpus here):

* `code` — continuation of a file: the first `prompt_tokens` tokens of a module's source (a second
  window further on once every file has given its first);
* `text` — docstrings: the docstrings of the held-out modules (module, classes, functions; `ast`) as
  one plain text, in consecutive windows of `prompt_tokens` tokens, then (where more prompts are needed)
  the held-out documents of the stdlib documentation corpus (`shared.data.corpus_documents("val")`);
* `edit` — code editing, the workload prompt lookup is for (Saxena 2023): the prompt holds a file (its
  first lines, up to `prompt_tokens` tokens) and asks for it again, edited; the answer rewrites it, so most
  of what the target emits is already in the prompt.

Prompts are token ids of the engine's tokenizer. A workload that cannot give `count` prompts reuses its
prompts in order (said in the notes); the files are read once per process.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable

from shared.data import corpus_documents, read_source, stdlib_files, stdlib_root, stdlib_split

WORKLOADS = ("code", "text", "edit")
EDIT_HEADER = "### {path}, as it is:\n"
EDIT_ASK = "\n### {path}, edited (the same code, its comments fixed):\n"


@functools.cache
def held_out_sources() -> tuple[tuple[str, str], ...]:
    """(relative path, source) of every held-out stdlib module, in path order."""
    root = stdlib_root()
    return tuple((rel, read_source(root / rel)) for rel in stdlib_files(root)
                 if stdlib_split(rel) == "val")


def docstrings(source: str) -> str:
    """The docstrings of a module's source (module, then classes and functions in order), joined by blank
    lines; "" for a file that does not parse or has none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    nodes = [n for n in ast.walk(tree)
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    docs = (ast.get_docstring(n) for n in nodes)
    return "\n\n".join(d for d in docs if d)


def windows(docs: list[list[int]], length: int, count: int) -> list[list[int]]:
    """`count` windows of `length` tokens: each document's first window, then each one's second, ...;
    documents shorter than `length` give none."""
    out: list[list[int]] = []
    start = 0
    while len(out) < count:
        found = [d[start : start + length] for d in docs if len(d) >= start + length]
        if not found:
            break
        out += found[: count - len(out)]
        start += length
    return out


def edit_prompt(path: str, source: str, encode: Callable[[str], list[int]], length: int) -> list[int]:
    """A file's first whole lines (up to `length` tokens with the two headers) and the ask to rewrite it,
    followed by the rewrite's first line (so the continuation is the rest of the file)."""
    head, ask = encode(EDIT_HEADER.format(path=path)), EDIT_ASK.format(path=path)
    lines = source.splitlines(keepends=True)
    budget = length - len(head) - len(encode(ask)) - len(encode(lines[0] if lines else ""))
    body, used = [], 0
    for line in lines:
        n = len(encode(line))
        if used + n > budget:
            break
        body.append(line)
        used += n
    if len(body) < 2:
        return []
    text = "".join(body)
    return head + encode(text.rstrip("\n") + ask + body[0])


def make_prompts(workload: str, encode: Callable[[str], list[int]], prompt_tokens: int,
                 count: int) -> tuple[list[list[int]], list[str]]:
    """`count` prompts of a workload (token ids of `encode`), and notes on what had to be reused."""
    if workload not in WORKLOADS:
        raise ValueError(f"workloads: unknown workload {workload!r}; valid: {list(WORKLOADS)}")
    sources = held_out_sources()
    if workload == "code":  # a file's first characters: enough for two windows (~4 per token)
        prompts = windows([encode(src[: 8 * prompt_tokens * 2]) for _, src in sources],
                          prompt_tokens, count)
    elif workload == "text":
        stream = "\n\n".join(d for d in (docstrings(src) for _, src in sources) if d)
        prompts = windows([encode(stream)], prompt_tokens, count)
        if len(prompts) < count:
            prompts += windows([encode("\n\n".join(corpus_documents("val")))], prompt_tokens,
                               count - len(prompts))
    else:
        prompts = [p for p in (edit_prompt(path, src, encode, prompt_tokens) for path, src in sources)
                   if p][:count]
    if not prompts:
        raise ValueError(f"workload {workload!r}: no held-out stdlib file gives a prompt of "
                         f"{prompt_tokens} tokens")
    notes = []
    if len(prompts) < count:
        notes.append(f"note: workload {workload!r} has {len(prompts)} distinct prompts of "
                     f"{prompt_tokens} tokens; they are reused to make {count}")
        prompts = [prompts[i % len(prompts)] for i in range(count)]
    return prompts, notes
