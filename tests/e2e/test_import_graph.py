"""The dependency rule of docs/ARCHITECTURE.md, enforced: imports between the project's packages flow one way.

    nano_flashattn   <- torch, triton only
    shared           <- nano_flashattn
    nano_megatron, nano_zero, nano_vllm   <- shared (+ nano_flashattn)
    nano_quant                            <- shared (+ nano_flashattn); nano_vllm may import it
    nano_sglang, nano_distserve           <- nano_vllm (+ shared, nano_flashattn)

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
