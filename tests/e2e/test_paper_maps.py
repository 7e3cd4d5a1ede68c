"""Every package README's paper -> code table names code that exists.

The code column of each table (headed "code" or "where"; `shared`'s "module" column) lists names in
backticks: `module.function`, `Class.method`, a bare name defined somewhere in the package (or a method
named right after its class), a fully qualified `package.module.name`, a file, a `python -m` entry
point, or a test function. Each must resolve; a rename that forgets the README fails here. Backticked
text that is not a name (`stage == 0`, `policy="plain"`, a config override) is prose and is skipped.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

# The table's parsing rule lives with the reader that renders it (one parser of each table).
from shared.reader.maps import code_cells

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["shared", "nano_flashattn", "nano_megatron", "nano_zero", "nano_vllm", "nano_sglang", "nano_distserve",
            "nano_quant", "nano_specdec"]
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def package_modules(package: str) -> list:
    mod = importlib.import_module(package)
    mods = [mod]
    for info in pkgutil.walk_packages(mod.__path__, package + "."):
        mods.append(importlib.import_module(info.name))
    return mods


def _getattr_chain(obj, parts: list[str]) -> bool:
    for i, p in enumerate(parts):
        if not hasattr(obj, p):
            # an instance attribute, named last after its class: assigned as `self.<p>` in the class
            return (i == len(parts) - 1 and inspect.isclass(obj)
                    and re.search(rf"self\.{p}\b\s*(:[^=]+)?=", inspect.getsource(obj)) is not None)
        obj = getattr(obj, p)
    return True


def _qualified(dotted: str) -> bool:
    """`pkg.module.attr...`: import the longest module prefix, then walk the attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            mod = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return _getattr_chain(mod, parts[i:])
    return False


def resolves(token: str, package: str, modules: list) -> bool:
    token = token.strip()
    if token.startswith("python -m "):
        return _qualified(token.split()[2])
    if re.fullmatch(r"[\w./*-]+\.(py|json|jsonl|safetensors)", token):
        return not token.endswith(".py") or any((ROOT / package).rglob(Path(token).name))
    token = re.sub(r"\(.*\)$", "", token)  # `f(arg=...)`, `Model(.fit)`: the name before the call
    if not NAME.fullmatch(token):
        return True  # prose in backticks: an expression, a string, an override
    if token.startswith("test_"):
        return any(f"def {token}(" in p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    if token.split(".")[0] in PACKAGES:
        return _qualified(token)
    if _qualified(f"{package}.{token}"):
        return True
    head, *rest = token.split(".")
    for mod in modules:  # a name defined in any module of the package, or a method of any of its classes
        if hasattr(mod, head) and _getattr_chain(getattr(mod, head), rest):
            return True
        if not rest:
            for _, cls in inspect.getmembers(mod, inspect.isclass):
                if cls.__module__.startswith(package) and hasattr(cls, head):
                    return True
    return False


@pytest.mark.parametrize("package", PACKAGES)
def test_paper_map_names_exist(package):
    tokens = code_cells(ROOT / package / "README.md")
    assert tokens, f"{package}/README.md has no paper -> code table"
    modules = package_modules(package)
    missing = sorted({t for t in tokens if not resolves(t, package, modules)})
    assert not missing, f"{package}/README.md names code that does not exist: {missing}"


def test_the_resolver_rejects_what_is_not_there():
    mods = package_modules("nano_vllm")
    assert resolves("scheduler.Scheduler.schedule", "nano_vllm", mods)
    assert resolves("BlockManager.allocate_slots", "nano_vllm", mods)
    assert resolves("shared.accounting.training_memory", "nano_vllm", mods)
    assert not resolves("scheduler.Scheduler.no_such_method", "nano_vllm", mods)
    assert not resolves("NoSuchClass", "nano_vllm", mods)
    assert resolves("Sequence.block_table", "nano_vllm", mods)  # an instance attribute
    assert not resolves("Sequence.no_such_attribute", "nano_vllm", mods)
    assert not resolves("test_no_such_test_anywhere", "nano_vllm", mods)
