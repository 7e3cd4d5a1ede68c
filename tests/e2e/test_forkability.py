"""Any package can be forked with what it stands on (the dependency rule of docs/ARCHITECTURE.md).

For each package: copy it, the packages the rule lets it import, its tests and tests/conftest.py into an
empty directory, then in a fresh interpreter that can see only that directory (the editable install of
this repository is switched off) import every module of the package, check that no sibling outside the
rule is importable, and run the package's tests there. Collection imports every test module, so a test
that needs a sibling outside the rule fails here too. The tests marked `slow` (multi-process runs and CLI
smoke runs, ~4-35 s each) are collected but not run in the fork: running them twice would double CI time;
they run from the repository in the same suite. The forks run one at a time in the background from the end of
collection (tests/conftest.py starts them and runs these tests last), beside the rest of the suite.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDS_ON = {
    "nano_flashattn": [],
    "shared": ["nano_flashattn"],
    "nano_megatron": ["shared", "nano_flashattn"],
    "nano_zero": ["shared", "nano_flashattn"],
    "nano_vllm": ["shared", "nano_flashattn", "nano_quant"],
    "nano_quant": ["shared", "nano_flashattn"],
    "nano_sglang": ["nano_vllm", "shared", "nano_flashattn", "nano_quant"],
    "nano_distserve": ["nano_vllm", "shared", "nano_flashattn", "nano_quant"],
    "nano_specdec": ["nano_vllm", "shared", "nano_flashattn", "nano_quant"],
}
CHECK = textwrap.dedent('''
    import importlib, pkgutil, sys
    # forget this repository's editable install: only the fork directory may provide our packages
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                        and "editable" not in repr(f).lower()]
    package, allowed, fork = sys.argv[1], set(sys.argv[2].split(",")) - {""}, sys.argv[3]
    mod = importlib.import_module(package)
    assert mod.__file__.startswith(fork), (package, mod.__file__)
    for info in pkgutil.walk_packages(mod.__path__, package + "."):
        importlib.import_module(info.name)
    for other in {"shared", "nano_flashattn", "nano_megatron", "nano_zero", "nano_vllm", "nano_sglang",
                  "nano_distserve", "nano_quant", "nano_specdec"} - allowed - {package}:
        try:
            importlib.import_module(other)
        except ImportError:
            continue
        raise AssertionError(f"{other} is importable in the fork of {package}: the fork is not isolated")
    import pytest
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu", f"tests/{package}"]))
''')


def _fork(package: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Copy `package`, what it stands on and its tests into tmp_path; run CHECK there."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "outputs")
    for name in (package, *STANDS_ON[package]):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=ignore)
    shutil.copytree(ROOT / "tests" / package, tmp_path / "tests" / package, ignore=ignore)
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n    slow: longer CPU tests\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", CHECK, package, ",".join(STANDS_ON[package]), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _test_bytes(package: str) -> int:
    return sum(f.stat().st_size for f in (ROOT / "tests" / package).rglob("*.py"))


_STARTED: dict[str, Future] = {}


def start_forks(packages: list[str]) -> None:
    """Start the forks of `packages` in the background, one at a time, the largest test directories first:
    tests/conftest.py calls this once pytest has collected the tests and moves these tests to the end,
    so the forks (single-threaded processes) run on the core the rest of the suite leaves idle instead of
    after it."""
    root = Path(tempfile.mkdtemp(prefix="forks_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    pool = ThreadPoolExecutor(max_workers=1)
    for package in sorted(set(packages), key=_test_bytes, reverse=True):
        (root / package).mkdir()
        _STARTED[package] = pool.submit(_fork, package, root / package)
    pool.shutdown(wait=False)


@pytest.fixture(scope="module")
def forks(request):
    """The selected packages' forks: those start_forks began, or (this file run without tests/conftest.py's
    hook) started now."""
    selected = [item.callspec.params["package"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_package_forks_with_what_it_stands_on"]
    if not all(package in _STARTED for package in selected):
        start_forks([package for package in selected if package not in _STARTED])
    return _STARTED


@pytest.mark.parametrize("package", sorted(STANDS_ON))
def test_package_forks_with_what_it_stands_on(package, forks):
    proc = forks[package].result()
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]
