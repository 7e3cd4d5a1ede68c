"""Each package README's `## Read the code` table tells the truth.

The section lists the package's paper path: the files a reader opens beside the paper, in reading order,
as a table whose first column names each file in backticks and whose second column gives its code lines
(lines holding a token that is not a comment, a docstring or blank). This test recounts every file,
checks the stated counts, and holds the paper path to the package's budget.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Paper-path budgets in code lines, per package.
BUDGETS = {
    "nano_flashattn": 650,
    "nano_megatron": 800,
    "nano_zero": 420,
    "nano_vllm": 740,
    "nano_sglang": 730,
    "nano_distserve": 640,
    "nano_quant": 600,
    "nano_specdec": 700,
}
# No paper-path line that holds code is longer than this (written at the density of the Triton tutorial).
MAX_CODE_LINE = 100


def code_lines(path: Path) -> int:
    """Lines of `path` that hold a token which is not a comment, part of a docstring, or blank."""
    return len(code_line_numbers(path))


def code_line_numbers(path: Path) -> set[int]:
    """The numbers (1-based) of the lines `code_lines` counts."""
    src = path.read_text(encoding="utf-8")
    doc: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                doc.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            lines.update(ln for ln in range(tok.start[0], tok.end[0] + 1) if ln not in doc)
    return lines


def reading_map(package: str) -> list[tuple[Path, int]]:
    """(file, stated code lines) for each row of the README's `## Read the code` table."""
    text = (ROOT / package / "README.md").read_text()
    m = re.search(r"^## Read the code\s*$(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"{package}/README.md has no section headed exactly '## Read the code'"
    rows = []
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 2 or set(line) <= set("|-: "):
            continue
        files = re.findall(r"`([\w/.\-]+\.py)`", cells[0])
        if not files:  # the header row, or a row that is prose
            continue
        assert len(files) == 1, f"{package}: one file per row, got {files}"
        path = ROOT / (files[0] if files[0].startswith(package + "/") else f"{package}/{files[0]}")
        count = re.search(r"\d[\d,]*", cells[1])
        assert count, f"{package}: row for {files[0]} states no code-line count: {line!r}"
        rows.append((path, int(count.group().replace(",", ""))))
    assert rows, f"{package}: the '## Read the code' table lists no files"
    return rows


PACKAGES = [p for p in BUDGETS if (ROOT / p / "README.md").exists()]


@pytest.mark.parametrize("package", PACKAGES)
def test_read_the_code_counts_and_budget(package):
    rows = reading_map(package)
    wrong = []
    for path, stated in rows:
        assert path.exists(), f"{package}: the reading map names {path.relative_to(ROOT)}, which does not exist"
        actual = code_lines(path)
        if actual != stated:
            wrong.append(f"{path.relative_to(ROOT)}: README says {stated}, counted {actual}")
    assert not wrong, f"{package}: stale code-line counts in '## Read the code':\n" + "\n".join(wrong)
    total = sum(n for _, n in rows)
    assert total <= BUDGETS[package], f"{package}: paper path is {total} code lines, budget {BUDGETS[package]}"


@pytest.mark.parametrize("package", PACKAGES)
def test_paper_path_code_lines_are_readable_width(package):
    long = []
    for path, _ in reading_map(package):
        text = path.read_text(encoding="utf-8").splitlines()
        long += [f"{path.relative_to(ROOT)}:{n}: {len(text[n - 1])} characters"
                 for n in sorted(code_line_numbers(path)) if len(text[n - 1]) > MAX_CODE_LINE]
    assert not long, (f"{package}: paper-path code lines over {MAX_CODE_LINE} characters "
                      f"({len(long)}):\n" + "\n".join(long[:40]))


def test_code_lines_counts_only_code(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""Module doc\nover two lines."""\n\n# a comment\nx = 1  # trailing\n\n'
                 'def g():\n    """Doc."""\n    return (1,\n            2)\n')
    assert code_lines(f) == 4  # x = 1; def g; return (1,; 2)
