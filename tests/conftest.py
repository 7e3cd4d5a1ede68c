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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
