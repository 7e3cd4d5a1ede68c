"""Programmatic dependent launch: where it turns on (the layer nano_flashattn/layers/pdl.py at the "pdl"
point; `launch.pdl_args` gives no PDL without it), and that every kernel taking it waits for the previous
kernel before its first load (compiled for sm_90, no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nano_flashattn as fa
from nano_flashattn import decode, launch
from nano_flashattn.launch import pdl_args
from nano_flashattn.layers import pdl

ROOT = Path(__file__).resolve().parents[2]
ON = {"PDL": True, "launch_pdl": True}
OFF = {"PDL": False}


def test_pdl_on_hopper_and_later_only_where_the_layer_is(monkeypatch):
    """CUDA sm_90 and later with a Triton that has grid dependency control: on; a CPU, an sm_80 GPU, the
    paper-path switch or the layer disabled (the A/B switch of its measurement): off."""
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability["value"])
    monkeypatch.setattr(launch, "_capability", launch._capability.__wrapped__)  # uncached
    monkeypatch.setattr(pdl, "HAS_PDL", True)
    cuda = torch.device("cuda", 0)
    assert pdl_args(torch.device("cpu")) == OFF and pdl_args(cuda) == ON
    capability["value"] = (10, 0)
    assert pdl_args(cuda) == ON
    capability["value"] = (8, 0)
    assert pdl_args(cuda) == OFF
    capability["value"] = (9, 0)
    with fa.performance_layers(False):
        assert pdl_args(cuda) == OFF
    pdl.disable()
    try:
        assert not pdl.enabled() and pdl_args(cuda) == OFF
    finally:
        pdl.enable()
    assert pdl.enabled() and pdl_args(cuda) == ON
    monkeypatch.setattr(pdl, "HAS_PDL", False)  # a Triton without gdc_wait / gdc_launch_dependents
    assert pdl_args(cuda) == OFF


def test_flash_decoding_takes_no_pdl():
    """The paper path's decode kernels launch plainly (a decode layer may launch a PDL variant)."""
    assert "PDL" not in decode._decode_split_kernel.arg_names
    assert "PDL" not in decode._combine_kernel.arg_names


@pytest.mark.slow
def test_every_pdl_kernel_waits_before_it_reads():
    """The interpreter cannot run the grid-dependency instructions: compile each kernel that takes PDL for
    sm_90 in a process without TRITON_INTERPRET and check where its wait and release sit (pdl_compile.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    script = Path(__file__).with_name("pdl_compile.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PDL checked in 10 kernels for sm_90" in proc.stdout
