"""Every command example in the docs parses as written, without running it.

Examples are `python -m <module> ...` and `torchrun ... -m <module> ...` lines for the project's modules,
found in the root README, BENCHMARKS.md, docs/*.md, each package's README and every module docstring.
A Hydra entry point's `key=value` overrides are composed with the module's shipped configs through
Hydra's compose API (strict, as `@hydra.main` runs them), so a key the config does not have (`rate=20`
where the key is `serving_rate`) or a config-group option that does not exist fails here. An argparse
entry point's arguments are parsed by the parser the module exposes (`build_parser()` or
`parse_args(argv)`); one that exposes neither is listed in NO_PARSER with the reason.

Placeholders are allowed: `<...>` and `...` stand for a value the reader supplies.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()
                  and (p.name == "shared" or p.name.startswith("nano_")))

# argparse entry points whose parser is built inside main(): their examples are not checked.
NO_PARSER: dict[str, str] = {}  # module -> why its examples cannot be parsed (none today)

# Examples known to be wrong in files this test does not fix itself: (file, module, the override or flag
# that fails). Strict: once an example is fixed, its entry must go.
KNOWN_WRONG: dict[tuple[str, str, str], str] = {}

COMMAND = re.compile(r"(?:\bpython3?|\btorchrun)\b[^`#\n]*?\s-m\s+(?P<module>(?:nano_\w+|shared)(?:\.\w+)+)"
                     r"(?=[\s`]|$)(?P<args>[^`#\n]*)")
COMMAND_LINE = re.compile(r"^\s*(?:[A-Z_]+=\S*\s+)*(?:python3?|torchrun)\s")


@dataclass(frozen=True)
class Example:
    file: str  # relative to the repository root
    line: int
    module: str
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: python -m {self.module} {' '.join(self.args)}".rstrip()


def _markdown_snippets(text: str) -> list[tuple[int, str]]:
    """(line, text) of each fenced code line (backslash continuations joined) and each inline code span
    (which may wrap across lines of a paragraph)."""
    out, fenced, lines = [], False, text.split("\n")
    prose = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
        elif fenced:
            start, joined = i, line
            while joined.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                joined = joined.rstrip()[:-1] + " " + lines[i]
                prose.append("")
            out.append((start + 1, joined))
            prose.append("")
        else:
            prose.append(line)
        i += 1
    body = "\n".join(prose)
    for m in re.finditer(r"`([^`]+)`", body):
        out.append((body.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())))
    return out


def _docstring_snippets(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each docstring line that is a command (it starts with `python` or `torchrun`, maybe
    after environment variables) and of each inline code span in the module docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree, clean=False)
    if not doc:
        return []
    first = tree.body[0].lineno
    spans = [(first + doc.count("\n", 0, m.start()), " ".join(m.group(1).split()))
             for m in re.finditer(r"`([^`]+)`", doc)]
    lines = [(first + i, line) for i, line in enumerate(doc.split("\n")) if COMMAND_LINE.match(line)]
    return lines + spans


def _args(raw: str) -> tuple[str, ...] | None:
    raw = re.split(r"\s(?:&&|\|\||[|;&])(?:\s|$)|\s&$", raw)[0]
    raw = re.sub(r"<[^<>]*>", "PLACEHOLDER", raw)
    try:
        tokens = shlex.split(raw)
    except ValueError:
        return None
    return tuple("PLACEHOLDER" if t == "..." else t.replace("=...", "=PLACEHOLDER") for t in tokens)


def collect() -> list[Example]:
    sources: list[tuple[Path, list[tuple[int, str]]]] = []
    docs = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
    docs += [ROOT / p / "README.md" for p in PACKAGES]
    for path in docs:
        if path.exists():
            sources.append((path, _markdown_snippets(path.read_text(encoding="utf-8"))))
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            sources.append((path, _docstring_snippets(path)))
    found: dict[tuple, Example] = {}
    for path, snippets in sources:
        rel = path.relative_to(ROOT).as_posix()
        for line, text in snippets:
            for m in COMMAND.finditer(text):
                args = _args(m.group("args"))
                if args is None or any(a.startswith("[") and a.endswith("]") and "=" in a for a in args):
                    continue  # a usage synopsis ("[model=...]"), not an example
                ex = Example(rel, line, m.group("module"), args)
                found.setdefault((rel, ex.module, args), ex)  # a span inside a fenced line: once
    return list(found.values())


EXAMPLES = collect()


def _module_path(module: str) -> Path:
    """The file `python -m module` runs: module.py, or a package's __main__.py."""
    base = ROOT / module.replace(".", "/")
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__main__.py"


def _hydra_app(module: str) -> tuple[Path, str] | None:
    """(config directory, config name) of a module whose main is `@hydra.main`, else None."""
    path = _module_path(module)
    if not path.exists():
        return None
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and ast.unparse(dec.func) == "hydra.main":
                    kw = {k.arg: ast.literal_eval(k.value) for k in dec.keywords}
                    return path.parent / kw["config_path"], kw["config_name"]
    return None


@functools.cache  # one composition per distinct command (failures are not cached)
def _compose(config_dir: Path, config_name: str, overrides: tuple[str, ...]) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)


def check_hydra(ex: Example, config_dir: Path, config_name: str) -> None:
    source = _module_path(ex.module).read_text(encoding="utf-8")
    overrides = []
    for a in ex.args:
        if a.startswith("-"):  # a flag the entry point maps itself (e.g. --quick → quick=true)
            assert f'"{a}"' in source, f"{ex}: {a} is not a Hydra override and {ex.module} does not handle it"
        else:
            overrides.append(a)
    _compose(config_dir, config_name, tuple(overrides))


def check_argparse(ex: Example) -> None:
    main = _module_path(ex.module)  # a package's __main__.py holds its command line
    mod = importlib.import_module(ex.module + (".__main__" if main.name == "__main__.py" else ""))
    args = [a for a in ex.args if a != "PLACEHOLDER"]
    if hasattr(mod, "build_parser"):
        mod.build_parser().parse_args(args)
    elif hasattr(mod, "parse_args"):
        mod.parse_args(args)
    else:
        raise AssertionError(f"{ex}: {ex.module} exposes no build_parser() / parse_args(argv) and is not in "
                             "NO_PARSER")


def _params():
    params = []
    for ex in sorted(EXAMPLES, key=lambda e: (e.file, e.line)):
        marks = []
        if ex.module in NO_PARSER:
            marks.append(pytest.mark.skip(reason=f"{ex.module}: {NO_PARSER[ex.module]}"))
        for (file, module, arg), why in KNOWN_WRONG.items():
            if (file, module) == (ex.file, ex.module) and arg in ex.args:
                marks.append(pytest.mark.xfail(reason=why, strict=True))
        params.append(pytest.param(ex, id=str(ex), marks=marks))
    return params


def test_the_checks_catch_a_wrong_key_a_wrong_option_and_a_wrong_flag():
    from hydra.errors import ConfigCompositionException

    config = _hydra_app("nano_vllm.bench")
    with pytest.raises(ConfigCompositionException, match="rate"):
        check_hydra(Example("x.md", 1, "nano_vllm.bench", ("rate=20",)), *config)
    with pytest.raises(ConfigCompositionException, match="no_such_workload"):
        check_hydra(Example("x.md", 1, "nano_vllm.bench", ("workload=no_such_workload",)), *config)
    with pytest.raises(AssertionError, match="--fast"):
        check_hydra(Example("x.md", 1, "nano_vllm.bench", ("--fast",)), *config)
    with pytest.raises(SystemExit):
        check_argparse(Example("x.md", 1, "nano_flashattn.bench", ("--no-such-flag",)))


def test_examples_were_found():
    modules = {ex.module for ex in EXAMPLES}
    assert {"nano_vllm.bench", "nano_megatron.train", "nano_flashattn.bench"} <= modules, sorted(modules)


@pytest.mark.parametrize("ex", _params())
def test_doc_command_parses(ex: Example):
    app = _hydra_app(ex.module)
    try:
        if app is not None:
            check_hydra(ex, *app)
        else:
            check_argparse(ex)
    except SystemExit as e:  # argparse reports bad arguments by exiting
        raise AssertionError(f"{ex}: argparse rejected the arguments (exit {e.code})") from None
