"""Each package README's `## Read the code` table tells the truth.

The section lists the package's paper path: the files a reader opens beside the paper, in reading order,
as a table whose first column names each file in backticks and whose second column gives its code lines
(lines holding a token that is not a comment, a docstring or blank). This test recounts every file,
checks the stated counts, and holds the paper path to the package's budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# The parsing rules live with the reader that renders the same tables (one parser of each table).
from shared.reader.maps import code_line_numbers, code_lines, reading_map

__all__ = ["code_line_numbers", "code_lines", "reading_map"]  # test_import_graph imports reading_map

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
