"""Where a name of a paper -> code table is defined, found by reading the source (nothing is imported).

The names are those `tests/e2e/test_paper_maps.py` resolves by importing: `module.function`,
`Class.method`, a bare name defined anywhere in the package (or a method of one of its classes), a
fully qualified `package.module.name`, an instance attribute assigned as `self.<name>` in its class.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass(frozen=True)
class Definition:
    """A definition: the module that holds it, its qualified name there ("" for the module itself), the
    file and the line of its `def` / `class` / assignment."""

    module: str
    qualname: str
    path: Path
    line: int

    @property
    def fullname(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module


def module_file(root: Path, module: str) -> Path | None:
    """The file of `module` under `root` (a .py file or a package's __init__.py), or None."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def definitions(path: Path, module: str) -> tuple[dict[str, int], dict[str, str]]:
    """({qualname: line} of what `path` defines, {name: module.name} of what it imports by name): module
    level (inside if / try too), class bodies (nested), and attributes assigned as `self.x` in methods."""
    return _definitions(path, module, path.stat().st_mtime_ns)  # read again once the file changes


@functools.cache
def _definitions(path: Path, module: str, mtime_ns: int) -> tuple[dict[str, int], dict[str, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: dict[str, int] = {}
    imports: dict[str, str] = {}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def targets(node: ast.AST) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            return node.targets
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            return [node.target]
        return []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(prefix + node.name, node.lineno)
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.")
                    for sub in ast.walk(node):
                        for t in (t for s in [sub] for t in targets(s)):
                            if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                    and t.value.id == "self"):
                                found.setdefault(f"{prefix}{node.name}.{t.attr}", t.lineno)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body, prefix)
                for extra in (getattr(node, "orelse", []), getattr(node, "finalbody", []),
                              *[h.body for h in getattr(node, "handlers", [])]):
                    visit(extra, prefix)
            elif isinstance(node, ast.ImportFrom) and not prefix:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    imports[alias.asname or alias.name] = f"{base}.{alias.name}"
            for t in targets(node):
                for name in ast.walk(t):
                    if isinstance(name, ast.Name):
                        found.setdefault(prefix + name.id, node.lineno)

    visit(tree.body, "")
    return found, imports


def qualified(root: Path, dotted: str, depth: int = 0) -> Definition | None:
    """`pkg.module.attr...`: the longest prefix that is a module, then the attributes inside it (following
    re-exports: `from .x import y`)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = module_file(root, ".".join(parts[:i]))
        if path is None:
            continue
        module, rest = ".".join(parts[:i]), parts[i:]
        if not rest:
            return Definition(module, "", path, 1)
        defs, imports = definitions(path, module)
        if ".".join(rest) in defs:
            return Definition(module, ".".join(rest), path, defs[".".join(rest)])
        if rest[0] in imports and depth < 8:
            return qualified(root, ".".join([imports[rest[0]], *rest[1:]]), depth + 1)
        return None
    return None


def package_files(root: Path, package: str) -> list[Path]:
    return sorted((root / package).rglob("*.py"))


def resolve(token: str, package: str, root: Path, packages: list[str],
            first: list[Path] = ()) -> Definition | None:
    """The definition a backticked name of `package`'s paper -> code table names, or None (prose, a file,
    a command, a test, or not found). `first`: files searched first for a bare name (the paper path)."""
    token = re.sub(r"\(.*\)$", "", token.strip())
    if token.endswith(".py"):  # a file of the package
        path = root / package / token
        hits = [path] if path.is_file() else sorted((root / package).rglob(Path(token).name))
        return Definition(module_name(root, hits[0]), "", hits[0], 1) if len(hits) == 1 else None
    if not NAME.fullmatch(token) or token.startswith("test_"):
        return None
    head, *rest = token.split(".")
    if head in packages:
        return qualified(root, token)
    found = qualified(root, f"{package}.{token}")
    if found:
        return found
    files = list(first) + [p for p in package_files(root, package) if p not in first]
    for path in files:  # a name defined in any module of the package, or a method of any of its classes
        module = module_name(root, path)
        defs, imports = definitions(path, module)
        if head in defs and (not rest or token in defs):
            return Definition(module, token if rest else head, path, defs[token if rest else head])
        if not rest:
            method = next((q for q in defs if q.count(".") == 1 and q.endswith("." + head)
                           and q.split(".")[0] in defs), None)
            if method:
                return Definition(module, method, path, defs[method])
    for path in files:  # a name a module of the package imports from elsewhere
        _, imports = definitions(path, module_name(root, path))
        if head in imports:
            found = qualified(root, ".".join([imports[head], *rest]))
            if found:
                return found
    return None
