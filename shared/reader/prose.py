"""Prose: docstrings, comments and README text as HTML, with every paper citation a link and the formulas
typeset at build time (no MathJax, nothing fetched when the page is read).

Citations (`§4.3`, `Algorithm 1, line 8`, a bare `line 8` after an algorithm was named, `Eq. 4`,
`Figure 3`, `Appendix B.1`, `Table 1`, `Theorem 3.1`, an arXiv id) link to the arXiv abstract of the paper
they cite: the one named closest before them in the same sentence (`SmoothQuant §4`, `2104.04473 §3`),
else the file's own paper (the first its module docstring names), else the package's. The link's title
names the paper and the section.

Formulas are written in the code as plain text (`S_ij = Q_i K_j^T`, `s_X^α / s_W^(1−α)`, `P~_ij`) or
LaTeX-ish (`$\\frac{a}{b}$`, `\\alpha`): subscripts and superscripts become <sub>/<sup>, LaTeX commands
Unicode, `<=` `>=` `!=` `->` their symbols.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

from .maps import ARXIV_ID, Paper

NUM = r"\d+(?:\.\d+)*"
RANGE = rf"{NUM}(?:\s?[–-]\s?{NUM})?"
CITATION = re.compile(
    rf"(?P<arxiv>\b(?:arXiv[: ]\s?)?{ARXIV_ID}(?:v\d+)?\b)"
    rf"|(?P<section>§\s?{RANGE}|\b[Ss]ections?\s{RANGE}\b)"
    r"|(?P<algorithm>\bAlgorithms?\s(?P<alg>\d+)(?:(?:,\s?|\s)lines?\s\d+(?:\s?[–-]\s?\d+)?\b)?)"
    r"|(?P<equation>\b(?:Eqs?\.|Equations?|eq\.)\s?\d+[a-z]?(?:\s?[–-]\s?\d+)?)"
    r"|(?P<figure>\b(?:Figs?\.|Figures?)\s?\d+[a-z]?(?:\s?[–-]\s?\d+[a-z]?)?)"
    r"|(?P<appendix>\b(?:[Aa]ppendix|App\.)\s[A-Z](?:\.\d+)*\b)"
    r"|(?P<table>\bTables?\s\d+\b)"
    r"|(?P<theorem>\b(?:Theorem|Lemma)\s\d+(?:\.\d+)?)"
    r"|(?P<line>\blines?\s\d+(?:\s?[–-]\s?\d+)?\b)")
SENTENCE_END = re.compile(r"[.!?;](?=\s+[A-Z(])|\n\s*\n")


@dataclass
class CiteContext:
    """What a citation in one file (or README) refers to: the papers it may name, the default one, and
    the algorithm a bare `line 8` belongs to (the last named before it)."""

    papers: list[Paper]
    default: Paper | None
    algorithm: str | None = None
    mention: re.Pattern = field(init=False)

    def __post_init__(self) -> None:
        names = sorted({n for p in self.papers for n in p.names}, key=len, reverse=True)
        alts = [rf"(?P<id>{ARXIV_ID})"] + ([rf"(?<![\w-])(?P<name>{'|'.join(map(re.escape, names))})(?![\w-])"]
                                            if names else [])
        self.mention = re.compile("|".join(alts))

    def paper_for(self, text: str, pos: int) -> Paper | None:
        """The paper named closest before `pos` in its sentence, else the default."""
        start = max((m.end() for m in SENTENCE_END.finditer(text, 0, pos)), default=0)
        best = None
        for m in self.mention.finditer(text, start, pos):
            best = m
        if best is None:
            return self.default
        if best.group("id"):
            return next((p for p in self.papers if p.arxiv == best.group("id")), Paper(best.group("id"), ()))
        return next(p for p in self.papers if best.group("name") in p.names)

    def first_paper(self, text: str) -> Paper | None:
        """The first paper `text` names, or None."""
        m = self.mention.search(text)
        return self.paper_for(text, m.end()) if m else None


def cite(text: str, ctx: CiteContext, typeset: bool = True) -> str:
    """`text` as HTML: citations linked, the rest typeset (or only escaped, for code comments)."""
    out, last = [], 0
    for m in CITATION.finditer(text):
        kind = m.lastgroup if m.lastgroup != "alg" else "algorithm"
        if kind == "line" and ctx.algorithm is None:
            continue  # "line 3" of nothing in particular
        out.append(math(text[last:m.start()]) if typeset else html.escape(text[last:m.start()], quote=False))
        label = m.group()
        if kind == "arxiv":
            arxiv = re.search(ARXIV_ID, label).group()
            paper = next((p for p in ctx.papers if p.arxiv == arxiv), Paper(arxiv, ()))
            title = paper.title
        else:
            paper = ctx.paper_for(text, m.start())
            if kind == "algorithm":
                ctx.algorithm = m.group("alg")
            where = f"Algorithm {ctx.algorithm}, {label}" if kind == "line" else label
            if paper is None:  # nothing to link to: say so rather than guess
                out.append(f'<span class="cite" title="{html.escape(where)}">{html.escape(label)}</span>')
                last = m.end()
                continue
            title = f"{paper.title}, {where}"
        out.append(f'<a class="cite" href="{paper.url}" title="{html.escape(title)}">{html.escape(label)}</a>')
        last = m.end()
    out.append(math(text[last:]) if typeset else html.escape(text[last:], quote=False))
    return "".join(out)


# --------------------------------------------------------------------------- formulas
LATEX = {
    "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ε", "eta": "η", "theta": "θ",
    "lambda": "λ", "mu": "μ", "pi": "π", "rho": "ρ", "sigma": "σ", "tau": "τ", "phi": "φ", "psi": "ψ",
    "omega": "ω", "Delta": "Δ", "Sigma": "Σ", "Psi": "Ψ", "Omega": "Ω", "sum": "Σ", "prod": "Π",
    "sqrt": "√", "cdot": "·", "times": "×", "le": "≤", "leq": "≤", "ge": "≥", "geq": "≥", "ne": "≠",
    "neq": "≠", "approx": "≈", "infty": "∞", "in": "∈", "to": "→", "rightarrow": "→", "leftarrow": "←",
    "odot": "⊙", "circ": "∘", "partial": "∂", "nabla": "∇", "lfloor": "⌊", "rfloor": "⌋", "lceil": "⌈",
    "rceil": "⌉", "log": "log", "exp": "exp", "max": "max", "min": "min", "top": "ᵀ", "ldots": "…",
    "cdots": "⋯", "|": "‖",
}
OPERATORS = {"<=": "≤", ">=": "≥", "!=": "≠", "->": "→"}
SCRIPT = r"\{[^{}\n]{1,16}\}|\([^()\n]{1,16}\)|[-−]?[A-Za-z0-9α-ωΑ-Ω]{1,3}(?![\w])"
FORMULA = re.compile(
    r"(?P<latex>\$(?=\S)[^$\n]+?(?<=\S)\$)"
    r"|(?P<cmd>\\(?:[A-Za-z]+|\|))"
    r"|(?P<op><=|>=|!=|->)"
    # the elementwise product written `o` between two matrices: `P o (dP - D)`, `dO_i o O_i`
    r"|(?P<hadamard>(?:(?<![\w])d?[A-Z](?:_[A-Za-z0-9]{1,2})?|\)) o (?=d?[A-Z(]))"
    # a math symbol with a subscript: one letter, dX, a Greek letter or an operator name; `P~` is P-tilde
    r"|(?P<sym>(?<![\w.])(?:d[A-Z]|[A-Za-z]|[α-ωΑ-ΩΣ]|sum|max|min|median|argmin|argmax|logsumexp)(?P<tilde>~)?)"
    r"(?P<sub>_(?:\{[^{}\n]{1,16}\}|[A-Za-z0-9α-ω]{1,2}))(?![\w])"
    rf"|(?<=[\w)|\]ᵀ])(?P<sup>\^(?:{SCRIPT}))")


def _script(text: str) -> str:
    """A sub/superscript's content without the braces or parentheses that group it; `-1` with a minus."""
    if text[:1] in "{(" and text[-1:] in "})":
        text = text[1:-1]
    return html.escape(text.replace("-", "−") if re.fullmatch(r"-\d+", text) else text, quote=False)


def _latex(body: str) -> str:
    """The inside of `$...$`: \\frac{a}{b} as a/b, commands as Unicode, x_{..} and x^{..} as scripts."""
    body = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", body)
    body = re.sub(r"\\(?:mathrm|text|mathbf|operatorname)\{([^{}]*)\}", r"\1", body)
    body = re.sub(r"\\([A-Za-z]+|\|)", lambda m: LATEX.get(m.group(1), m.group(1)), body)
    out, last = [], 0
    for m in re.finditer(rf"([_^])({SCRIPT}|\S)", body):
        out.append(html.escape(body[last:m.start()], quote=False))
        tag = "sub" if m.group(1) == "_" else "sup"
        out.append(f"<{tag}>{_script(m.group(2))}</{tag}>")
        last = m.end()
    out.append(html.escape(body[last:], quote=False))
    return "".join(out)


def math(text: str) -> str:
    """Plain text -> HTML with its formulas typeset (see the module docstring)."""
    out, last = [], 0
    for m in FORMULA.finditer(text):
        out.append(html.escape(text[last:m.start()], quote=False))
        if m.group("latex"):
            out.append(f'<span class="math">{_latex(m.group("latex")[1:-1])}</span>')
        elif m.group("cmd"):
            name = m.group("cmd")[1:]
            out.append(LATEX.get(name, html.escape(m.group("cmd"), quote=False)))
        elif m.group("op"):
            out.append(OPERATORS[m.group("op")])
        elif m.group("sym"):
            base = m.group("sym").removesuffix("~")
            base = {"sum": "Σ"}.get(base, html.escape(base, quote=False)) + ("\u0303" if m.group("tilde") else "")
            out.append(f'<span class="math">{base}<sub>{_script(m.group("sub")[1:])}</sub></span>')
        elif m.group("sup"):
            out.append(f"<sup>{_script(m.group('sup')[1:])}</sup>")
        else:
            out.append(math(m.group("hadamard")[:-3]) + " ∘ ")
        last = m.end()
    out.append(html.escape(text[last:], quote=False))
    return "".join(out)
