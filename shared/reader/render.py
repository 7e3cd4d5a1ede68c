"""HTML pieces of a page: Markdown (markdown-it-py) with citations, formulas, rewritten links and linked code
names; a parsed file as two columns; a definition's source."""

from __future__ import annotations

import html
import re
from collections.abc import Callable

from .maps import CODE_COLUMNS
from .prose import CiteContext, cite, math
from .source import SourceFile

DOCS_HINT = 'shared.reader renders with Pygments and markdown-it-py, which are not installed: pip install -e ".[docs]"'
# Citations wrapped across two lines of a docstring or README: joined, so that each is one link.
WRAPPED = re.compile(r"\b(Algorithms?|[Aa]ppendix|Figures?|Fig\.|Eqs?\.|Equations?|Table|Theorem|[Ss]ection|§)"
                     r"[ \t]*\n[ \t]*(?=\d|[A-Z](?:\.\d)*\b)|(Algorithm \d+,?)[ \t]*\n[ \t]*(?=lines? \d)")


def _markdown_it():
    try:
        from markdown_it import MarkdownIt
    except ImportError as e:
        raise ImportError(DOCS_HINT) from e
    return MarkdownIt("commonmark", {"html": False}).enable("table")


class Markdown:
    """Markdown -> HTML for one page.

    links(href) -> the page's href for a link of the source text, or None to drop the link (a file the
    site does not carry); code(token, column) -> the href a backticked name links to, or None (`column`:
    "code" in a paper -> code table's code column, "file" in a reading table's file column, "" elsewhere).
    """

    def __init__(self, links: Callable[[str], str | None], code: Callable[[str, str], str | None] | None = None,
                 heading_ids: bool = False):
        self.md = _markdown_it()
        self.links, self.code, self.heading_ids = links, code, heading_ids
        self.md.renderer.rules.update(text=self._text, link_open=self._link_open, link_close=self._link_close,
                                      image=self._image, code_inline=self._code_inline,
                                      heading_open=self._heading_open)

    def render(self, text: str, ctx: CiteContext, refs: str = "", inline: bool = False) -> str:
        text = WRAPPED.sub(lambda m: (m.group(1) or m.group(2)) + " ", text)
        env = {"ctx": ctx, "stack": []}
        if inline:
            tokens = self.md.parseInline(text, env)
        else:
            tokens = self.md.parse(text + ("\n\n" + refs if refs else ""), env)
            self._mark_columns(tokens)
        return self.md.renderer.render(tokens, self.md.options, env)

    @staticmethod
    def _mark_columns(tokens) -> None:
        """Mark the code spans of a table's code or file column (see `code`)."""
        header: list[str] = []
        col, in_head = -1, False
        for tok in tokens:
            if tok.type == "thead_open":
                header, in_head = [], True
            elif tok.type == "thead_close":
                in_head = False
            elif tok.type == "tr_open":
                col = -1
            elif tok.type in ("th_open", "td_open"):
                col += 1
            elif tok.type == "inline" and in_head:
                header.append(tok.content.strip().lower())
            elif tok.type == "inline" and header and col >= 0:
                code_col = next((header.index(c) for c in CODE_COLUMNS if c in header), -1)
                kind = "code" if col == code_col else "file" if header[col:col + 1] == ["file"] else ""
                for child in tok.children or []:
                    if child.type == "code_inline":
                        child.meta["column"] = kind

    def _text(self, tokens, idx, options, env) -> str:
        content = tokens[idx].content
        return math(content) if any(env["stack"]) else cite(content, env["ctx"])

    def _link_open(self, tokens, idx, options, env) -> str:
        tok = tokens[idx]
        href = self.links(tok.attrGet("href") or "")
        env["stack"].append(href is not None)
        if href is None:
            return f'<span class="repo-link" title="{html.escape(tok.attrGet("href") or "")}">'
        tok.attrSet("href", href)
        return self.md.renderer.renderToken(tokens, idx, options, env)

    def _link_close(self, tokens, idx, options, env) -> str:
        return "</a>" if env["stack"].pop() else "</span>"

    def _image(self, tokens, idx, options, env) -> str:
        tok = tokens[idx]
        src = self.links(tok.attrGet("src") or "")
        alt = html.escape(tok.content)
        return f'<img src="{html.escape(src)}" alt="{alt}">' if src else f"<em>[{alt}]</em>"

    def _code_inline(self, tokens, idx, options, env) -> str:
        tok = tokens[idx]
        code = f"<code>{html.escape(tok.content, quote=False)}</code>"
        if self.code is None or any(env["stack"]):
            return code
        href = self.code(tok.content, tok.meta.get("column", ""))
        return f'<a class="name" href="{html.escape(href)}">{code}</a>' if href else code

    def _heading_open(self, tokens, idx, options, env) -> str:
        if self.heading_ids:
            from .maps import slug

            tokens[idx].attrSet("id", slug(tokens[idx + 1].content))
        return self.md.renderer.renderToken(tokens, idx, options, env)


def reference_definitions(text: str) -> str:
    """The `[label]: url` lines of a Markdown text (reference links used in a section rendered alone)."""
    return "\n".join(re.findall(r"^\[[^\]]+\]:[ \t]+\S+.*$", text, re.M))


# --------------------------------------------------------------------------- code
def code_lines_html(sf: SourceFile, numbers: list[int], highlighted: list[str], prefix: str | None,
                    anchors: dict[int, list[str]]) -> str:
    """Lines of a file inside a <pre>: each with its number (linked to itself when `prefix` gives the
    lines ids) and the anchors of the definitions on it."""
    out = []
    for n in numbers:
        marks = "".join(f'<span class="def" id="{html.escape(a)}"></span>' for a in anchors.get(n, []))
        if prefix is None:
            out.append(f'<span class="line" data-n="{n}"><span class="ln">{n}</span>'
                       f'<span class="src">{marks}{highlighted[n - 1]}</span></span>')
        else:
            lid = f"{prefix}-L{n}"
            out.append(f'<span class="line" id="{lid}" data-n="{n}"><a class="ln" href="#{lid}">{n}</a>'
                       f'<span class="src">{marks}{highlighted[n - 1]}</span></span>')
    return "".join(out)  # each line is a block: a newline between them would be a blank line


def two_columns(sf: SourceFile, name: str, role: str, rel: str, md: Markdown, ctx: CiteContext,
                highlighted: list[str], anchors: dict[int, list[str]]) -> str:
    """The file's blocks: prose on the left, the code it explains on the right."""
    rows = []
    for block in sf.blocks:
        prose = []
        for text, line in block.prose:
            ctx.algorithm = sf.algorithm_at(line)
            prose.append(md.render(text, ctx))
        code = code_lines_html(sf, block.lines, highlighted, name, anchors) if block.lines else ""
        rows.append(f'<div class="block"><div class="prose">{"".join(prose)}</div>'
                    f'<div class="code"><pre data-file="{html.escape(rel)}" data-role="{role}">{code}</pre>'
                    "</div></div>")
    return "\n".join(rows)


def comment_renderer(sf: SourceFile, ctx: CiteContext) -> Callable[[str, int], str]:
    """Comments in the code column: citations linked (the algorithm of their line), the rest escaped."""
    def render(text: str, line: int) -> str:
        ctx.algorithm = sf.algorithm_at(line)
        return cite(text, ctx, typeset=False)
    return render
