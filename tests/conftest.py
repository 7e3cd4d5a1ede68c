"""Test-wide setup.

On a machine without CUDA the Triton kernels run under Triton's interpreter (`TRITON_INTERPRET=1`);
it must be set before `triton.jit` decorates anything, i.e. before any package imports its kernels.
GPU-only tests carry the `gpu` marker and are skipped without CUDA.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run far faster on one thread than on two contended ones (the CI box has two cores,
    shared with any spawned ranks): `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: `items` is what runs
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    # tests/e2e/test_forkability.py: its forks start now, in the background, and its tests run last
    forks = [item for item in items if getattr(item, "originalname", None) == "test_package_forks_with_what_it_stands_on"]
    if forks:
        items[:] = [item for item in items if item not in forks] + forks
        forks[0].module.start_forks([item.callspec.params["package"] for item in forks])


def pytest_configure(config):
    """Test files and their helper modules share one flat module namespace (rootdir imports, no packages:
    a `tests/shared` package would shadow the real `shared`), so two files with one basename break
    collection: fail with a clear message instead of pytest's 'import file mismatch'."""
    import collections
    import pathlib

    names = collections.Counter(p.name for p in pathlib.Path(__file__).parent.rglob("*.py")
                                if p.name != "conftest.py")  # helpers too: tests import them by name
    dupes = sorted(n for n, c in names.items() if c > 1)
    if dupes:
        raise pytest.UsageError(f"test file basenames must be unique across tests/: {dupes}")


@pytest.fixture
def run_in_copy(tmp_path):
    """Run a Python script in a copy of some of the project's packages with some of their files deleted,
    the editable install out of the way, and return the finished process.

    An editable install's import finder resolves a module the copy lacks from the checkout, which would hide
    exactly the failure a deletion test looks for; so the script runs under `python -S` (no site
    initialisation: no .pth file, no finder) with the copy first on PYTHONPATH and the site-packages after
    it. `delete` names files relative to the copy's root (`nano_vllm/layers/gemv.py`); each must exist."""
    import shutil
    import site
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def run(packages, delete, script, timeout=600):
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "outputs")
        for name in packages:
            shutil.copytree(root / name, tmp_path / name, ignore=ignore)
        for rel in delete:
            path = tmp_path / rel
            assert path.is_file(), f"{rel} does not exist: the deletion test lists a file the package lacks"
            path.unlink()
        paths = [str(tmp_path), *site.getsitepackages()]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
        return subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=timeout)

    return run
