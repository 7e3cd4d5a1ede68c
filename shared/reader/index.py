"""The index page (the README's paper -> package table with each paper path's size and headline result,
and the import arrows drawn), BENCHMARKS.md as a page, and the stylesheet."""

from __future__ import annotations

import html
from pathlib import Path

from . import maps
from .prose import CiteContext
from .render import Markdown

ASSETS = Path(__file__).resolve().parent


def import_svg(diagram: str, packages: list[str]) -> str:
    """The README's import diagram drawn: one row per line of it, the first at the bottom; an arrow from
    each package to what it imports (dashed: "may import"); what a row may import besides, in parentheses
    in the README, is written under its boxes."""
    rows: list[list[str]] = []
    for line in diagram.splitlines():
        if "←" in line:
            rows.append([p.strip() for p in line.split("←")[0].split(",") if p.strip()])
    edges = maps.import_edges(diagram)
    external = list(dict.fromkeys(d for _, d, _ in edges if not any(d in r for r in rows)))
    if external:  # what the lowest package stands on, outside the project: one box
        rows.insert(0, [", ".join(external)])
        edges = list(dict.fromkeys((a, rows[0][0] if b in external else b, k) for a, b, k in edges))
    besides = {a: [b for x, b, k in edges if x == a and k == "optional"] for a, _, _ in edges}
    drawn = [(a, b, k) for a, b, k in edges if k != "optional"]
    width, row_h, box_h = 760, 92, 34
    height = row_h * len(rows) + 20
    pos: dict[str, tuple[float, float, float]] = {}  # name -> (centre x, top y, width)
    for i, row in enumerate(rows):  # spread evenly
        for j, name in enumerate(row):
            pos[name] = (width * (j + 1) / (len(row) + 1), height - row_h * (i + 1) + 10, 12 + 8.2 * len(name))

    def ends(a: str, b: str) -> tuple[float, float, float, float]:
        (x1, y1, _), (x2, y2, _) = pos[a], pos[b]
        return (x1, y1 + box_h, x2, y2) if y2 > y1 else (x1, y1, x2, y2 + box_h)

    def crossings(only: str | None = None) -> int:
        """(arrow, box) pairs where an arrow passes through a box it does not start or end at (those that
        involve box `only`, if given)."""
        hits = 0
        for name, (x, y, w) in pos.items():
            for a, b, _ in drawn:
                x1, y1, x2, y2 = ends(a, b)
                if name in (a, b) or (only and only not in (name, a, b)):
                    continue
                if not min(y1, y2) < y + box_h / 2 < max(y1, y2):
                    continue
                xs = [x1 + (x2 - x1) * (yy - y1) / (y2 - y1) for yy in (y - 6, y + box_h + 6)]
                hits += min(xs) < x + w / 2 + 10 and max(xs) > x - w / 2 - 10
        return hits

    for row in rows[:0:-1]:  # top down, a box alone in its row that an arrow crosses, or whose arrows
        name = row[0]        # cross a box: moved to where fewest do, nearest the middle
        if len(row) == 1 and crossings(name):
            _, y, w = pos[name]
            costs = []
            for k in range(41):
                pos[name] = (w / 2 + 8 + k * (width - w - 16) / 40, y, w)
                costs.append((crossings(), abs(pos[name][0] - width / 2), pos[name]))
            pos[name] = min(costs)[2]
    out = [f'<svg class="imports" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           'role="img" aria-labelledby="imports-title"><title id="imports-title">Imports flow one way: '
           'each package imports only what its arrows point to</title><defs><marker id="head" '
           'viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
           '<path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>']
    for a, b, kind in drawn:
        x1, y1, x2, y2 = ends(a, b)
        dash = ' stroke-dasharray="5,4"' if kind == "may" else ""
        out.append(f'<line x1="{x1:.0f}" y1="{y1:.0f}" x2="{x2:.0f}" y2="{y2:.0f}" stroke="#555" '
                   f'stroke-width="1.4" marker-end="url(#head)"{dash}/>')
    for name, (x, y, w) in pos.items():
        box = (f'<rect x="{x - w / 2:.0f}" y="{y:.0f}" width="{w:.0f}" height="{box_h}" rx="6" '
               f'class="{"pkg" if name in packages else "ext"}"/><text x="{x:.0f}" y="{y + 22:.0f}" '
               f'text-anchor="middle">{html.escape(name)}</text>')
        out.append(f'<a href="{name}.html">{box}</a>' if name in packages else box)
        if besides.get(name):
            out.append(f'<text class="besides" x="{x:.0f}" y="{y + box_h + 14:.0f}" text-anchor="middle">'
                       f'(+ {html.escape(", ".join(besides[name]))})</text>')
    return "".join(out) + "</svg>"


def headline_html(head: maps.Headline, md: Markdown, ctx: CiteContext) -> str:
    """`workload: ours; peer; ratio (card, dates)` from a row of BENCHMARKS.md's Headlines table."""
    cells = [c.removeprefix("— ").strip() for c in list(head.cells.values())[1:5]]
    workload, rest = cells[0], [c for c in cells[1:] if c and c != "—"]
    text = f"{workload}: " + "; ".join(rest)
    when = ", ".join(head.dates) or "date not given"
    return f'{md.render(text, ctx, inline=True)} <span class="when">({head.card}, {when})</span>'


def index_page(site) -> str:
    from .site import _html

    root = site.root
    readme = (root / "README.md").read_text(encoding="utf-8")
    md = Markdown(lambda href: site.link(root, href))
    papers = [p for pkg in site.packages for p in maps.package_papers(pkg, root)]
    ctx = CiteContext(papers, None)
    heads = maps.headlines(root)
    intro = readme.split("\n## ", 1)[0].split("\n", 1)[1].strip().split("\n\n")[0]
    rows = []
    for package, paper in maps.package_table(root) or [(p, "") for p in site.packages]:
        name = (f'<a href="{package}.html"><code>{package}</code></a>' if package in site.packages
                else f"<code>{package}</code> <span class='meta'>(no reading map)</span>")
        if package in site.packages:
            files = maps.reading_rows(package, root)
            size = (f"{sum(maps.code_lines(r.path) for r in files):,} code lines in {len(files)} files")
        else:
            size = "—"
        head = heads.get(package, [])
        result = headline_html(head[0], md, ctx) if head else "—"
        rows.append(f"<tr><td>{md.render(paper, ctx, inline=True)}</td><td>{name}</td>"
                    f'<td class="num">{size}</td><td>{result}</td></tr>')
    diagram = maps.import_diagram(root)
    arrows = ""
    if diagram:
        arrows = (f'<section id="imports"><h2>Imports flow one way</h2>{import_svg(diagram, site.packages)}'
                  f"<pre>{html.escape(diagram)}</pre></section>")
    body = (f'<header><nav><a href="index.html">nano-infra reader</a> · <a href="benchmarks.html">benchmarks</a>'
            f"</nav><h1>nano-infra: the papers beside the code</h1>{md.render(intro, ctx)}"
            "<p>Each page puts a package's paper path in reading order, the docstrings and comments beside "
            "the code they explain, every citation linked to the paper; its performance layers follow, "
            "collapsed.</p></header>"
            '<section id="packages"><h2>Paper → package</h2><table><thead><tr><th>paper</th><th>package</th>'
            "<th>paper path</th><th>headline result (card, date)</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></section>" + arrows)
    return _html("nano-infra reader", body)


def benchmarks_page(site) -> str:
    from .site import _html

    root = site.root
    path = root / "BENCHMARKS.md"
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Benchmarks\n\nBENCHMARKS.md is missing."
    md = Markdown(lambda href: site.link(root, href, same_page_ids=True), heading_ids=True)
    papers = [p for pkg in site.packages for p in maps.package_papers(pkg, root)]
    nav = '<nav><a href="index.html">nano-infra reader</a> · ' + " · ".join(
        f'<a href="{p}.html">{p}</a>' for p in site.packages) + "</nav>"
    return _html("Benchmarks — nano-infra reader",
                 f'<header>{nav}</header><article class="doc">{md.render(text, CiteContext(papers, None))}</article>')


def stylesheet() -> str:
    """reader.css and the Pygments colours of the code column."""
    from pygments.formatters import HtmlFormatter

    colours = [line for line in HtmlFormatter(style="friendly").get_style_defs(".code pre").splitlines()
               if not line.startswith(("pre {", ".code pre {"))]  # the page's own layout and background
    return ((ASSETS / "reader.css").read_text(encoding="utf-8") + "\n/* Pygments, style 'friendly' */\n"
            + "\n".join(colours) + "\n")
