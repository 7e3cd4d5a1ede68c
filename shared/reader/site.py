"""The site: one page per package with a reading map, the index, BENCHMARKS.md as a page, the figures, one
CSS file and a few lines of JavaScript (open the collapsed section an anchor points into)."""

from __future__ import annotations

import ast
import html
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from . import maps
from .prose import CiteContext
from .render import DOCS_HINT, Markdown, comment_renderer, reference_definitions, two_columns
from .resolve import Definition, definitions, module_name, resolve
from .source import SourceFile, highlight_lines, parse

ASSETS = Path(__file__).resolve().parent
MARKER = ".nano-infra-reader"  # a folder holding this file was written by the reader and may be rebuilt


@dataclass
class Site:
    """What every page needs to know: where each rendered file is, which figures to copy."""

    root: Path
    packages: list[str]  # those with a page
    project: list[str]  # every package of the repository (names a qualified code name may start with)
    rendered: dict[Path, tuple[str, str]] = field(default_factory=dict)  # file -> (page, section id)
    images: set[Path] = field(default_factory=set)

    def link(self, base: Path, href: str, same_page_ids: bool = False) -> str | None:
        """A link of a Markdown file in `base` as the site's href, or None (a file the site does not carry)."""
        if re.match(r"[a-z]+:", href):
            return href
        path, _, frag = href.partition("#")
        if not path:
            return href if same_page_ids else None
        target = (base / path).resolve()
        try:
            rel = target.relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return None
        if rel == "BENCHMARKS.md":
            return "benchmarks.html" + (f"#{frag}" if frag else "")
        if rel == "README.md":
            return "index.html"
        if rel.endswith("/README.md") and rel.split("/")[0] in self.packages:
            return f"{rel.split('/')[0]}.html" + ("#read-the-code" if frag == "read-the-code" else "")
        if rel.startswith("docs/img/") and target.is_file():
            self.images.add(target)
            return f"img/{target.name}"
        return None


def _anchors(site: Site, path: Path) -> dict[int, list[str]]:
    """{line: full names of what is defined there} for a rendered file."""
    module = module_name(site.root, path)
    found: dict[int, list[str]] = {}
    for qualname, line in definitions(path, module)[0].items():
        found.setdefault(line, []).append(f"{module}.{qualname}")
    return found


def _file_context(papers: list[maps.Paper], default: maps.Paper | None, sf: SourceFile) -> CiteContext:
    """The citation context of a file: the package's papers and those its module docstring names; its
    default paper the first its docstring names, else the package's."""
    doc = sf.blocks[0].prose[0][0] if sf.blocks and sf.blocks[0].prose else ""
    own = maps.papers_in(doc)
    known = papers + [p for p in own if p.arxiv not in {q.arxiv for q in papers}]
    ctx = CiteContext(known, default)
    ctx.default = ctx.first_paper(doc) or default
    return ctx


def _headline(site: Site, package: str, md: Markdown, ctx: CiteContext) -> str:
    from .index import headline_html

    rows = maps.headlines(site.root).get(package, [])
    if not rows:
        return ""
    return f'<p class="headline"><span class="label">Headline:</span> {headline_html(rows[0], md, ctx)}</p>'


def package_page(site: Site, package: str) -> str:
    root = site.root
    page = f"{package}.html"
    rows = maps.reading_rows(package, root)
    papers = maps.package_papers(package, root)
    default = papers[0] if papers else None
    readme = (root / package / "README.md").read_text(encoding="utf-8")
    refs = reference_definitions(readme)
    beside: dict[str, Definition] = {}

    def code_href(token: str, column: str) -> str | None:
        d = resolve(token, package, root, site.project, first=[r.path for r in rows])
        if d is None:
            return None
        where = site.rendered.get(d.path)
        if where:
            return ("" if where[0] == page else where[0]) + "#" + (d.fullname if d.qualname else where[1])
        if column == "code":  # named by the paper -> code table: shown on this page, collapsed
            beside[d.fullname] = d
            return "#" + d.fullname
        return None

    md = Markdown(lambda href: site.link(root / package, href), code_href)
    ctx = CiteContext(papers, default)
    paper_links = ", ".join(f'<a href="{p.url}">{html.escape(p.title)}</a>' for p in papers[:3])
    bench_anchor, bench_body = maps.benchmarks_sections(root).get(package, ("", ""))
    parts = [f'<header><nav><a href="index.html">nano-infra reader</a> · <a href="benchmarks.html">benchmarks</a>'
             f'</nav><h1>{package}</h1><p class="papers">{paper_links}</p>'
             + _headline(site, package, md, ctx)
             + (f'<p><a href="benchmarks.html#{bench_anchor}">Measured: BENCHMARKS.md, {package}</a></p>'
                if bench_anchor else "")
             + '<p class="toc">' + " · ".join(f'<a href="#{r.name}">{r.name}</a>' for r in rows)
             + ' · <a href="#performance-layers">performance layers</a> · <a href="#paper-to-code">paper → code'
             "</a></p></header>"]
    parts.append(f'<section id="read-the-code"><h2>Read the code</h2>'
                 f'{md.render(maps.read_the_code(package, root), ctx, refs)}</section>')
    for row in rows:
        sf = parse(row.path)
        fctx = _file_context(papers, default, sf)
        lines = highlight_lines(row.path.read_text(encoding="utf-8"), comment_renderer(sf, fctx))
        rel = row.path.relative_to(root).as_posix()
        parts.append(f'<section class="file" id="{row.name}"><h2><code>{row.name}</code> '
                     f'<span class="meta">{maps.code_lines(row.path)} code lines</span></h2>'
                     f'<p class="sections">{md.render(row.sections, ctx, inline=True)}</p>'
                     + two_columns(sf, row.name, "paper", rel, md, fctx, lines, _anchors(site, row.path))
                     + "</section>")
    parts.append(_layers(site, package, md, papers, default))
    parts.append('<section id="paper-to-code"><h2>Paper → code</h2>'
                 + md.render(maps.section(readme, "Paper → code") or "", ctx, refs) + "</section>")
    parts.append(_beside(site, beside, papers, default))
    figures = re.findall(r"!\[[^\]]*\]\([^)]+\)", bench_body)
    if figures:
        parts.append(f'<section id="figures"><h2>Figures (<a href="benchmarks.html#{bench_anchor}">'
                     f'BENCHMARKS.md</a>)</h2>' + Markdown(lambda h: site.link(root, h)).render(
                         "\n\n".join(figures), ctx) + "</section>")
    return _html(f"{package} — nano-infra reader", "\n".join(parts))


def _layers(site: Site, package: str, md: Markdown, papers: list[maps.Paper], default) -> str:
    """The performance layers, collapsed: the README's line for each, then the file in two columns."""
    root = site.root
    lines = {(ln.owner, ln.file): ln for ln in maps.layer_lines(package, root)}
    order = [name for owner, name in lines if owner == package]
    ctx = CiteContext(papers, default)
    out = ['<section id="performance-layers"><h2>Performance layers</h2>']
    files = sorted(maps.layer_files(package, root), key=lambda p: (  # the README's order, then the rest
        order.index(p.relative_to(root / package).as_posix()) if p.relative_to(root / package).as_posix()
        in order else len(order), p.name != "__init__.py", p.name))
    if not files and not lines:
        out.append(f"<p>{package} has no performance layer.</p>")
    for path in files:
        name = path.relative_to(root / package).as_posix()
        line = lines.pop((package, name), None)
        sf = parse(path)
        fctx = _file_context(papers, default, sf)
        doc = sf.blocks[0].prose[0][0] if sf.blocks and sf.blocks[0].prose else ""
        what = md.render(line.markdown, ctx, inline=True) if line else (
            f"<code>{name}</code> — " + md.render(doc.split("\n\n")[0], fctx, inline=True))
        highlighted = highlight_lines(path.read_text(encoding="utf-8"), comment_renderer(sf, fctx))
        body = two_columns(sf, name, "layer", path.relative_to(root).as_posix(), md, fctx, highlighted,
                           _anchors(site, path))
        out.append(f'<details class="layer" id="{name}"><summary>{what}</summary>{body}</details>')
    for (owner, name), line in lines.items():  # another package's layer: its line, and where its code is
        href = f"{owner}.html#{name}" if owner in site.packages else None
        where = f' <a href="{href}">Its code: {owner}’s page.</a>' if href else ""
        out.append(f'<details class="layer"><summary>{md.render(line.markdown, ctx, inline=True)}</summary>'
                   f"<p>{where}</p></details>")
    return "".join(out) + "</section>"


def _beside(site: Site, beside: dict[str, Definition], papers: list[maps.Paper], default) -> str:
    """Definitions the paper -> code table names that live beside the paper path (on no page), collapsed:
    a class's or function's source, or a whole module."""
    if not beside:
        return ""
    out = ['<section id="beside"><h2>Named in the paper → code table, defined beside the paper path</h2>']
    cache: dict[Path, tuple[list[str], ast.Module]] = {}
    for fullname, d in sorted(beside.items()):
        if d.path not in cache:
            sf = parse(d.path)
            cache[d.path] = (highlight_lines(d.path.read_text(encoding="utf-8"),
                                             comment_renderer(sf, _file_context(papers, default, sf))), sf.tree)
        lines, tree = cache[d.path]
        first, end = (1, len(lines)) if not d.qualname else (d.line, d.line)
        for node in ast.walk(tree):
            if d.qualname and getattr(node, "lineno", None) == d.line and hasattr(node, "end_lineno"):
                first = min([first] + [x.lineno for x in getattr(node, "decorator_list", [])])
                end = max(end, node.end_lineno)
        rel = d.path.relative_to(site.root).as_posix()
        code = "".join(f'<span class="line" data-n="{n}"><span class="ln">{n}</span><span class="src">'
                       f"{lines[n - 1]}</span></span>" for n in range(first, end + 1))
        out.append(f'<details class="def" id="{html.escape(fullname)}"><summary><code>{html.escape(fullname)}'
                   f'</code> <span class="meta">{rel}:{d.line}</span></summary><div class="code">'
                   f'<pre data-file="{html.escape(rel)}" data-role="beside">{code}</pre></div></details>')
    return "".join(out) + "</section>"


def _html(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{html.escape(title)}'
            # an empty icon: without one the browser asks the server for /favicon.ico, which is not there
            f'</title><link rel="icon" href="data:,"><link rel="stylesheet" href="reader.css">'
            f'<script src="reader.js" defer></script></head>'
            f"<body>\n{body}\n</body></html>\n")


def prepare_out(out: Path) -> None:
    """Create `out`, or empty it if the reader wrote it; refuse a folder holding anything else."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            raise FileExistsError(f"--out {out} is a folder the reader did not write (no {MARKER} in it); "
                                  "give an empty or new folder")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by python -m shared.reader; rebuilt in place\n")


def build(root: Path, out: Path) -> list[Path]:
    """Write the site for the repository at `root` into `out`; the pages written."""
    from .index import benchmarks_page, index_page, stylesheet

    try:
        import markdown_it  # noqa: F401
        import pygments  # noqa: F401
    except ImportError as e:
        raise ImportError(DOCS_HINT) from e
    if not (root / "README.md").is_file():
        raise FileNotFoundError(f"{root / 'README.md'} does not exist: shared.reader reads a nano-infra checkout "
                                "(an editable install), not an installed wheel")
    packages = maps.paper_path_packages(root)
    project = sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file()
                     and (p.name == "shared" or p.name.startswith("nano_")))
    site = Site(root, packages, project)
    for package in packages:
        for row in maps.reading_rows(package, root):
            if not row.path.is_file():
                raise FileNotFoundError(f"{package}/README.md's '## Read the code' names {row.name}, which does "
                                        f"not exist ({row.path})")
            site.rendered[row.path] = (f"{package}.html", row.name)
        for path in maps.layer_files(package, root):
            site.rendered[path] = (f"{package}.html", path.relative_to(root / package).as_posix())
    pages = {f"{p}.html": package_page(site, p) for p in packages}
    pages["index.html"] = index_page(site)
    pages["benchmarks.html"] = benchmarks_page(site)
    prepare_out(out)  # only now: a build that fails leaves the last site as it was
    written = []
    for name, text in pages.items():
        (out / name).write_text(text, encoding="utf-8")
        written.append(out / name)
    (out / "reader.css").write_text(stylesheet(), encoding="utf-8")
    shutil.copy(ASSETS / "reader.js", out / "reader.js")
    if site.images:
        (out / "img").mkdir(exist_ok=True)
        for image in site.images:
            shutil.copy(image, out / "img" / image.name)
    return written
