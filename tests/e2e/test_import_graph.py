"""The dependency rule of docs/ARCHITECTURE.md, enforced: imports between the project's packages flow one way.

    nano_flashattn   <- torch, triton only
    shared           <- nano_flashattn
    nano_megatron, nano_zero, nano_vllm   <- shared (+ nano_flashattn)
    nano_quant                            <- shared (+ nano_flashattn); nano_vllm may import it
    nano_sglang, nano_distserve, nano_specdec   <- nano_vllm (+ shared, nano_flashattn)

Every `import` / `from ... import` anywhere in a package's files (function bodies included) is read with
`ast`; relative imports stay inside the package and are fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "nano_flashattn": set(),
    "shared": {"nano_flashattn"},
    "nano_megatron": {"shared", "nano_flashattn"},
    "nano_zero": {"shared", "nano_flashattn"},
    "nano_vllm": {"shared", "nano_flashattn", "nano_quant"},
    "nano_quant": {"shared", "nano_flashattn"},
    "nano_sglang": {"nano_vllm", "shared", "nano_flashattn"},
    "nano_distserve": {"nano_vllm", "shared", "nano_flashattn"},
    "nano_specdec": {"shared", "nano_vllm", "nano_flashattn"},
}


def project_imports(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """{sibling package: files of `package` that import it}."""
    found: dict[str, set[str]] = {}
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in ALLOWED and top != package:
                    found.setdefault(top, set()).add(str(path.relative_to(root)))
    return found


def test_every_package_is_listed():
    on_disk = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and
               (p.name == "shared" or p.name.startswith("nano_"))}
    assert on_disk == set(ALLOWED), "a new package needs its place in docs/ARCHITECTURE.md's dependency rule"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_dependency_rule(package):
    bad = {dep: files for dep, files in project_imports(package).items() if dep not in ALLOWED[package]}
    assert not bad, f"{package} imports outside the dependency rule: {bad}"


def test_the_checker_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "nano_flashattn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def f():\n    from nano_vllm import LLM\n    import shared.model\n")
    assert project_imports("nano_flashattn", tmp_path) == {"nano_vllm": {"nano_flashattn/__init__.py"},
                                                 "shared": {"nano_flashattn/__init__.py"}}


# --------------------------------------------------------------------------- the paper path imports no layer
# What a paper path must never reach, by import (function bodies included, parent packages included): the
# performance layers (a package's `layers/` folder), benchmarks, measurement code and tools.
def is_off_the_paper_path(rel: str) -> bool:
    parts = rel.split("/")
    name = parts[-1]
    return ("layers" in parts[:-1] or "bench" in parts[:-1] or name.startswith("bench")
            or name in {"ledger.py", "step_timing.py", "profile.py"} or parts[0] == "tools")


def module_file(module: str, root: Path = ROOT) -> Path | None:
    """The project file that defines `module` (a package's __init__.py, or a .py file), or None."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every project module `path` imports anywhere in its body, with the packages that hold them."""
    rel = path.relative_to(root)
    package = list(rel.parent.parts)  # the package a relative import starts from
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    project = set()
    for module in found:
        parts = module.split(".")
        if parts[0] not in ALLOWED:
            continue
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__.py and a/b/__init__.py too
            project.add(".".join(parts[:i]))
    return {m for m in project if module_file(m, root) is not None}


def paper_path_reach(files: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    """{file reached: the import chain from a paper-path file to it}, following imports transitively."""
    chains: dict[str, list[str]] = {}
    todo = []
    for f in files:
        rel = str(f.relative_to(root))
        chains[rel] = [rel]
        todo.append(f)
    while todo:
        f = todo.pop()
        chain = chains[str(f.relative_to(root))]
        for module in sorted(imported_modules(f, root)):
            target = module_file(module, root)
            rel = str(target.relative_to(root))
            if rel not in chains:
                chains[rel] = [*chain, rel]
                todo.append(target)
    return chains


PAPER_PATH_PACKAGES = sorted(p for p in ALLOWED if (ROOT / p / "README.md").exists() and
                             "## Read the code" in (ROOT / p / "README.md").read_text())


@pytest.mark.parametrize("package", PAPER_PATH_PACKAGES)
def test_the_paper_path_reaches_no_layer_bench_or_tool(package):
    from test_read_the_code import reading_map

    reach = paper_path_reach([path for path, _ in reading_map(package)])
    bad = {rel: " -> ".join(chain) for rel, chain in reach.items() if is_off_the_paper_path(rel)}
    assert not bad, f"{package}'s paper path imports layers, benches or tools:\n" + "\n".join(bad.values())


def test_the_reach_checker_follows_functions_parents_and_relative_imports(tmp_path):
    for rel, text in {
        "nano_flashattn/__init__.py": "",
        "nano_flashattn/forward.py": "def f():\n    from .util import x\n",
        "nano_flashattn/util.py": "from nano_flashattn.layers import pdl\n",
        "nano_flashattn/layers/__init__.py": "",
        "nano_flashattn/layers/pdl.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    reach = paper_path_reach([tmp_path / "nano_flashattn/forward.py"], tmp_path)
    assert reach["nano_flashattn/layers/pdl.py"] == ["nano_flashattn/forward.py", "nano_flashattn/util.py",
                                                     "nano_flashattn/layers/pdl.py"]
    assert is_off_the_paper_path("nano_flashattn/layers/pdl.py")
    assert "nano_flashattn/__init__.py" in reach
