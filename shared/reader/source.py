"""A Python file as the reader shows it: blocks of (prose, code), the code highlighted line by line.

A block starts at every comment that stands on its own lines between statements and at every class or
function that has a docstring (its decorators and signature open the block, the docstring becomes its
prose). Its prose is those comments and that docstring, as Markdown; its code is every other line up to
the next block, so each line of the file that holds code appears in exactly one block. Comments inside
brackets and at the end of a line stay with their code.
"""

from __future__ import annotations

import ast
import html
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .maps import docstring_ranges
from .prose import CITATION

PRAGMA = re.compile(r"#\s*(noqa|type:|fmt:|ruff:|pragma|pylint:|isort:|!)")


@dataclass
class Block:
    """Prose (Markdown pieces, each with the source line it starts on) beside consecutive lines of code."""

    prose: list[tuple[str, int]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)


@dataclass
class SourceFile:
    """A parsed file: its lines, its blocks and the algorithm each line's citations continue."""

    path: Path
    lines: list[str]
    blocks: list[Block]
    algorithms: list[tuple[int, str]]  # (line, number) where the text names "Algorithm <number>"
    tree: ast.Module

    def algorithm_at(self, line: int) -> str | None:
        """The algorithm a bare `line 8` at `line` refers to: the last one named before it, else the first
        the file names."""
        before = [alg for ln, alg in self.algorithms if ln <= line]
        return before[-1] if before else (self.algorithms[0][1] if self.algorithms else None)


def _comment_text(lines: list[str]) -> str:
    """Comment lines -> Markdown: the `#` and one space dropped, rules of dashes dropped."""
    body = []
    for line in lines:
        text = line.strip()[1:]
        text = text[1:] if text.startswith(" ") else text
        body.append(re.sub(r"^[-=#*]{4,}\s*", "", text))
    return textwrap.dedent("\n".join(body)).strip("\n")


def parse(path: Path) -> SourceFile:
    """Split `path` into blocks (see the module docstring)."""
    src = path.read_text(encoding="utf-8")
    lines = src.splitlines()
    tree = ast.parse(src)
    doc_at: dict[int, tuple[int, str]] = {}  # docstring's first line -> (last line, cleaned text)
    opens: dict[int, int] = {}  # first line of a class / def with a docstring -> its docstring's first line
    for owner, first in docstring_ranges(tree):
        start, end = first.lineno, first.end_lineno
        if lines[start - 1][:first.col_offset].strip() or lines[end - 1][first.end_col_offset:].split("#")[0].strip():
            continue  # shares a line with code: stays code
        doc_at[start] = (end, inspect.cleandoc(first.value.value))
        if not isinstance(owner, ast.Module):
            opens[min([owner.lineno] + [d.lineno for d in owner.decorator_list])] = start

    # comments on lines of their own, between statements (not inside brackets)
    standalone: set[int] = set()
    algorithms: list[tuple[int, str]] = []
    depth = 0
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif tok.type in (tokenize.COMMENT, tokenize.STRING):
            for m in CITATION.finditer(tok.string):
                if m.group("alg"):
                    algorithms.append((tok.start[0] + tok.string.count("\n", 0, m.start()), m.group("alg")))
        # at depth 0 a comment on a line of its own stands between statements (a backslash continuation
        # cannot be followed by one)
        if (tok.type == tokenize.COMMENT and depth == 0 and not tok.line[:tok.start[1]].strip()
                and not PRAGMA.match(tok.string)):
            standalone.add(tok.start[0])

    blocks = [Block()]
    n = 1
    while n <= len(lines):
        block = blocks[-1]
        has_code = any(lines[i - 1].strip() for i in block.lines)
        if n in standalone:
            run = []
            while n <= len(lines) and (n in standalone or (not lines[n - 1].strip() and n + 1 in standalone)):
                run.append(lines[n - 1])
                n += 1
            if has_code:
                block = Block()
                blocks.append(block)
            block.prose.append((_comment_text(run), n - len(run)))
            continue
        if n in opens and has_code:
            block = Block()
            blocks.append(block)
        if n in doc_at:
            end, text = doc_at[n]
            block.prose.append((text, n))
            n = end + 1
            continue
        block.lines.append(n)
        n += 1

    tidy: list[Block] = []
    for block in blocks:
        while block.lines and not lines[block.lines[0] - 1].strip():
            block.lines.pop(0)
        while block.lines and not lines[block.lines[-1] - 1].strip():
            block.lines.pop()
        if not block.lines and tidy:  # prose with no code after it (a file's last comment): the block before
            tidy[-1].prose += block.prose
        elif block.lines or block.prose:
            tidy.append(block)
    return SourceFile(path, lines, tidy, algorithms, tree)


# --------------------------------------------------------------------------- highlighting
def highlight_lines(src: str, comment: Callable[[str, int], str]) -> list[str]:
    """The HTML of each line of `src`, highlighted by Pygments; each line's spans are closed on it.
    `comment(text, line)` renders a comment (citations as links)."""
    from pygments.lexers import PythonLexer
    from pygments.token import STANDARD_TYPES, Comment

    lexer = PythonLexer(stripnl=False, ensurenl=False, stripall=False)
    out: list[list[str]] = [[]]
    for ttype, value in lexer.get_tokens(src):
        css = ttype
        while css not in STANDARD_TYPES:
            css = css.parent
        cls = STANDARD_TYPES[css]
        for i, piece in enumerate(value.split("\n")):
            if i:
                out.append([])
            if not piece:
                continue
            text = comment(piece, len(out)) if ttype in Comment else html.escape(piece, quote=False)
            out[-1].append(f'<span class="{cls}">{text}</span>' if cls else text)
    return ["".join(parts) for parts in out]
