"""The annotated reader: the paper beside the code, as a static site generated from the code as it stands.

    python -m shared.reader --out site/        # then: python -m http.server -d site
    pip install -e ".[docs]"                   # Pygments and markdown-it-py

One page per package that has a `## Read the code` section: its paper-path files in reading order, each as
two columns (docstrings and comments as prose beside the code they explain, highlighted), every citation a
link to the paper, every name of the paper -> code table an anchor on its definition; then the performance
layers, collapsed, each with the README's line of what it buys; the package's BENCHMARKS.md section and
figures. An index page carries the README's paper -> package table with each paper path's size and
headline result, and the import arrows drawn. Plain HTML, one CSS file and a few lines of JavaScript:
nothing is fetched when a page is read.

Why it lives in `shared`, beside `shared.report`: like the report (which draws docs/img from
docs/results), it is a command the whole repository uses, run from a checkout; as a module of the project
it runs from any directory (`python -m shared.reader`), the documentation tests check its command line like
every other, and the tests of the READMEs import their parsing rules from it (`shared.reader.maps`), so
the reader and those tests cannot disagree about what a table says. It reads files and imports no other
package, and no paper path imports it. It needs the checkout: the READMEs, BENCHMARKS.md and docs/img are
not part of an installed wheel, and it says so when they are missing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .maps import ROOT


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m shared.reader", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("site"),
                   help="folder to write the site into (created; rebuilt if the reader wrote it; default: site)")
    p.add_argument("--root", type=Path, default=ROOT,
                   help="the repository checkout to read (default: the one this module lives in)")
    return p


def build_site(out: Path, root: Path = ROOT) -> list[Path]:
    """Write the site into `out`; the HTML pages written."""
    from .site import build

    return build(Path(root), Path(out))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    pages = build_site(args.out, args.root)
    print(f"wrote {len(pages)} pages to {args.out} in {time.perf_counter() - start:.1f} s; "
          f"read them with: python -m http.server -d {args.out}", file=sys.stderr)
