"""Build the embedded corpus `stdlib_docs.txt.gz`: the documentation that ships inside Python's stdlib.

Run once; the result is committed, so every machine and every Python version trains on the same bytes:

    python -m shared.corpus.build_corpus            # writes shared/corpus/stdlib_docs.txt.gz

What goes in, one document each:
- the docstring of every public module, class, function and method of the standard library, keyed by
  qualified name (`json.decoder.JSONDecoder.decode`);
- the topics of `pydoc_data.topics`, the language-reference pages that `help("with")` shows (key
  `pydoc_data.topics.<topic>`); they add about a third to what docstrings alone give.
Documents are sorted by key, deduplicated by text (the first occurrence in sorted order wins) and joined
with the end-of-text token `<|endoftext|>`, the way GPT-2 (Radford et al. 2019) separated documents.

Pure-Python modules are *parsed* with `ast`, never imported, so modules with side effects (`antigravity`
opens a browser, `this` prints, `tkinter` opens windows) cannot run. Only C extension modules, which have
no source to parse, are imported and introspected; importing those runs no Python code.
Skipped: private members (`_x`; dunders such as `__init__` are kept), test modules, and the GUI / demo /
legacy-tool noise in `SKIP_TOP`. Private *modules* are kept, because many implement public API
(`concurrent.futures._base.Future`, the C accelerators `_io`, `_collections`, `_decimal`, `_socket`).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

EOT = "<|endoftext|>"
OUT = Path(__file__).with_name("stdlib_docs.txt.gz")

# Left out: GUI toolkits and demos, the retired 2to3 tool, test packages and C-API test/example
# modules, bundled wheels, and the jokes `antigravity` / `this`.
SKIP_TOP = {
    "idlelib", "tkinter", "_tkinter", "turtle", "turtledemo", "lib2to3", "test", "antigravity", "this",
    "ensurepip", "pydoc_data", "__future__", "__main__", "__phello__", "_ctypes_test", "_msi",
}
SKIP_PREFIXES = ("_test", "_xx", "xx")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_test(name: str) -> bool:
    return name in ("test", "tests", "idle_test") or name.startswith("test_") or name.endswith("_test")


def _ast_docs(node: ast.AST, qualname: str) -> Iterator[tuple[str, str]]:
    """(qualified name, cleaned docstring) of a module/class/function and the public defs in its body."""
    doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
    if doc:
        yield qualname, doc
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return  # functions nested in functions are implementation detail
    body = list(node.body)  # type: ignore[attr-defined]
    while body:
        child = body.pop(0)
        if isinstance(child, (ast.If, ast.Try)):
            # platform-specific definitions (`if sys.platform == ...: def f(): ...`) are public API too
            nested = child.body + child.orelse + getattr(child, "finalbody", [])
            for handler in getattr(child, "handlers", []):
                nested += handler.body
            body[:0] = nested
        elif (isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
              and not _is_private(child.name)):
            yield from _ast_docs(child, f"{qualname}.{child.name}")


def _source_docs(path: Path, modname: str) -> Iterator[tuple[str, str]]:
    yield from _ast_docs(ast.parse(path.read_bytes(), filename=str(path)), modname)


def _package_docs(pkg_dir: Path, modname: str) -> Iterator[tuple[str, str]]:
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = list(path.relative_to(pkg_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if not any(_is_test(p) or p == "__pycache__" for p in parts):
            yield from _source_docs(path, ".".join([modname, *parts]))


def _extension_docs(module: object, modname: str) -> Iterator[tuple[str, str]]:
    """Docstrings of an imported C module, its classes and functions, and the classes' methods."""
    if isinstance(module.__doc__, str):
        yield modname, inspect.cleandoc(module.__doc__)
    for name, member in sorted(vars(module).items()):
        if _is_private(name) or inspect.ismodule(member):
            continue
        if inspect.isclass(member):
            yield from _class_docs(member, f"{modname}.{name}")
        elif callable(member) and isinstance(member.__doc__, str):
            yield f"{modname}.{name}", inspect.cleandoc(member.__doc__)


def _class_docs(cls: type, qualname: str) -> Iterator[tuple[str, str]]:
    if isinstance(cls.__doc__, str):
        yield qualname, inspect.cleandoc(cls.__doc__)
    # vars(cls), not dir(cls): only what this class defines, not what it inherits
    for name, member in sorted(vars(cls).items()):
        doc = getattr(member, "__doc__", None)
        if not _is_private(name) and isinstance(doc, str) and (callable(member) or hasattr(member, "__get__")):
            yield f"{qualname}.{name}", inspect.cleandoc(doc)


def stdlib_docs() -> list[tuple[str, str]]:
    """All (key, text) documents: stdlib docstrings and pydoc topics, unsorted, not deduplicated."""
    docs: list[tuple[str, str]] = []
    for top in sorted(sys.stdlib_module_names):
        if top in SKIP_TOP or top.startswith(SKIP_PREFIXES) or _is_test(top):
            continue
        spec = importlib.util.find_spec(top)  # for a top-level name this locates without executing
        if spec is None:
            continue  # not built on this platform (e.g. `winreg` on Linux)
        origin = spec.origin or ""
        if spec.submodule_search_locations:
            docs.extend(_package_docs(Path(origin).parent, top))
        elif origin.endswith(".py"):
            docs.extend(_source_docs(Path(origin), top))
        elif origin in ("built-in", "frozen") or origin.endswith((".so", ".pyd")):
            docs.extend(_extension_docs(importlib.import_module(top), top))
    from pydoc_data.topics import topics  # a plain dict literal: importing it has no side effects

    docs.extend((f"pydoc_data.topics.{key}", text) for key, text in topics.items())
    return docs


def build_text(docs: list[tuple[str, str]]) -> str:
    """Sort by key, drop repeated texts, join with the end-of-text separator."""
    seen: set[str] = set()
    texts = []
    for _, doc in sorted(docs):
        doc = doc.strip().replace(EOT, "")  # the separator must never occur inside a document
        if doc and doc not in seen:
            seen.add(doc)
            texts.append(doc)
    return EOT.join(texts)


def write_gz(text: str, path: Path) -> None:
    # mtime=0 and an empty file name in the header make the .gz bytes reproducible
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                 compresslevel=9) as gz:
        gz.write(text.encode("utf-8"))


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m shared.corpus.build_corpus`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="output .txt.gz path")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    text = build_text(stdlib_docs())
    write_gz(text, args.out)
    print(f"{args.out}: {text.count(EOT) + 1} documents, {len(text.encode()) / 1e6:.2f} MB raw, "
          f"{args.out.stat().st_size / 1e6:.2f} MB gzip (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
