"""The repository's maps, read as text: each package README's `## Read the code` table (the paper path in
reading order), its performance-layer lines, its paper -> code table, the papers it implements, the
root README's package table and import diagram, and BENCHMARKS.md's headlines and sections.

These are the parsing rules the documentation tests hold the READMEs to
(`tests/e2e/test_read_the_code.py`, `tests/e2e/test_paper_maps.py` import them from here), so the reader
and the tests cannot disagree about what a table says. Nothing here imports a package: files are read.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARXIV_ID = r"\d{4}\.\d{4,5}"
# The code column of a paper -> code table (test_paper_maps): headed "code" or "where"; shared's "module".
CODE_COLUMNS = ("code", "where", "module")


# --------------------------------------------------------------------------- code lines
def docstring_ranges(tree: ast.Module) -> list[tuple[ast.AST, ast.Expr]]:
    """(owner, docstring expression) of the module and of every class and function that has one."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                found.append((node, first))
    return found


def code_line_numbers(path: Path) -> set[int]:
    """The numbers (1-based) of the lines of `path` that hold a token which is not a comment, part of a
    docstring, or blank: the lines `code_lines` counts."""
    src = path.read_text(encoding="utf-8")
    doc: set[int] = set()
    for _, first in docstring_ranges(ast.parse(src)):
        doc.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            lines.update(ln for ln in range(tok.start[0], tok.end[0] + 1) if ln not in doc)
    return lines


def code_lines(path: Path) -> int:
    """Lines of `path` that hold a token which is not a comment, part of a docstring, or blank."""
    return len(code_line_numbers(path))


# --------------------------------------------------------------------------- markdown tables and sections
def section(text: str, heading: str) -> str | None:
    """The body of the `## heading` section of a Markdown text (up to the next `## `), or None."""
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.S | re.M)
    return m.group(1) if m else None


def split_row(line: str) -> list[str]:
    """The cells of a Markdown table row (escaped pipes `\\|` stay inside their cell)."""
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip() for c in cells]


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header cells, body rows) of every Markdown table in `text`."""
    found: list[tuple[list[str], list[list[str]]]] = []
    header = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        if header is None:
            header = split_row(line)
            found.append((header, []))
        elif not set(line) <= set("|-: "):
            found[-1][1].append(split_row(line))
    return found


# --------------------------------------------------------------------------- the reading map
@dataclass(frozen=True)
class ReadingRow:
    """One row of a `## Read the code` table: a paper-path file, its stated code lines, its paper sections
    (Markdown, as written)."""

    path: Path
    stated: int
    sections: str
    name: str  # the file's path inside its package, as the page names it


def read_the_code(package: str, root: Path = ROOT) -> str:
    """The text of the package README's section headed exactly `## Read the code`."""
    readme = root / package / "README.md"
    if not readme.is_file():
        raise FileNotFoundError(f"{readme} does not exist (is {root} a nano-infra checkout?)")
    body = section(readme.read_text(encoding="utf-8"), "Read the code")
    if body is None:
        raise ValueError(f"{package}/README.md has no section headed exactly '## Read the code'")
    return body


def reading_rows(package: str, root: Path = ROOT) -> list[ReadingRow]:
    """The rows of the `## Read the code` table: the paper path, in reading order."""
    rows = []
    for line in read_the_code(package, root).splitlines():
        cells = split_row(line) if line.startswith("|") else []
        if len(cells) < 2 or set(line) <= set("|-: "):
            continue
        files = re.findall(r"`([\w/.\-]+\.py)`", cells[0])
        if not files:  # the header row, or a row that is prose
            continue
        if len(files) != 1:
            raise ValueError(f"{package}: one file per row of '## Read the code', got {files}")
        name = files[0].removeprefix(package + "/")
        count = re.search(r"\d[\d,]*", cells[1])
        if not count:
            raise ValueError(f"{package}: row for {files[0]} states no code-line count: {line!r}")
        rows.append(ReadingRow(root / package / name, int(count.group().replace(",", "")),
                               cells[2] if len(cells) > 2 else "", name))
    if not rows:
        raise ValueError(f"{package}: the '## Read the code' table lists no files")
    return rows


def reading_map(package: str, root: Path = ROOT) -> list[tuple[Path, int]]:
    """(file, stated code lines) for each row of the README's `## Read the code` table."""
    return [(row.path, row.stated) for row in reading_rows(package, root)]


def paper_path_packages(root: Path = ROOT) -> list[str]:
    """The packages whose README has a `## Read the code` section, in the root README's order."""
    found = [p.name for p in sorted(root.iterdir()) if (p / "README.md").is_file() and (p / "__init__.py").is_file()
             and section((p / "README.md").read_text(encoding="utf-8"), "Read the code") is not None]
    order = [pkg for pkg, _ in package_table(root)]
    return sorted(found, key=lambda p: (order.index(p) if p in order else len(order), p))


# --------------------------------------------------------------------------- performance layers
@dataclass(frozen=True)
class LayerLine:
    """One performance-layer line of a `## Read the code` section: the layer file (inside `owner`), and the
    line as written (Markdown: what it buys, a number with card and date, a BENCHMARKS link)."""

    file: str
    owner: str
    markdown: str


def layer_lines(package: str, root: Path = ROOT) -> list[LayerLine]:
    """The section's list items that name a `layers/` file, in order."""
    items, current = [], None
    for line in read_the_code(package, root).splitlines():
        if re.match(r"[*-] ", line):
            current = [line[2:]]
            items.append(current)
        elif current is not None and line.startswith("  ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    found = []
    for item in items:
        text = " ".join(item)
        m = re.search(r"(?:(nano_\w+|shared)'s\s+)?`(layers/[\w/]+\.py)`", text)
        if m:
            found.append(LayerLine(m.group(2), m.group(1) or package, text))
    return found


def layer_files(package: str, root: Path = ROOT) -> list[Path]:
    """The package's `layers/` files that hold code."""
    folder = root / package / "layers"
    return [p for p in sorted(folder.rglob("*.py")) if p.read_text(encoding="utf-8").strip()] if folder.is_dir() else []


# --------------------------------------------------------------------------- paper -> code
def code_cells(readme: Path) -> list[str]:
    """Backticked strings of the code column of every table in `readme`."""
    found = []
    for header, rows in tables(readme.read_text(encoding="utf-8")):
        names = [c.lower() for c in header]
        column = next((names.index(c) for c in CODE_COLUMNS if c in names), -1)
        if column < 0:
            continue
        for cells in rows:
            if column < len(cells):
                found += re.findall(r"`([^`]+)`", cells[column])
    return found


# --------------------------------------------------------------------------- papers
@dataclass(frozen=True)
class Paper:
    """A paper a package implements or cites: its arXiv id and the names the text calls it by."""

    arxiv: str
    names: tuple[str, ...]

    @property
    def url(self) -> str:
        return f"https://arxiv.org/abs/{self.arxiv}"

    @property
    def title(self) -> str:
        return f"{self.names[0]} (arXiv {self.arxiv})" if self.names else f"arXiv {self.arxiv}"


def _aliases(clause: str) -> list[str]:
    """The names a clause gives the paper cited after it: its first word with a capital letter, the words
    around a ` / ` beside it, and an acronym with a digit (`FlashAttention-2` -> `FA2`)."""
    words = [w.strip("*_`\"") for w in clause.split()]
    first = next((i for i, w in enumerate(words) if any(ch.isupper() for ch in w) and w != "arXiv"
                  and not (i + 1 < len(words) and re.fullmatch(r"\d{4}", words[i + 1]))), None)
    if first is None:
        return []
    out = [words[first].removesuffix("'s")]
    i = first
    while i + 2 < len(words) and words[i + 1] == "/":
        out.append(words[i + 2].removesuffix("'s"))
        i += 2
    acronym = "".join(ch for ch in out[0] if ch.isupper() or ch.isdigit())
    if len(acronym) >= 2 and any(ch.isdigit() for ch in acronym):
        out.append(acronym)
    return out


def papers_in(text: str) -> list[Paper]:
    """Papers named as `Name (arXiv id[, id])`, `Name ([Author 2023, arXiv id](...))` or `Name, arXiv id`:
    each id with the names of the clause before it (an id listed after another takes that one's names)."""
    found: dict[str, list[str]] = {}
    last_names: list[str] = []
    for m in re.finditer(ARXIV_ID, text):
        before = text[max(0, m.start() - 80):m.start()]
        if re.search(rf"{ARXIV_ID},\s*$", before):
            names = last_names
        else:
            before = re.sub(r"\s*[\[(]*\s*(?:[A-Z][\w\-]+(?: et al\.?)?(?: & [A-Z]\w+)? \d{4},\s*)?"
                            r"(?:arXiv[: ]?\s*)?$", "", before)
            clause = re.split(r"[;:.,()\[\]|]", before.rstrip(", "))[-1]
            names = _aliases(clause)
        last_names = names
        entry = found.setdefault(m.group(), [])
        entry += [n for n in names if n not in entry]
    return [Paper(arxiv, tuple(names)) for arxiv, names in found.items()]


def package_papers(package: str, root: Path = ROOT) -> list[Paper]:
    """The package's papers, its own first (the root README's row, then its README's opening), then every
    other paper its README names."""
    own = next((cell for pkg, cell in package_table(root) if pkg == package), "")
    readme = (root / package / "README.md").read_text(encoding="utf-8")
    opening = readme.split("\n## ", 1)[0]
    merged: dict[str, list[str]] = {}
    for paper in papers_in(own) + papers_in(opening) + papers_in(readme):
        names = merged.setdefault(paper.arxiv, [])
        names += [n for n in paper.names if n not in names]
    return [Paper(arxiv, tuple(names)) for arxiv, names in merged.items()]


# --------------------------------------------------------------------------- the root README
def package_table(root: Path = ROOT) -> list[tuple[str, str]]:
    """(package, paper cell) of each row of the root README's paper -> package table."""
    readme = root / "README.md"
    if not readme.is_file():
        return []
    rows = []
    for header, body in tables(readme.read_text(encoding="utf-8")):
        names = [c.lower() for c in header]
        if "package" in names and "paper" in names:
            for cells in body:
                m = re.search(r"`(\w+)`", cells[names.index("package")])
                if m:
                    rows.append((m.group(1), cells[names.index("paper")]))
    return rows


def import_diagram(root: Path = ROOT) -> str | None:
    """The root README's import diagram: the fenced block whose lines hold the arrows `←`."""
    readme = root / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        if "←" in block and "nano_" in block:
            return block.rstrip("\n")
    return None


def import_edges(diagram: str) -> list[tuple[str, str, str]]:
    """(importer, imported, kind) for each arrow of the diagram: `a, b ← c (+ d); e may import it` gives
    a→c and b→c ("direct"), a→d and b→d ("optional": in parentheses), e→a and e→b ("may")."""
    edges = []
    for line in diagram.splitlines():
        if "←" not in line:
            continue
        left, right = line.split("←", 1)
        importers = [p.strip() for p in left.split(",") if p.strip()]
        for part in right.split(";"):
            for name in re.findall(r"(\w+) may import it", part):
                edges += [(name, imp, "may") for imp in importers]
            part = re.sub(r"\w+ may import it", "", part)
            optional = " ".join(re.findall(r"\(([^)]*)\)", part))
            for text, kind in ((re.sub(r"\([^)]*\)", "", part), "direct"), (optional, "optional")):
                for dep in re.findall(r"[A-Za-z_]\w*", text):
                    if dep != "only":
                        edges += [(imp, dep, kind) for imp in importers]
    return edges


# --------------------------------------------------------------------------- BENCHMARKS.md
def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (lower case; punctuation but `-` and `_` dropped; spaces
    to `-`): the anchors the READMEs' BENCHMARKS links use."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def benchmarks_sections(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """{package: (anchor, body)} of BENCHMARKS.md's `## <package> — ...` sections."""
    path = root / "BENCHMARKS.md"
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    found = {}
    for m in re.finditer(r"^## ((\w+)\b[^\n]*)\n(.*?)(?=^## |\Z)", text, re.S | re.M):
        found.setdefault(m.group(2), (slug(m.group(1)), m.group(3)))
    return found


@dataclass(frozen=True)
class Headline:
    """A row of BENCHMARKS.md's Headlines table, with the card and dates it was measured on."""

    package: str
    cells: dict[str, str]
    card: str
    dates: tuple[str, ...]


def headlines(root: Path = ROOT) -> dict[str, list[Headline]]:
    """{package: its rows of the Headlines table}. The card is the one the row names, else the one its
    section's dates line names, else the page's default (the first GPU model the page names); the dates
    are the row's own, else those of its section's `**Date(s):**` line."""
    path = root / "BENCHMARKS.md"
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    body = section(text, "Headlines") or ""
    cards = re.findall(r"\b([HAB]\d{2,3})\b", text.split("\n## ", 1)[0])
    default = cards[0] if cards else "GPU"
    sections = benchmarks_sections(root)
    found: dict[str, list[Headline]] = {}
    for header, rows in tables(body)[:1]:
        names = [h.lower() for h in header]
        for cells in rows:
            row = dict(zip(names, cells))
            package = row.get("package", "").strip("` ")
            dates_line = re.search(r"\*\*Dates?:\*\*([^\n]*(?:\n(?!- )[^\n]*)*?)(?=\*\*|\n- |\n\n|$)",
                                   sections.get(package, ("", ""))[1])
            dates_text = dates_line.group(1) if dates_line else ""
            joined = " ".join(cells)
            card = next(iter(re.findall(r"\b(H100|H200|A100|B200)\b", joined)), None)
            card = card or next(iter(re.findall(r"\b(H100|H200|A100|B200)\b", dates_text)), None) or default
            dates = re.findall(r"\d{4}-\d{2}-\d{2}", joined) or re.findall(r"\d{4}-\d{2}-\d{2}", dates_text)
            found.setdefault(package, []).append(Headline(package, row, card, tuple(dict.fromkeys(dates))))
    return found
