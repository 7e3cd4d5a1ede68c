"""`python -m shared.reader`: the site it builds, checked without a browser.

Every paper-path line of code appears exactly once in its page's code column (with its own text); no
internal link or anchor is broken; every file of each README's reading table is on its page, every layer
file in the collapsed layers; every citation in the prose and in the code's comments is a link to arXiv;
every name of the paper -> code tables links to an anchor on its definition line; the index carries every
package's paper-path size and headline. Plus the formula and citation rules, and the errors.
"""

from __future__ import annotations

import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from shared.reader import build_parser, build_site, main, maps
from shared.reader.maps import code_line_numbers, code_lines, reading_rows
from shared.reader.prose import CiteContext, cite, math
from shared.reader.resolve import resolve

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = maps.paper_path_packages(ROOT)
PROJECT = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()
                 and (p.name == "shared" or p.name.startswith("nano_")))
VOID = {"img", "br", "meta", "link", "input", "hr", "wbr", "source", "area", "col", "path", "rect", "line"}
COMMENT_CLASSES = {"c", "c1", "cm", "ch", "cs", "cpf"}
# What a citation starts with: written independently of the reader's own pattern.
CITATION_START = re.compile(r"§\s?\d|\bAlgorithms? \d|\bEqs?\. ?\d|\bEquations? \d|\bFig(?:ure)?s?\.? ?\d"
                            r"|\b[Aa]ppendix [A-Z]|\bTheorem \d|\bTable \d|\b\d{4}\.\d{4,5}\b|\b[Ss]ection \d")
BARE_LINE = re.compile(r"\blines? \d")


class Page(HTMLParser):
    """What the tests read off a generated page."""

    def __init__(self, path: Path):
        super().__init__(convert_charrefs=True)
        self.ids: dict[str, tuple[str, str, int | None]] = {}  # id -> (tag, file, line it sits on)
        self.hrefs: list[str] = []
        self.srcs: list[str] = []
        self.code: dict[tuple[str, str], dict[int, list[str]]] = {}  # (file, role) -> {line: [texts]}
        self.unlinked: list[tuple[str, str]] = []  # (file or "", text) of citations outside a link
        self.names: list[tuple[str, str]] = []  # (code text, href) of linked names
        self.stack: list[tuple[str, dict]] = []
        self._line_text: list[str] | None = None
        self.feed(path.read_text(encoding="utf-8"))

    def _inside(self, tag: str, cls: str | None = None) -> dict | None:
        for t, attrs in reversed(self.stack):
            if t == tag and (cls is None or cls in (attrs.get("class") or "").split()):
                return attrs
        return None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        pre = self._inside("pre")
        line = self._inside("span", "line")
        if "id" in attrs:
            assert attrs["id"] not in self.ids, f"duplicate id {attrs['id']!r}"
            self.ids[attrs["id"]] = (tag, (pre or {}).get("data-file", ""),
                                     int(line["data-n"]) if line and "data-n" in line else None)
        if tag == "a" and "href" in attrs:
            self.hrefs.append(attrs["href"])
        if tag in ("img", "script") and "src" in attrs:
            self.srcs.append(attrs["src"])
        if tag == "link" and attrs.get("rel") == "stylesheet":
            self.srcs.append(attrs["href"])
        if tag not in VOID:
            self.stack.append((tag, attrs))
        if tag == "span" and "src" in (attrs.get("class") or "").split() and pre:
            self._line_text = []
        if tag == "a" and "name" in (attrs.get("class") or "").split():
            self._name = (attrs["href"], [])

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        while self.stack:
            t, attrs = self.stack.pop()
            if t == "span" and "src" in (attrs.get("class") or "").split() and self._line_text is not None:
                pre, line = self._inside("pre"), self._inside("span", "line")
                key = (pre.get("data-file", ""), pre.get("data-role", ""))
                self.code.setdefault(key, {}).setdefault(int(line["data-n"]), []).append("".join(self._line_text))
                self._line_text = None
            if t == "a" and "name" in (attrs.get("class") or "").split():
                self.names.append(("".join(self._name[1]), self._name[0]))
            if t == tag:
                break

    def handle_data(self, data):
        if self._line_text is not None:
            self._line_text.append(data)
        if self._inside("a", "name") is not None:
            self._name[1].append(data)
        if any(t in ("a", "code", "title", "script", "style", "svg", "nav") for t, _ in self.stack):
            return
        pre = self._inside("pre")
        if pre is not None and not any(set((a.get("class") or "").split()) & COMMENT_CLASSES
                                       for t, a in self.stack if t == "span"):
            return  # code, not a comment
        file = (pre or {}).get("data-file", "")
        for m in CITATION_START.finditer(data):
            self.unlinked.append((file, data[max(0, m.start() - 30):m.end() + 30]))
        for m in BARE_LINE.finditer(data):
            self.unlinked.append((file or "?line", data[max(0, m.start() - 30):m.end() + 30]))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site") / "site"
    pages = build_site(out, ROOT)
    assert {p.name for p in pages} == {f"{p}.html" for p in PACKAGES} | {"index.html", "benchmarks.html"}
    return out


@pytest.fixture(scope="module")
def pages(site) -> dict[str, Page]:
    return {p.name: Page(p) for p in sorted(site.glob("*.html"))}


@pytest.mark.parametrize("package", PACKAGES)
def test_every_paper_path_code_line_appears_exactly_once(package, pages):
    page = pages[f"{package}.html"]
    for row in reading_rows(package, ROOT):
        rel = row.path.relative_to(ROOT).as_posix()
        shown = page.code.get((rel, "paper"), {})
        source = row.path.read_text(encoding="utf-8").splitlines()
        wanted = code_line_numbers(row.path)
        missing = sorted(wanted - set(shown))
        assert not missing, f"{rel}: code lines not on the page: {missing[:20]}"
        twice = sorted(n for n, texts in shown.items() if len(texts) != 1)
        assert not twice, f"{rel}: lines shown more than once: {twice[:20]}"
        wrong = [n for n in wanted if shown[n][0] != source[n - 1]]
        assert not wrong, f"{rel}: lines whose text differs from the file: {wrong[:10]}"
        assert len([n for n in shown if n in wanted]) == code_lines(row.path)
        assert list(shown) == sorted(shown), f"{rel}: lines out of order"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_file_of_the_reading_table_and_every_layer_is_on_its_page(package, pages):
    page = pages[f"{package}.html"]
    for row in reading_rows(package, ROOT):
        assert page.ids.get(row.name, ("",))[0] == "section", f"{package}: no section for {row.name}"
    for path in maps.layer_files(package, ROOT):
        name = path.relative_to(ROOT / package).as_posix()
        assert page.ids.get(name, ("",))[0] == "details", f"{package}: {name} is not a collapsed layer"
        shown = page.code.get((path.relative_to(ROOT).as_posix(), "layer"), {})
        assert set(shown) >= code_line_numbers(path), f"{package}: {name}'s code is not all there"
    for line in maps.layer_lines(package, ROOT):  # another package's layer: a link to its page
        if line.owner != package:
            assert f"{line.owner}.html#{line.file}" in page.hrefs


def test_no_internal_link_or_anchor_is_broken(site, pages):
    broken = []
    for name, page in pages.items():
        external = [src for src in page.srcs if re.match(r"[a-z]+:|//", src)]
        assert not external, f"{name} loads from elsewhere (the site must work offline): {external}"
        for href in page.hrefs + page.srcs:
            if re.match(r"[a-z]+:", href):
                assert href.startswith(("https://", "http://")), f"{name}: {href}"
                continue
            target, _, frag = href.partition("#")
            target = target or name
            if not (site / target).is_file():
                broken.append(f"{name}: {href} (no file {target})")
            elif frag and target.endswith(".html") and frag not in pages[target].ids:
                broken.append(f"{name}: {href} (no id {frag!r} in {target})")
    assert not broken, "\n".join(broken[:30])


@pytest.mark.parametrize("package", PACKAGES)
def test_every_citation_is_a_link(package, pages):
    unlinked = pages[f"{package}.html"].unlinked
    assert not unlinked, f"{package}: citations that are not links: {unlinked[:10]}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_of_the_paper_to_code_table_is_an_anchor_on_its_definition(package, pages):
    page = pages[f"{package}.html"]
    paper_path = [row.path for row in reading_rows(package, ROOT)]
    linked = dict(page.names)
    table = maps.section((ROOT / package / "README.md").read_text(encoding="utf-8"), "Paper → code") or ""
    wrong = []
    for token in re.findall(r"`([^`]+)`", "".join(c for h, rows in maps.tables(table) for r in rows
                                                  for i, c in enumerate(r) if h[i].lower() in maps.CODE_COLUMNS)):
        d = resolve(token, package, ROOT, PROJECT, first=paper_path)
        if d is None:
            continue  # prose in backticks, a test, a command
        href = linked.get(token)
        if href is None:
            wrong.append(f"{token}: not a link")
            continue
        target, _, frag = href.partition("#")
        tag, file, line = pages[target or f"{package}.html"].ids[frag]
        on_line = tag == "span" and file == d.path.relative_to(ROOT).as_posix() and line == d.line
        beside = (tag == "details" and frag == d.fullname
                  and d.line in page.code.get((d.path.relative_to(ROOT).as_posix(), "beside"), {}))
        whole_file = d.qualname == "" and tag == "section"
        if not (on_line or beside or whole_file):
            wrong.append(f"{token}: {href} is a {tag} at {file}:{line}, not {d.path.name}:{d.line}")
    assert not wrong, f"{package}: " + "; ".join(wrong)


def test_the_index_has_every_package_its_size_and_headline(pages, site):
    text = (site / "index.html").read_text(encoding="utf-8")
    heads = maps.headlines(ROOT)
    for package in PACKAGES:
        total = sum(code_lines(r.path) for r in reading_rows(package, ROOT))
        assert f'href="{package}.html"' in text
        assert f"{total:,} code lines" in text, f"{package}: {total} code lines not on the index"
        if package in heads:
            assert f"({heads[package][0].card}, {heads[package][0].dates[0]}" in text
    assert "<svg" in text and all(f'<a href="{p}.html"><rect' in text for p in PACKAGES)  # the import arrows
    assert any(p.startswith("img/") for p in pages["nano_flashattn.html"].srcs)


def test_formulas_are_typeset():
    assert math("S_ij = Q_i K_j^T") == ('<span class="math">S<sub>ij</sub></span> = <span class="math">Q<sub>i'
                                       '</sub></span> <span class="math">K<sub>j</sub></span><sup>T</sup>')
    assert math("s_X^α / s_W^(1−α)").endswith("<sup>1−α</sup>")
    assert "<sup>−1</sup>" in math("diag(l_i)^-1")
    assert math("for 1 <= j, P o (dP - D)") == "for 1 ≤ j, P ∘ (dP - D)"
    assert math("k/v by kv heads, o by rows") == "k/v by kv heads, o by rows"  # o_proj, not a product
    assert math("BLOCK_M, max_seqlen_q, head_dim, k_base") == "BLOCK_M, max_seqlen_q, head_dim, k_base"
    assert math(r"$\frac{a}{b} + x_{ij}$ and \alpha") == ('<span class="math">(a)/(b) + x<sub>ij</sub></span>'
                                                         " and α")
    assert math("a < b & c") == "a &lt; b &amp; c"


def test_citations_link_the_paper_named_before_them():
    papers = [maps.Paper("1909.08053", ("Megatron-LM",)), maps.Paper("2104.04473", ()),
              maps.Paper("2211.10438", ("SmoothQuant",))]
    ctx = CiteContext(papers, papers[0])
    out = cite("2104.04473 §2.2, Figure 3. Then §3 and SmoothQuant Eq. 4; line 8", ctx)
    assert out.count("<a ") == 5  # no algorithm was named: "line 8" is not a citation
    assert 'href="https://arxiv.org/abs/2104.04473" title="arXiv 2104.04473, §2.2">§2.2</a>' in out
    assert 'abs/2104.04473" title="arXiv 2104.04473, Figure 3">' in out
    assert 'abs/1909.08053" title="Megatron-LM (arXiv 1909.08053), §3">' in out
    assert 'abs/2211.10438" title="SmoothQuant (arXiv 2211.10438), Eq. 4">' in out
    out = cite("Algorithm 1, lines 6-11; then line 9", ctx)
    assert 'title="Megatron-LM (arXiv 1909.08053), Algorithm 1, line 9">line 9</a>' in out


def test_the_checks_see_an_unlinked_citation(tmp_path):
    page = tmp_path / "p.html"
    page.write_text('<div class="prose"><p>see §4.2, <a href="x">§4.3</a> and <code>§5</code></p></div>'
                    '<pre data-file="f.py" data-role="paper"><span class="c1"># Eq. 4</span> x = "§6"</pre>')
    assert [f for f, _ in Page(page).unlinked] == ["", "f.py"]


def _tiny_repo(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "core.py").write_text('"""The core (Tiny 2024, arXiv 2401.00001, §2)."""\n\n\n'
                                          "# §2.1: one line\nX = 1\n\n\ndef f():\n"
                                          '    """Algorithm 1, line 3."""\n    return X  # line 4\n')
    (root / "README.md").write_text("# tiny\n\n| paper | package |\n|---|---|\n| Tiny (2401.00001) | `pkg` |\n")
    (root / "pkg" / "README.md").write_text("# pkg\n\n## Read the code\n\n| file | code lines | paper sections |\n"
                                            "|---|---|---|\n| `core.py` | 3 | §2 |\n\n## Paper → code\n\n"
                                            "| paper | code |\n|---|---|\n| §2 | `core.f`, `X` |\n")
    return root


def test_a_small_repository_builds_and_bad_inputs_are_named(tmp_path, monkeypatch):
    root = _tiny_repo(tmp_path / "repo")
    out = tmp_path / "site"
    main(["--root", str(root), "--out", str(out)])
    page = Page(out / "pkg.html")
    assert page.code[("pkg/core.py", "paper")].keys() == {5, 8, 10}
    assert page.ids["pkg.core.f"][2] == 8 and not page.unlinked
    main(["--root", str(root), "--out", str(out)])  # the reader's own folder is rebuilt in place
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="did not write"):
        build_site(tmp_path / "other", root)
    with pytest.raises(NotADirectoryError, match="--out"):
        build_site(tmp_path / "other" / "notes.txt", root)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "pygments", None)  # the docs extra not installed
        with pytest.raises(ImportError, match=re.escape('pip install -e ".[docs]"')):
            build_site(out, root)
    assert (out / "pkg.html").is_file()  # a failed build leaves the last site
    (root / "pkg" / "core.py").unlink()
    with pytest.raises(FileNotFoundError, match="core.py"):
        build_site(out, root)
    shutil.rmtree(root)
    with pytest.raises(FileNotFoundError, match="README.md"):
        build_site(out, root)


def test_the_command_line():
    args = build_parser().parse_args(["--out", "site/"])
    assert args.out == Path("site/") and args.root == ROOT
