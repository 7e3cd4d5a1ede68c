"""Programmatic dependent launch (nano_flashattn/pdl.py): where it turns on, and that every kernel taking it
waits for the previous kernel before its first load (compiled for sm_90, no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nano_flashattn.pdl import use_pdl

ROOT = Path(__file__).resolve().parents[2]


def test_pdl_only_on_cuda_and_off_by_env(monkeypatch):
    """A CUDA sm_90+ launch attribute: never on a CPU; `NANO_PDL=0` turns it off everywhere (the A/B switch
    its measurement uses), decided before any CUDA query."""
    assert not use_pdl(torch.device("cpu"))
    monkeypatch.setenv("NANO_PDL", "0")
    assert not use_pdl(torch.device("cuda", 0))


@pytest.mark.slow
def test_every_pdl_kernel_waits_before_it_reads():
    """The interpreter cannot run the grid-dependency instructions: compile each kernel that takes PDL for
    sm_90 in a process without TRITON_INTERPRET and check where its wait and release sit (pdl_compile.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("pdl_compile.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PDL checked in 9 kernels for sm_90" in proc.stdout
